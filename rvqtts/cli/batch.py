"""How `rvqtts synth -f` runs a batch file: here on one loaded model, or on a Ray cluster's workers
(`--ray`); both report per line as they go, then the table, the totals and the exit code."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import typer

from rvqtts.cli.common import fail, progress_bar, say, show_stats, stderr_console, write_stats

if TYPE_CHECKING:
    from rvqtts.synthesis.settings import Line

INTERRUPTED = 130  # a shell's code for a process ended by Ctrl-C (128 + SIGINT)


class _LineProgress:
    """A batch's bar as its lines end (`done`): it advances, counts the files written (for an interrupted batch's
    message), and names a failed line (always) and a line's warnings (unless quiet)."""

    def __init__(self, progress, task, file: Path, quiet: bool):
        self.progress, self.task, self.file, self.quiet = progress, task, file, quiet
        self.written = 0

    def done(self, result) -> None:
        self.written += result.status == "done"
        self.progress.advance(self.task)
        if result.status == "failed":
            typer.echo(f"rvqtts: {self.file}:{result.line.utterance}: failed: {result.error}", err=True)
        for warning in (result.record or {}).get("warnings", []):
            say(f"warning: {result.line.name}: {warning}", self.quiet)

    def lines(self, total: int) -> None:
        """The bar's total, once it is known (a Ray batch learns it when its workers start)."""
        self.progress.update(self.task, total=total)


@contextlib.contextmanager
def _batch_progress(title: str, total: int | None, file: Path, out_dir: Path, quiet: bool) -> Iterator[_LineProgress]:
    """A batch's bar, its lines reported as they end; Ctrl-C inside says what is there (only whole files: each is
    written atomically) and how to go on, and exits INTERRUPTED."""
    with progress_bar(quiet) as progress:
        lines = _LineProgress(progress, progress.add_task(title, total=total), file, quiet)
        try:
            yield lines
        except KeyboardInterrupt:
            typer.echo(
                f"rvqtts: interrupted: {lines.written} files written to {out_dir}, each whole; run the same command "
                "again to make the rest",
                err=True,
            )
            raise typer.Exit(INTERRUPTED) from None


def _report(results, out_dir: Path, stats_json: Optional[Path], quiet: bool, wall: float, cluster=None) -> None:
    """The made lines' table and total (its wall the batch's own, `wall` seconds: lines that share calls overlap),
    the counts, --stats-json; exit 1 when a line failed."""
    from rvqtts.support.report import total_record, workers_table

    made = [(r.line.name, r.record) for r in results if r.status == "done"]
    skipped = sum(r.status == "skipped" for r in results)
    failed = sum(r.status == "failed" for r in results)
    extra = {} if cluster is None else {"cluster": cluster.totals(), "workers": [w.summary() for w in cluster.workers]}
    total = total_record([record for _, record in made], wall)
    write_stats(stats_json, [{"name": name, **record} for name, record in made], total, **extra)
    if made:
        show_stats(made + ([("total", total)] if len(made) > 1 else []), quiet)
    if cluster is not None and cluster.workers and not quiet:
        stderr_console().print(workers_table(extra["workers"], extra["cluster"]))
    say(
        f"{len(made)} written, {skipped} skipped (already there; --force redoes them), {failed} failed -> {out_dir}",
        quiet and not failed,
    )
    if failed:
        raise typer.Exit(1)


def run_here(
    synthesizer,
    utterances,
    out_dir: Path,
    file: Path,
    defaults: Line,
    chunk_chars: Optional[float],
    force: bool,
    codes_out: Optional[Path],
    stats_json: Optional[Path],
    quiet: bool,
    batch_size: int = 1,
) -> None:
    from rvqtts.synthesis.batch_files import synthesize_batch

    began = time.perf_counter()
    with _batch_progress(f"synthesizing {file.name}", len(utterances), file, out_dir, quiet) as lines:
        results = synthesize_batch(
            synthesizer,
            utterances,
            out_dir,
            defaults,
            chunk_chars,
            force=force,
            codes_dir=codes_out,
            on_done=lines.done,
            batch_size=batch_size,
            on_notice=lambda notice: say(notice, quiet),
        )
    _report(results, out_dir, stats_json, quiet, time.perf_counter() - began)


def say_worker_threads(spec, quiet: bool) -> None:
    """Say where Ray workers run another thread count than a local run here (their files' last bits can differ)."""
    import torch

    threads = torch.get_num_threads()  # a local run's here
    if spec.gpus == 0 and max(1, int(spec.cpus)) != threads:
        say(
            f"each worker runs {max(1, int(spec.cpus))} torch thread(s), a local run here {threads}: the speech "
            f"decoder's last bits depend on it, so files can differ from a local run's (the codes do not); "
            f"--cpus-per-worker {threads} gives a local run's bytes (docs/cluster.md)",
            quiet,
        )


def run_on_ray(
    spec,
    address: str,
    workers: Optional[int],
    utterances,
    out_dir: Path,
    file: Path,
    defaults: Line,
    chunk_chars: Optional[float],
    force: bool,
    codes_out: Optional[Path],
    stats_json: Optional[Path],
    quiet: bool,
) -> None:
    """The batch on a Ray cluster; the driver (this process) writes every file. A cluster that fails
    before any file is written is exit 2 with one line, after some were written exit 1 (they stay)."""

    from rvqtts.serving.cluster import ClusterError, synthesize_batch_on_ray

    say(
        f"starting Ray workers for {file.name} ({'a cluster here or $RAY_ADDRESS' if address == 'auto' else address})",
        quiet,
    )
    say_worker_threads(spec, quiet)
    with _batch_progress(f"synthesizing {file.name} on Ray", None, file, out_dir, quiet) as lines:
        try:
            batch = synthesize_batch_on_ray(
                utterances,
                out_dir,
                spec,
                defaults,
                chunk_chars,
                address=address,
                workers=workers,
                force=force,
                codes_dir=codes_out,
                on_start=lines.lines,
                on_done=lines.done,
            )
        except ClusterError as error:
            if not lines.written:
                fail(str(error))
            typer.echo(
                f"rvqtts: error: {error} ({lines.written} files were written to {out_dir}; a rerun resumes)", err=True
            )
            raise typer.Exit(1)
    for notice in batch.notices:
        say(notice, quiet and not notice.startswith("warning"))
    _report(batch.results, out_dir, stats_json, quiet, batch.wall_seconds, cluster=batch)
