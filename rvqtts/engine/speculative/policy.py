"""The tree policy: which inner loop a model runs (plain, a fixed tree, or the tree size chosen online), from the
user's --tree and --offsets and this machine's measurements (rvqtts.engine.speculative.tree's best sizes,
rvqtts.engine.speculative.online)."""

from __future__ import annotations

import os

import torch

from rvqtts.engine.model.kernels import measured_choices
from rvqtts.engine.speculative.offsets import Offsets, load_offsets, predictor_fingerprint, shipped_offsets_for
from rvqtts.engine.speculative.online import OnlineSpeculation
from rvqtts.engine.speculative.speculation import DEFAULT_DEPTH, Speculation, TreePolicy
from rvqtts.engine.speculative.tree import best_budget, platform_key, resolve_tree


def choose_speculation(
    code_predictor: torch.nn.Module,
    tree: str | os.PathLike = "auto",
    offsets: str | os.PathLike | None = None,
    allow_plain: bool = False,
    device_type: str | None = None,
    weights: str = "native",
) -> tuple[TreePolicy | None, str | None]:
    """The tree and offsets to draft with, and a notice for the user (or None). `tree`: a node budget N (a shipped tree,
    preferring one calibrated for this model), a file, or `auto`: decided online with `allow_plain` on the torch backend
    (an OnlineSpeculation, rvqtts.engine.speculative.online, starting from the best N recorded for this platform), else
    that best N (None where it is 0 and `allow_plain`), as everywhere with RVQTTS_CHOICES=fixed. The platform:
    `device_type` (coreml) or the model's device kind, with the dtype and `weights`. Offsets: the given file (checked
    whatever runs), else shipped ones whose fingerprint matches the model, else zeros (reused heads). Raises
    TreeFileError / OffsetsFileError / ValueError with their messages."""
    fingerprint = predictor_fingerprint(code_predictor)
    hidden = code_predictor.config.hidden_size
    weight = code_predictor.lm_head[0].weight
    platform = (
        platform_key(device_type, "float16")
        if device_type == "coreml"
        else platform_key(weight.device.type, weight.dtype, weights)
    )
    plain = None
    if allow_plain and str(tree) == "auto":
        budget, source = best_budget(platform, fingerprint)
        if device_type != "coreml" and measured_choices():
            drafts, notice = drafting_offsets(offsets, hidden, fingerprint, DEFAULT_DEPTH)
            online = OnlineSpeculation(drafts, fingerprint, start_budget=budget)
            starting = "the plain loop" if budget == 0 else f"N = {budget}"
            message = f"--tree auto: the tree size is chosen online, starting from {starting} ({source})"
            return online, message + (f"; {notice}" if notice else "")
        if budget == 0:
            plain = (
                f"plain inner loop: no tree was measured to pay for this model on {platform} ({source});"
                f" --tree N forces speculation"
            )
            if offsets is None:
                return None, plain
    chosen = resolve_tree(tree, fingerprint, platform)
    drafts, notice = drafting_offsets(offsets, hidden, fingerprint, chosen.depth)
    try:
        speculation = Speculation(chosen, drafts)
    except ValueError as error:
        raise ValueError(f"tree {tree} with offsets {offsets}: {error}") from error
    if plain:  # a given offsets file is checked, against the tree it would draft, even where it goes unused
        return None, f"{plain}; the offsets file is not used"
    return speculation, notice


def drafting_offsets(
    offsets: str | os.PathLike | None, hidden: int, fingerprint: str, depth: int
) -> tuple[Offsets, str | None]:
    """The offsets file given, else shipped offsets matching the model, else zero offsets of at least
    `depth` (reused heads, said in the notice)."""
    if offsets is not None:
        return load_offsets(offsets, hidden_size=hidden, fingerprint=fingerprint), None
    drafts = shipped_offsets_for(fingerprint, hidden)
    if drafts is not None:
        return drafts, None
    return (
        Offsets.zeros(max(DEFAULT_DEPTH, depth), hidden),
        "no shipped offsets match this model: drafting with zero offsets (reused heads)",
    )


def tree_nodes(speculation: TreePolicy | None) -> int:
    """The tree size a speculation runs now: the fixed tree's, the online choice's (0: the plain loop), or 0."""
    return max(speculation.budget, 0) if speculation else 0
