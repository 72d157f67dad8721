"""`rvqtts bench`: predictor call costs, projected speedup, end to end, dtypes, the speech decoder, Core ML."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rvqtts.cli.common import (
    DEFAULT_MODEL,
    HELP_STYLE,
    WEIGHTS_HELP,
    app,
    batch_rows,
    check_coreml,
    ensure_writable,
    fail,
    json_option,
    list_of_ints,
    load_synthesizer,
    progress_bar,
    publish,
    refused,
    say,
)
from rvqtts.cli.frames import (
    CONTEXTS_HELP,
    INSTRUCT_HELP,
    SPLIT_HELP,
    TEXTS_HELP,
    VOICE_HELP,
    check_source,
    recorded_frames,
)

bench_app = typer.Typer(
    help="Benchmarks: predictor call cost per query length, projected speedup per tree size, and whole synthesis "
    "against stock qwen-tts (docs/benchmarks.md).",
    **HELP_STYLE,
)
app.add_typer(bench_app, name="bench")


@bench_app.command("predictor")
def bench_predictor_command(
    model: Optional[str] = typer.Option(None, help="Time this checkpoint's code predictor (hub id or folder)."),
    dims: str = typer.Option("0.6b", help="Without --model: random weights at the real 0.6b or 1.7b dimensions."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("bfloat16", help="float32, bfloat16 or float16."),
    q: str = typer.Option(
        "1,2,4,5,8,9,16,17,24,32,33,48,64,65",  # N + 1 for N = 4..64 included
        "--q",
        help="Query lengths (q = N + 1 for a tree of N nodes; 1 is always timed).",
    ),
    repeats: int = typer.Option(30, help="Timed repetitions per query length (after 5 warm-up rounds)."),
    weights: str = typer.Option("native", help=WEIGHTS_HELP),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
) -> None:
    """Median and spread of one predictor call per query length (a verify round for q > 1, KV length 8, after warm-up),
    with qwen-tts's own q = 1 forward timed in the same run, interleaved."""
    import torch

    from rvqtts.bench.harness import PREDICTOR_DIMS, random_code_predictor
    from rvqtts.bench.predictor import bench_predictor, predictor_table
    from rvqtts.engine.model.devices import pick_device
    from rvqtts.engine.model.quantize import check_weights
    from rvqtts.qwen.checkpoints import DTYPES

    queries = sorted({1, *list_of_ints(q, "--q")})
    if dtype not in DTYPES:
        fail(f"unknown --dtype {dtype!r}: choose {', '.join(DTYPES)}")
    if repeats < 1:
        fail(f"--repeats must be at least 1, got {repeats}")
    if model is None:
        if dims not in PREDICTOR_DIMS:
            fail(f"unknown --dims {dims!r}: choose {', '.join(PREDICTOR_DIMS)}")
        with refused(ValueError):  # DeviceError, and weights this device cannot run
            chosen = pick_device(device)
            check_weights(weights, torch.device(chosen))
        code_predictor = random_code_predictor(dims, getattr(torch, dtype), chosen)
        source = f"random at the real {dims} dimensions"
    else:
        code_predictor = load_synthesizer(
            model, quiet, device=device, dtype=dtype, weights=weights, spec=False
        ).code_predictor
        source = model
    with progress_bar(quiet) as progress:
        task = progress.add_task("warming up and timing", total=len(queries))
        result = bench_predictor(
            code_predictor,
            queries,
            repeats=repeats,
            weights=source,
            progress=lambda done, total: progress.update(task, completed=done),
            weight_format=weights,
        )
    publish(result, json_out, predictor_table, quiet)


@bench_app.command("speedup")
def bench_speedup_command(
    predictor: Path = typer.Option(..., help="JSON that `rvqtts bench predictor --json` wrote."),
    acceptance: Optional[Path] = typer.Option(
        None, help="Acceptance table (`rvqtts calibrate` writes NAME-acceptance.json); default: the paper's figures."
    ),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG in the manner of the paper's Figure 4."),
    json_out: Optional[Path] = json_option("Write the projection as JSON."),
    save: bool = typer.Option(
        False, "--save", help="Make the best N the default tree of `rvqtts synth` on this kind of device."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table."),
) -> None:
    """Projected inner-loop speedup per N = codes per call at N / (cost of a q = N + 1 call / cost of a
    q = 1 call), and the best N."""
    from rvqtts.bench.speedup import codes_per_call_by_budget, plot_speedup, project_speedup, speedup_table
    from rvqtts.engine.speculative.tree import load_acceptance, platform_key, save_best_budget
    from rvqtts.support.files import read_json
    from rvqtts.support.measurements import BEST_TREES

    if save:  # the user asked for this write: an unwritable cache fails here, before any work
        ensure_writable(BEST_TREES.path)
    with refused(ValueError):  # AcceptanceFileError too
        measured = read_json(predictor, "predictor bench", ValueError)
        if not isinstance(measured, dict) or not {"q", "ratio_to_q1", "ratio_to_stock_q1", "device"} <= set(measured):
            raise ValueError(f"{predictor} is not the JSON of `rvqtts bench predictor --json`")
        table = load_acceptance(acceptance) if acceptance else None
        figures, source = codes_per_call_by_budget(table)
        projection = project_speedup(figures, measured)
    if plot:
        try:
            plot_speedup(projection, source, plot)
        except ImportError:
            fail(
                "--plot needs matplotlib: pip install -e '.[bench]' from rvqtts's checkout folder "
                "(or pip install matplotlib)"
            )
    if save:
        best, note = projection["best_N"], f"rvqtts bench speedup: {source}; {projection['weights']}"
        fingerprint = table.get("model_fingerprint") if table else None  # the choice is this model's only
        platform = platform_key(projection["device"], projection["dtype"], projection["weight_format"])
        where = save_best_budget(platform, best, note, fingerprint)
        scope = "for this model" if fingerprint else "for every model without its own choice"
        choice = f"defaults to --tree {best}" if best else "runs the plain loop (no tree pays)"
        say(f"rvqtts synth on {platform} now {choice} {scope} (recorded in {where})", quiet)
    publish(projection, json_out, speedup_table, quiet, acceptance_source=source)


@bench_app.command("e2e")
def bench_e2e_command(
    texts: Path = typer.Option(
        ...,
        help="Text file, one utterance per line (.jsonl lines may set speaker and language; --instruct and --voice "
        "hold for every line).",
    ),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    tree: str = typer.Option(
        "16",
        help="Trees of the fixed-size speculative runs, comma-separated: N or a tree file each, e.g. 4,8,16,32 (the "
        "auto runs choose theirs online, as `rvqtts synth` does).",
    ),
    offsets: Optional[Path] = typer.Option(None, help="Offsets file; default: shipped offsets matching the model."),
    speaker: Optional[str] = typer.Option(
        None, help="Speaker of lines that name none (CustomVoice models; default vivian)."
    ),
    language: str = typer.Option("auto", help="Language of lines that name none."),
    instruct: Optional[str] = typer.Option(None, help="Instruction of every line (VoiceDesign models need one)."),
    voice: Optional[Path] = typer.Option(
        None,
        help="Base models: the cloned voice of every line, a voice file (rvqtts synth --ref-audio ... --save-voice "
        "VOICE).",
    ),
    seed: int = typer.Option(0, help="Seed of every run."),
    max_frames: Optional[int] = typer.Option(None, help="Most frames per utterance."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    weights: str = typer.Option("native", help=WEIGHTS_HELP),
    json_out: Optional[Path] = json_option("Write every run and the totals as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
) -> None:
    """Stock qwen-tts, `rvqtts synth --no-spec`, `rvqtts synth` (auto: the tree size chosen online) and
    `rvqtts synth --tree N` for each N on the same texts and seed, interleaved after an untimed 2-frame turn of each:
    wall, inner-loop, talker and decoder time per frame, RTF, and the ratios between them (the auto runs against the
    fixed tree whose inner loop was fastest)."""
    from rvqtts.bench.e2e import bench_e2e, e2e_table, fixed_variants
    from rvqtts.engine.speculative.policy import choose_speculation
    from rvqtts.qwen.cloning import VoiceSource
    from rvqtts.synthesis.batch_files import read_batch
    from rvqtts.synthesis.settings import GenerationSettings

    with refused(ValueError):  # BatchFileError too
        lines = [(u.text, u.speaker or speaker, u.language or language) for u in read_batch(texts)]
        settings = GenerationSettings(max_frames=max_frames)
    synthesizer = load_synthesizer(model, quiet, device=device, dtype=dtype, weights=weights, spec=False)
    with refused(ValueError):  # TreeFileError, OffsetsFileError, a voice the model does not speak
        clone = None if voice is None else synthesizer.voice_of(VoiceSource(voice=voice))
        for _, line_speaker, line_language in lines:
            synthesizer.check_voice(line_speaker, line_language, instruct, clone)
        default, notice = choose_speculation(
            synthesizer.code_predictor, "auto", offsets, allow_plain=True, weights=weights
        )
        trees = [item.strip() for item in tree.split(",") if item.strip()]
        fixed = [choose_speculation(synthesizer.code_predictor, item, offsets, weights=weights)[0] for item in trees]
        fixed_variants(fixed)
    say(notice, quiet)
    with progress_bar(quiet) as progress:
        variants = 3 + len(fixed)
        task = progress.add_task(f"{len(lines)} texts x {variants} variants", total=len(lines) * variants)
        result = bench_e2e(
            synthesizer.tts,
            lines,
            fixed,
            seed,
            settings,
            progress=lambda done, total: progress.update(task, completed=done),
            weight_format=weights,
            instruct=instruct,
            clone=clone,
            default=default,
        )
    publish(result, json_out, e2e_table, quiet)


@bench_app.command("batch")
def bench_batch_command(
    texts: Path = typer.Option(..., help="Text file, one utterance per line (.txt or .jsonl; each spoken whole)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    sizes: str = typer.Option("1,2,4,8", help="Batch sizes, comma-separated (1: each line alone)."),
    speaker: Optional[str] = typer.Option(None, help="Speaker of every line (CustomVoice models)."),
    language: str = typer.Option("auto", help="Language of every line."),
    max_frames: Optional[int] = typer.Option(None, help="Most frames per line."),
    stock: bool = typer.Option(True, "--stock/--no-stock", help="Time stock qwen-tts's batched call too."),
    repeats: int = typer.Option(1, help="Turns of every size and side."),
    seed: int = typer.Option(0, help="Seed of every run."),
    spec: bool = typer.Option(
        True,
        "--spec/--no-spec",
        help="The inner loop speculative (--tree auto: the tree size chosen online, for each batch size at its rows) "
        "or plain.",
    ),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    weights: str = typer.Option("native", help=WEIGHTS_HELP),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
) -> None:
    """Batch throughput (audio seconds per wall second) and first files by batch size, `rvqtts synth -f
    --batch-size B` against stock qwen-tts's list-of-texts call at the same B, on the same lines, taking
    turns."""
    from rvqtts.bench.batch import batch_table, bench_batch
    from rvqtts.synthesis.batch_files import read_batch
    from rvqtts.synthesis.settings import GenerationSettings

    batch_sizes = list_of_ints(sizes, "--sizes")
    if repeats < 1:
        fail(f"--repeats must be at least 1, got {repeats}")
    with refused(ValueError):  # BatchFileError too
        lines = [u.text for u in read_batch(texts)]
        settings = GenerationSettings(max_frames=max_frames)
    synthesizer = load_synthesizer(model, quiet, device=device, dtype=dtype, weights=weights, spec=spec)
    with progress_bar(quiet) as progress:
        task = progress.add_task(f"{len(lines)} lines x {len(batch_sizes)} sizes", total=None)
        with refused(ValueError):
            result = bench_batch(
                synthesizer,
                lines,
                batch_sizes,
                settings,
                speaker,
                language,
                seed,
                stock,
                repeats,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
    publish(result, json_out, batch_table, quiet, model=model)


@bench_app.command("document")
def bench_document_command(
    document: Optional[Path] = typer.Option(
        None, help="A document (.epub, .md, .txt); default: a Markdown book of --chunks paragraphs of stock sentences."
    ),
    chunks: int = typer.Option(48, help="Chunks of the default book (a paragraph each, in 4 chapters)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    speaker: Optional[str] = typer.Option(None, help="Speaker (CustomVoice models)."),
    max_frames: Optional[int] = typer.Option(20, help="Most frames per chunk (random weights rarely end speech)."),
    batch_size: str = typer.Option("auto", help="Rows of the batched side (auto: measured best here)."),
    stock: bool = typer.Option(True, "--stock/--no-stock", help="Time stock qwen-tts over the same chunks too."),
    repeats: int = typer.Option(1, help="Turns of every side."),
    seed: int = typer.Option(0, help="The document's seed."),
    memory: Optional[str] = typer.Option(
        None,
        help="Chunk counts of default books whose peak memory is measured, each read by `rvqtts read` in a process of "
        "its own (e.g. 10,200).",
    ),
    spec: bool = typer.Option(True, "--spec/--no-spec", help="The inner loop speculative or plain."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    weights: str = typer.Option("native", help=WEIGHTS_HELP),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
) -> None:
    """A document spoken whole (`rvqtts read`) with its chunks B rows at a time against one row at a time, and against
    stock qwen-tts over the same chunks, one at a time and B a call, taking turns; with --memory, the peak memory of
    long and short books."""
    import tempfile

    from rvqtts.bench.document import bench_document, bench_document_text, document_memory, document_table
    from rvqtts.documents.document import DocumentError
    from rvqtts.documents.reading import read_document
    from rvqtts.synthesis.batch_size import choose_batch_size
    from rvqtts.synthesis.settings import GenerationSettings

    rows = batch_rows(batch_size)
    counts = list_of_ints(memory, "--memory") if memory else []
    if repeats < 1 or chunks < 1:
        fail(f"--repeats and --chunks must be at least 1, got {repeats} and {chunks}")
    with refused(DocumentError, ValueError), tempfile.TemporaryDirectory() as folder:
        if document is None:
            document = Path(folder) / "book.md"
            document.write_text(bench_document_text(chunks), encoding="utf-8")
        book = read_document(document)
        settings = GenerationSettings(max_frames=max_frames)
    engine = dict(device=device, dtype=dtype, weights=weights, spec=spec)
    synthesizer = load_synthesizer(model, quiet, **engine)
    if rows is None:
        rows, source = choose_batch_size(synthesizer, chunks, lambda message: say(message, quiet))
        say(f"--batch-size auto: {rows} ({source})", quiet)
    with progress_bar(quiet) as progress:
        task = progress.add_task("sides in turns", total=None)
        with refused(ValueError):
            result = bench_document(
                synthesizer,
                book,
                rows,
                settings,
                speaker,
                seed,
                stock,
                repeats,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
    if counts:
        arguments = ["--dtype", dtype, "--weights", weights, "--batch-size", str(rows), "--seed", str(seed)]
        arguments += [] if max_frames is None else ["--max-frames", str(max_frames)]
        result["memory"] = document_memory(model, counts, arguments)
    publish(result, json_out, document_table, quiet, model=model)


@bench_app.command("dtype")
def bench_dtype_command(
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    dtype: str = typer.Option(
        "bfloat16",
        help="The dtype to compare with float32 (bfloat16 or float16), or, with --weights int8 or int4, the dtype "
        "whose own weights are the reference.",
    ),
    weights: str = typer.Option(
        "native", help="native, or int8 or int4: compare 8-bit or 4-bit weights with the dtype's own."
    ),
    frames: int = typer.Option(100, help="Frames to decode (random contexts)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    seed: int = typer.Option(0, help="Seed of the contexts and the noise."),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table."),
) -> None:
    """The code predictor in a reduced dtype against float32, or with 8-bit or 4-bit weights against its own, on the
    same frames and noise: how often the change alters a code (teacher forcing), frames that stay identical,
    and both plain loops' ms per frame."""
    from rvqtts.bench.dtype import bench_dtype, dtype_table, random_prefixes

    if weights == "native" and dtype not in ("bfloat16", "float16"):
        fail(f"--dtype must be bfloat16 or float16 (the reference is float32), got {dtype!r}")
    if frames < 1:
        fail(f"--frames must be at least 1, got {frames}")
    if weights == "native":
        reference = load_synthesizer(model, quiet, device=device, dtype="float32", spec=False)
        candidate = load_synthesizer(model, quiet, device=device, dtype=dtype, spec=False)
    else:  # one model: the runners hold the quantized weights beside the module's own
        reference = candidate = load_synthesizer(model, quiet, device=device, dtype=dtype, weights=weights, spec=False)
    prefixes = random_prefixes(reference.talker, frames, seed)
    with progress_bar(quiet) as progress:
        progress.add_task(f"decoding {frames} frames both ways", total=None)
        result = bench_dtype(
            reference.code_predictor, candidate.code_predictor, prefixes, seed, candidate_weights=weights
        )
    publish(result, json_out, dtype_table, quiet, model=model)


@bench_app.command("decoder")
def bench_decoder_command(
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    frames: str = typer.Option(
        "50,300,301,600", help="Utterance lengths in frames (qwen-tts decodes in chunks of 300 past 300)."
    ),
    repeats: int = typer.Option(3, help="Timed repetitions per length (after one warm-up)."),
    stream_frames: int = typer.Option(4, help="Frames per push of the streamed column (as synth --stream-frames)."),
    streams: int = typer.Option(
        8, help="Streams whose pieces (1 frame, and --stream-frames) are decoded one by one and together."
    ),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table."),
) -> None:
    """The speech decoder's cost per frame over utterances of growing length (random codes): qwen-tts's decode()
    beside rvqtts's, offline and streamed; then several streams' pieces decoded one by one and together, as a
    server's rows are."""
    from rvqtts.bench.decoder import bench_decoder, decoder_table

    lengths = list_of_ints(frames, "--frames")
    if stream_frames < 1:
        fail(f"--stream-frames must be at least 1, got {stream_frames}")
    if repeats < 1:
        fail(f"--repeats must be at least 1, got {repeats}")
    if streams < 1:
        fail(f"--streams must be at least 1, got {streams}")
    tts = load_synthesizer(model, quiet, device=device, dtype=dtype, spec=False).tts
    result = bench_decoder(tts, lengths, repeats, stream_frames=stream_frames, streams=streams)
    publish(result, json_out, decoder_table, quiet, model=model)


@bench_app.command("talker")
def bench_talker_command(
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    contexts: str = typer.Option("64,256,1024", help="Context lengths (prompt plus frames so far) to step at."),
    repeats: int = typer.Option(20, help="Timed steps per context length and side (after three warm-ups)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    weights: str = typer.Option("native", help=WEIGHTS_HELP),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table."),
) -> None:
    """One talker step, rvqtts's static-cache runner against qwen-tts's talker forward, by context length."""
    from rvqtts.bench.talker import bench_talker, talker_table

    lengths = list_of_ints(contexts, "--contexts")
    if repeats < 1:
        fail(f"--repeats must be at least 1, got {repeats}")
    synthesizer = load_synthesizer(model, quiet, device=device, dtype=dtype, weights=weights, spec=False)
    result = bench_talker(synthesizer.talker, lengths, repeats, weight_format=synthesizer.weights)
    publish(result, json_out, talker_table, quiet, model=model)


@bench_app.command("coreml")
def bench_coreml_command(
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    contexts: Optional[Path] = typer.Option(None, help=CONTEXTS_HELP),
    texts: Optional[Path] = typer.Option(None, help=TEXTS_HELP),
    split: str = typer.Option("evaluation", help=SPLIT_HELP),
    frames: int = typer.Option(200, help="Frames to decode (the first of the source)."),
    package: Optional[Path] = typer.Option(
        None, help="Package to measure (macOS); default: the cache's, exported on first use."
    ),
    tree: str = typer.Option("auto", help="auto (the best N measured for Core ML, else 16), N, or a tree file."),
    offsets: Optional[Path] = typer.Option(None, help="Offsets file; default: shipped offsets matching the model."),
    precision: str = typer.Option("w8a16", help="Precision of a package exported on first use: w8a16 or fp16."),
    compute_units: str = typer.Option("all", help="all, cpu_and_ne, cpu_and_gpu or cpu_only."),
    instruct: Optional[str] = typer.Option(None, help=INSTRUCT_HELP),
    voice: Optional[Path] = typer.Option(None, help=VOICE_HELP),
    seed: int = typer.Option(0, help="Seed of the noise."),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress or table."),
) -> None:
    """Core ML package against the float32 PyTorch engine on the same frames and noise: codes and frames that
    agree, codes per call, ms per frame speculative and plain. Off macOS, PyTorch float16 stands in for the
    package (a proxy for float16 rounding, not a Core ML measurement)."""
    import sys

    from rvqtts.bench.dtype import bench_fused, coreml_table
    from rvqtts.engine.backends.coreml import coreml_loop, float16_stand_in
    from rvqtts.engine.model.sampling import SamplingConfig
    from rvqtts.engine.speculative.policy import choose_speculation

    check_source(texts, contexts)
    if frames < 1:
        fail(f"--frames must be at least 1, got {frames}")
    on_mac = sys.platform == "darwin"
    if on_mac:
        check_coreml(compute_units, precision)
    synthesizer = load_synthesizer(model, quiet, device="cpu", dtype="float32", spec=False)
    sampling = SamplingConfig()
    with refused(ValueError):  # CoreMLError, TreeFileError, OffsetsFileError
        speculation, notice = choose_speculation(synthesizer.code_predictor, tree, offsets, device_type="coreml")
        if on_mac:
            candidate = coreml_loop(
                synthesizer.code_predictor,
                speculation,
                sampling,
                package,
                precision,
                compute_units,
                report=lambda message: say(message, quiet),
            )
        else:
            candidate = float16_stand_in(synthesizer.code_predictor, speculation, sampling)
    say(notice, quiet)
    source = recorded_frames(synthesizer, texts, contexts, split, None, "auto", seed, quiet, None, instruct, voice)
    prefixes = source.prefixes(synthesizer.talker.get_input_embeddings())[:frames]
    with progress_bar(quiet) as progress:
        progress.add_task(f"decoding {len(prefixes)} frames three ways", total=None)
        result = bench_fused(synthesizer.code_predictor, speculation, candidate, prefixes, seed, sampling)
    publish(
        result,
        json_out,
        coreml_table,
        quiet,
        model=model,
        candidate=f"coreml {compute_units}" if on_mac else "pytorch float16 (proxy)",
        tree_nodes=speculation.tree.nodes,
        frames_source=source.source,
    )


@bench_app.command("serve")
def bench_serve_command(
    url: str = typer.Option("http://127.0.0.1:8880", help="Base URL of a running rvqtts serve."),
    texts: Path = typer.Option(..., help="Text file, one request's input per line (.txt or .jsonl), taken in turn."),
    requests: int = typer.Option(32, help="Requests in all."),
    clients: int = typer.Option(8, help="Concurrent clients, each sending its share one after another."),
    stagger: float = typer.Option(
        0.0, help="Seconds between the clients' starts (0: all at once, so that requests of one length join in bursts)."
    ),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Streamed responses (time to first audio)."),
    voice: Optional[str] = typer.Option(None, help="Voice of every request; default: the server's first."),
    max_frames: Optional[int] = typer.Option(None, help="Most frames per chunk of every request."),
    api_key: Optional[str] = typer.Option(None, envvar="RVQTTS_API_KEY", help="The server's key, if it has one."),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table."),
) -> None:
    """Load-test a running `rvqtts serve` (docs/server.md): time to first audio and total time per request
    (p50, p95), the server's mean split of a streamed request's first audio (queue, prefill, frames, decoder),
    requests per minute, and the server's resident memory before and after."""
    import httpx

    from rvqtts.bench.serve import load_test, serve_table
    from rvqtts.synthesis.batch_files import BatchFileError, read_batch

    if requests < 1 or clients < 1 or stagger < 0:
        fail("--requests and --clients must be at least 1, --stagger at least 0")
    with refused(BatchFileError):
        lines = [u.text for u in read_batch(texts)]
    url = url.rstrip("/")
    with refused(httpx.HTTPError, RuntimeError, KeyError, prefix=f"the load test against {url} failed: "):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        served = httpx.get(f"{url}/v1/audio/voices", headers=headers, timeout=30).json()["voices"]
        voice = voice or (served or [None])[0]
        fields = {"voice": voice, **({"max_frames": max_frames} if max_frames else {})}
        result = load_test(url, lines, requests, clients, stream, api_key, fields, stagger)
    publish(result, json_out, serve_table, quiet)
