"""`rvqtts read`: a book or document (EPUB, Markdown, plain text, standard input) to chapter files, captions and an
.m4b audiobook, resumable (rvqtts.documents.narration)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from rvqtts.cli import options
from rvqtts.cli.batch import INTERRUPTED
from rvqtts.cli.common import (
    app,
    batch_rows,
    ensure_writable,
    fail,
    load_synthesizer,
    refused,
    say,
    stderr_console,
)
from rvqtts.cli.synth import (
    check_voice_files,
    check_worker_options,
    encode_voices,
    generation_settings,
    ray_worker_spec,
    voice_source,
)


@app.command()
def read(
    document: str = typer.Argument(
        ..., help="The document: .epub, .md or .markdown, .txt (else plain text); '-' reads standard input."
    ),
    out_dir: Optional[Path] = typer.Option(
        None, "--out-dir", help="Folder for the chapter files, captions, audiobook and manifest.json (not with --list)."
    ),
    list_chapters: bool = typer.Option(
        False,
        "--list",
        help="Print the chapters with their characters, chunks, expected audio and the time expected on this machine "
        "(the model's frame costs, measured once), and speak nothing.",
    ),
    chapters: Optional[str] = typer.Option(None, help="Speak these chapters only: 3, 3-5 or 1,4-6."),
    kind: str = typer.Option("auto", help="Read the document as epub, markdown or text (auto: by its suffix)."),
    encoding: Optional[str] = typer.Option(None, help="A text or Markdown file's encoding where it is not UTF-8."),
    lexicon: Optional[Path] = typer.Option(
        None,
        help="A file of `written = spoken` lines (whole words, case counts), applied before chunking; captions keep "
        "the text as written.",
    ),
    audio_format: str = typer.Option("wav", "--format", help="Chapter files' format: wav, flac, ogg, mp3 or opus."),
    paragraph_pause: float = typer.Option(0.5, help="Seconds of silence between paragraphs."),
    chapter_pause: float = typer.Option(2.0, help="Seconds of silence after each chapter in the audiobook."),
    loudness: Optional[float] = typer.Option(
        None,
        help="Normalize each chapter to this integrated loudness in LUFS (ITU-R BS.1770; e.g. -18; audiobooks use -18 "
        "to -23); default: as spoken.",
    ),
    captions: bool = typer.Option(True, "--captions/--no-captions", help="SRT and WebVTT captions per chapter."),
    audiobook: bool = typer.Option(
        True, "--audiobook/--no-audiobook", help="An .m4b with chapter marks, once every chapter is made."
    ),
    force: bool = typer.Option(
        False, "--force", help="Remake the chapter files asked for (and the audiobook) even where they are there."
    ),
    batch_size: str = typer.Option(
        "auto",
        "--batch-size",
        help="Chunks spoken together, a row each (auto: the size measured best on this machine and model; on Ray, on "
        "each worker's). The files are the same whatever the size where the kernels keep rows invariant (rvqtts tune).",
    ),
    clone_on: Optional[str] = typer.Option(
        None,
        help="With a VoiceDesign --model and its --instruct: design the voice once (speaking the document's opening) "
        "and clone it on this Base model (hub id or folder), which reads every chunk in it; kept in OUT for reruns.",
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
    language: str = typer.Option("auto", help="Language, or auto (the document's own where the model speaks it)."),
    instruct: Optional[str] = options.INSTRUCT,
    temperature: Optional[float] = options.TEMPERATURE,
    top_k: Optional[int] = options.TOP_K,
    top_p: Optional[float] = options.TOP_P,
    predictor_temperature: Optional[float] = options.PREDICTOR_TEMPERATURE,
    predictor_top_k: Optional[int] = options.PREDICTOR_TOP_K,
    predictor_top_p: Optional[float] = options.PREDICTOR_TOP_P,
    repetition_penalty: Optional[float] = options.REPETITION_PENALTY,
    max_frames: Optional[int] = options.MAX_FRAMES,
    chunk_chars: int = options.CHUNK_CHARS,
    seed: int = typer.Option(
        0,
        help="The document's seed: each chunk's is derived from it and the chunk's place (docs/documents.md), so a "
        "chunk sounds as `rvqtts synth` makes it with that seed.",
    ),
    spec: bool = options.SPEC,
    tree: str = options.TREE,
    offsets: Optional[Path] = options.OFFSETS,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display or notices."),
) -> None:
    """Speak a book or document: a file per chapter with captions, and an .m4b audiobook.

    Chapters come from an EPUB's spine and table of contents, a Markdown file's headings or a text file's heading
    lines. Every chunk of every chapter takes a row of the frame loop, B at a time; each chunk's audio is kept in
    OUT/.chunks as it ends, so Ctrl-C (or a crash) loses nothing: the same command resumes, and ends with the files
    an uninterrupted run writes.
    """
    from rvqtts.documents.document import DocumentError
    from rvqtts.documents.lexicon import Lexicon, read_lexicon
    from rvqtts.documents.narration import ReadingOptions, narrate
    from rvqtts.documents.plan import parse_chapters, plan_document
    from rvqtts.documents.reading import read_document
    from rvqtts.synthesis.settings import Line

    if not list_chapters and out_dir is None:
        fail("give --out-dir DIR for the chapter files (or --list to see the chapters)")
    if chunk_chars < 20:
        fail(f"--chunk-chars must be at least 20, got {chunk_chars}")
    rows = batch_rows(batch_size)
    check_worker_options(ray, workers, cpus_per_worker, gpus_per_worker)
    if ray is not None and list_chapters:
        fail("--list measures this machine: drop --ray")
    clone = voice_source(ref_audio, ref_text, x_vector_only, voice)
    asked = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty)
    predictor = dict(temperature=predictor_temperature, top_k=predictor_top_k, top_p=predictor_top_p)
    settings = generation_settings(asked, predictor, max_frames)
    with refused(DocumentError):
        words = read_lexicon(lexicon) if lexicon is not None else Lexicon()
        book = read_document(document, kind, encoding)
        selection = tuple(parse_chapters(chapters, len(book.chapters))) if chapters else None
        plans = plan_document(book, seed, words, chunk_chars)
    with refused(ValueError):
        reading = ReadingOptions(
            seed, selection, f".{audio_format.lower()}", paragraph_pause, chapter_pause, captions, audiobook, force,
            chunk_chars, rows, words, loudness,
        )  # fmt: skip
    for notice in book.notices:
        say(notice, quiet)
    reader = _check_voices(model, clone_on, speaker, language, instruct, clone)
    if clone is not None:
        check_voice_files([clone])
    if not list_chapters:
        ensure_writable(out_dir, folder=True)
    engine = dict(device=device, dtype=dtype, decoder_dtype=decoder_dtype, weights=weights, spec=spec, tree=tree)
    line = Line(speaker=speaker, language=language, instruct=instruct, clone=clone, settings=settings)
    if clone_on is not None and not list_chapters:
        line = _designed(model, clone_on, {**engine, "offsets": offsets}, book, out_dir, line, seed, quiet)
    if ray is not None:
        worker_engine = (device, dtype, decoder_dtype, weights, spec, tree, offsets, True)
        worker_spec = ray_worker_spec(reader, worker_engine, workers, cpus_per_worker, gpus_per_worker)
        voices = (line.clone,) if line.clone else ()
        worker_spec = replace(worker_spec, voices=voices, choices=replace(worker_spec.choices, batch_size=rows))
        _narrate_on_ray(worker_spec, ray, workers, book, out_dir, line, reading, quiet)
        return
    synthesizer = load_synthesizer(reader, quiet, offsets=offsets, batch_size=rows, **engine)
    if list_chapters:
        _list(synthesizer, book, plans, selection, rows, quiet)
        return
    encode_voices(synthesizer, [line.clone] if line.clone else [], line.clone, None, quiet)
    notice = lambda message: say(message, quiet)  # noqa: E731
    _narrate(lambda update: narrate(synthesizer, book, out_dir, line, reading, update, notice), out_dir, quiet)


def _check_voices(model: str, clone_on: Optional[str], speaker, language: str, instruct, clone) -> str:
    """The model that reads the chunks (--clone-on's Base model, else --model), its voice and --clone-on's checked
    from the models' configs; fails with one line."""
    from rvqtts.qwen.checkpoints import ModelLoadError, model_voices

    if clone_on is None:
        _check_voice(model, speaker, language, instruct, clone)
        return model
    with refused(ModelLoadError):
        kinds = model_voices(model).kind, model_voices(clone_on).kind
    if kinds != ("voice_design", "base"):
        fail(
            "--clone-on designs the voice once on a VoiceDesign --model and clones it on a Base model: give a "
            f"VoiceDesign --model and a Base model to --clone-on (here {kinds[0]} and {kinds[1]})"
        )
    if clone is not None:
        fail("--clone-on makes the document's voice: drop --ref-audio, --ref-text, --x-vector-only and --voice")
    _check_voice(model, speaker, language, instruct, clone)
    return clone_on


def _designed(model: str, clone_on: str, engine: dict, book, out_dir: Path, line, seed: int, quiet: bool):
    """The reading's voice with --clone-on: designed once on the VoiceDesign model, cloned on the Base model, kept in
    OUT (rvqtts.documents.designed_voice); the line to read with it (the Base model takes no instruction)."""
    import gc

    from rvqtts.documents.designed_voice import VOICE_FILE, designed_voice
    from rvqtts.qwen.cloning import VoiceError

    designer = load_synthesizer(model, quiet, **engine)
    cloner = load_synthesizer(clone_on, quiet, **engine)
    with refused(VoiceError):
        source = designed_voice(designer, cloner, book, out_dir, line.instruct, line.language, seed, line.settings)
    say(
        f"the voice described by --instruct is kept in {out_dir / VOICE_FILE}; {clone_on} reads every chunk in it",
        quiet,
    )
    del designer, cloner
    gc.collect()
    return replace(line, clone=source, instruct=None)


def _check_voice(model: str, speaker, language: str, instruct, clone) -> None:
    """Fail with one line where the model's config says it does not speak this voice."""
    from rvqtts.qwen.checkpoints import ModelLoadError, model_voices

    with refused(ModelLoadError, ValueError):
        model_voices(model).check(speaker, language, instruct, cloned=clone is not None)


def _list(synthesizer, book, plans, selection, rows: Optional[int], quiet: bool) -> None:
    """The chapters' table on standard output: characters, chunks, the audio expected and the time expected here."""
    from rich.console import Console
    from rich.table import Table

    from rvqtts.documents.narration import expected_seconds
    from rvqtts.synthesis.batch_size import best_batch_size, measured_frame_costs
    from rvqtts.synthesis.text import FRAMES_PER_SECOND

    costs, source = measured_frame_costs(synthesizer, lambda message: say(message, quiet))
    chunks = sum(len(plan.chunks) for plan in plans)
    batch = min(rows or best_batch_size(costs), max(chunks, 1))
    batch = max(b for b in costs if b <= batch) if batch not in costs else batch
    per_frame = costs[batch] / 1e3
    table = Table(title=f"{book.title}" + (f", by {book.author}" if book.author else ""))
    for column in ("#", "chapter", "characters", "chunks", "audio", "time here"):
        table.add_column(column, justify="left" if column == "chapter" else "right")
    totals = [0, 0, 0.0, 0.0]
    for plan in plans:
        if selection and plan.number not in selection:
            continue
        audio = expected_seconds(plan)
        wall = audio * FRAMES_PER_SECOND * per_frame
        table.add_row(
            str(plan.number), plan.title, f"{plan.characters:,}", str(len(plan.chunks)), _hms(audio), _hms(wall)
        )
        for index, value in enumerate((plan.characters, len(plan.chunks), audio, wall)):
            totals[index] += value
    table.add_row("", "total", f"{totals[0]:,}", str(totals[1]), _hms(totals[2]), _hms(totals[3]))
    Console(width=max(Console().width, 100)).print(table)
    say(
        f"time here at batch size {batch}: {costs[batch]:.1f} ms a frame ({source}); audio from the text's length",
        quiet,
    )


def _hms(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


@contextlib.contextmanager
def _reading_progress(quiet: bool):
    """Progress of a reading: on a terminal a bar of chunks with the chapters, audio made, speed and time left; in a
    log, a line as each chapter ends. Yields its update function."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = stderr_console()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("chunks, {task.fields[status]}"),
    )
    with Progress(*columns, console=console, transient=True, disable=quiet or not console.is_terminal) as progress:
        task = progress.add_task("reading", total=None, status="")
        chapters_said = [0]

        def update(state) -> None:
            speed = state.audio_seconds / state.wall_seconds if state.wall_seconds and state.audio_seconds else None
            left = state.seconds_left
            status = (
                f"{state.chapters_done}/{state.chapters} chapters, {_hms(state.audio_seconds)} audio made"
                + (f", {speed:.2f}x real time" if speed else "")
                + (f", {_hms(left)} left" if left is not None else "")
            )
            progress.update(task, completed=state.chunks_done, total=state.chunks, status=status)
            if not console.is_terminal and state.chapters_done > chapters_said[0]:
                chapters_said[0] = state.chapters_done
                say(f"{state.chunks_done}/{state.chunks} chunks, {status}", quiet)

        yield update


def _narrate_on_ray(spec, address: str, workers: Optional[int], book, out_dir: Path, line, reading, quiet: bool):
    """The book read with its chunks made by Ray workers; this process writes every file."""
    from rvqtts.cli.batch import say_worker_threads
    from rvqtts.documents.narration import narrate_on_ray
    from rvqtts.serving.cluster import ClusterError

    where = "a cluster here or $RAY_ADDRESS" if address == "auto" else address
    say(f"starting Ray workers for {book.title} ({where})", quiet)
    say_worker_threads(spec, quiet)

    def run(update):
        result, batch = narrate_on_ray(spec, book, out_dir, line, reading, address, workers, update)
        for notice in batch.notices:
            say(notice, quiet and not notice.startswith("warning"))
        return result

    with refused(ClusterError):
        _narrate(run, out_dir, quiet)


def _narrate(run, out_dir: Path, quiet: bool) -> None:
    """`run(on_progress)` (a reading here or on Ray) under a progress display, then what was written said; exit 1
    when a chapter failed, 2 when the folder could not be written, INTERRUPTED on Ctrl-C (what is whole stays; the
    same command resumes)."""
    from rvqtts.documents.audiobook import AudiobookError
    from rvqtts.engine.model.sampling import NonFiniteError

    try:
        with _reading_progress(quiet) as update:
            result = run(update)
    except KeyboardInterrupt:
        typer.echo(
            f"rvqtts: interrupted: the chapters finished are whole in {out_dir} and every chunk made is kept; run the "
            "same command again to go on",
            err=True,
        )
        raise typer.Exit(INTERRUPTED) from None
    except (NonFiniteError, AudiobookError) as error:
        typer.echo(f"rvqtts: error: {error}", err=True)
        raise typer.Exit(1)
    except OSError as error:
        fail(
            f"cannot write in {out_dir}: {error.strerror or error}; the chapters finished are whole and every chunk "
            "made is kept: make room and run the same command again to go on"
        )
    _said(result, out_dir, quiet)


def _said(result, out_dir: Path, quiet: bool) -> None:
    """A reading's notices, warnings and totals; exit 1 when a chapter failed."""
    for notice in result.notices:
        say(notice, quiet and not notice.startswith("chapter"))
    if result.warnings:
        say(
            f"{len(result.warnings)} chunks were cut at their frame limit (--max-frames): {result.manifest.name} lists "
            "them",
            quiet,
        )
    made = [chapter for chapter in result.chapters if chapter.status == "made"]
    stats = result.statistics
    speed = f", {stats['audio_per_wall_second']:.2f}x real time" if stats["audio_per_wall_second"] else ""
    say(
        f"{len(made)} chapters made, {len(result.chapters) - len(made) - len(result.failed)} already there, "
        f"{len(result.failed)} failed; {stats['chunks_made']} chunks spoken in {stats['wall_seconds']:.1f} s{speed} "
        f"-> {out_dir}" + (f" (audiobook {result.audiobook.name})" if result.audiobook else ""),
        quiet and not result.failed,
    )
    if result.failed:
        raise typer.Exit(1)
