"""Drafts computed offline, in batch, from a frozen predictor's hidden states: what offsets train on and
what calibration measures.

For a frame, h_k (k = 1..L, L = G - 1 residual codes) is the normed hidden state whose head LMH_k
scores c_k; it has seen c0..c_{k-1}. The draft for the code j places ahead is LMH_{k+j}(h_k + b_j).
Every head is a bias-free linear map, so all drafts of depth j over all frames and positions are one
batched product with the stacked head weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CHUNK = 256  # frames per batched pass, to bound memory at real vocabulary sizes


@dataclass(frozen=True)
class DraftData:
    """Per frame: the hidden states h_1..h_L [n, L, H] and the codes c1..c_L [n, L] they were forced on."""

    hidden: torch.Tensor
    codes: torch.Tensor

    def __len__(self) -> int:
        return self.codes.shape[0]

    def take(self, index: torch.Tensor) -> "DraftData":
        return DraftData(self.hidden[index], self.codes[index])


def head_weights(code_predictor: torch.nn.Module) -> torch.Tensor:
    """The heads LMH_1..LMH_L stacked, [L, V, H] (float32, detached: they stay frozen)."""
    heads = code_predictor.lm_head
    if any(getattr(h, "bias", None) is not None for h in heads):
        raise ValueError("the code predictor's heads have biases; rvqtts expects bias-free heads")
    return torch.stack([h.weight.detach().float() for h in heads])


def teacher_forced_hidden(code_predictor: torch.nn.Module, prefixes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """h_1..h_{m+1} [n, m+1, H] from one causal pass over [h_t, embedding of c0, c1..c_m] (codes [n, m]),
    through the module's own batched forward (training and measurement, not the decode loop)."""
    embeddings = code_predictor.get_input_embeddings()
    parts = [prefixes] + [embeddings[i](codes[:, i : i + 1]) for i in range(codes.shape[1])]
    inputs = code_predictor.small_to_mtp_projection(torch.cat(parts, 1).to(code_predictor.lm_head[0].weight.dtype))
    return code_predictor.model(inputs_embeds=inputs).last_hidden_state[:, 1:]


@torch.no_grad()
def frozen_draft_data(
    code_predictor: torch.nn.Module,
    prefixes: torch.Tensor,
    codes: np.ndarray | torch.Tensor,
    device: str | torch.device | None = None,
) -> DraftData:
    """Hidden states of the frames' codes c1..c_L ([n, L]) under the frozen predictor, float32 on `device`
    (default: the predictor's)."""
    codes = torch.as_tensor(codes, dtype=torch.long)
    weight = code_predictor.lm_head[0].weight
    device = device or weight.device
    hidden = [
        teacher_forced_hidden(
            code_predictor, prefixes[s : s + CHUNK].to(weight.device), codes[s : s + CHUNK, :-1].to(weight.device)
        )
        .float()
        .to(device)
        for s in range(0, len(codes), CHUNK)
    ]
    return DraftData(torch.cat(hidden), codes.to(device))


def draft_logits(weights: torch.Tensor, hidden: torch.Tensor, offset: torch.Tensor, depth: int) -> torch.Tensor:
    """Scores [n, L - depth, V] of c_{k+depth} from h_k + offset, for k = 1..L - depth."""
    length = weights.shape[0]
    return torch.einsum("nkh,kvh->nkv", hidden[:, : length - depth] + offset, weights[depth:])


@torch.no_grad()
def draft_ranks(drafter: torch.nn.Module, weights: torch.Tensor, data: DraftData, max_rank: int) -> np.ndarray:
    """ranks[f, k-1, j-1]: the rank of c_{k+j} among the drafter's scores for it in the round rooted at
    c_k (max_rank: not in the top max_rank; -1: past the frame's end). See rvqtts.tuning.drafters."""
    n, length = data.codes.shape
    weights = weights.to(data.hidden.device)
    ranks = np.full((n, length, drafter.depth), -1, dtype=np.int64)
    for s in range(0, n, CHUNK):
        hidden, codes = data.hidden[s : s + CHUNK], data.codes[s : s + CHUNK]
        for j in range(1, min(drafter.depth, length - 1) + 1):
            top = torch.topk(drafter(weights, hidden, codes, j), max_rank, dim=-1).indices
            hit = top == codes[:, j:, None]
            found = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(codes[:, j:], max_rank))
            ranks[s : s + CHUNK, : length - j, j - 1] = found.cpu().numpy()
    return ranks


def top1_by_depth(ranks: np.ndarray) -> list[float | None]:
    """How often the rank-0 draft is the code, per depth (None where no position reaches that depth)."""
    result: list[float | None] = []
    for d in range(ranks.shape[2]):
        valid = ranks[:, :, d][ranks[:, :, d] >= 0]
        result.append(round(float((valid == 0).mean()), 4) if valid.size else None)
    return result
