"""The `rvqtts` command line: a thin layer over the library (rvqtts.synthesis, rvqtts.batch, rvqtts.tiny).

Exit codes: 0 done; 1 some utterances of a batch failed (the rest were written); 2 bad input, with
nothing written. Standard output carries only audio (`-o -`) or the listing asked for; everything for
people goes to standard error.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import typer

# Plain (click) help: no "<bool>" placeholders after switches, and it reads the same in a pipe or a log.
HELP_STYLE = dict(no_args_is_help=True, rich_markup_mode=None)
app = typer.Typer(help="Fast, exact Qwen3-TTS synthesis with RVQ position-aware speculative decoding.",
                  add_completion=False, pretty_exceptions_enable=False, **HELP_STYLE)

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
DEFAULT_BENCH_QUERIES = (1, 2, 4, 5, 8, 9, 16, 17, 24, 32, 33, 48, 64, 65)  # N + 1 for N = 4..64 included


def fail(message: str) -> None:
    """One line on stderr and exit code 2: the input was wrong, nothing was written."""
    typer.echo(f"rvqtts: error: {message}", err=True)
    raise typer.Exit(2)


def say(message: str, quiet: bool = False) -> None:
    if not quiet:
        typer.echo(f"rvqtts: {message}", err=True)


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        typer.echo(f"rvqtts {version('rvqtts')}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Show rvqtts's version and exit.")) -> None:
    """Fast, exact Qwen3-TTS synthesis with RVQ position-aware speculative decoding."""


@app.command("make-tiny-model")
def make_tiny_model(
    directory: Path = typer.Argument(..., help="Folder to create; it must not exist or be empty."),
    dims: str = typer.Option("tiny", help="tiny (shrunk), or 0.6b / 1.7b: the released CustomVoice model's "
                                          "dimensions and layout (rvqtts/released/), stored in bfloat16."),
    shallow: bool = typer.Option(False, "--shallow", help="With --dims: two talker and two code-predictor layers "
                                                          "and a small speech tokenizer, released widths and heads."),
    codebook: int = typer.Option(2048, help="--dims tiny: residual codebook size (the code predictor's "
                                            "vocabulary)."),
    code_groups: int = typer.Option(16, help="--dims tiny: codes per frame, c0 plus code_groups - 1 residual codes."),
    seed: int = typer.Option(0, help="Seed of the random weights; same arguments give byte-identical files."),
    force: bool = typer.Option(False, "--force", help="Replace the folder if it already exists."),
) -> None:
    """Write a random-weight Qwen3-TTS 12 Hz CustomVoice checkpoint, offline, for tests, trials and benchmarks.

    It loads with qwen_tts.Qwen3TTSModel.from_pretrained(DIR) like a real checkpoint. Its weights are
    random: its audio is noise, its talker never ends its speech (use --max-frames), and its acceptance
    figures mean nothing about real models. --dims 0.6b / 1.7b cost what the real models cost to run.
    """
    import shutil

    from rvqtts.tiny import build_tiny_model

    if force and directory.is_dir():
        shutil.rmtree(directory)
    try:
        build_tiny_model(directory, codebook=codebook, code_groups=code_groups, seed=seed, dims=dims,
                         shallow=shallow)
    except (ValueError, FileExistsError) as error:
        fail(str(error))
    say(f"wrote {directory}")


@app.command()
def voices(model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model.")) -> None:
    """List the speakers and languages of a model (reads its config only)."""
    from rvqtts.loading import ModelLoadError
    from rvqtts.loading import voices as model_voices

    try:
        speakers, languages = model_voices(model)
    except ModelLoadError as error:
        fail(str(error))
    typer.echo("speakers: " + ", ".join(speakers))
    typer.echo("languages: " + ", ".join(languages))


def _pick_device(device: str) -> str:
    """The device to run on: `auto` picks the best one present; a named one must be present."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {device}: " + ("this torch is built without CUDA; install a CUDA build of torch, or "
                                       "use --device cpu" if torch.version.cuda is None else
                                       "no CUDA GPU is visible; use --device cpu"))
    if device == "mps" and not torch.backends.mps.is_available():
        fail("--device mps: MPS is not available here (it needs a Mac with Apple silicon and a torch built with "
             "MPS); use --device cpu")
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _pick_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return {"cuda": "bfloat16", "mps": "float16"}.get(device.split(":")[0], "float32")


def _read_text(text: Optional[str]) -> str:
    if text is None or text == "-":
        if sys.stdin is None or sys.stdin.isatty():
            fail("no text: give TEXT, pipe text on standard input, or use -f FILE")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
        try:
            text = data.decode("utf-8") if isinstance(data, bytes) else data
        except UnicodeDecodeError as error:
            fail(f"standard input is not UTF-8 text (byte {error.start} is {data[error.start:error.start + 1]!r}): "
                 f"convert it first, e.g. iconv -f LATIN1 -t UTF-8")
    if not text.strip():
        fail("the text is empty: give something to say")
    return text


def _check_writable(path: Path, folder: bool = False) -> None:
    """Fail with one line, before any model work, unless a file can be written at `path` (or, with
    `folder`, into the folder `path`); nothing is left behind by the check."""
    from rvqtts.files import OutputPathError, check_writable

    try:
        check_writable(path, folder)
    except OutputPathError as error:
        fail(str(error))


@app.command()
def synth(
    text: Optional[str] = typer.Argument(None, help="Text to speak; '-' or nothing reads standard input."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="WAV file to write; '-' writes to stdout."),
    file: Optional[Path] = typer.Option(None, "-f", "--file",
                                        help="Batch: a .txt file (one utterance per line) or a .jsonl file "
                                             "(text, speaker, language, instruct, out)."),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Batch output folder (required with -f)."),
    force: bool = typer.Option(False, "--force", help="Batch: overwrite outputs that already exist."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of a Qwen3-TTS 12 Hz CustomVoice model."),
    device: str = typer.Option("auto", help="auto (cuda, then mps, then cpu), cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on cuda, float16 on mps, float32 on cpu), float32, "
                                           "bfloat16 or float16."),
    speaker: str = typer.Option("vivian", help="Speaker (rvqtts voices lists them)."),
    language: str = typer.Option("auto", help="Language, or auto."),
    instruct: Optional[str] = typer.Option(None, help="Style instruction (ignored, with a warning, by models "
                                                      "without instruction support such as the 0.6B)."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature of both loops; default: the "
                                                           "model's generation_config.json (talker and code "
                                                           "predictor apart), else 0.9."),
    top_k: Optional[int] = typer.Option(None, help="Top-k of both loops (0 = off); default: the model's, else 50."),
    top_p: Optional[float] = typer.Option(None, help="Top-p of both loops (1 = off); default: the model's, else 1."),
    predictor_temperature: Optional[float] = typer.Option(None, help="The code predictor's temperature apart "
                                                                     "from the talker's."),
    predictor_top_k: Optional[int] = typer.Option(None, help="The code predictor's top-k apart from the talker's."),
    predictor_top_p: Optional[float] = typer.Option(None, help="The code predictor's top-p apart from the talker's."),
    repetition_penalty: Optional[float] = typer.Option(None, help="Repetition penalty of the talker; default: the "
                                                                  "model's, else 1.05."),
    max_frames: Optional[int] = typer.Option(None, help="Most frames per chunk (12.5 frames = 1 s); default: "
                                                        "three times what the chunk's text needs plus 2 s, within "
                                                        "the model's max_new_tokens."),
    chunk_chars: int = typer.Option(240, help="Long text is spoken in chunks of about this many characters, cut "
                                              "at sentence ends (ideographs and kana count 2.5)."),
    no_chunk: bool = typer.Option(False, "--no-chunk", help="Speak the whole text in one pass, as qwen-tts does "
                                                            "(keeps prosody across sentences; the runaway cut "
                                                            "still applies)."),
    seed: int = typer.Option(0, help="Same seed, same codes, same WAV, speculative or not."),
    spec: bool = typer.Option(True, "--spec/--no-spec", help="Speculative inner loop (default) or the plain one."),
    tree: str = typer.Option("auto", help="Draft tree: auto (the best N measured for this device; see "
                                          "`rvqtts bench speedup --save`), a node budget N (a shipped tree) or "
                                          "a tree file."),
    offsets: Optional[Path] = typer.Option(None, help="Draft offsets file; default: shipped offsets matching "
                                                      "the model, else zero offsets."),
    backend: str = typer.Option("torch", help="torch, or coreml (macOS): the inner loop runs on a Core ML "
                                              "package (docs/coreml.md)."),
    compute_units: str = typer.Option("all", help="Core ML compute units: all, cpu_and_ne, cpu_and_gpu or "
                                                  "cpu_only."),
    coreml_package: Optional[Path] = typer.Option(None, help="Core ML package from rvqtts export-coreml; default: "
                                                             "the cache's, exported on first use."),
    coreml_precision: str = typer.Option("w8a16", help="Precision of a package exported on first use: w8a16 "
                                                       "or fp16."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                                     help="On CUDA, replay the inner loop's calls from CUDA graphs."),
    codes_out: Optional[Path] = typer.Option(None, help="Save frame codes as int .npy [frames, 16] (batch: a "
                                                        "folder of NAME.npy)."),
    stats_json: Optional[Path] = typer.Option(None, help="Write the run's statistics as JSON (per utterance and "
                                                         "total)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, table or notices."),
) -> None:
    """Synthesize speech to WAV: one text, standard input, or a batch file.

    The statistics table (stderr) and --stats-json report frames, predictor calls, codes per call,
    where the time went, and RTF = compute seconds / audio seconds (below 1 is faster than real time).
    """
    from rvqtts.audio import audio_format
    from rvqtts.sampling import NonFiniteError
    from rvqtts.batch import BatchFileError, Utterance, read_batch
    from rvqtts.loading import ModelLoadError, check_voice, voices
    from rvqtts.offsets import OffsetsFileError
    from rvqtts.synthesis import GenerationSettings, choose_speculation
    from rvqtts.tree import TreeFileError

    # Everything that can be checked without the model is checked first: bad input costs no model load.
    if backend not in ("torch", "coreml"):
        fail(f"unknown --backend {backend!r}: choose torch or coreml")
    if backend == "coreml":
        _check_coreml(compute_units, coreml_precision)
    if chunk_chars < 20:
        fail(f"--chunk-chars must be at least 20, got {chunk_chars} (--no-chunk speaks the text in one pass)")
    if file is not None:
        if text is not None:
            fail("give either TEXT or -f FILE, not both")
        if out_dir is None:
            fail("-f needs --out-dir DIR for its audio files")
        try:
            utterances = read_batch(file)
        except BatchFileError as error:
            fail(str(error))
        _check_writable(out_dir, folder=True)
        if codes_out is not None:
            _check_writable(codes_out, folder=True)
    else:
        if output is None:
            fail("give -o FILE.wav (.flac, .ogg; or -o - for a WAV on standard output)")
        try:
            audio_format(output)
        except ValueError as error:
            fail(str(error))
        if output != "-":
            _check_writable(Path(output))
        if codes_out is not None:
            _check_writable(codes_out)
        utterances = [Utterance(1, _read_text(text).strip(), output)]
    if stats_json is not None:
        _check_writable(stats_json)
    try:
        settings = GenerationSettings(temperature, top_k, top_p, repetition_penalty, max_frames,
                                      predictor_temperature, predictor_top_k, predictor_top_p)
    except ValueError as error:
        fail(str(error))
    if file is not None and not force and all((out_dir / u.name).exists() for u in utterances):
        say(f"all {len(utterances)} outputs are already in {out_dir}; --force redoes them", quiet)
        return
    try:
        known_speakers, known_languages = voices(model)
    except ModelLoadError as error:
        fail(str(error))
    for item in utterances:
        try:
            check_voice(known_speakers, known_languages, item.speaker or speaker, item.language or language)
        except ValueError as error:
            fail(f"{file}:{item.line}: {error}" if file else str(error))
    synthesizer = _load_synthesizer(model, device, dtype)
    synthesizer.cuda_graphs = cuda_graphs
    device_type = "coreml" if backend == "coreml" else None  # whose best tree size --tree auto means
    if spec:
        try:
            synthesizer.speculation, notice = choose_speculation(synthesizer.code_predictor, tree, offsets,
                                                                 allow_plain=True, device_type=device_type)
        except (TreeFileError, OffsetsFileError, ValueError) as error:
            fail(str(error))
        if notice:
            say(notice, quiet)
    if backend == "coreml":
        _use_coreml(synthesizer, tree, offsets, settings, coreml_package, coreml_precision, compute_units, quiet)
    if (instruct or any(u.instruct for u in utterances)) and not synthesizer.supports_instruct:
        say("warning: this model does not support --instruct (the 0.6B ignores instructions); ignoring it")

    run = dict(speaker=speaker, language=language, instruct=instruct, seed=seed, settings=settings,
               chunk_chars=None if no_chunk else chunk_chars)
    try:
        if file is None:
            _synth_one(synthesizer, utterances[0], output, run, codes_out, stats_json, quiet)
        else:
            _synth_batch(synthesizer, utterances, out_dir, file, run, force, codes_out, stats_json, quiet)
    except NonFiniteError as error:
        typer.echo(f"rvqtts: error: {error}", err=True)
        raise typer.Exit(1)


def _check_coreml(compute_units: str, precision: str) -> None:
    """Fail with one line unless Core ML can run here with these settings."""
    from rvqtts.coreml import COMPUTE_UNITS, PRECISIONS, CoreMLError, coremltools, require_macos

    try:
        require_macos()
        coremltools()
    except CoreMLError as error:
        fail(str(error))
    if compute_units not in COMPUTE_UNITS:
        fail(f"unknown --compute-units {compute_units!r}: choose {', '.join(COMPUTE_UNITS)}")
    if precision not in PRECISIONS:
        fail(f"unknown --coreml-precision {precision!r}: choose {' or '.join(PRECISIONS)}")


def _use_coreml(synthesizer, tree: str, offsets: Optional[Path], settings, package: Optional[Path],
                precision: str, compute_units: str, quiet: bool) -> None:
    """Run the synthesizer's inner loop on a Core ML package (the plain step when it has no speculation)."""
    from rvqtts.coreml import CoreMLError, coreml_decoder
    from rvqtts.offsets import OffsetsFileError
    from rvqtts.synthesis import choose_speculation
    from rvqtts.tree import TreeFileError

    try:
        speculation = synthesizer.speculation  # None: --no-spec, whose package still holds a tree
        if speculation is None:
            speculation, _ = choose_speculation(synthesizer.code_predictor, tree, offsets, device_type="coreml")
        sampling = synthesizer.sampling(settings).predictor
        synthesizer.fused = coreml_decoder(synthesizer.code_predictor, speculation, sampling, package, precision,
                                           compute_units, report=lambda message: say(message, quiet))
    except (CoreMLError, TreeFileError, OffsetsFileError) as error:
        fail(str(error))


def _progress(quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    # A bar only helps on a terminal; in a log file it would leave blank lines behind.
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=quiet or not console.is_terminal)


def _console():
    """A rich console on stderr, at least 110 columns wide (also when stderr is a file)."""
    from rich.console import Console

    console = Console(stderr=True)
    console.width = max(console.width, 110)
    return console


def _show(rows: list[tuple[str, dict]], quiet: bool) -> None:
    from rvqtts.report import stats_table

    if not quiet:
        _console().print(stats_table(rows))


def _publish(result: dict, json_out: Optional[Path], table: Callable[[dict], object], quiet: bool) -> None:
    """A command's figures: to `json_out` if given, and as `table(result)` on stderr unless quiet."""
    from rvqtts.files import write_json

    if json_out is not None:
        write_json(json_out, result)
    if not quiet:
        _console().print(table(result))


def _write_stats(path: Optional[Path], entries: list[dict]) -> None:
    from rvqtts.files import write_json
    from rvqtts.report import total_record

    if path is not None:
        write_json(path, {"utterances": entries, "total": total_record(entries)})


def _synth_one(synthesizer, item, output, run: dict, codes_out, stats_json, quiet) -> None:
    from rvqtts.audio import write_audio, write_codes

    with _progress(quiet) as progress:
        task = progress.add_task("synthesizing", total=None)
        result = synthesizer.synthesize(item.text, **run,
                                        on_chunk=lambda done, total: progress.update(task, completed=done,
                                                                                     total=total))
    for warning in result.warnings:
        say(f"warning: {warning}", quiet)
    write_audio(output, result.audio, result.sample_rate)
    if codes_out:
        write_codes(codes_out, result.codes)
    record = result.record()
    _write_stats(stats_json, [{"name": output, **record}])
    _show([(output, record)], quiet)


def _synth_batch(synthesizer, utterances, out_dir, file, run: dict, force, codes_out, stats_json, quiet) -> None:
    from rvqtts.batch import synthesize_batch

    with _progress(quiet) as progress:
        task = progress.add_task(f"synthesizing {file.name}", total=len(utterances))

        def done(result) -> None:
            progress.advance(task)
            if result.status == "failed":
                typer.echo(f"rvqtts: {file}:{result.utterance.line}: failed: {result.error}", err=True)
            for warning in (result.record or {}).get("warnings", []):
                say(f"warning: {result.utterance.name}: {warning}", quiet)

        results = synthesize_batch(synthesizer, utterances, out_dir, **run, force=force, codes_dir=codes_out,
                                   on_done=done)
    made = [(r.utterance.name, r.record) for r in results if r.status == "done"]
    skipped = sum(r.status == "skipped" for r in results)
    failed = sum(r.status == "failed" for r in results)
    _write_stats(stats_json, [{"name": name, **record} for name, record in made])
    if made:
        from rvqtts.report import total_record

        _show(made + ([("total", total_record([r for _, r in made]))] if len(made) > 1 else []), quiet)
    say(f"{len(made)} written, {skipped} skipped (already there; --force redoes them), {failed} failed "
        f"-> {out_dir}", quiet and not failed)
    if failed:
        raise typer.Exit(1)


def _load_synthesizer(model: str, device: str, dtype: str):
    """The model loaded for the drafting commands (fails with one line on a bad model, device or dtype)."""
    from rvqtts.loading import DTYPES, ModelLoadError
    from rvqtts.synthesis import Synthesizer

    if dtype not in ("auto", *DTYPES):
        fail(f"unknown --dtype {dtype!r}: choose auto, {', '.join(DTYPES)}")
    if device not in ("auto", "cpu", "mps") and not device.startswith("cuda"):
        fail(f"unknown --device {device!r}: choose auto, cpu, cuda or mps")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    chosen = _pick_device(device)
    try:
        return Synthesizer.load(model, device=chosen, dtype=_pick_dtype(dtype, chosen))
    except ModelLoadError as error:
        fail(str(error))


def _list_of_ints(value: str, option: str, least: int = 1) -> list[int]:
    try:
        numbers = sorted({int(v) for v in value.split(",")})
    except ValueError:
        fail(f"{option} must be comma-separated whole numbers, got {value!r}")
    if not numbers or numbers[0] < least:
        fail(f"{option} must be at least {least}, got {value!r}")
    return numbers


def _check_source(texts: Optional[Path], contexts: Optional[Path], audio: Optional[Path] = None,
                  audio_allowed: bool = False) -> None:
    if sum(source is not None for source in (texts, contexts, audio)) != 1:
        fail("give one data source: --texts FILE (synthesize and record), --contexts FILE (recorded frames)"
             + (" or --audio FILE.jsonl (recordings and transcripts)" if audio_allowed else ""))


def _frames(synthesizer, texts: Optional[Path], contexts: Optional[Path], split: str, speaker: str, language: str,
            seed: int, quiet: bool, audio: Optional[Path] = None):
    """Frames from a contexts file, from recordings by teacher forcing, or recorded by synthesizing a text
    file with the plain inner loop."""
    from rvqtts.batch import BatchFileError, read_batch
    from rvqtts.contexts import ContextsFileError, force_contexts, load_contexts, read_audio_pairs, record_contexts
    from rvqtts.synthesis import GenerationSettings

    config = synthesizer.code_predictor.config
    if contexts is not None:
        try:
            return load_contexts(contexts, split, synthesizer.talker.config.hidden_size, config.num_code_groups)
        except ContextsFileError as error:
            fail(str(error))
    if audio is not None:
        try:
            pairs = read_audio_pairs(audio)
            for pair in pairs:
                synthesizer.check_voice(pair.speaker or speaker, pair.language or language)
        except (ContextsFileError, ValueError) as error:
            fail(str(error))
        with _progress(quiet) as progress:
            task = progress.add_task(f"teacher forcing {audio.name}", total=len(pairs))
            frames = force_contexts(synthesizer, pairs, speaker, language,
                                    on_pair=lambda done, total: progress.update(task, completed=done))
        say(f"recorded {len(frames)} frames from {len(pairs)} recordings", quiet)
        return frames
    try:
        utterances = read_batch(texts)
    except BatchFileError as error:
        fail(str(error))
    for item in utterances:
        try:
            synthesizer.check_voice(item.speaker or speaker, item.language or language)
        except ValueError as error:
            fail(f"{texts}:{item.line}: {error}")
    with _progress(quiet) as progress:
        task = progress.add_task(f"synthesizing {texts.name}", total=len(utterances))
        frames = record_contexts(synthesizer, utterances, speaker, language, seed, GenerationSettings(),
                                 on_utterance=lambda done, total: progress.update(task, completed=done))
    say(f"recorded {len(frames)} frames from {len(utterances)} texts", quiet)
    return frames


def _check_new_file(path: Path, force: bool, suffix: str) -> None:
    if path.suffix != suffix:
        fail(f"{path}: the file name must end in {suffix}")
    if path.exists() and not force:
        fail(f"{path} already exists: --force replaces it")
    _check_writable(path)


TEXTS_HELP = "Texts to synthesize and record (.txt, or .jsonl with text/speaker/language per line)."
CONTEXTS_HELP = "Recorded frames: a contexts .npz (h_t, codes, language), as rvqtts standin build writes."
SPLIT_HELP = "The split of a contexts file that has splits (calibration or evaluation)."


@app.command("train-offsets")
def train_offsets_command(
    out: Path = typer.Option(..., help="Offsets file to write (.safetensors)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    texts: Optional[Path] = typer.Option(None, help=TEXTS_HELP + " Self-distillation: the offsets learn from "
                                                                 "the model's own codes."),
    contexts: Optional[Path] = typer.Option(None, help=CONTEXTS_HELP + " Teacher forcing on their codes."),
    audio: Optional[Path] = typer.Option(None, help="Recordings and transcripts: a .jsonl file of {\"audio\": "
                                                    "WAV, \"text\": transcript} (optional speaker, language). "
                                                    "Teacher forcing on the codes of the model's speech tokenizer."),
    split: str = typer.Option("calibration", help=SPLIT_HELP),
    resample: bool = typer.Option(False, "--resample", help="With --contexts: train on codes the model samples "
                                                            "itself from each frame's h_t and c0."),
    depth: int = typer.Option(3, help="K, codes drafted ahead (1..14)."),
    target: str = typer.Option("hard", help="hard: the codes; soft: the distribution they are sampled from."),
    learning_rate: float = typer.Option(1e-3, help="Adam's learning rate."),
    batch: int = typer.Option(32, help="Frames per step."),
    max_steps: int = typer.Option(20000, help="Most training steps (training stops earlier when the held-out "
                                              "loss stops falling)."),
    held_out: float = typer.Option(0.1, help="Fraction of the frames held out for early stopping."),
    speaker: str = typer.Option("vivian", help="With --texts or --audio: speaker of lines that name none."),
    language: str = typer.Option("auto", help="With --texts or --audio: language of lines that name none."),
    seed: int = typer.Option(0, help="Seed of synthesis, the split and the batches."),
    save_contexts: Optional[Path] = typer.Option(None, help="With --texts or --audio: also keep the recorded "
                                                            "frames (.npz) for rvqtts calibrate and accept."),
    device: str = typer.Option("auto", help="auto (cuda, then mps, then cpu), cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Train the draft offsets (K x hidden numbers) of a frozen model; backbone and heads stay frozen.

    Codes do not change: the verifier never reads an offset state. The file records the model, K, the
    data and the losses; rvqtts synth uses it when given with --offsets.
    """
    from rvqtts.contexts import save_contexts as write_contexts
    from rvqtts.offsets import save_offsets
    from rvqtts.training import TrainingConfig, fit_offsets

    _check_source(texts, contexts, audio, audio_allowed=True)
    _check_new_file(out, force, ".safetensors")
    if save_contexts is not None:
        _check_new_file(save_contexts, force, ".npz")
    try:
        config = TrainingConfig(depth=depth, learning_rate=learning_rate, batch=batch, max_steps=max_steps,
                                target=target, seed=seed)
        if not 0 < held_out < 1:
            raise ValueError(f"--held-out must be between 0 and 1, got {held_out}")
    except ValueError as error:
        fail(str(error))
    synthesizer = _load_synthesizer(model, device, dtype)
    frames = _frames(synthesizer, texts, contexts, split, speaker, language, seed, quiet, audio)
    if save_contexts is not None:
        write_contexts(frames, save_contexts)
    with _progress(quiet) as progress:
        task = progress.add_task("training offsets", total=max_steps)

        def report(step: int, total: int, train_loss: float, held_loss: float) -> None:
            progress.update(task, completed=step,
                            description=f"training offsets (loss {train_loss:.3f}, held out {held_loss:.3f})")

        try:
            offsets, record = fit_offsets(synthesizer, frames, config, held_out=held_out, self_distill=resample,
                                          model_name=model, on_progress=report)
        except ValueError as error:
            fail(str(error))
    save_offsets(offsets, out)
    say(f"held-out loss {record['initial_held_out_loss']:.4f} -> {record['held_out_loss']:.4f} nats "
        f"(top-1 by depth {record['initial_held_out_top1']} -> {record['held_out_top1']}) after "
        f"{record['steps']} steps; wrote {out}", quiet)


def _drafting(synthesizer, offsets: Optional[Path], depth: int):
    """Offsets [K, H] from a file, or zeros (reused heads)."""
    from rvqtts.offsets import Offsets, OffsetsFileError, load_offsets, predictor_fingerprint

    if offsets is None:
        return Offsets.zeros(depth, synthesizer.hidden_size)
    try:
        return load_offsets(offsets, hidden_size=synthesizer.hidden_size,
                            fingerprint=predictor_fingerprint(synthesizer.code_predictor))
    except OffsetsFileError as error:
        fail(str(error))


@app.command()
def calibrate(
    out_dir: Path = typer.Option(..., help="Folder for the acceptance table and one tree file per budget."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    offsets: Optional[Path] = typer.Option(None, help="Offsets file; default: zero offsets (reused heads)."),
    texts: Optional[Path] = typer.Option(None, help=TEXTS_HELP),
    contexts: Optional[Path] = typer.Option(None, help=CONTEXTS_HELP),
    split: str = typer.Option("calibration", help=SPLIT_HELP),
    budgets: str = typer.Option("4,7,8,15,16,31,32,63,64", help="Node budgets N, comma-separated: one tree each "
                                                               "(N + 1 a multiple of 8 or 16 is often cheaper to run)."),
    name: Optional[str] = typer.Option(None, help="File name prefix; default: the offsets file's name, or "
                                                  "reused-heads."),
    speaker: str = typer.Option("vivian", help="With --texts: speaker of lines that name none."),
    language: str = typer.Option("auto", help="With --texts: language of lines that name none."),
    seed: int = typer.Option(0, help="Seed of synthesis and of the codes sampled for the table."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    force: bool = typer.Option(False, "--force", help="Replace files that exist."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Measure the per-depth, per-rank acceptance table on free-running codes and grow one sparse tree
    per node budget (depth capped at K), each with its expected codes per call."""
    from rvqtts.calibration import calibrate_trees
    from rvqtts.tree import ACCEPTANCE_SUFFIX, save_acceptance, save_tree

    _check_source(texts, contexts)
    sizes = _list_of_ints(budgets, "--budgets")
    prefix = name or (offsets.stem if offsets else "reused-heads")
    table_path = out_dir / f"{prefix}{ACCEPTANCE_SUFFIX}"
    tree_paths = {n: out_dir / f"{prefix}-n{n}.json" for n in sizes}
    existing = [str(p) for p in (table_path, *tree_paths.values()) if p.exists()]
    if existing and not force:
        fail(f"{', '.join(existing)} already exist: --force replaces them")
    _check_writable(out_dir, folder=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    synthesizer = _load_synthesizer(model, device, dtype)
    drafting = _drafting(synthesizer, offsets, 3)
    frames = _frames(synthesizer, texts, contexts, split, speaker, language, seed, quiet)
    with _progress(quiet) as progress:
        progress.add_task(f"sampling {len(frames)} frames and ranking drafts", total=None)
        table, trees = calibrate_trees(synthesizer, frames, drafting, sizes, seed, model_name=model,
                                       offsets_name=offsets.name if offsets else "")
    save_acceptance(table, table_path)
    for size, tree in trees.items():
        save_tree(tree, tree_paths[size])
    summary = ", ".join(f"N={n}: {t.expected_codes_per_call}" for n, t in trees.items())
    say(f"expected codes per call {summary}; wrote {table_path} and {len(trees)} trees in {out_dir}", quiet)


@app.command("export-coreml")
def export_coreml(
    out: Path = typer.Option(..., "--out", help="Folder for the .mlpackage (named by what it was built for)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    tree: str = typer.Option("auto", help="Draft tree: auto (the best N measured for Core ML, else 16), a node "
                                          "budget N (a shipped tree) or a tree file."),
    offsets: Optional[Path] = typer.Option(None, help="Draft offsets file; default: shipped offsets matching "
                                                      "the model, else zero offsets."),
    precision: str = typer.Option("w8a16", help="w8a16 (int8 per-channel weights, float16 activations) or fp16."),
    min_target: str = typer.Option("macOS15", help="Oldest macOS the package runs on (macOS15 or later)."),
    temperature: float = typer.Option(0.9, help="Sampling temperature baked into the package (synth's must match)."),
    top_k: int = typer.Option(50, help="Top-k baked into the package (0 = off; synth's must match)."),
    force: bool = typer.Option(False, "--force", help="Export again over a package of the same name."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress messages."),
) -> None:
    """Export the fused inner loop (prefill, tree round, plain step) for one tree as a Core ML package,
    for `rvqtts synth --backend coreml --coreml-package`. Runs on any OS; the package runs on macOS."""
    from rvqtts.coreml import CoreMLError, check_export_settings, export_package
    from rvqtts.offsets import OffsetsFileError
    from rvqtts.sampling import SamplingConfig
    from rvqtts.synthesis import choose_speculation
    from rvqtts.tree import TreeFileError

    try:
        sampling = SamplingConfig(temperature, top_k)
        check_export_settings(sampling, precision, min_target)
    except (CoreMLError, ValueError) as error:
        fail(str(error))
    _check_writable(out, folder=True)
    synthesizer = _load_synthesizer(model, "cpu", "float32")
    try:
        speculation, notice = choose_speculation(synthesizer.code_predictor, tree, offsets, device_type="coreml")
        if notice:
            say(notice, quiet)
        exported = export_package(synthesizer.code_predictor, speculation, sampling, out, precision, min_target,
                                  report=lambda message: say(message, quiet), force=force)
    except (CoreMLError, TreeFileError, OffsetsFileError, ValueError) as error:
        fail(str(error))
    if exported.reused:
        say(f"{exported.path} is already exported for this model, tree, offsets and sampling (--force redoes it)",
            quiet)
    else:
        say(f"wrote {exported.path}: {exported.bytes / 1e6:.1f} MB in {exported.seconds:.1f} s", quiet)
    typer.echo(str(exported.path))


@app.command()
def accept(
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    offsets: Optional[Path] = typer.Option(None, help="Offsets file; default: shipped offsets matching the "
                                                      "model, else zero offsets."),
    tree: str = typer.Option("16", help="A node budget N (a shipped tree) or a tree file."),
    texts: Optional[Path] = typer.Option(None, help=TEXTS_HELP),
    contexts: Optional[Path] = typer.Option(None, help=CONTEXTS_HELP),
    split: str = typer.Option("evaluation", help=SPLIT_HELP),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the figures as JSON."),
    speaker: str = typer.Option("vivian", help="With --texts: speaker of lines that name none."),
    language: str = typer.Option("auto", help="With --texts: language of lines that name none."),
    seed: int = typer.Option(0, help="Seed of synthesis and of the speculative decoding's draws."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
) -> None:
    """Measure codes per predictor call of the speculative inner loop on these frames: overall and per
    language, with a 95 % confidence interval."""
    from rvqtts.calibration import codes_per_call
    from rvqtts.offsets import OffsetsFileError
    from rvqtts.report import codes_per_call_table
    from rvqtts.synthesis import choose_speculation
    from rvqtts.tree import TreeFileError

    _check_source(texts, contexts)
    if json_out is not None:
        _check_writable(json_out)
    synthesizer = _load_synthesizer(model, device, dtype)
    try:
        speculation, notice = choose_speculation(synthesizer.code_predictor, tree, offsets)
    except (TreeFileError, OffsetsFileError, ValueError) as error:
        fail(str(error))
    if notice:
        say(notice, quiet)
    frames = _frames(synthesizer, texts, contexts, split, speaker, language, seed, quiet)
    with _progress(quiet) as progress:
        progress.add_task(f"decoding {len(frames)} frames", total=None)
        result = codes_per_call(synthesizer.code_predictor, speculation,
                                frames.prefixes(synthesizer.talker.get_input_embeddings()), list(frames.language),
                                seed)
    result.update(model=model, tree=tree, tree_nodes=speculation.tree.nodes,
                  offsets=str(offsets) if offsets else speculation.offsets.metadata.get("source", "shipped"),
                  frames_source=frames.source)
    _publish(result, json_out, codes_per_call_table, quiet)


standin_app = typer.Typer(help="The trained stand-in code predictor (a proxy for tests and benchmarks, not "
                                "Qwen3-TTS).", **HELP_STYLE)
app.add_typer(standin_app, name="standin")


@standin_app.command("build")
def standin_build(
    out: Path = typer.Argument(..., help="Folder for the model, codec, contexts and report.json."),
    small: bool = typer.Option(False, "--small", help="The same pipeline, shrunk to run in well under two minutes."),
    device: str = typer.Option("cpu", help="cpu or cuda (training and the codec's k-means)."),
    sentences: Optional[Path] = typer.Option(None, help="Folder of {en,de,es,ru,ja,cmn}.txt; default: the 86 "
                                                        "sentences shipped with rvqtts."),
    steps: Optional[int] = typer.Option(None, help="Training steps (default 1500, --small 150); more on a GPU."),
) -> None:
    """Rebuild corpus (espeak-ng), codec, stand-in and contexts with fixed seeds, and report faithfulness.

    Prints the tables and writes OUT/report.json. Needs espeak-ng (Debian: apt-get install espeak-ng).
    """
    from rvqtts.report import standin_tables
    from rvqtts.standin.build import build_standin
    from rvqtts.standin.corpus import CorpusError

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        fail(f"unknown --device {device!r}: choose cpu or cuda")
    try:
        report = build_standin(out, small=small, device=device, sentences_dir=sentences, steps=steps,
                               log=lambda m: say(m))
    except CorpusError as error:
        fail(str(error))
    console = _console()
    for table in standin_tables(report):
        console.print(table)
    say(f"wrote {out / 'report.json'}")


bench_app = typer.Typer(help="Benchmarks: predictor call cost per query length, projected speedup per tree size, "
                             "and whole synthesis against stock qwen-tts (docs/benchmarks.md).", **HELP_STYLE)
app.add_typer(bench_app, name="bench")


@bench_app.command("predictor")
def bench_predictor_command(
    model: Optional[str] = typer.Option(None, help="Time this checkpoint's code predictor (hub id or folder)."),
    dims: str = typer.Option("0.6b", help="Without --model: random weights at the real 0.6b or 1.7b dimensions."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16."),
    q: str = typer.Option(",".join(map(str, DEFAULT_BENCH_QUERIES)), "--q",
                          help="Query lengths (q = N + 1 for a tree of N nodes; 1 is always timed)."),
    repeats: int = typer.Option(30, help="Timed repetitions per query length (after 5 warm-up rounds)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the figures as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
) -> None:
    """Median and spread of one predictor call per query length (tree mask, KV length 8, after warm-up),
    with qwen-tts's own q = 1 forward timed in the same run, interleaved."""
    from rvqtts.bench import PREDICTOR_DIMS, bench_predictor, random_code_predictor
    from rvqtts.loading import DTYPES
    from rvqtts.report import predictor_table

    queries = _list_of_ints(q, "--q")
    if 1 not in queries:
        queries = [1, *queries]
    if dtype not in DTYPES:
        fail(f"unknown --dtype {dtype!r}: choose {', '.join(DTYPES)}")
    if repeats < 1:
        fail(f"--repeats must be at least 1, got {repeats}")
    if model is None:
        if dims not in PREDICTOR_DIMS:
            fail(f"unknown --dims {dims!r}: choose {', '.join(PREDICTOR_DIMS)}")
        import torch

        code_predictor = random_code_predictor(dims, getattr(torch, dtype), _pick_device(device))
        weights = f"random at the real {dims} dimensions"
    else:
        code_predictor = _load_synthesizer(model, device, dtype).code_predictor
        weights = model
    with _progress(quiet) as progress:
        task = progress.add_task("warming up and timing", total=len(queries))
        result = bench_predictor(code_predictor, queries, repeats=repeats, weights=weights,
                                 progress=lambda done, total: progress.update(task, completed=done))
    _publish(result, json_out, predictor_table, quiet)


@bench_app.command("speedup")
def bench_speedup_command(
    predictor: Path = typer.Option(..., help="JSON that `rvqtts bench predictor --json` wrote."),
    acceptance: Optional[Path] = typer.Option(None, help="Acceptance table (`rvqtts calibrate` writes "
                                                         "NAME-acceptance.json); default: the paper's figures."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG in the manner of the paper's Figure 4."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the projection as JSON."),
    save: bool = typer.Option(False, "--save", help="Make the best N the default tree of `rvqtts synth` on "
                                                   "this kind of device."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table."),
) -> None:
    """Projected inner-loop speedup per N = codes per call at N / (cost of a q = N + 1 call / cost of a
    q = 1 call), and the best N."""
    from rvqtts.bench import codes_per_call_by_budget, project_speedup, plot_speedup
    from rvqtts.files import read_json, write_json
    from rvqtts.report import speedup_table
    from rvqtts.tree import AcceptanceFileError, load_acceptance, save_best_budget

    try:
        measured = read_json(predictor, "predictor bench", ValueError)
        if not isinstance(measured, dict) or not {"q", "ratio_to_q1", "ratio_to_stock_q1", "device"} <= set(measured):
            raise ValueError(f"{predictor} is not the JSON of `rvqtts bench predictor --json`")
        table = load_acceptance(acceptance) if acceptance else None
        figures, source = codes_per_call_by_budget(table)
        projection = project_speedup(figures, measured)
    except (ValueError, AcceptanceFileError) as error:
        fail(str(error))
    projection["acceptance_source"] = source
    if plot:
        try:
            plot_speedup(projection, source, plot)
        except ImportError:
            fail("--plot needs matplotlib: pip install 'rvqtts[bench]' (or pip install matplotlib)")
    if json_out:
        write_json(json_out, projection)
    if save:
        fingerprint = table.get("model_fingerprint") if table else None  # the choice is this model's only
        where = save_best_budget(projection["device"], projection["best_N"], f"rvqtts bench speedup: {source}; "
                                 f"{projection['dtype']}, {projection['weights']}", fingerprint)
        device_type = projection["device"].split(":")[0]
        scope = "for this model" if fingerprint else "for every model without its own choice"
        choice = (f"defaults to --tree {projection['best_N']}" if projection["best_N"]
                  else "runs the plain loop (no tree pays)")
        say(f"rvqtts synth on {device_type} now {choice} {scope} (recorded in {where})", quiet)
    if not quiet:
        _console().print(speedup_table(projection))


@bench_app.command("e2e")
def bench_e2e_command(
    texts: Path = typer.Option(..., help="Text file, one utterance per line (.jsonl lines may set speaker and "
                                         "language)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    tree: str = typer.Option("auto", help="Tree of the speculative runs: auto (the best N for this device), N, "
                                          "or a tree file."),
    offsets: Optional[Path] = typer.Option(None, help="Offsets file; default: shipped offsets matching the model."),
    speaker: str = typer.Option("vivian", help="Speaker of lines that name none."),
    language: str = typer.Option("auto", help="Language of lines that name none."),
    seed: int = typer.Option(0, help="Seed of every run."),
    max_frames: Optional[int] = typer.Option(None, help="Most frames per utterance."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every run and the totals as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
) -> None:
    """Stock qwen-tts, `rvqtts synth --no-spec` and `rvqtts synth` on the same texts and seed, interleaved:
    wall, inner-loop, talker and decoder time per frame, RTF, and the ratios between them."""
    from rvqtts.batch import BatchFileError, read_batch
    from rvqtts.bench import bench_e2e
    from rvqtts.offsets import OffsetsFileError
    from rvqtts.report import e2e_table
    from rvqtts.synthesis import GenerationSettings, choose_speculation
    from rvqtts.tree import TreeFileError

    try:
        lines = [(u.text, u.speaker or speaker, u.language or language) for u in read_batch(texts)]
        settings = GenerationSettings(max_frames=max_frames)
    except (BatchFileError, ValueError) as error:
        fail(str(error))
    synthesizer = _load_synthesizer(model, device, dtype)
    try:
        for _, line_speaker, line_language in lines:
            synthesizer.check_voice(line_speaker, line_language)
        speculation, notice = choose_speculation(synthesizer.code_predictor, tree, offsets)
    except (TreeFileError, OffsetsFileError, ValueError) as error:
        fail(str(error))
    if notice:
        say(notice, quiet)
    with _progress(quiet) as progress:
        task = progress.add_task(f"{len(lines)} texts x 3 variants", total=len(lines) * 3)
        result = bench_e2e(synthesizer.tts, lines, speculation, seed, settings,
                           progress=lambda done, total: progress.update(task, completed=done))
    _publish(result, json_out, e2e_table, quiet)


@bench_app.command("coreml")
def bench_coreml_command(
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    contexts: Optional[Path] = typer.Option(None, help=CONTEXTS_HELP),
    texts: Optional[Path] = typer.Option(None, help=TEXTS_HELP),
    split: str = typer.Option("evaluation", help=SPLIT_HELP),
    frames: int = typer.Option(200, help="Frames to decode (the first of the source)."),
    package: Optional[Path] = typer.Option(None, help="Package to measure (macOS); default: the cache's, "
                                                      "exported on first use."),
    tree: str = typer.Option("auto", help="auto (the best N measured for Core ML, else 16), N, or a tree file."),
    offsets: Optional[Path] = typer.Option(None, help="Offsets file; default: shipped offsets matching the model."),
    precision: str = typer.Option("w8a16", help="Precision of a package exported on first use: w8a16 or fp16."),
    compute_units: str = typer.Option("all", help="all, cpu_and_ne, cpu_and_gpu or cpu_only."),
    seed: int = typer.Option(0, help="Seed of the noise."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the figures as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress or table."),
) -> None:
    """Core ML package against the float32 PyTorch engine on the same frames and noise: codes and frames that
    agree, codes per call, ms per frame speculative and plain. Off macOS, PyTorch float16 stands in for the
    package (a proxy for float16 rounding, not a Core ML measurement)."""
    import sys

    from rvqtts.bench import bench_fused
    from rvqtts.coreml import CoreMLError, coreml_decoder, float16_stand_in
    from rvqtts.offsets import OffsetsFileError
    from rvqtts.report import coreml_table
    from rvqtts.sampling import SamplingConfig
    from rvqtts.synthesis import choose_speculation
    from rvqtts.tree import TreeFileError

    _check_source(texts, contexts)
    if frames < 1:
        fail(f"--frames must be at least 1, got {frames}")
    on_mac = sys.platform == "darwin"
    if on_mac:
        _check_coreml(compute_units, precision)
    if json_out is not None:
        _check_writable(json_out)
    synthesizer = _load_synthesizer(model, "cpu", "float32")
    sampling = SamplingConfig()
    try:
        speculation, notice = choose_speculation(synthesizer.code_predictor, tree, offsets, device_type="coreml")
        if on_mac:
            candidate = coreml_decoder(synthesizer.code_predictor, speculation, sampling, package, precision,
                                       compute_units, report=lambda message: say(message, quiet))
        else:
            candidate = float16_stand_in(synthesizer.code_predictor, speculation, sampling)
    except (CoreMLError, TreeFileError, OffsetsFileError, ValueError) as error:
        fail(str(error))
    if notice:
        say(notice, quiet)
    source = _frames(synthesizer, texts, contexts, split, "vivian", "auto", seed, quiet)
    prefixes = source.prefixes(synthesizer.talker.get_input_embeddings())[:frames]
    with _progress(quiet) as progress:
        progress.add_task(f"decoding {len(prefixes)} frames three ways", total=None)
        result = bench_fused(synthesizer.code_predictor, speculation, candidate, prefixes, seed, sampling)
    result.update(model=model, candidate=f"coreml {compute_units}" if on_mac else "pytorch float16 (proxy)",
                  tree_nodes=speculation.tree.nodes, frames_source=source.source)
    _publish(result, json_out, coreml_table, quiet)

def main() -> None:
    app(prog_name="rvqtts")


if __name__ == "__main__":
    main()
