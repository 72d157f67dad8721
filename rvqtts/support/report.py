"""Run statistics for people: the batch total of per-utterance records, and the tables `rvqtts synth`, `tune` and
the stand-in show on stderr (each benchmark's table is beside its benchmark, in rvqtts.bench)."""

from __future__ import annotations

import json

from rich import box
from rich.console import Group
from rich.table import Table

SUMMED = (
    "frames",
    "audio_seconds",
    "chunks",
    "talker_calls",
    "predictor_calls",
    "predictor_codes",
    "wall_seconds",
    "talker_seconds",
    "predictor_seconds",
    "decoder_seconds",
)


def titled_table(
    title: str, columns: tuple[str, ...], left: tuple[str, ...] = (), no_wrap: tuple[str, ...] = ()
) -> Table:
    """A report table: its title on the left, a rule under the header, its columns right-justified (figures)
    but those named in `left`, and never wrapped where named in `no_wrap`."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=column in no_wrap)
    return table


def figures_table(title: str, columns: tuple[str, ...], cells: tuple[str, ...], rows, caption=None) -> Table:
    """A titled table of one row per record in `rows`, each column's cell its format string in `cells` filled from
    the record (e.g. "{ratio:.3f}")."""
    table = titled_table(title, columns)
    for row in rows:
        table.add_row(*(cell.format(**row) for cell in cells))
    table.caption = caption
    return table


def ms_by_part(records: list[dict], frames: int) -> dict[str, float]:
    """The lines' inner-loop milliseconds per frame by part, weighted by their frames."""
    parts = sorted({part for r in records for part in r.get("inner_loop_ms_by_part", {})})
    spent = {
        part: sum(r.get("inner_loop_ms_by_part", {}).get(part, 0.0) * r["frames"] for r in records) for part in parts
    }
    return {part: round(ms / frames, 3) if frames else 0.0 for part, ms in spent.items()}


def total_record(records: list[dict], wall_seconds: float | None = None) -> dict:
    """One record for a whole batch: counts and seconds add up; ratios are recomputed from the sums. Lines that
    share calls (a batch of rows) overlap in time, so the sum of their walls is not the batch's: `wall_seconds`,
    the batch's own (measured around it), is then its wall, its RTF's and its throughput's, and the lines' sum
    stays as `lines_wall_seconds`."""
    total: dict = {key: round(sum(r[key] for r in records), 3) for key in SUMMED}
    if wall_seconds is not None:
        total["lines_wall_seconds"], total["wall_seconds"] = total["wall_seconds"], round(wall_seconds, 3)
    depth = max((len(r["accepted_per_depth"]) for r in records), default=0)
    total["accepted_per_depth"] = [
        sum(r["accepted_per_depth"][d] for r in records if d < len(r["accepted_per_depth"])) for d in range(depth)
    ]
    total["inner_loop_ms_by_part"] = ms_by_part(records, total["frames"])
    calls = total["predictor_calls"]
    total["codes_per_call"] = round(total["predictor_codes"] / calls, 4) if calls else 0.0
    total["rtf"] = round(total["wall_seconds"] / total["audio_seconds"], 4) if total["audio_seconds"] else None
    wall = total["wall_seconds"]
    total["audio_seconds_per_wall_second"] = round(total["audio_seconds"] / wall, 4) if wall else None
    total["utterances"] = len(records)
    for key in ("spec", "tree_nodes", "weights", "seed"):
        values = {r[key] for r in records}
        total[key] = values.pop() if len(values) == 1 else None
    engines = [r.get("engine") for r in records]
    total["engine"] = engines[0] if engines and all(e == engines[0] for e in engines) else None
    total["warnings"] = sum(len(r["warnings"]) for r in records)
    return total


def stats_table(rows: list[tuple[str, dict]]) -> Table:
    """A table of (name, record) rows: what was made, how the inner loop did, where the time went."""
    table = Table(title="rvqtts synth (seconds)", title_justify="left", box=box.SIMPLE_HEAD)
    columns = {  # title: (record key, format)
        "frames": ("frames", ""),
        "audio": ("audio_seconds", ".2f"),
        "calls": ("predictor_calls", ""),
        "codes/call": ("codes_per_call", ".2f"),
        "wall": ("wall_seconds", ".2f"),
        "talker": ("talker_seconds", ".2f"),
        "predictor": ("predictor_seconds", ".2f"),
        "decoder": ("decoder_seconds", ".2f"),
        "1st audio": ("first_audio_seconds", ".2f"),
        "RTF": ("rtf", ".2f"),
    }
    cells = [
        [name, *("-" if record.get(key) is None else format(record[key], fmt) for key, fmt in columns.values())]
        for name, record in rows
    ]
    table.add_column("", justify="left", overflow="fold", ratio=1)  # a long name folds instead of a figure:
    for i, title in enumerate(columns, 1):  # figures are never cut, their columns keep their full width
        width = max(len(title), *(len(row[i]) for row in cells))
        table.add_column(title, justify="right", no_wrap=True, min_width=width)
    for row in cells:
        table.add_row(*row)
    spec = {r.get("spec") for _, r in rows}
    nodes = {r.get("tree_nodes") for _, r in rows}
    chosen: dict[str, int] = {}
    for _, record in rows:
        for n, frames in ((record.get("online") or {}).get("frames_by_N") or {}).items():
            chosen[n] = chosen.get(n, 0) + frames
    if chosen:
        caption = "tree size chosen online, frames by N: " + ", ".join(
            f"N = {n}: {frames}" for n, frames in sorted(chosen.items(), key=lambda item: int(item[0]))
        )
    else:
        caption = (
            "speculative, tree N = " + "/".join(str(n) for n in sorted(nodes))
            if spec == {True}
            else "plain inner loop (--no-spec)"
            if spec == {False}
            else "mixed"
        )
    engines = {json.dumps(r.get("engine"), sort_keys=True) for _, r in rows if r.get("engine")}
    if len(engines) == 1:
        caption += f"; {_engine_summary(json.loads(engines.pop()))}"
    totals = [r for name, r in rows if name == "total" and "lines_wall_seconds" in r]
    if totals:
        caption += (
            f"; total wall: the batch's own ({totals[0]['audio_seconds_per_wall_second']:.2f} audio s per wall s; "
            f"lines that share calls overlap, their walls add up to {totals[0]['lines_wall_seconds']:.2f} s)"
        )
    table.caption = caption + "; calls = predictor calls; RTF = compute seconds / audio seconds"
    return table


def _engine_summary(engine: dict) -> str:
    """One clause for the stats table: dtype, device, weights, and the kernels each loop ran."""
    loops = []
    for loop, used in engine.get("kernels", {}).items():
        invariant = {True: "rows invariant", False: "rows NOT invariant", None: "not probed"}[used["row_invariant"]]
        attention = {"rows": ", row attention", "gathered": ", gathered attention"}.get(used.get("attention"), "")
        native = {"layers": ", native layers", "rows": ", native rows"}.get(used.get("native"), "")
        loops.append(f"{loop} " + "/".join(used["maps"]) + f" ({invariant}{attention}{native})")
    weights = "" if engine.get("weights", "native") == "native" else f" {engine['weights']} weights"
    return f"{engine['dtype']}{weights} on {engine['device']}" + (": " + ", ".join(loops) if loops else "")


def workers_table(workers: list[dict], totals: dict) -> Table:
    """A cluster batch's workers (rvqtts.serving.cluster): where each ran, what it made, how busy it was."""
    keys = ("worker", "node", "pid", "device", "dtype", "threads", "lines", "failed", "audio_seconds", "busy_seconds")
    titles = (*keys[:-2], "audio", "busy", "lines/s busy")
    table = titled_table("workers (seconds)", titles, left=("worker", "node"), no_wrap=titles)
    for worker in workers:
        busy = worker["busy_seconds"]
        cells = [f"{worker[key]:.2f}" if key.endswith("seconds") else str(worker[key]) for key in keys]
        table.add_row(*cells, f"{worker['lines'] / busy:.3f}" if busy else "-", style="dim" if worker["died"] else None)
    table.caption = (
        f"{totals['lines']} lines in {totals['wall_seconds']:.1f} s wall (the first "
        f"{totals['startup_seconds']:.1f} s starting workers): "
        f"{totals['lines_per_second']:.3f} lines/s, {totals['audio_seconds_per_wall_second']:.2f} "
        f"audio s per wall s on {totals['workers']} worker(s)"
        + (
            f"; {totals['workers_died']} died, {totals['retried_lines']} line(s) retried"
            if totals["workers_died"]
            else ""
        )
    )
    return table


def standin_tables(report: dict) -> list[Table]:
    """The stand-in's faithfulness per position, and each drafter's codes per call per tree size."""
    per_position = titled_table(
        "stand-in, per position k (held-out frames)",
        ("k", "sampling entropy bits", "raw entropy bits", "cross-entropy bits", "chain gain bits"),
    )
    for k in range(len(report["entropy_bits"])):
        gain = report["chain_gain_bits"][k]
        per_position.add_row(
            str(k + 1),
            f"{report['entropy_bits'][k]:.2f}",
            f"{report['raw_entropy_bits'][k]:.2f}",
            f"{report['cross_entropy_bits'][k]:.2f}",
            "-" if gain is None else f"{gain:+.2f}",
        )
    drafts = report["draft_top1_by_depth"]
    per_position.caption = (
        "reused-heads draft top-1 by depth: "
        + ", ".join(f"{a:.3f}" for a in drafts)
        + f"; c1 top-1 {report['c1_top1_accuracy']:.3f} (chance {report['chance_top1_accuracy']:.4f})"
    )
    tables = [per_position]
    for drafter in ("reused_heads", "offsets"):
        rows = report.get(f"{drafter}_codes_per_call")
        if not rows:
            continue
        languages = sorted(next(iter(rows.values()))["per_language"])
        per_budget = titled_table(
            f"{drafter.replace('_', ' ')}: codes per predictor call (evaluation frames)",
            ("N", "overall", "95% CI", *languages, "nodes per depth"),
        )
        for budget, row in rows.items():
            depths = [sum(len(p) == d for p in row["tree"]) for d in range(1, 4)]
            per_budget.add_row(
                budget,
                f"{row['codes_per_call']:.3f}",
                "{:.3f}-{:.3f}".format(*row["ci95"]),
                *(f"{row['per_language'][lang]['codes_per_call']:.3f}" for lang in languages),
                "/".join(map(str, depths)),
            )
        tables.append(per_budget)
    if report.get("drafters"):
        tables.append(drafters_table(report["drafters"]))
    return tables


def drafters_table(drafters: dict) -> Table:
    """Drafters side by side: trained parameters, codes per call per N (replayed), draft top-1 by depth."""
    budgets = list(next(iter(drafters.values()))["codes_per_call"])
    table = titled_table(
        "drafters, each with its own calibrated trees: codes per predictor call (evaluation frames)",
        ("drafter", "parameters", *(f"N={n}" for n in budgets), "top-1 by depth"),
        left=("drafter",),
    )
    for name, entry in drafters.items():
        top1 = "/".join("-" if a is None else f"{a:.3f}" for a in entry["top1_by_depth"][:3])
        table.add_row(
            name,
            f"{entry['parameters']:,}",
            *(f"{entry['codes_per_call'][n]['codes_per_call']:.3f}" for n in budgets),
            top1,
        )
    return table


def codes_per_call_table(result: dict) -> Table:
    """`rvqtts accept`'s figures: codes per predictor call, overall and per language, with 95 % intervals."""
    languages = [{**row, "language": name} for name, row in sorted(result["per_language"].items())]
    return figures_table(
        f"codes per predictor call, tree N = {result['tree_nodes']}",
        ("frames", "language", "codes/call", "95% CI"),
        ("{frames}", "{language}", "{codes_per_call:.3f}", "{ci95[0]:.3f}-{ci95[1]:.3f}"),
        [{**result, "language": "all"}, *languages],
        f"offsets: {result['offsets']}; frames: {result['frames_source']}",
    )


def tune_table(result: dict) -> Table:
    """`rvqtts tune`: each map shape's kernel, its rows' invariance and costs, against the fixed rule's."""
    left = ("dtype", "loop", "map", "kernel", "fixed rule")
    columns = ("dtype", "loop", "map", "per frame", "kernel", "rows invariant", "1 row ms", "17 rows ms", "fixed rule")
    table = titled_table(f"kernels on {result['machine']}", (*columns, "its 1 row ms"), left=left, no_wrap=left)
    for name, measured in result["dtypes"].items():
        for row in measured["maps"]:
            costs = row["ms"][row["kernel"]]
            fixed = next((ms for name, ms in row["ms"].items() if name.split("/pad")[0] == row["fixed"]), {})
            table.add_row(
                name,
                row["loop"],
                "x".join(map(str, row["shape"])),
                str(row["per_frame"]),
                row["kernel"],
                {True: "yes", False: "NO", None: "-"}[row["row_invariant"]],
                f"{costs['1']:.3f}",
                f"{costs['17']:.3f}",
                row["fixed"],
                f"{fixed['1']:.3f}" if fixed else "-",
            )
    costs = ", ".join(f"{measured['frame_map_ms']:.1f} ms in {name}" for name, measured in result["dtypes"].items())
    picked = f"; --dtype auto picks {result['auto']}" if "auto" in result else ""
    native = (
        f"rvqtts's native kernels run here (built for {result.get('native_level')})"
        if result.get("native") is None
        else f"rvqtts's native kernels do not run here ({result['native']})"
    )
    decoder = f"; {result['decoder_reason']}" if result.get("decoder_reason") else ""
    table.caption = f"one frame's linear maps: {costs}{picked}{decoder}; kept in {result['cache']}; {native}"
    return table if "trees" not in result else Group(table, trees_table(result["trees"]))


def trees_table(online: dict) -> Table:
    """What `--tree auto` chose from (rvqtts.engine.speculative.online): per tree size, the projection and what ran."""
    table = titled_table(
        f"tree size chosen online: N = {online['N']}",
        ("N", "codes/call", "call ms", "projected ms/frame", "frames run", "ms/frame run"),
    )
    for n, row in online["projected"].items():
        table.add_row(
            n,
            f"{row['codes_per_call']:.3f}",
            f"{row['call_ms']:.2f}",
            f"{row['inner_loop_ms_per_frame']:.1f}",
            str(online["frames_by_N"].get(n, 0)),
            f"{online['inner_loop_ms_per_frame_by_N'][n]:.1f}" if n in online["frames_by_N"] else "-",
        )
    acceptance = "; ".join(
        f"depth {d}: " + " ".join(f"{a:.3f}" for a in row[:4]) for d, row in enumerate(online["acceptance"], 1)
    )
    table.caption = (
        f"acceptance counted over {online['roots_counted']} roots (ranks 0-3), {acceptance}; "
        f"{online['probe_frames']} probe frames; call costs: {online['call_costs']}"
        + "".join(
            f"; in this run's frames, a call of {q} rows {ms:.2f} ms"
            for q, ms in online.get("call_ms_in_frames", {}).items()
        )
    )
    return table
