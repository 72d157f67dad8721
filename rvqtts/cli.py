"""The `rvqtts` command line: a thin layer over the library (rvqtts.synthesis, rvqtts.tiny)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Fast, exact Qwen3-TTS synthesis with RVQ position-aware speculative decoding.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"


def fail(message: str) -> None:
    """One line on stderr and exit code 2: the input was wrong, nothing was written."""
    typer.echo(f"rvqtts: error: {message}", err=True)
    raise typer.Exit(2)


@app.command("make-tiny-model")
def make_tiny_model(
    directory: Path = typer.Argument(..., help="Folder to create; it must not exist or be empty."),
    codebook: int = typer.Option(2048, help="Residual codebook size (the code predictor's vocabulary)."),
    code_groups: int = typer.Option(16, help="Codes per frame: c0 plus code_groups - 1 residual codes."),
    seed: int = typer.Option(0, help="Seed of the random weights; same arguments give byte-identical files."),
    force: bool = typer.Option(False, "--force", help="Replace the folder if it already exists."),
) -> None:
    """Write a tiny random-weight Qwen3-TTS 12 Hz CustomVoice checkpoint, offline, for tests and trials.

    It loads with qwen_tts.Qwen3TTSModel.from_pretrained(DIR) like a real checkpoint. Its weights are
    random: its audio is noise and its acceptance figures mean nothing about real models.
    """
    import shutil

    from rvqtts.tiny import build_tiny_model

    if force and directory.exists():
        shutil.rmtree(directory)
    try:
        build_tiny_model(directory, codebook=codebook, code_groups=code_groups, seed=seed)
    except (ValueError, FileExistsError) as error:
        fail(str(error))
    typer.echo(f"wrote {directory}", err=True)


def _write_wav_atomically(path: Path, audio, sample_rate: int) -> None:
    import soundfile

    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    try:
        soundfile.write(partial, audio, sample_rate, format="WAV", subtype="PCM_16")
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def _pick_device(device: str) -> str:
    import torch

    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


@app.command()
def synth(
    text: str = typer.Argument(..., help="The text to speak."),
    output: Path = typer.Option(..., "-o", "--output", help="WAV file to write (24 kHz mono)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of a Qwen3-TTS 12 Hz CustomVoice model."),
    speaker: str = typer.Option("vivian", help="Speaker name (see the model's supported speakers)."),
    language: str = typer.Option("auto", help="Language name, or auto."),
    seed: int = typer.Option(0, help="Same seed, same codes, same WAV (speculative or not)."),
    spec: bool = typer.Option(True, "--spec/--no-spec", help="Speculative inner loop (default) or the plain one."),
    tree: str = typer.Option("16", help="Draft tree: a node budget N (a shipped tree) or a tree file."),
    offsets: Optional[Path] = typer.Option(None, help="Draft offsets file; default: zero offsets (reused heads)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    codes_out: Optional[Path] = typer.Option(None, help="Save the frame codes as an int .npy array [frames, G]."),
) -> None:
    """Synthesize TEXT to a WAV file."""
    import numpy as np

    from rvqtts.decode import Speculation
    from rvqtts.offsets import Offsets, OffsetsFileError, load_offsets
    from rvqtts.synthesis import DTYPES, Synthesizer
    from rvqtts.tree import TreeFileError, resolve_tree

    if not text.strip():
        fail("the text is empty: give something to say")
    if dtype not in DTYPES:
        fail(f"unknown --dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    try:
        chosen_tree = resolve_tree(tree) if spec else None
    except TreeFileError as error:
        fail(str(error))
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF's per-generate notices are noise on a CLI's stderr
    synthesizer = Synthesizer.load(model, device=_pick_device(device), dtype=dtype)
    if chosen_tree is not None:
        try:
            drafts = (load_offsets(offsets, synthesizer.hidden_size) if offsets
                      else Offsets.zeros(chosen_tree.depth, synthesizer.hidden_size))
            synthesizer.speculation = Speculation(chosen_tree, drafts)
        except OffsetsFileError as error:
            fail(str(error))
        except ValueError as error:  # the tree drafts deeper than the offsets do
            fail(f"tree {tree} with offsets {offsets}: {error}")
    try:
        result = synthesizer.synthesize(text, speaker=speaker, language=language, seed=seed)
    except ValueError as error:  # qwen-tts's check of speaker and language names
        fail(str(error).strip())
    _write_wav_atomically(output, result.audio, result.sample_rate)
    if codes_out:
        np.save(codes_out, result.codes)
    stats = result.stats
    typer.echo(f"{output}: {result.codes.shape[0]} frames, {stats.calls} predictor calls, "
               f"{stats.codes_per_call:.2f} codes per call, {result.seconds['wall']:.2f} s", err=True)


def main() -> None:
    app(prog_name="rvqtts")


if __name__ == "__main__":
    sys.exit(main())
