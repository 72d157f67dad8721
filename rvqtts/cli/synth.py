"""`rvqtts synth`: one text, standard input or a batch file (here or on a Ray cluster) to audio, with
statistics."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from rvqtts.cli import options
from rvqtts.cli.common import (
    FIRST_STREAM_FRAMES_HELP,
    STREAM_FRAMES_HELP,
    app,
    batch_rows,
    check_coreml,
    check_new_file,
    check_stream_frames,
    ensure_writable,
    fail,
    load_synthesizer,
    progress_bar,
    refused,
    say,
    show_stats,
    write_stats,
)

if TYPE_CHECKING:
    from rvqtts.qwen.codec import StreamPacing


def _read_text(text: Optional[str]) -> str:
    if text is None or text == "-":
        if sys.stdin is None or sys.stdin.isatty():
            fail("no text: give TEXT, pipe text on standard input, or use -f FILE")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
        try:
            text = data.decode("utf-8") if isinstance(data, bytes) else data
        except UnicodeDecodeError as error:
            fail(
                f"standard input is not UTF-8 text (byte {error.start} is {data[error.start : error.start + 1]!r}): "
                f"convert it first, e.g. iconv -f LATIN1 -t UTF-8"
            )
    if not text.strip():
        fail("the text is empty: give something to say")
    return text


@app.command()
def synth(
    text: Optional[str] = typer.Argument(None, help="Text to speak; '-' or nothing reads standard input."),
    output: Optional[str] = typer.Option(
        None,
        "-o",
        "--output",
        help="Audio file to write: .wav, .flac, .ogg (Vorbis), .mp3 or .opus; '-' writes to standard output "
        "(--format).",
    ),
    stream: bool = typer.Option(
        False,
        "--stream",
        help="Write audio while it is made: the first piece after --first-stream-frames frames, then every "
        "--stream-frames (decoded incrementally: the audio of a run without --stream up to float rounding, for chunks "
        "of up to 300 frames); a file appears when it is complete.",
    ),
    first_stream_frames: int = typer.Option(1, help=FIRST_STREAM_FRAMES_HELP),
    stream_frames: int = typer.Option(4, help=STREAM_FRAMES_HELP),
    stdout_format: str = typer.Option(
        "wav",
        "--format",
        help="What -o - writes: wav (streamed: a WAV header of unknown length) or raw (16-bit little-endian mono PCM "
        "at 24 kHz).",
    ),
    file: Optional[Path] = typer.Option(
        None,
        "-f",
        "--file",
        help="Batch: a .txt file (one utterance per line) or a .jsonl file (text, speaker, language, instruct, out; on "
        "Base models ref_audio, ref_text, x_vector_only or voice).",
    ),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Batch output folder (required with -f)."),
    force: bool = typer.Option(False, "--force", help="Batch: overwrite outputs that already exist."),
    batch_size: str = typer.Option(
        "auto",
        "--batch-size",
        help="Batch: lines spoken together, a row each in every call of both loops (a free row takes the next line); "
        "auto: the size measured best on this machine and model (once; on Ray, on each worker's; 1 with "
        "RVQTTS_CHOICES=fixed). Each line's file is the one a one-line run writes where the kernels keep rows "
        "invariant (rvqtts tune); a batch's inner loop speculates as one line's does, every row's tree round in one "
        "call.",
    ),
    ray: Optional[str] = options.RAY,
    workers: Optional[int] = options.WORKERS,
    cpus_per_worker: Optional[float] = options.CPUS_PER_WORKER,
    gpus_per_worker: Optional[float] = options.GPUS_PER_WORKER,
    model: str = options.MODEL,
    device: str = options.DEVICE,
    dtype: str = options.DTYPE,
    decoder_dtype: str = options.DECODER_DTYPE,
    weights: str = options.WEIGHTS,
    speaker: Optional[str] = options.SPEAKER,
    ref_audio: Optional[Path] = options.REF_AUDIO,
    ref_text: Optional[str] = options.REF_TEXT,
    x_vector_only: bool = options.X_VECTOR_ONLY,
    voice: Optional[Path] = options.VOICE,
    save_voice: Optional[Path] = typer.Option(
        None,
        help="Write the voice cloned from --ref-audio to this file (.safetensors) for --voice; with no text, only "
        "that.",
    ),
    language: str = typer.Option("auto", help="Language, or auto."),
    instruct: Optional[str] = options.INSTRUCT,
    temperature: Optional[float] = options.TEMPERATURE,
    top_k: Optional[int] = options.TOP_K,
    top_p: Optional[float] = options.TOP_P,
    predictor_temperature: Optional[float] = options.PREDICTOR_TEMPERATURE,
    predictor_top_k: Optional[int] = options.PREDICTOR_TOP_K,
    predictor_top_p: Optional[float] = options.PREDICTOR_TOP_P,
    repetition_penalty: Optional[float] = options.REPETITION_PENALTY,
    max_frames: Optional[int] = options.MAX_FRAMES,
    speed: float = typer.Option(
        1.0,
        help="Play the speech this many times faster, 0.25 to 4, its pitch kept (time-stretched: WSOLA); "
        "streamed pieces join seamlessly.",
    ),
    chunk_chars: int = options.CHUNK_CHARS,
    no_chunk: bool = typer.Option(
        False,
        "--no-chunk",
        help="Speak the whole text in one pass, as qwen-tts does (keeps prosody across sentences; the runaway cut "
        "still applies).",
    ),
    seed: int = typer.Option(
        0,
        help="Same seed, same codes, speculative or not, on the same model, dtype, device, thread count and kernel "
        "choices, wherever the chosen kernels are row-invariant (rvqtts tune); the same WAV also needs the speech "
        "decoder's bits, which depend on the thread count (docs/usage.md: Same seed, same codes).",
    ),
    spec: bool = options.SPEC,
    tree: str = options.TREE,
    offsets: Optional[Path] = options.OFFSETS,
    backend: str = typer.Option(
        "torch", help="torch, or coreml (macOS): the inner loop runs on a Core ML package (docs/coreml.md)."
    ),
    compute_units: str = typer.Option("all", help="Core ML compute units: all, cpu_and_ne, cpu_and_gpu or cpu_only."),
    coreml_package: Optional[Path] = typer.Option(
        None, help="Core ML package from rvqtts export-coreml; default: the cache's, exported on first use."
    ),
    coreml_precision: str = typer.Option("w8a16", help="Precision of a package exported on first use: w8a16 or fp16."),
    cuda_graphs: bool = typer.Option(
        True,
        "--cuda-graphs/--no-cuda-graphs",
        help="On CUDA, replay the talker's and the inner loop's calls from CUDA graphs.",
    ),
    codes_out: Optional[Path] = typer.Option(
        None, help="Save frame codes as int .npy [frames, 16] (batch: a folder of NAME.npy)."
    ),
    stats_json: Optional[Path] = typer.Option(
        None, help="Write the run's statistics as JSON (per utterance and total)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, table or notices."),
) -> None:
    """Synthesize speech to audio files: one text, standard input, or a batch file.

    The statistics table (stderr) and --stats-json report frames, predictor calls, codes per call,
    where the time went, the time to first audio, and RTF = compute seconds / audio seconds (below 1 is
    faster than real time).
    """
    # Everything that can be checked without the model is checked first: bad input costs no model load.
    _check_options(backend, weights, compute_units, coreml_precision, stdout_format, chunk_chars)
    check_stream_frames(first_stream_frames, stream_frames)
    check_worker_options(ray, workers, cpus_per_worker, gpus_per_worker)
    if file is None:  # one text: a voice this model does not speak is refused from its config, before torch loads
        cloned = ref_audio is not None or voice is not None or ref_text is not None or x_vector_only
        _refuse_unknown_voice(model, speaker, language, instruct, cloned)
    clone = voice_source(ref_audio, ref_text, x_vector_only, voice)
    if save_voice is not None:
        save_voice = _checked_save_voice(save_voice, clone, ray)
        if text is None and file is None and output is None:  # only the voice: nothing to say
            _save_voice_only(clone, save_voice, model, device, dtype, quiet)
            return
    engine = (device, dtype, decoder_dtype, weights, spec, tree, offsets, cuda_graphs)
    if ray is not None:
        if file is None:
            fail("--ray is for batch files: give -f FILE --out-dir DIR")
        if backend != "torch":
            fail("--ray runs the torch backend; Core ML packages run on one Mac (drop --backend coreml)")
        worker_spec = ray_worker_spec(model, engine, workers, cpus_per_worker, gpus_per_worker)
    utterances, rows = _inputs(text, file, output, out_dir, stream, batch_size, stdout_format, codes_out)
    output = output if file is not None else utterances[0].name
    ensure_writable(stats_json)
    from rvqtts.qwen.codec import StreamPacing
    from rvqtts.synthesis.settings import Line

    asked = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, speed=speed)
    predictor = dict(temperature=predictor_temperature, top_k=predictor_top_k, top_p=predictor_top_p)
    settings = generation_settings(asked, predictor, max_frames)
    if file is not None and not force and save_voice is None and all((out_dir / u.name).exists() for u in utterances):
        say(f"all {len(utterances)} outputs are already in {out_dir}; --force redoes them", quiet)
        return
    defaults = Line(speaker=speaker, language=language, instruct=instruct, seed=seed, settings=settings, clone=clone)
    chunk_chars = None if no_chunk else chunk_chars
    making, voices = _checked_voices(model, utterances, file, out_dir, force, defaults)
    batch = (utterances, out_dir, file, defaults, chunk_chars, force, codes_out, stats_json, quiet)
    with _run_errors():
        if ray is not None:
            from rvqtts.cli.batch import run_on_ray

            choices = replace(worker_spec.choices, batch_size=rows)  # auto: each worker measures
            run_on_ray(replace(worker_spec, voices=tuple(voices), choices=choices), ray, workers, *batch)
            return
        # the model is loaded here; on Ray each worker loads its own; the tree size --tree auto means is Core ML's there
        synthesizer = load_synthesizer(model, quiet, *engine, rows, "coreml" if backend == "coreml" else None)
        if backend == "coreml":
            coreml = (coreml_package, coreml_precision, compute_units)
            synthesizer = _on_coreml(synthesizer, tree, offsets, settings, *coreml, quiet)
        _say_instruct_ignored(synthesizer, [instruct, *(u.instruct for u in utterances)])
        encode_voices(synthesizer, voices, clone, save_voice, quiet)
        if file is None:
            pacing = StreamPacing(first_stream_frames, stream_frames) if stream else None
            spoken = (synthesizer, utterances[0].under(defaults), chunk_chars, output, pacing)
            _synth_one(*spoken, stdout_format, codes_out, stats_json, quiet)
        else:
            _batch_here(synthesizer, batch, rows, len(making), quiet)


def generation_settings(asked: dict, predictor: dict, max_frames: Optional[int]):
    """The sampling options as GenerationSettings (`predictor`: the code predictor's own), checked."""
    from rvqtts.synthesis.settings import GenerationSettings

    with refused(ValueError):
        return GenerationSettings(
            **asked, max_frames=max_frames, **{f"predictor_{name}": value for name, value in predictor.items()}
        )


def _inputs(text, file, output, out_dir, stream: bool, batch_size: str, stdout_format: str, codes_out):
    """The lines to speak, checked (one text, or a batch file's), and the batch's rows (None: measured)."""
    if file is None:
        return [_one_input(text, output, batch_size, stdout_format, codes_out)], None
    if text is not None:
        fail("give either TEXT or -f FILE, not both")
    return _batch_input(file, out_dir, stream, batch_size, codes_out)


def _say_instruct_ignored(synthesizer, instructs: list) -> None:
    if any(instructs) and not synthesizer.supports_instruct:
        from rvqtts.synthesis.synthesizer import INSTRUCT_IGNORED

        say(INSTRUCT_IGNORED)


def _batch_here(synthesizer, batch: tuple, rows: Optional[int], making: int, quiet: bool) -> None:
    """A batch file's lines spoken here (`batch`: run_here's arguments), `rows` at a time (None: as many as measured
    best for `making` lines)."""
    from rvqtts.cli.batch import run_here
    from rvqtts.synthesis.batch_size import choose_batch_size

    if rows is None:
        rows, source = choose_batch_size(synthesizer, making, progress=lambda m: say(m, quiet))
        say(f"--batch-size auto: {rows} ({source})", quiet)
    run_here(synthesizer, *batch, rows)


def _check_options(
    backend: str,
    weights: str,
    compute_units: str,
    coreml_precision: str,
    stdout_format: str,
    chunk_chars: float,
) -> None:
    """Fail with one line on an option that is wrong whatever the model."""
    from rvqtts.support.audio import STDOUT_FORMATS

    if backend not in ("torch", "coreml"):
        fail(f"unknown --backend {backend!r}: choose torch or coreml")
    if backend == "coreml" and weights != "native":
        fail(
            f"--weights {weights} is for the torch backend: Core ML packages hold their own weights "
            "(--coreml-precision)"
        )
    if backend == "coreml":
        check_coreml(compute_units, coreml_precision)
    if stdout_format not in STDOUT_FORMATS:
        fail(f"unknown --format {stdout_format!r}: choose wav or raw")
    if chunk_chars < 20:
        fail(f"--chunk-chars must be at least 20, got {chunk_chars} (--no-chunk speaks the text in one pass)")


def voice_source(ref_audio: Optional[Path], ref_text: Optional[str], x_vector_only: bool, voice: Optional[Path]):
    """The cloned voice the options name (a VoiceSource, its paths absolute as batch lines' are: Ray workers
    start elsewhere), or None; fails with one line on a combination that names none."""
    from rvqtts.qwen.cloning import VoiceError, VoiceSource

    ref_audio, voice = (None if path is None else path.expanduser().resolve() for path in (ref_audio, voice))
    if not (ref_audio or voice or ref_text is not None or x_vector_only):
        return None
    with refused(VoiceError):
        return VoiceSource(ref_audio, ref_text, x_vector_only, voice)


def _checked_save_voice(save_voice: Path, clone, ray: Optional[str]) -> Path:
    """--save-voice's file, checked writable, for a voice cloned here from reference audio."""
    if clone is None or clone.voice is not None:
        fail("--save-voice writes the voice cloned from --ref-audio FILE (with --ref-text or --x-vector-only)")
    if ray is not None:
        fail("--save-voice encodes the voice here: run it without --ray, then give the batch --voice FILE")
    save_voice = save_voice.expanduser()
    check_new_file(save_voice, ".safetensors", force=True)
    return save_voice


def _batch_input(file: Path, out_dir: Optional[Path], stream: bool, batch_size: str, codes_out: Optional[Path]):
    """A batch file's utterances and the rows it is spoken in (None: auto), its outputs checked writable."""
    from rvqtts.synthesis.batch_files import BatchFileError, read_batch

    if out_dir is None:
        fail("-f needs --out-dir DIR for its audio files")
    if stream:
        fail("--stream is for one text; a batch writes each line's file whole")
    rows = batch_rows(batch_size)
    with refused(BatchFileError):
        utterances = read_batch(file)
    ensure_writable(out_dir, folder=True)
    ensure_writable(codes_out, folder=True)
    return utterances, rows


def _one_input(text: Optional[str], output: Optional[str], batch_size: str, stdout_format: str, codes_out):
    """The one utterance of a text (or standard input), its output checked writable ("-": standard output)."""
    from rvqtts.support.audio import audio_format
    from rvqtts.synthesis.settings import Line

    if batch_size not in ("auto", "1"):
        fail("--batch-size is for batch files: give -f FILE --out-dir DIR")
    if output is None:
        fail("give -o FILE.wav (.flac, .ogg, .mp3, .opus; or -o - for a WAV on standard output)")
    with refused(ValueError):
        audio_format(output)
    if stdout_format != "wav" and output != "-":
        fail("--format is for -o - (standard output); a file's suffix picks its format")
    if output != "-":
        ensure_writable(Path(output))
        output = str(Path(output).expanduser())  # as checked, also where no shell expanded a "~"
    ensure_writable(codes_out)
    return Line(text=_read_text(text).strip(), name=output)


def _checked_voices(model: str, utterances: list, file, out_dir, force: bool, defaults):
    """The utterances to make (a resumed batch skips the lines it has) and their cloned voices, after every
    utterance's voice is checked against the model's config and every cloned voice's file is read (failing with one
    line, the batch line named)."""
    from rvqtts.qwen.checkpoints import ModelLoadError, model_voices
    from rvqtts.synthesis.batch_files import to_do

    with refused(ModelLoadError):
        found = model_voices(model)
    for item in utterances:
        line, where = item.under(defaults), f"{file}:{item.utterance}: " if file else ""
        try:
            found.check(line.speaker, line.language, line.instruct, cloned=line.clone is not None)
        except ValueError as error:
            fail(f"{where}{error}" + (" (or the line's fields)" if file else ""))
    # the cloned voices of the lines to make (a resumed batch does not encode the voices of lines it skips)
    making = to_do(utterances, out_dir, force) if file is not None else utterances
    voices = sorted(({item.clone for item in making} | {defaults.clone}) - {None}, key=str)
    check_voice_files(voices, {item.clone: f"{file}:{item.utterance}: " for item in reversed(making) if item.clone})
    return making, voices


@contextlib.contextmanager
def _run_errors():
    """A model that made NaN or inf, or a reader of standard output that left, ends the run with one line."""
    from rvqtts.engine.model.sampling import NonFiniteError

    try:
        yield
    except NonFiniteError as error:
        typer.echo(f"rvqtts: error: {error}", err=True)
        raise typer.Exit(1)
    except BrokenPipeError:
        # Whoever read standard output stopped (`| head`): stop too, without a traceback or a failed flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        typer.echo("rvqtts: standard output was closed before the audio ended", err=True)
        raise typer.Exit(1)


def _refuse_unknown_voice(model: str, speaker: Optional[str], language: str, instruct: Optional[str], cloned: bool):
    """Fail with one line where the model's config says it does not speak this voice (a model that cannot be
    read is reported later, in its turn among the other checks)."""
    from rvqtts.qwen.checkpoints import ModelLoadError, model_voices

    try:
        found = model_voices(model)
    except ModelLoadError:
        return
    with refused(ValueError):
        found.check(speaker, language, instruct, cloned=cloned)


def check_voice_files(sources: list, where: dict | None = None) -> None:
    """Fail with one line (prefixed with `where[source]`, the batch line that first names it) unless every
    reference audio file can clone a voice and every voice file is one (which model encoded it is checked
    once the model is loaded)."""
    from rvqtts.qwen.cloning import VoiceError, load_voice, read_reference

    for source in sources:
        with refused(VoiceError, prefix=(where or {}).get(source, "")):
            read_reference(source.ref_audio) if source.voice is None else load_voice(source.voice)


def encode_voices(synthesizer, sources: list, clone, save_voice: Optional[Path], quiet: bool) -> None:
    """Encode (or read) every cloned voice of the run before any synthesis, so a voice this model cannot
    use fails with one line; with `save_voice`, write the voice of `clone` there."""
    from rvqtts.qwen.cloning import save_voice as write_voice

    with refused(ValueError):  # VoiceError, and a cloned voice on a model of another kind
        for source in sources:
            synthesizer.voice_of(source)
    if save_voice is not None:
        with refused(OSError, prefix=f"cannot write {save_voice}: "):  # the disk filled or the folder changed
            write_voice(synthesizer.voice_of(clone), save_voice)
        say(f"wrote the voice cloned from {clone.ref_audio} to {save_voice} (use it with --voice)", quiet)


def _save_voice_only(clone, save_voice: Path, model: str, device: str, dtype: str, quiet: bool) -> None:
    """`rvqtts synth --ref-audio F ... --save-voice V` with nothing to say: encode the voice and write it."""
    from rvqtts.qwen.checkpoints import ModelLoadError, model_voices

    with refused(ModelLoadError, ValueError):
        model_voices(model).check(None, "auto", cloned=True)
    check_voice_files([clone])
    synthesizer = load_synthesizer(model, quiet, device=device, dtype=dtype, spec=False)
    encode_voices(synthesizer, [clone], clone, save_voice, quiet)


def check_worker_options(
    ray: Optional[str], workers: Optional[int], cpus: Optional[float], gpus: Optional[float]
) -> None:
    """Fail with one line where the Ray workers' options are given without --ray."""
    if ray is None and (workers, cpus, gpus) != (None, None, None):
        fail("--workers, --cpus-per-worker and --gpus-per-worker are for --ray")


def ray_worker_spec(model: str, engine: tuple, workers: Optional[int], cpus: Optional[float], gpus: Optional[float]):
    """What each Ray worker loads (`engine`: EngineChoices's fields in order, to cuda_graphs), checked here as far as
    it can be: the workers' machines resolve the device and read the model, tree and offsets (local paths go to
    them absolute: a worker starts in a folder of its own)."""
    device, dtype, decoder_dtype, weights, spec, tree, offsets, cuda_graphs = engine
    from rvqtts.serving.cluster import ClusterError, WorkerSpec, require_ray
    from rvqtts.synthesis.loader import EngineChoices

    cpus, gpus = 1.0 if cpus is None else cpus, 0.0 if gpus is None else gpus
    if workers is not None and workers < 1:
        fail(f"--workers must be at least 1, got {workers}")
    if cpus <= 0 or gpus < 0:
        fail(f"--cpus-per-worker must be above 0 and --gpus-per-worker at least 0, got {cpus:g} and {gpus:g}")
    if device not in ("auto", "cpu", "cuda"):
        fail(
            f"--device {device} cannot be given to Ray workers: choose auto, cpu or cuda (Ray hands each "
            "worker its own GPUs)"
        )
    if device == "cuda" and gpus == 0:
        fail("--device cuda on Ray needs GPUs for the workers: add --gpus-per-worker (e.g. 1)")

    def absolute(path: str) -> str:
        return str(Path(path).expanduser().resolve()) if Path(path).expanduser().exists() else path

    tree = tree if tree == "auto" or tree.isdigit() else absolute(tree)
    offsets = None if offsets is None else absolute(str(offsets))
    with refused(ValueError):
        choices = EngineChoices(device, dtype, decoder_dtype, weights, spec, tree, offsets, cuda_graphs)
    if tree != "auto" and not tree.isdigit() and not Path(tree).is_file():
        fail(f"--tree {tree}: no such tree file (give auto, a node budget N or a tree file)")
    if offsets is not None and not Path(offsets).is_file():
        fail(f"--offsets {offsets}: no such file")
    with refused(ClusterError):
        require_ray()
    return WorkerSpec(absolute(model), choices, cpus, gpus)


def _on_coreml(
    synthesizer,
    tree: str,
    offsets: Optional[Path],
    settings,
    package: Optional[Path],
    precision: str,
    compute_units: str,
    quiet: bool,
):
    """The synthesizer with its inner loop on a Core ML package (the plain step when it has no speculation)."""
    from rvqtts.engine.backends.coreml import coreml_loop
    from rvqtts.engine.speculative.policy import choose_speculation

    with refused(ValueError):  # CoreMLError, TreeFileError, OffsetsFileError and a tree the offsets cannot draft
        speculation = synthesizer.speculation  # None: --no-spec, whose package still holds a tree
        if speculation is None:
            speculation, _ = choose_speculation(synthesizer.code_predictor, tree, offsets, device_type="coreml")
        sampling = synthesizer.sampling(settings).predictor
        report = lambda message: say(message, quiet)  # noqa: E731
        loop = coreml_loop(synthesizer.code_predictor, speculation, sampling, package, precision, compute_units, report)
    return synthesizer.using(synthesizer.speculation, loop)


def _synth_one(
    synthesizer,
    line,
    chunk_chars,
    output,
    pacing: Optional[StreamPacing],
    stdout_format: str,
    codes_out,
    stats_json,
    quiet,
) -> None:
    """One line (in the run's voice) to `output`: streamed as `pacing` says, or (None) written whole at the end."""
    from rvqtts.support.audio import write_audio, write_codes, write_stream

    if pacing:  # the decoder's cold start taken at load, not out of the first audio
        synthesizer.codec.warm_up(pacing)

    with progress_bar(quiet) as progress:
        task = progress.add_task("synthesizing", total=None)
        keywords = dict(
            speaker=line.speaker,
            language=line.language,
            instruct=line.instruct,
            seed=line.seed,
            settings=line.settings,
            chunk_chars=chunk_chars,
            on_chunk=lambda done, total: progress.update(task, completed=done, total=total),
            clone=synthesizer.voice_of(line.clone) if line.clone else None,
        )
        if pacing:
            audio = synthesizer.stream(line.text, **keywords, pacing=pacing)
            write_stream(output, audio, synthesizer.sample_rate, stdout_format)
            result = audio.result
        else:
            result = synthesizer.synthesize(line.text, **keywords)
            write_audio(output, result.audio, result.sample_rate, stdout_format)
    for warning in result.warnings:
        say(f"warning: {warning}", quiet)
    if codes_out:
        write_codes(codes_out, result.codes)
    record = result.record()
    write_stats(stats_json, [{"name": output, **record}])
    show_stats([(output, record)], quiet)
