"""Training the draft offsets b_1..b_K on a frozen predictor (the paper's recipe, plus soft targets).

The loss is the cross-entropy of the drafts LMH_{k+j}(h_k + b_j), summed over depths j = 1..K and
averaged over frames and positions k. Hard targets are the frames' codes c_{k+j}; soft targets are the
distribution c_{k+j} is sampled from (temperature, top-k, top-p of LMH_{k+j}(h_{k+j})), which is what a
draft is accepted against. Only the K x hidden offsets train, from zero (reused heads), with Adam; a
held-out split stops training when its loss stops falling, and the best offsets are kept. The verifier
never reads an offset state, so trained offsets cannot change which codes come out.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from rvqtts.engine.model.sampling import SamplingConfig, target_probs
from rvqtts.engine.speculative.offsets import MAX_DEPTH, Offsets, predictor_fingerprint
from rvqtts.tuning.calibration import sample_codes
from rvqtts.tuning.contexts import Contexts
from rvqtts.tuning.drafters import OffsetDrafter
from rvqtts.tuning.drafts import DraftData, draft_logits, draft_ranks, frozen_draft_data, head_weights, top1_by_depth

TARGETS = ("hard", "soft")


@dataclass(frozen=True)
class TrainingConfig:
    depth: int = 3  # K, codes drafted ahead
    learning_rate: float = 1e-3  # the paper's
    batch: int = 32  # frames per step, the paper's batch
    max_steps: int = 20_000
    eval_every: int = 250  # steps between held-out evaluations
    patience: int = 4  # evaluations without improvement before stopping
    target: str = "hard"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"K (the draft depth) must be between 1 and {MAX_DEPTH}, got {self.depth}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        for name in ("batch", "max_steps", "eval_every", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ValueError(f"the learning rate must be positive, got {self.learning_rate}")


def draft_loss(
    drafter: torch.nn.Module, weights: torch.Tensor, data: DraftData, target: str, sampling: SamplingConfig
) -> torch.Tensor:
    """Summed over depths, mean over frames and positions (nats)."""
    total = weights.new_zeros(())
    soft = None
    if target == "soft":
        with torch.no_grad():
            soft = target_probs(draft_logits(weights, data.hidden, 0.0, 0), sampling)
    for j in range(1, min(drafter.depth, data.codes.shape[1] - 1) + 1):
        log_probs = drafter(weights, data.hidden, data.codes, j)
        if soft is None:
            total = total + F.nll_loss(log_probs.flatten(0, 1), data.codes[:, j:].flatten())
        else:
            total = total - (soft[:, j:] * log_probs).sum(-1).mean()
    return total


@torch.no_grad()
def evaluate(
    drafter: torch.nn.Module, weights: torch.Tensor, data: DraftData, target: str, sampling: SamplingConfig
) -> dict:
    """Loss and the drafts' top-1 accuracy per depth against the frames' codes."""
    losses = []
    for s in range(0, len(data), 256):
        part = data.take(torch.arange(s, min(s + 256, len(data)), device=data.codes.device))
        losses.append(float(draft_loss(drafter, weights, part, target, sampling)) * len(part))
    return {"loss": sum(losses) / len(data), "top1_by_depth": top1_by_depth(draft_ranks(drafter, weights, data, 1))}


def train_drafter(
    drafter: torch.nn.Module,
    weights: torch.Tensor,
    train: DraftData,
    held_out: DraftData,
    config: TrainingConfig,
    sampling: SamplingConfig = SamplingConfig(),
    on_progress: Callable[[int, int, float, float], None] | None = None,
) -> dict:
    """Train the drafter's parameters (the heads stay frozen) and leave it at its best held-out state;
    returns the training record. `on_progress(step, max_steps, train_loss, held_out_loss)` is called
    after every held-out evaluation."""
    generator = torch.Generator().manual_seed(config.seed)
    device = train.hidden.device
    weights = weights.to(device)
    drafter.to(device)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=config.learning_rate)
    initial = evaluate(drafter, weights, held_out, config.target, sampling)
    best = (initial["loss"], copy.deepcopy(drafter.state_dict()), 0)
    recent: list[float] = []
    stale, step = 0, 0
    started = time.perf_counter()
    while step < config.max_steps and stale < config.patience:
        index = torch.randint(0, len(train), (config.batch,), generator=generator).to(device)
        loss = draft_loss(drafter, weights, train.take(index), config.target, sampling)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        recent.append(float(loss.detach()))
        step += 1
        if step % config.eval_every == 0 or step == config.max_steps:
            held = evaluate(drafter, weights, held_out, config.target, sampling)["loss"]
            if held < best[0] - 1e-5:
                best, stale = (held, copy.deepcopy(drafter.state_dict()), step), 0
            else:
                stale += 1
            if on_progress:
                on_progress(step, config.max_steps, float(np.mean(recent[-config.eval_every :])), held)
    drafter.load_state_dict(best[1])
    final_train = evaluate(drafter, weights, train, config.target, sampling)
    final_held = evaluate(drafter, weights, held_out, config.target, sampling)
    return {
        "steps": step,
        "best_step": best[2],
        "stopped_early": stale >= config.patience,
        "seconds": round(time.perf_counter() - started, 1),
        "target": config.target,
        "train_frames": len(train),
        "held_out_frames": len(held_out),
        "initial_held_out_loss": round(initial["loss"], 5),
        "train_loss": round(final_train["loss"], 5),
        "held_out_loss": round(final_held["loss"], 5),
        "initial_held_out_top1": initial["top1_by_depth"],
        "held_out_top1": final_held["top1_by_depth"],
    }


def draft_data(
    synthesizer,
    contexts: Contexts,
    config: TrainingConfig,
    sampling: SamplingConfig,
    held_out: float,
    self_distill: bool,
) -> tuple[DraftData, DraftData]:
    """(train, held-out) hidden states and target codes of the frames under the frozen predictor; with
    `self_distill` the codes are resampled by the model's plain inner loop from each frame's h_t and c0."""
    if not 0 < held_out < 1:
        raise ValueError(f"the held-out fraction must be between 0 and 1, got {held_out}")
    if len(contexts) < 2:
        raise ValueError(f"training needs at least 2 frames, got {len(contexts)}")
    code_predictor = synthesizer.code_predictor
    talker_embedding = synthesizer.talker.get_input_embeddings()
    parts = []
    for number, part in enumerate(contexts.split(held_out, config.seed)):
        prefixes = part.prefixes(talker_embedding)
        codes = (
            sample_codes(code_predictor, prefixes, config.seed + number, sampling)
            if self_distill
            else part.codes[:, 1:]
        )
        parts.append(frozen_draft_data(code_predictor, prefixes, codes))
    return parts[0], parts[1]


def fit_offsets(
    synthesizer,
    contexts: Contexts,
    config: TrainingConfig,
    sampling: SamplingConfig = SamplingConfig(),
    held_out: float = 0.1,
    self_distill: bool = False,
    model_name: str = "",
    on_progress: Callable[[int, int, float, float], None] | None = None,
) -> tuple[Offsets, dict]:
    """Offsets for the synthesizer's predictor from recorded frames, with provenance in their metadata.

    The frames' own codes are the targets (teacher forcing on recorded data, or self-distillation when
    the contexts were recorded from the model's synthesis); `self_distill` resamples the codes with the
    model's plain inner loop from each frame's h_t and c0 first."""
    train, held = draft_data(synthesizer, contexts, config, sampling, held_out, self_distill)
    code_predictor = synthesizer.code_predictor
    drafter = OffsetDrafter(config.depth, train.hidden.shape[2])  # from zero: the reused heads
    record = train_drafter(drafter, head_weights(code_predictor), train, held, config, sampling, on_progress)
    targets = "resampled by the model (self-distillation)" if self_distill else "the frames' own codes"
    record.update(
        source=contexts.source,
        frames=len(contexts),
        codes=targets,
        depth=config.depth,
        learning_rate=config.learning_rate,
        batch=config.batch,
        date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        sampling=f"temperature {sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}",
    )
    offsets = Offsets(
        drafter.vectors.detach().cpu(),
        model=model_name,
        model_fingerprint=predictor_fingerprint(code_predictor),
        metadata={"training": json.dumps(record)},
    )
    return offsets, record
