"""`rvqtts bench document`: a document spoken whole (`rvqtts read`: chapter files, captions, audiobook) with its
chunks B rows at a time against one row at a time, and against stock qwen-tts speaking the same chunks one after
another and in its own batched call, the sides taking turns; and the peak memory of a long document against a short
one, each read in a process of its own."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from rich.table import Table

from rvqtts.bench.batch import stock_batches
from rvqtts.documents.document import Chapter, Document
from rvqtts.documents.narration import ReadingOptions, narrate
from rvqtts.documents.plan import plan_document
from rvqtts.support.report import titled_table
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.synthesis.synthesizer import Synthesizer

SENTENCES = Path(__file__).parents[1] / "tuning" / "standin" / "sentences" / "en.txt"
CHAPTERS = 4
SENTENCES_PER_PARAGRAPH = 2  # about 130 characters: one chunk a paragraph


def bench_document_text(chunks: int) -> str:
    """A Markdown book of about `chunks` chunks (its title, CHAPTERS headings and paragraphs of a chunk each), from
    the stand-in's English sentences taken in turn."""
    sentences = SENTENCES.read_text(encoding="utf-8").split("\n")
    sentences = [s for s in sentences if s.strip()]
    parts = ["# A Benchmark Book\n"]
    paragraphs = max(chunks - CHAPTERS - 1, CHAPTERS)
    for index in range(paragraphs):
        if index % (paragraphs // CHAPTERS) == 0 and index // (paragraphs // CHAPTERS) < CHAPTERS:
            parts.append(f"## Chapter {len([p for p in parts if p.startswith('##')]) + 1}\n")
        start = index * SENTENCES_PER_PARAGRAPH
        words = [sentences[(start + k) % len(sentences)] for k in range(SENTENCES_PER_PARAGRAPH)]
        parts.append(" ".join(words) + "\n")
    return "\n".join(parts)


def _narrated(synth, document: Document, rows: int, settings: GenerationSettings, speaker, seed: int) -> dict:
    """`rvqtts read`'s whole job into a fresh folder at `rows` rows: wall seconds and the chunks' audio seconds."""
    with tempfile.TemporaryDirectory(prefix="rvqtts-bench-document-") as folder:
        started = time.perf_counter()
        options = ReadingOptions(seed=seed, batch_size=rows)
        result = narrate(synth, document, folder, Line(speaker=speaker, settings=settings), options)
        wall = time.perf_counter() - started
    if result.failed:
        raise RuntimeError(f"the document failed: {result.failed[0].error}")
    return {"wall_seconds": wall, "audio_seconds": result.statistics["audio_seconds_made"]}


def bench_document(
    synth: Synthesizer,
    document: Document,
    rows: int,
    settings: GenerationSettings,
    speaker: str | None = None,
    seed: int = 0,
    stock: bool = True,
    repeats: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Medians over `repeats` turns of each side's wall seconds and throughput (audio seconds per wall second): the
    document read at `rows` rows and at one, stock qwen-tts over its chunks one at a time and `rows` at a time."""
    speaker = synth.check_voice(speaker, "auto")
    texts = [chunk.text for plan in plan_document(document, seed) for chunk in plan.chunks]
    sides: dict[str, Callable[[GenerationSettings, Document, list[str]], dict]] = {
        f"rvqtts read, B = {rows}": lambda s, d, t: _narrated(synth, d, rows, s, speaker, seed),
        "rvqtts read, B = 1": lambda s, d, t: _narrated(synth, d, 1, s, speaker, seed),
    }
    if stock:
        sides["stock, one chunk at a time"] = lambda s, d, t: stock_batches(synth, t, 1, speaker, "auto", s, seed)
        sides[f"stock, {rows} chunks a call"] = lambda s, d, t: stock_batches(synth, t, rows, speaker, "auto", s, seed)
    warm_document = Document("warm-up", (Chapter("One", tuple(texts[:2])),))
    for run in sides.values():  # first calls (kernel choices, packing) paid by no turn
        run(GenerationSettings(max_frames=2), warm_document, texts[:2])
    turns: dict[str, list[dict]] = {side: [] for side in sides}
    done = 0
    for _ in range(repeats):
        for side, run in sides.items():
            turns[side].append(run(settings, document, texts))
            done += 1
            if progress:
                progress(done, repeats * len(sides))
    rows_out = []
    for side, runs in turns.items():
        wall = statistics.median(run["wall_seconds"] for run in runs)
        audio = runs[0]["audio_seconds"]
        rows_out.append({"side": side, "wall_seconds": round(wall, 3), "audio_seconds": round(audio, 3)})
        rows_out[-1]["throughput"] = round(audio / wall, 4)
    base = {row["side"]: row["throughput"] for row in rows_out}
    for row in rows_out:
        row["vs_one_row"] = round(row["throughput"] / base["rvqtts read, B = 1"], 3)
        if stock:
            row["vs_stock_one_at_a_time"] = round(row["throughput"] / base["stock, one chunk at a time"], 3)
    return {
        "chunks": len(texts),
        "chapters": len(document.chapters),
        "rows": rows,
        "max_frames": settings.max_frames,
        "seed": seed,
        "repeats": repeats,
        "sides": rows_out,
        "engine": synth.engine_record(),
    }


def document_memory(model: str, chunk_counts: list[int], arguments: list[str]) -> list[dict]:
    """Each document of `chunk_counts` chunks read by `rvqtts read` in a process of its own (with `arguments`, e.g.
    --max-frames), and that process's peak resident memory (manifest.json's statistics)."""
    measured = []
    for chunks in chunk_counts:
        with tempfile.TemporaryDirectory(prefix="rvqtts-bench-memory-") as folder:
            book = Path(folder) / "book.md"
            book.write_text(bench_document_text(chunks), encoding="utf-8")
            command = [sys.executable, "-m", "rvqtts.cli", "read", str(book), "--model", model, "-q"]
            subprocess.run([*command, "--out-dir", str(Path(folder) / "out"), *arguments], check=True)
            statistics_ = json.loads((Path(folder) / "out" / "manifest.json").read_text())["statistics"]
            measured.append({"chunks": chunks, **statistics_["memory"]})
    return measured


def document_table(result: dict) -> Table:
    """`rvqtts bench document`: each side's wall time and audio seconds per wall second, and the ratios."""
    engine = result["engine"]
    stock = "vs_stock_one_at_a_time" in result["sides"][0]
    table = titled_table(
        f"a document of {result['chunks']} chunks in {result['chapters']} chapters, {engine['device']} "
        f"{engine['dtype']} {engine['weights']}, at most {result['max_frames']} frames a chunk, median of "
        f"{result['repeats']}",
        ("side", "wall s", "audio s", "audio s / s", "vs one row", *(("vs stock one at a time",) if stock else ())),
        left=("side",),
    )
    for row in result["sides"]:
        cells = [row["side"], f"{row['wall_seconds']:.2f}", f"{row['audio_seconds']:.1f}", f"{row['throughput']:.3f}"]
        cells.append(f"{row['vs_one_row']:.2f}")
        if stock:
            cells.append(f"{row['vs_stock_one_at_a_time']:.2f}")
        table.add_row(*cells)
    for memory in result.get("memory", []):
        table.add_row(f"peak memory, {memory['chunks']} chunks", "", "", f"{memory['peak_rss_mib']:.0f} MiB")
    table.caption = (
        "rvqtts read: the whole job (chunks, chapter files, captions, .m4b) into a fresh folder; stock: qwen-tts's "
        "generate_custom_voice over the same chunks, audio only"
    )
    return table
