"""Training the stand-in: a code predictor of the real qwen-tts class, taught with teacher forcing to
produce c1..c15 of the corpus frames from (h_t, c0), where h_t comes from a small frame-context encoder that
knows what the real talker's h_t knows, never the current frame's residual codes (docs/standin.md, step 3).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rvqtts.tuning.drafts import teacher_forced_hidden
from rvqtts.tuning.standin.codec import LEVELS


@dataclass(frozen=True)
class StandinConfig:
    entries: int = 1024  # codebook size of every level (the predictor's vocabulary)
    hidden: int = 256  # talker and predictor width
    layers: int = 3  # predictor layers
    coarse_dims: int = 8  # principal components of the current frame the context sees
    coarse_noise: float = 0.5  # noise added to them, in units of their standard deviation
    history_levels: int = 4  # levels of the previous frame's codes the context sees (its coarse part)
    copies: int = 8  # jittered, re-encoded copies of each training frame
    jitter: float = 0.15  # feature noise of a copy, in standard deviations
    steps: int = 1500
    batch: int = 256
    learning_rate: float = 2e-3
    seed: int = 0


class ContextEncoder(torch.nn.Module):
    """h_t from (the previous frame's coarse codes, language, coarse view of the current frame)."""

    def __init__(self, config: StandinConfig, languages: int):
        super().__init__()
        width = 64
        self.levels = config.history_levels
        self.previous = torch.nn.Embedding(self.levels * (config.entries + 1), width)  # + 1: "no previous frame"
        self.entries = config.entries
        self.language = torch.nn.Embedding(languages, width)
        self.coarse = torch.nn.Linear(config.coarse_dims, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(3 * width, 2 * config.hidden),
            torch.nn.SiLU(),
            torch.nn.Linear(2 * config.hidden, config.hidden),
        )

    def forward(self, previous: torch.Tensor, language: torch.Tensor, coarse: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.levels, device=previous.device) * (self.entries + 1)
        history = self.previous(previous[:, : self.levels] + offsets).sum(1)
        return self.mlp(torch.cat([history, self.language(language), self.coarse(coarse)], -1))


@dataclass
class FrameData:
    """Frames of one split: codes [n, 16], previous frame's codes [n, 16] (entries = none), language
    index [n], coarse view [n, coarse_dims]."""

    codes: np.ndarray
    previous: np.ndarray
    language: np.ndarray
    coarse: np.ndarray


def teacher_forced_logits(code_predictor, talker_embedding, h_t: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Logits [n, G-1, V] of c1..c_{G-1} from [h_t, c0, c1..c_{G-2}] in one causal pass (the training objective)."""
    prefixes = torch.stack([h_t, talker_embedding(codes[:, 0])], 1)
    hidden = teacher_forced_hidden(code_predictor, prefixes, codes[:, 1:-1])
    return torch.stack([code_predictor.lm_head[i](hidden[:, i]) for i in range(codes.shape[1] - 1)], 1)


def train(
    code_predictor,
    talker_embedding,
    encoder: ContextEncoder,
    data: FrameData,
    config: StandinConfig,
    device: str,
    log=print,
) -> dict:
    """Adam with a cosine schedule on the summed cross-entropy of c1..c15; returns the training record."""
    generator = torch.Generator().manual_seed(config.seed)
    modules = [code_predictor, talker_embedding, encoder]
    for module in modules:
        module.to(device).train()
    parameters = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=config.learning_rate)
    tensors = [torch.from_numpy(a).to(device) for a in (data.codes, data.previous, data.language, data.coarse)]
    started, losses = time.perf_counter(), []
    for step in range(config.steps):
        rate = config.learning_rate * 0.5 * (1 + math.cos(math.pi * step / config.steps))
        for group in optimizer.param_groups:
            group["lr"] = rate * min(1.0, (step + 1) / 50)
        index = torch.randint(0, tensors[0].shape[0], (config.batch,), generator=generator).to(device)
        codes, previous, language, coarse = (t[index] for t in tensors)
        h_t = encoder(previous, language, coarse)
        logits = teacher_forced_logits(code_predictor, talker_embedding, h_t, codes)
        loss = F.cross_entropy(logits.flatten(0, 1), codes[:, 1:].flatten(), reduction="mean") * (LEVELS - 1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % max(1, config.steps // 10) == 0:
            log(
                f"step {step + 1}/{config.steps}: loss {np.mean(losses[-50:]):.3f} nats per frame "
                f"({time.perf_counter() - started:.0f} s)"
            )
    for module in modules:
        module.eval()
    return {
        "steps": config.steps,
        "seconds": round(time.perf_counter() - started, 1),
        "final_loss_nats": round(float(np.mean(losses[-50:])), 4),
    }
