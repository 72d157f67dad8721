"""Options that mean the same in several commands (`rvqtts synth`, `rvqtts read`): the model and engine, the voice, the
sampling and the chunking, each declared once."""

from __future__ import annotations

import typer

from rvqtts.cli.common import (
    DECODER_DTYPE_HELP,
    DEFAULT_MODEL,
    DEVICE_HELP,
    DTYPE_HELP,
    MODEL_HELP,
    OFFSETS_HELP,
    TREE_HELP,
    WEIGHTS_HELP,
)

SPEAKER = typer.Option(
    None,
    help="Speaker of a CustomVoice model (rvqtts voices lists them); default vivian. Base and VoiceDesign models "
    "have none.",
)

REF_AUDIO = typer.Option(
    None,
    help="Base models: reference audio of the voice to clone (.wav, .flac, .ogg; at least 1 s), with --ref-text or "
    "--x-vector-only.",
)

REF_TEXT = typer.Option(
    None, help="Base models: what the reference audio says, word for word (ICL cloning, qwen-tts's default)."
)

X_VECTOR_ONLY = typer.Option(
    False,
    "--x-vector-only",
    help="Base models: clone from the reference's speaker embedding alone (no transcript; its codes are not in the "
    "prompt).",
)

VOICE = typer.Option(None, help="Base models: a voice file written by --save-voice (the reference encoded once).")

INSTRUCT = typer.Option(
    None,
    help="Style instruction (ignored, with a warning, by models without instruction support such as the 0.6B "
    "CustomVoice); on a VoiceDesign model, the voice described in words (required).",
)

TEMPERATURE = typer.Option(
    None,
    help="Sampling temperature of both loops; default: the model's generation_config.json (talker and code "
    "predictor apart), else 0.9.",
)

TOP_K = typer.Option(None, help="Top-k of both loops (0 = off); default: the model's, else 50.")

TOP_P = typer.Option(None, help="Top-p of both loops (1 = off); default: the model's, else 1.")

PREDICTOR_TEMPERATURE = typer.Option(None, help="The code predictor's temperature apart from the talker's.")

PREDICTOR_TOP_K = typer.Option(None, help="The code predictor's top-k apart from the talker's.")

PREDICTOR_TOP_P = typer.Option(None, help="The code predictor's top-p apart from the talker's.")

REPETITION_PENALTY = typer.Option(None, help="Repetition penalty of the talker; default: the model's, else 1.05.")

MAX_FRAMES = typer.Option(
    None,
    help="Most frames per chunk (12.5 frames = 1 s); default: three times what the chunk's text needs plus 2 s, "
    "within the model's max_new_tokens.",
)

CHUNK_CHARS = typer.Option(
    240,
    help="Long text is spoken in chunks of about this many characters, cut at sentence ends (ideographs and kana "
    "count 2.5).",
)

MODEL = typer.Option(DEFAULT_MODEL, help=MODEL_HELP)

DEVICE = typer.Option("auto", help=DEVICE_HELP)

DTYPE = typer.Option("auto", help=DTYPE_HELP)

DECODER_DTYPE = typer.Option("auto", help=DECODER_DTYPE_HELP)

WEIGHTS = typer.Option("native", help=WEIGHTS_HELP)

SPEC = typer.Option(True, "--spec/--no-spec", help="Speculative inner loop (default) or the plain one.")

TREE = typer.Option("auto", help=TREE_HELP)

OFFSETS = typer.Option(None, help=OFFSETS_HELP)

RAY = typer.Option(
    None,
    "--ray",
    help="Run on a Ray cluster (pip install -e '.[ray]' in rvqtts's checkout): auto ($RAY_ADDRESS, or the cluster "
    "`ray start` made here, else a new one on this machine) or the cluster's address (HOST:PORT). This machine writes "
    "every file (docs/cluster.md).",
)

WORKERS = typer.Option(
    None, help="--ray: workers, each loading the model once; default: as many as the cluster's CPUs (GPUs) hold."
)

CPUS_PER_WORKER = typer.Option(None, help="--ray: CPUs (torch threads) per worker; default 1.")

GPUS_PER_WORKER = typer.Option(
    None, help="--ray: GPUs per worker (fractions share one); default 0. With GPUs, --device auto is cuda."
)
