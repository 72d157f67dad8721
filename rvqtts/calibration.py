"""Acceptance measured on data: per-depth, per-rank acceptance tables, trees grown from them, and codes
per call measured by running the engine itself.

Frames come as contexts: the talker's h_t and c0 for each frame (recorded from synthesis, or from the
stand-in). Codes are sampled free-running by the plain inner loop, as a user's run would sample them;
the hidden states h_1..h_15 of those codes come from one teacher-forced predictor call per frame.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from rvqtts.decode import Speculation
from rvqtts.predictor import PredictorRunner
from rvqtts.sampling import SamplingConfig


def frame_prefixes(talker_embedding: torch.nn.Module, h_t: np.ndarray, c0: np.ndarray) -> torch.Tensor:
    """Predictor inputs [n, 2, E]: h_t and the talker's embedding of c0, per frame."""
    with torch.no_grad():
        embedded = talker_embedding(torch.from_numpy(c0).long())
    return torch.stack([torch.from_numpy(h_t).float(), embedded.float()], 1)


def sample_codes(code_predictor, prefixes: torch.Tensor, seed: int,
                 sampling: SamplingConfig = SamplingConfig()) -> np.ndarray:
    """Free-running codes c1..c15 [n, 15] from the plain inner loop, frame f keyed (seed, 0, f)."""
    from rvqtts.synthesis import InnerLoop

    loop = InnerLoop(code_predictor, None, seed)
    return np.array([loop.decode(p, sampling, 0, f) for f, p in enumerate(prefixes)], dtype=np.int64)


@torch.inference_mode()
def hidden_states(runner: PredictorRunner, prefix: torch.Tensor, codes: np.ndarray) -> torch.Tensor:
    """h_1..h_{G-1} [G-1, hidden] of one frame, teacher-forced in one causal call."""
    embeds = [prefix] + [runner.embeddings[i](torch.tensor([int(c)], device=runner.device))
                         for i, c in enumerate(codes[:-1])]
    query = torch.cat(embeds)
    q = query.shape[0]
    out = runner.forward(query, torch.arange(q, device=runner.device), 0, runner.causal[:q])
    return out[1:]


@torch.inference_mode()
def draft_ranks(runner: PredictorRunner, prefixes: torch.Tensor, codes: np.ndarray, offsets: torch.Tensor,
                max_rank: int) -> np.ndarray:
    """ranks[f, k-1, j-1]: rank of c_{k+j} among the drafts LMH_{k+j}(h_k + b_j) (max_rank = not in the
    top max_rank; -1 = past the frame's end)."""
    last = runner.code_groups - 1
    depth = offsets.shape[0]
    ranks = np.full((len(prefixes), last, depth), -1, dtype=np.int64)
    for f, prefix in enumerate(prefixes):
        hidden = hidden_states(runner, prefix.to(runner.device), codes[f])
        for j in range(1, depth + 1):
            rows = np.arange(1, last - j + 1)  # k with k + j <= last
            if rows.size == 0:
                continue
            scores = torch.stack([runner.logits(hidden[k - 1] + offsets[j - 1], k + j) for k in rows])
            top = torch.topk(scores.float(), max_rank, dim=-1).indices.cpu().numpy()
            truth = codes[f][rows + j - 1]
            hit = top == truth[:, None]
            ranks[f, rows - 1, j - 1] = np.where(hit.any(1), hit.argmax(1), max_rank)
    return ranks


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


def codes_per_call(code_predictor, speculation: Speculation, prefixes: torch.Tensor, languages: list[str],
                   seed: int, sampling: SamplingConfig = SamplingConfig()) -> dict:
    """Codes per predictor call of the engine's speculative loop over these frames, overall and per language,
    with a 95 % interval from the spread of per-frame calls."""
    from rvqtts.synthesis import InnerLoop

    loop = InnerLoop(code_predictor, speculation, seed)
    calls = []
    for f, prefix in enumerate(prefixes):
        before = loop.stats.calls
        loop.decode(prefix, sampling, 0, f)
        calls.append(loop.stats.calls - before)
    calls = np.array(calls, dtype=np.float64)
    codes = loop.runner.code_groups - 1
    by_language: dict[str, list[float]] = defaultdict(list)
    for language, count in zip(languages, calls):
        by_language[language].append(count)

    def summary(values: np.ndarray) -> dict:
        mean = values.mean()
        half = 1.96 * values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0.0
        return {"codes_per_call": round(float(codes / mean), 4),
                "ci95": [round(float(codes / (mean + half)), 4), round(float(codes / max(mean - half, 1e-9)), 4)],
                "frames": int(len(values))}

    return {**summary(calls),
            "per_language": {str(k): summary(np.array(v)) for k, v in sorted(by_language.items())}}
