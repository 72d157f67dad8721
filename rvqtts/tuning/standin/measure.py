"""How faithful the stand-in is, per position k = 1..15, on held-out frames: sampling entropy and chain gain
(docs/standin.md, step 5 of the pipeline)."""

from __future__ import annotations

import numpy as np
import torch

from rvqtts.engine.model.sampling import SamplingConfig, entropy_bits, target_probs
from rvqtts.tuning.standin.model import teacher_forced_logits

LN2 = float(np.log(2))


@torch.no_grad()
def entropy_by_position(
    code_predictor,
    talker_embedding,
    h_t: torch.Tensor,
    codes: torch.Tensor,
    sampling: SamplingConfig = SamplingConfig(),
) -> dict:
    logits = teacher_forced_logits(code_predictor, talker_embedding, h_t, codes).float()
    sampled = entropy_bits(target_probs(logits, sampling)).mean(0)
    raw = entropy_bits(logits.softmax(-1)).mean(0)
    truth_ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), codes[:, 1:].flatten(), reduction="none")
    return {
        "entropy_bits": [round(float(x), 3) for x in sampled],
        "raw_entropy_bits": [round(float(x), 3) for x in raw],
        "cross_entropy_bits": [round(float(x), 3) for x in truth_ce.view(codes.shape[0], -1).mean(0) / LN2],
    }


@torch.no_grad()
def chain_gain(
    code_predictor, talker_embedding, h_t: torch.Tensor, codes: torch.Tensor, samples: int = 8, seed: int = 0
) -> list[float]:
    """Bits per position (2..15) that the true previous code adds; position 1 is reported as None."""
    generator = torch.Generator().manual_seed(seed)
    with_true = teacher_forced_logits(code_predictor, talker_embedding, h_t, codes).float().log_softmax(-1)
    gains: list[float | None] = [None]
    n = codes.shape[0]
    for k in range(2, codes.shape[1]):  # target c_k, marginalise c_{k-1}
        previous = torch.multinomial(with_true[:, k - 2].exp(), samples, replacement=True, generator=generator)
        variants = codes.repeat_interleave(samples, 0).clone()
        variants[:, k - 1] = previous.flatten()
        logits = teacher_forced_logits(
            code_predictor, talker_embedding, h_t.repeat_interleave(samples, 0), variants[:, : k + 1]
        )[:, k - 1].float()
        truth = codes[:, k].repeat_interleave(samples)
        likelihood = logits.softmax(-1).gather(1, truth[:, None]).view(n, samples).mean(1)
        without = -torch.log(likelihood.clamp(min=1e-30))
        with_ = -with_true[:, k - 1].gather(1, codes[:, k : k + 1])[:, 0]
        gains.append(round(float((without - with_).mean() / LN2), 3))
    return gains
