"""Models and packages: `make-tiny-model`, `voices`, `standin build`, `export-coreml`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rvqtts.cli.common import (
    DEFAULT_MODEL,
    HELP_STYLE,
    OFFSETS_HELP,
    app,
    ensure_writable,
    fail,
    load_synthesizer,
    refused,
    say,
    stderr_console,
)


@app.command("make-tiny-model")
def make_tiny_model(
    directory: Path = typer.Argument(..., help="Folder to create; it must not exist or be empty."),
    dims: str = typer.Option(
        "tiny",
        help="tiny (shrunk), or 0.6b / 1.7b: the released CustomVoice model's dimensions and layout "
        "(rvqtts/tuning/released/), stored in bfloat16.",
    ),
    kind: str = typer.Option(
        "custom-voice",
        help="custom-voice (built-in speakers), base (voice cloning: a speaker encoder, no speakers) or voice-design "
        "(described voices; 1.7B only).",
    ),
    shallow: bool = typer.Option(
        False,
        "--shallow",
        help="With --dims: two talker and two code-predictor layers and a small speech tokenizer, released widths and "
        "heads.",
    ),
    codebook: int = typer.Option(2048, help="--dims tiny: residual codebook size (the code predictor's vocabulary)."),
    code_groups: int = typer.Option(16, help="--dims tiny: codes per frame, c0 plus code_groups - 1 residual codes."),
    acceptance: str = typer.Option(
        "none",
        help="none (random weights), or paper (--dims 0.6b): a code predictor whose own weights draft about as well as "
        "the paper reports (docs/acceptance.md).",
    ),
    seed: int = typer.Option(0, help="Seed of the random weights; same arguments give byte-identical files."),
    force: bool = typer.Option(False, "--force", help="Replace the folder if it already exists."),
) -> None:
    """Write a random-weight Qwen3-TTS 12 Hz checkpoint, offline, for tests, trials and benchmarks.

    It loads with qwen_tts.Qwen3TTSModel.from_pretrained(DIR) like a real checkpoint. Its weights are
    random: its audio is noise, its talker never ends its speech (use --max-frames), and its acceptance
    figures mean nothing about real models, unless --acceptance paper shapes its code predictor's.
    --dims 0.6b / 1.7b cost what the real models cost to run.
    """
    import shutil

    from rvqtts.tuning.tiny import SHALLOW_LAYERS, build_tiny_model

    if force and directory.is_dir():
        shutil.rmtree(directory)
    with refused(ValueError, FileExistsError):
        build_tiny_model(
            directory,
            codebook=codebook,
            code_groups=code_groups,
            seed=seed,
            dims=dims,
            layers=SHALLOW_LAYERS if shallow else None,
            kind=kind,
            acceptance=acceptance,
        )
    say(f"wrote {directory}")


@app.command()
def voices(model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model.")) -> None:
    """Say which kind of model it is and what it takes, and list its speakers and languages (reads its config
    only)."""
    from rvqtts.qwen.checkpoints import KINDS, ModelLoadError, model_voices

    with refused(ModelLoadError):
        found = model_voices(model)
    name, takes = KINDS[found.kind]
    typer.echo(f"kind: {name} ({takes})")
    typer.echo("speakers: " + (", ".join(found.speakers) or "none"))
    typer.echo("languages: " + ", ".join(found.languages))


@app.command("export-coreml")
def export_coreml(
    out: Path = typer.Option(..., "--out", help="Folder for the .mlpackage (named by what it was built for)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    tree: str = typer.Option(
        "auto",
        help="Draft tree: auto (the best N measured for Core ML, else 16), a node budget N (a shipped tree) or a tree "
        "file.",
    ),
    offsets: Optional[Path] = typer.Option(None, help=OFFSETS_HELP),
    precision: str = typer.Option("w8a16", help="w8a16 (int8 per-channel weights, float16 activations) or fp16."),
    min_target: str = typer.Option("macOS15", help="Oldest macOS the package runs on (macOS15 or later)."),
    temperature: float = typer.Option(0.9, help="Sampling temperature baked into the package (synth's must match)."),
    top_k: int = typer.Option(50, help="Top-k baked into the package (0 = off; synth's must match)."),
    force: bool = typer.Option(False, "--force", help="Export again over a package of the same name."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress messages."),
) -> None:
    """Export the fused inner loop (prefill, tree round, plain step) for one tree as a Core ML package,
    for `rvqtts synth --backend coreml --coreml-package`. Runs on any OS; the package runs on macOS."""
    from rvqtts.engine.backends.coreml import check_export_settings, export_package
    from rvqtts.engine.model.sampling import SamplingConfig
    from rvqtts.engine.speculative.policy import choose_speculation

    with refused(ValueError):  # CoreMLError too
        sampling = SamplingConfig(temperature, top_k)
        check_export_settings(sampling, precision, min_target)
    ensure_writable(out, folder=True)
    synthesizer = load_synthesizer(model, quiet, device="cpu", dtype="float32", spec=False)
    with refused(ValueError):  # CoreMLError, TreeFileError, OffsetsFileError too
        speculation, notice = choose_speculation(synthesizer.code_predictor, tree, offsets, device_type="coreml")
        say(notice, quiet)
        exported = export_package(
            synthesizer.code_predictor,
            speculation,
            sampling,
            out,
            precision,
            min_target,
            report=lambda message: say(message, quiet),
            force=force,
        )
    if exported.reused:
        say(
            f"{exported.path} is already exported for this model, tree, offsets and sampling (--force redoes it)", quiet
        )
    else:
        say(f"wrote {exported.path}: {exported.bytes / 1e6:.1f} MB in {exported.seconds:.1f} s", quiet)
    typer.echo(str(exported.path))


standin_app = typer.Typer(
    help="The trained stand-in code predictor (a proxy for tests and benchmarks, not Qwen3-TTS).", **HELP_STYLE
)
app.add_typer(standin_app, name="standin")


@standin_app.command("build")
def standin_build(
    out: Path = typer.Argument(..., help="Folder for the model, codec, contexts and report.json."),
    small: bool = typer.Option(False, "--small", help="The same pipeline, shrunk to run in well under two minutes."),
    device: str = typer.Option("cpu", help="cpu or cuda (training and the codec's k-means)."),
    sentences: Optional[Path] = typer.Option(
        None, help="Folder of {en,de,es,ru,ja,cmn}.txt; default: the 86 sentences shipped with rvqtts."
    ),
    steps: Optional[int] = typer.Option(None, help="Training steps (default 1500, --small 150); more on a GPU."),
) -> None:
    """Rebuild corpus (espeak-ng), codec, stand-in and contexts with fixed seeds, and report faithfulness.

    Prints the tables and writes OUT/report.json. Needs espeak-ng (Debian: apt-get install espeak-ng).
    """
    from rvqtts.support.report import standin_tables
    from rvqtts.tuning.standin.build import build_standin
    from rvqtts.tuning.standin.corpus import CorpusError

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        fail(f"unknown --device {device!r}: choose cpu or cuda")
    with refused(CorpusError):
        report = build_standin(out, small=small, device=device, sentences_dir=sentences, steps=steps, log=say)
    console = stderr_console()
    for table in standin_tables(report):
        console.print(table)
    say(f"wrote {out / 'report.json'}")
