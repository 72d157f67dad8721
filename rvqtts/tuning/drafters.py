"""Drafters: what scores the codes c_{k+j} ahead of a round rooted at c_k, from the root's hidden state h_k
(which has not seen c_k) and the root code c_k itself (just sampled, known to the host); the table in
docs/acceptance.md says what each drafts with.

Every drafter returns log-probabilities [n, L - j, V] for c_{1+j}..c_L from hidden states [n, L, H] and codes
[n, L] (c1..c_L; the root of position k is codes[:, k - 1]): only their order matters for drafting, but the
mixture adds them.
"""

from __future__ import annotations

import torch

from rvqtts.tuning.drafts import draft_logits


class OffsetDrafter(torch.nn.Module):
    def __init__(self, depth: int, hidden: int, vectors: torch.Tensor | None = None):
        super().__init__()
        self.depth = depth
        self.vectors = torch.nn.Parameter(torch.zeros(depth, hidden) if vectors is None else vectors.clone().float())

    def forward(self, weights: torch.Tensor, hidden: torch.Tensor, codes: torch.Tensor, j: int) -> torch.Tensor:
        return draft_logits(weights, hidden, self.vectors[j - 1], j).log_softmax(-1)


class MedusaDrafter(torch.nn.Module):
    """Residual blocks start at zero, so training starts from the reused heads."""

    def __init__(self, depth: int, hidden: int, length: int):
        super().__init__()
        self.depth = depth
        self.blocks = torch.nn.Parameter(torch.zeros(depth, length, hidden, hidden))
        self.biases = torch.nn.Parameter(torch.zeros(depth, length, hidden))

    def forward(self, weights: torch.Tensor, hidden: torch.Tensor, codes: torch.Tensor, j: int) -> torch.Tensor:
        kept = weights.shape[0] - j
        block = torch.einsum("nkh,kgh->nkg", hidden[:, :kept], self.blocks[j - 1, :kept]) + self.biases[j - 1, :kept]
        return draft_logits(weights, hidden, torch.nn.functional.silu(block), j).log_softmax(-1)


class PriorDrafter(torch.nn.Module):
    def __init__(self, codes: torch.Tensor, vocab: int, depth: int, smoothing: float = 0.5):
        super().__init__()
        self.depth = depth
        counts = torch.stack([torch.bincount(codes[:, k], minlength=vocab).float() for k in range(codes.shape[1])])
        self.register_buffer("log_prior", ((counts + smoothing) / (counts + smoothing).sum(-1, keepdim=True)).log())

    def forward(self, weights: torch.Tensor, hidden: torch.Tensor, codes: torch.Tensor, j: int) -> torch.Tensor:
        return self.log_prior[j:].expand(codes.shape[0], -1, -1)


class TableDrafter(torch.nn.Module):
    """log P(c_{k+j} = x | c_k) = log (N_{k,j}(c_k, x) + s P_{k+j}(x)) / (N_{k,j}(c_k) + s)."""

    def __init__(self, codes: torch.Tensor, vocab: int, depth: int, strength: float = 4.0):
        super().__init__()
        self.depth = depth
        prior = PriorDrafter(codes, vocab, depth).log_prior.exp()
        length = codes.shape[1]
        tables = []
        for j in range(1, depth + 1):
            counts = torch.zeros(length - j, vocab * vocab)
            pairs = codes[:, : length - j] * vocab + codes[:, j:]
            counts.scatter_add_(1, pairs.T.contiguous(), torch.ones(pairs.shape[1], pairs.shape[0]))
            counts = counts.view(length - j, vocab, vocab)
            smoothed = counts + strength * prior[j:, None, :]
            tables.append((smoothed / smoothed.sum(-1, keepdim=True)).log().half())
        self.tables = tables  # per depth [L - j, V, V], float16 to halve the memory of V x V tables

    def forward(self, weights: torch.Tensor, hidden: torch.Tensor, codes: torch.Tensor, j: int) -> torch.Tensor:
        table = self.tables[j - 1].to(codes.device)
        length = table.shape[0]
        positions = torch.arange(length, device=codes.device)
        return table[positions, codes[:, :length]].float()


class MixedDrafter(torch.nn.Module):
    def __init__(self, heads: torch.nn.Module, table: torch.nn.Module, weight: float):
        super().__init__()
        self.heads, self.table, self.weight = heads, table, weight
        self.depth = min(heads.depth, table.depth)

    def forward(self, weights: torch.Tensor, hidden: torch.Tensor, codes: torch.Tensor, j: int) -> torch.Tensor:
        return self.heads(weights, hidden, codes, j) + self.weight * self.table(weights, hidden, codes, j)


def parameter_count(drafter: torch.nn.Module) -> int:
    """Trainable parameters (frozen ones, such as the reused heads' zero offsets, and counted tables are not)."""
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad)
