"""`rvqtts bench speedup`: the inner-loop speedup each tree size projects to, from codes per call (an
acceptance table, or the paper's figures) and the predictor bench's call costs."""

from __future__ import annotations

import io

from rich.table import Table

from rvqtts.engine.speculative.tree import frame_codes_per_call, grow_tree
from rvqtts.support.files import write_atomically
from rvqtts.support.report import figures_table

BUDGETS = (4, 7, 8, 15, 16, 31, 32, 63, 64)  # q = N + 1 of 8, 16, 32, 64 are kernel sweet spots on CPUs
# The paper's codes per call for its offsets drafter (Figure 4, N = 16 / 32 / 64): a labelled reference,
# used when no acceptance table of the model is given.
PAPER_CODES_PER_CALL = {16: 2.25, 32: 2.47, 64: 2.60}


def codes_per_call_by_budget(table: dict | None) -> tuple[dict[int, float], str]:
    """Codes per call per node budget: from an acceptance table (a greedy tree per budget, whole frames,
    rvqtts.engine.speculative.tree.frame_codes_per_call), or the paper's figures when there is none."""
    if table is None:
        return dict(PAPER_CODES_PER_CALL), "paper, offsets drafter (Figure 4; reference, not measured here)"
    rates = table["acceptance"]
    figures = {n: round(frame_codes_per_call(rates, grow_tree(rates, n)), 4) for n in BUDGETS}
    source = table.get("source") or f"acceptance table of {table.get('model') or 'a model'}"
    return figures, source


def cost_at(predictor: dict, q: int, key: str = "ratio_to_q1") -> float:
    """A predictor bench figure at query length q (within the measured range), interpolated linearly
    between measured lengths."""
    lengths, values = predictor["q"], predictor[key]
    if q in lengths:
        return values[lengths.index(q)]
    below = max(x for x in lengths if x < q)
    above = min(x for x in lengths if x > q)
    low, high = values[lengths.index(below)], values[lengths.index(above)]
    return low + (high - low) * (q - below) / (above - below)


def project_speedup(codes_per_call: dict[int, float], predictor: dict) -> dict:
    """Projected inner-loop speedup per N: codes per call at N over the cost of a q = N + 1 call relative
    to a q = 1 call (against rvqtts's plain loop, and against qwen-tts's stock q = 1 call). The best N is
    the fastest, or 0 when none beats the plain loop."""
    measured = [n for n in sorted(codes_per_call) if min(predictor["q"]) <= n + 1 <= max(predictor["q"])]
    if not measured:
        raise ValueError(
            f"the predictor bench measured q = {min(predictor['q'])}..{max(predictor['q'])}, none of "
            f"q = N + 1 for N = {', '.join(map(str, sorted(codes_per_call)))}: rerun `rvqtts bench "
            f"predictor` with --q covering them"
        )
    rows = []
    for n in measured:
        codes = codes_per_call[n]
        ratio, ratio_stock = cost_at(predictor, n + 1), cost_at(predictor, n + 1, "ratio_to_stock_q1")
        rows.append(
            {
                "N": n,
                "codes_per_call": codes,
                "cost_ratio": round(ratio, 4),
                "speedup": round(codes / ratio, 4),
                "speedup_vs_stock": round(codes / ratio_stock, 4),
            }
        )
    best = max(rows, key=lambda row: row["speedup"])
    # best_N = 0: no tree beats the plain loop on this device with this acceptance.
    return {
        "rows": rows,
        "best_N": best["N"] if best["speedup"] > 1.0 else 0,
        "best_speedup": best["speedup"],
        "not_measured": [n for n in sorted(codes_per_call) if n not in measured],
        "device": predictor["device"],
        "dtype": predictor["dtype"],
        "weights": predictor["weights"],
        "weight_format": predictor.get("weight_format", "native"),
    }


def plot_speedup(projection: dict, acceptance_source: str, path) -> None:
    """Two panels in the manner of the paper's Figure 4: the acceptance ceiling (codes per call) over N,
    and the projected speedup over N on the measured device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [row["N"] for row in projection["rows"]]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(budgets, [row["codes_per_call"] for row in projection["rows"]], "o-", color="tab:blue")
    left.set(xscale="log", xlabel="tree nodes N", ylabel="codes per call", title="acceptance ceiling")
    left.text(0.02, 0.02, acceptance_source[:70], transform=left.transAxes, fontsize=7, color="gray")
    label = f"{projection['device']} {projection['dtype']}"
    right.plot(
        budgets,
        [row["speedup"] for row in projection["rows"]],
        "o-",
        color="tab:red",
        label=f"vs rvqtts plain loop ({label})",
    )
    right.plot(
        budgets,
        [row["speedup_vs_stock"] for row in projection["rows"]],
        "s--",
        color="tab:orange",
        label="vs stock qwen-tts q = 1 call",
    )
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set(
        xscale="log",
        xlabel="tree nodes N",
        ylabel="projected inner-loop speedup",
        title=f"{label}: " + (f"best N = {projection['best_N']}" if projection["best_N"] else "no N pays"),
    )
    right.legend(fontsize=7)
    ticks = [n for n in budgets if n & (n - 1) == 0]  # powers of two; neighbours like 15 and 16 would collide
    for axis in (left, right):
        axis.set_xticks(ticks, [str(n) for n in ticks])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=120)
    plt.close(figure)
    write_atomically(path, image.getvalue())


def speedup_table(projection: dict) -> Table:
    """`rvqtts bench speedup`: codes per call, cost ratio and projected inner-loop speedup per N."""
    best = f"best N = {projection['best_N']}" if projection["best_N"] else "no N beats the plain loop"
    skipped = ", ".join(map(str, projection["not_measured"]))
    return figures_table(
        f"projected inner-loop speedup, {projection['device']} {projection['dtype']}: {best}",
        ("N", "codes/call", "cost q=N+1 / q=1", "speedup", "vs stock"),
        ("{N}", "{codes_per_call:.3f}", "{cost_ratio:.3f}", "{speedup:.3f}", "{speedup_vs_stock:.3f}"),
        projection["rows"],
        f"acceptance: {projection['acceptance_source']}"
        + (f"; N = {skipped} not projected (q = N + 1 outside the bench's range)" if skipped else ""),
    )
