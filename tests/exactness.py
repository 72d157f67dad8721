"""Comparing two runs' codes as the exactness promise allows: equal, or different only where a near-tie shows.

Speculative and plain runs draw every code with the same noise, so they agree wherever a tree call's row computes
what a plain step computes. Where the kernels are not row-invariant the rows differ in their last bits, and a draw
whose two best noisy scores lie within that rounding can flip. A test that allows a difference allows only such a
flip, shown at the frame's first differing code: the two codes' noisy scores, recomputed in float32 by qwen-tts's own
uncached forward from the same committed codes, lie within a few units in the last place of the run's dtype. A broken
verifier (accepting a draft the target did not draw) differs by whole logits: of its first differences over 30
frames on the paper-acceptance checkpoint at the 0.6B widths in bfloat16, 5 lay within the tolerance (0.59-0.82
there) and 25 outside it, up to 7.6."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from helpers import stock_path_logits

from rvqtts.engine.model.sampling import SamplingConfig, warp_logits
from rvqtts.engine.speculative.offsets import Offsets

TIE_ULPS = 4  # how many units in the last place of a logit (in the run's dtype) a near-tie's two scores may differ by
REFERENCE_ULPS = 64  # and at least this many float32 units: the reference's own summation order is not the run's


@dataclass(frozen=True)
class Difference:
    """The first code where two runs of a frame differ, and whether it is a near-tie."""

    frame: int
    position: int  # m of c_m
    gap: float  # |score_a - score_b| of the two drawn codes, recomputed by the reference
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.tolerance


def float32_reference(code_predictor: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of the code predictor, to recompute scores with more precision than either run had."""
    return copy.deepcopy(code_predictor).float()


def broken_walk(children, node_codes, draws, slot_index, last_index):
    """A planted fault in the verifier (rvqtts.engine.speculative.speculation.walk_tree): when the draw hits any drafted
    child, descend into the first (rank 0) child."""
    accepted, u = [], 0
    while slot_index[u] < last_index:
        if not any(node_codes[c] == draws[u] for _, c in children[u]):
            return accepted, draws[u]
        u = children[u][0][1]
        accepted.append(u)
    return accepted, None


def first_difference(
    reference: torch.nn.Module,
    dtype: torch.dtype,
    prefix: torch.Tensor,
    noise: torch.Tensor,
    sampling: SamplingConfig,
    codes_a: list[int],
    codes_b: list[int],
    frame: int = 0,
) -> Difference | None:
    """Where the codes c1..c_{G-1} of one frame first differ (None if nowhere): the two drawn codes' noisy scores
    from the float32 `reference`'s uncached forward over [h_t, c0, the committed codes], against a near-tie's
    tolerance of TIE_ULPS units in the last place of the larger logit in the runs' `dtype` (over the temperature,
    as the scores are)."""
    differing = np.flatnonzero(np.asarray(codes_a) != np.asarray(codes_b))
    if differing.size == 0:
        return None
    index = int(differing[0])
    with torch.inference_mode():
        logits = stock_path_logits(reference, prefix.float(), list(codes_a[:index]))[index]
    scores = warp_logits(logits, sampling) + (noise[index].float() if sampling.do_sample else 0)
    a, b = int(codes_a[index]), int(codes_b[index])
    pair = max(logits[[a, b]].abs().max().item(), 1.0)
    scale = sampling.temperature if sampling.do_sample else 1.0
    ulps = max(TIE_ULPS * torch.finfo(dtype).eps, REFERENCE_ULPS * torch.finfo(torch.float32).eps)
    tolerance = ulps * pair / scale
    gap = (scores[a] - scores[b]).abs().item()
    return Difference(frame, index + 1, gap if np.isfinite(gap) else float("inf"), tolerance)


def unexplained_differences(
    code_predictor: torch.nn.Module,
    prefixes: list[torch.Tensor],
    noises: list[torch.Tensor],
    sampling: SamplingConfig,
    codes_a: np.ndarray,
    codes_b: np.ndarray,
) -> list[Difference]:
    """The frames whose codes differ other than by a near-tie at their first differing code (tolerance in the code
    predictor's dtype): what a test of speculative == plain must find none of. The float32 reference is made only
    where some frame differs."""
    differing = [f for f in range(len(prefixes)) if not np.array_equal(codes_a[f], codes_b[f])]
    if not differing:
        return []
    reference, dtype = float32_reference(code_predictor), code_predictor.lm_head[0].weight.dtype
    found = []
    for frame in differing:
        difference = first_difference(
            reference, dtype, prefixes[frame], noises[frame], sampling, codes_a[frame], codes_b[frame], frame
        )
        if not difference.near_tie:
            found.append(difference)
    return found


def paper_offsets(synth) -> Offsets:
    """Offsets for the paper-acceptance checkpoint (`paper_dir`): b_j moves a state j positions on, by the mean drift
    between consecutive positions' normed inputs (what train-offsets approaches): over 2 codes per call at N = 16."""
    tables = synth.code_predictor.model.codec_embedding
    with torch.no_grad():
        first, last = (synth.code_predictor.model.norm(t.weight).float().mean(0) for t in (tables[0], tables[-1]))
    step = (last - first) / (len(tables) - 1)
    return Offsets(torch.stack([step * j for j in (1, 2, 3)]))
