"""Run statistics for people: the batch total of per-utterance records, and the table shown on stderr."""

from __future__ import annotations

from rich import box
from rich.table import Table

SUMMED = ("frames", "audio_seconds", "chunks", "talker_calls", "predictor_calls", "predictor_codes",
          "wall_seconds", "talker_seconds", "predictor_seconds", "decoder_seconds")


def total_record(records: list[dict]) -> dict:
    """One record for a whole batch: counts and seconds add up; ratios are recomputed from the sums."""
    total: dict = {key: round(sum(r[key] for r in records), 3) for key in SUMMED}
    depth = max((len(r["accepted_per_depth"]) for r in records), default=0)
    total["accepted_per_depth"] = [sum(r["accepted_per_depth"][d] for r in records
                                       if d < len(r["accepted_per_depth"])) for d in range(depth)]
    calls = total["predictor_calls"]
    total["codes_per_call"] = round(total["predictor_codes"] / calls, 4) if calls else 0.0
    total["rtf"] = round(total["wall_seconds"] / total["audio_seconds"], 4) if total["audio_seconds"] else None
    total["utterances"] = len(records)
    for key in ("spec", "tree_nodes", "seed"):
        values = {r[key] for r in records}
        total[key] = values.pop() if len(values) == 1 else None
    total["warnings"] = sum(len(r["warnings"]) for r in records)
    return total


def stats_table(rows: list[tuple[str, dict]]) -> Table:
    """A table of (name, record) rows: what was made, how the inner loop did, where the time went."""
    table = Table(title="rvqtts synth (seconds)", title_justify="left", box=box.SIMPLE_HEAD)
    columns = [("", "name", None), ("frames", "frames", None), ("audio", "audio_seconds", ".2f"),
               ("calls", "predictor_calls", None), ("codes/call", "codes_per_call", ".2f"),
               ("wall", "wall_seconds", ".2f"), ("talker", "talker_seconds", ".2f"),
               ("predictor", "predictor_seconds", ".2f"), ("decoder", "decoder_seconds", ".2f"),
               ("RTF", "rtf", ".2f")]
    for title, _, _ in columns:
        table.add_column(title, justify="right" if title else "left", no_wrap=True,
                         max_width=None if title else 24, overflow="ellipsis")
    for name, record in rows:
        cells = []
        for _, key, fmt in columns:
            value = name if key == "name" else record.get(key)
            cells.append("-" if value is None else format(value, fmt) if fmt else str(value))
        table.add_row(*cells)
    spec = {r.get("spec") for _, r in rows}
    nodes = {r.get("tree_nodes") for _, r in rows}
    table.caption = ("speculative, tree N = " + "/".join(str(n) for n in sorted(nodes)) if spec == {True}
                     else "plain inner loop (--no-spec)" if spec == {False} else "mixed")
    table.caption += "; calls = predictor calls; RTF = compute seconds / audio seconds"
    return table


def standin_tables(report: dict) -> list[Table]:
    """The stand-in's faithfulness per position, and reused-heads codes per call per tree size."""
    per_position = Table(title="stand-in, per position k (held-out frames)", title_justify="left",
                         box=box.SIMPLE_HEAD)
    for title in ("k", "sampling entropy bits", "raw entropy bits", "cross-entropy bits", "chain gain bits"):
        per_position.add_column(title, justify="right")
    for k in range(len(report["entropy_bits"])):
        gain = report["chain_gain_bits"][k]
        per_position.add_row(str(k + 1), f"{report['entropy_bits'][k]:.2f}", f"{report['raw_entropy_bits'][k]:.2f}",
                             f"{report['cross_entropy_bits'][k]:.2f}", "-" if gain is None else f"{gain:+.2f}")
    drafts = report["draft_top1_by_depth"]
    per_position.caption = ("reused-heads draft top-1 by depth: " + ", ".join(f"{a:.3f}" for a in drafts)
                            + f"; c1 top-1 {report['c1_top1_accuracy']:.3f} (chance {report['chance_top1_accuracy']:.4f})")
    per_budget = Table(title="reused heads: codes per predictor call (evaluation frames)", title_justify="left",
                       box=box.SIMPLE_HEAD)
    languages = sorted(next(iter(report["reused_heads_codes_per_call"].values()))["per_language"])
    for title in ("N", "overall", "95% CI", *languages, "nodes per depth"):
        per_budget.add_column(title, justify="right")
    for budget, row in report["reused_heads_codes_per_call"].items():
        depths = [sum(len(p) == d for p in row["tree"]) for d in range(1, 4)]
        per_budget.add_row(budget, f"{row['codes_per_call']:.3f}", "{:.3f}-{:.3f}".format(*row["ci95"]),
                           *(f"{row['per_language'][lang]['codes_per_call']:.3f}" for lang in languages),
                           "/".join(map(str, depths)))
    return [per_position, per_budget]
