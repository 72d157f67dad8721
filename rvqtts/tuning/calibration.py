"""Acceptance measured on data: per-depth, per-rank acceptance tables, trees grown from them, and codes
per call measured by running the engine itself (how frames are batched and replayed: docs/acceptance.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import torch

from rvqtts.engine.loop.inner_loop import LoopParts
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import SamplingConfig, entropy_bits, residual_noise, target_probs
from rvqtts.engine.speculative.offsets import Offsets, predictor_fingerprint
from rvqtts.engine.speculative.rounds import plain_frames, speculative_frames
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import Tree, grow_tree
from rvqtts.tuning.contexts import Contexts
from rvqtts.tuning.drafters import OffsetDrafter
from rvqtts.tuning.drafts import DraftData, draft_logits, draft_ranks, frozen_draft_data, head_weights, top1_by_depth

MAX_RANK = 16  # ranks per depth an acceptance table records; greedy trees rarely reach past rank 10
FRAMES_PER_CALL = 32  # frames decoded together, a batch row each


def frame_batches(
    runner: PredictorRunner, prefixes: torch.Tensor, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The prefixes FRAMES_PER_CALL at a time with their noise [n, G-1, V], frame f keyed (seed, 0, f) as the
    inner loop keys an utterance's frames."""
    for start in range(0, len(prefixes), FRAMES_PER_CALL):
        chunk = prefixes[start : start + FRAMES_PER_CALL].to(runner.device, runner.dtype)
        frames = range(start, start + len(chunk))
        noise = torch.stack([residual_noise(seed, 0, f, runner.code_groups, runner.vocab_size) for f in frames])
        yield chunk, noise.to(runner.device)


def sample_codes(
    code_predictor, prefixes: torch.Tensor, seed: int, sampling: SamplingConfig = SamplingConfig()
) -> np.ndarray:
    """Free-running codes c1..c15 [n, 15] from the plain inner loop, frame f keyed (seed, 0, f); the codes each
    frame gets alone where the kernels keep rows invariant (elsewhere a near-tie may draw the other code)."""
    runner = LoopParts.build(code_predictor, None, False).runner
    codes = [
        frame
        for chunk, noise in frame_batches(runner, prefixes, seed)
        for frame in plain_frames(runner, chunk, noise, sampling)
    ]
    return np.array(codes, dtype=np.int64).reshape(len(prefixes), runner.code_groups - 1)


def free_running_data(
    code_predictor, prefixes: torch.Tensor, seed: int, sampling: SamplingConfig = SamplingConfig()
) -> DraftData:
    """Codes sampled free-running from these prefixes, with their hidden states under the frozen predictor."""
    return frozen_draft_data(code_predictor, prefixes, sample_codes(code_predictor, prefixes, seed, sampling))


def measure_acceptance(
    code_predictor,
    prefixes: torch.Tensor,
    offsets: torch.Tensor,
    seed: int,
    sampling: SamplingConfig = SamplingConfig(),
    max_rank: int = MAX_RANK,
) -> dict:
    """The acceptance table of drafts with these offsets [K, H] on free-running codes from `prefixes`,
    with the drafts' top-1 accuracy per depth and the entropy of each position's sampling distribution."""
    max_rank = min(max_rank, code_predictor.config.vocab_size)
    data = free_running_data(code_predictor, prefixes, seed, sampling)
    weights = head_weights(code_predictor)
    drafter = OffsetDrafter(offsets.shape[0], offsets.shape[1], offsets).to(data.hidden.device)
    ranks = draft_ranks(drafter, weights, data, max_rank)
    return {
        "acceptance": acceptance_table(ranks, max_rank),
        "top1_by_depth": top1_by_depth(ranks),
        "entropy_bits": sampling_entropy(weights, data, sampling),
        "frames": len(prefixes),
        "max_rank": max_rank,
    }


def sampling_entropy(weights: torch.Tensor, data: DraftData, sampling: SamplingConfig) -> list[float]:
    """Bits of entropy of the distribution each code c1..c_L is drawn from (after temperature and top-k),
    averaged over the frames: how predictable each position is, which bounds what any draft can accept."""
    totals = torch.zeros(weights.shape[0])
    for start in range(0, len(data), 256):  # [256, L, V] logits at a time
        logits = draft_logits(weights, data.hidden[start : start + 256], 0.0, 0)
        totals += entropy_bits(target_probs(logits, sampling)).sum(0).cpu()
    return [round(float(bits), 3) for bits in totals / max(len(data), 1)]


def acceptance_table(ranks: np.ndarray, max_rank: int) -> list[list[float]]:
    """acceptance[d][r]: how often the rank-r draft at depth d+1 is the committed code, given that the
    codes above it in the round were among the drafted ranks."""
    depth = ranks.shape[2]
    flat = ranks.reshape(-1, depth)
    table = []
    reached = np.ones(flat.shape[0], dtype=bool)
    for d in range(depth):
        valid = reached & (flat[:, d] >= 0)
        counts = np.bincount(flat[valid, d], minlength=max_rank + 1)[:max_rank]
        table.append((counts / max(valid.sum(), 1)).round(6).tolist())
        reached = valid & (flat[:, d] < max_rank)
    return table


def codes_per_call(
    code_predictor,
    speculation: Speculation,
    prefixes: torch.Tensor,
    languages: list[str],
    seed: int,
    sampling: SamplingConfig = SamplingConfig(),
) -> dict:
    """Codes per predictor call of the engine's speculative loop over these frames, overall and per language,
    with a 95 % interval from the spread of per-frame calls."""
    parts = LoopParts.build(code_predictor, speculation, False)
    calls = [
        frame.calls
        for chunk, noise in frame_batches(parts.runner, prefixes, seed)
        for frame in speculative_frames(parts.runner, chunk, noise, sampling, [speculation] * len(chunk), parts.offsets)
    ]
    return summarize_calls(np.array(calls), languages, parts.runner.code_groups - 1)


def summarize_calls(calls: np.ndarray, languages: list[str], codes: int) -> dict:
    """Codes per call from per-frame call counts, overall and per language, with 95 % intervals."""

    def summary(values: np.ndarray) -> dict:
        mean = values.mean()
        half = 1.96 * values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0.0
        return {
            "codes_per_call": round(float(codes / mean), 4),
            "ci95": [round(float(codes / (mean + half)), 4), round(float(codes / max(mean - half, 1e-9)), 4)],
            "frames": int(len(values)),
        }

    by_language: dict[str, list[float]] = defaultdict(list)
    for language, count in zip(languages, calls):
        by_language[str(language)].append(float(count))
    return {
        **summary(calls.astype(np.float64)),
        "per_language": {k: summary(np.array(v)) for k, v in sorted(by_language.items())},
    }


def replay_calls(ranks: np.ndarray, trees: Tree | list[Tree]) -> np.ndarray:
    """Predictor calls per frame of the speculative loop, replayed from the ranks of the committed codes
    among each round's drafts (`ranks[f, k-1, j-1]` as `draft_ranks` gives them for free-running codes).

    The loop's codes are the plain loop's, so a round rooted at c_k accepts the longest tree path
    (rank of c_{k+1}, rank of c_{k+2}, ...) and its next root is the code after it. Equal to running the
    engine, up to ranks that float rounding orders differently, and far cheaper: drafters are compared
    this way without running them inside the engine. `trees` may give one tree per root position k."""
    per_position = [trees] * ranks.shape[1] if isinstance(trees, Tree) else trees
    node_sets = [set(t.paths) for t in per_position]
    frames, length, _ = ranks.shape
    calls = np.ones(frames, dtype=np.int64)  # the prefill call samples c1
    for f in range(frames):
        k = 1
        while k < length:
            calls[f] += 1
            paths, cap = node_sets[k - 1], min(per_position[k - 1].depth, length - k)
            path: tuple[int, ...] = ()
            while len(path) < cap and (*path, int(ranks[f, k - 1, len(path)])) in paths:
                path = (*path, int(ranks[f, k - 1, len(path)]))
            k += len(path) + 1
    return calls


def calibrate_trees(
    synthesizer,
    frames: Contexts,
    offsets: Offsets,
    budgets: list[int],
    seed: int,
    model_name: str = "",
    offsets_name: str = "",
) -> tuple[dict, dict[int, Tree]]:
    """The acceptance table of these offsets on free-running codes from the frames, and one greedy tree
    per budget (depth capped at K), each tagged with the model it was calibrated for."""
    code_predictor = synthesizer.code_predictor
    prefixes = frames.prefixes(synthesizer.talker.get_input_embeddings())
    measured = measure_acceptance(code_predictor, prefixes, offsets.vectors, seed)
    drafts = offsets_name or ("zero offsets (reused heads)" if offsets.is_zero else "offsets")
    provenance = {
        "model": model_name,
        "model_fingerprint": predictor_fingerprint(code_predictor),
        "offsets": drafts,
        "frames_source": frames.source,
        "seed": seed,
    }
    table = {**provenance, **measured}
    source = f"calibrated on {measured['frames']} free-running frames ({frames.source}) with {drafts}"
    trees = {n: replace(grow_tree(measured["acceptance"], n, source), extra=provenance) for n in budgets}
    return table, trees
