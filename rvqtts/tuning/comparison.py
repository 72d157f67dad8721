"""Drafters compared on one model's frames, each with its own calibrated trees (the paper's Table 2 and
the variants past it), by replaying the speculative loop on free-running codes.

Frames split three ways: calibration frames split into a fitting part (trained drafters and count tables
learn here) and a tuning part (early stopping, acceptance tables, trees); evaluation frames measure codes
per call. Codes for tuning and evaluation are sampled free-running by the plain loop, as synthesis
samples them; `calibration.replay_calls` turns their draft ranks into the engine's call counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.tree import Tree, grow_tree
from rvqtts.tuning.calibration import MAX_RANK, acceptance_table, free_running_data, replay_calls, summarize_calls
from rvqtts.tuning.contexts import Contexts
from rvqtts.tuning.drafters import (
    MedusaDrafter,
    MixedDrafter,
    OffsetDrafter,
    PriorDrafter,
    TableDrafter,
    parameter_count,
)
from rvqtts.tuning.drafts import DraftData, draft_ranks, frozen_draft_data, head_weights, top1_by_depth
from rvqtts.tuning.training import TrainingConfig, train_drafter


@dataclass(frozen=True)
class ComparisonData:
    fit_recorded: DraftData  # fitting frames with their recorded codes (teacher forcing)
    fit_sampled: DraftData  # the same frames with codes the model sampled (self-distillation)
    tune: DraftData  # tuning frames, free-running codes
    evaluation: DraftData  # evaluation frames, free-running codes
    evaluation_language: np.ndarray


def comparison_data(
    synthesizer,
    calibration: Contexts,
    evaluation: Contexts,
    seed: int,
    sampling: SamplingConfig = SamplingConfig(),
    tune_fraction: float = 0.15,
) -> ComparisonData:
    code_predictor = synthesizer.code_predictor
    embedding = synthesizer.talker.get_input_embeddings()
    fit, tune = calibration.split(tune_fraction, seed)
    fit_prefixes, tune_prefixes, evaluation_prefixes = (f.prefixes(embedding) for f in (fit, tune, evaluation))
    return ComparisonData(
        frozen_draft_data(code_predictor, fit_prefixes, fit.codes[:, 1:]),
        free_running_data(code_predictor, fit_prefixes, seed, sampling),
        free_running_data(code_predictor, tune_prefixes, seed + 1, sampling),
        free_running_data(code_predictor, evaluation_prefixes, seed + 2, sampling),
        evaluation.language,
    )


def trees_for(ranks: np.ndarray, budget: int, by_position: bool, source: str) -> Tree | list[Tree]:
    """One greedy tree from the pooled acceptance table, or one per root position k (from that k's rows)."""
    if not by_position:
        return grow_tree(acceptance_table(ranks, MAX_RANK), budget, source)
    depth = ranks.shape[2]
    trees = []
    for k in range(ranks.shape[1]):
        usable = min(depth, ranks.shape[1] - k - 1)
        if usable < 1:
            trees.append(trees[-1] if trees else grow_tree([[1.0]], 1))
            continue
        table = acceptance_table(ranks[:, k : k + 1, :usable], MAX_RANK)
        trees.append(grow_tree(table, budget, f"{source}, root position {k + 1}"))
    return trees


def measure_drafter(
    drafter: torch.nn.Module, weights: torch.Tensor, data: ComparisonData, budgets: list[int], by_position: bool = False
) -> dict:
    """Acceptance (tuning frames) and replayed codes per call (evaluation frames) per budget."""
    tune_ranks = draft_ranks(drafter, weights, data.tune, MAX_RANK)
    evaluation_ranks = draft_ranks(drafter, weights, data.evaluation, MAX_RANK)
    codes = data.evaluation.codes.shape[1]
    result = {
        "acceptance": acceptance_table(tune_ranks, MAX_RANK)[:3],
        "top1_by_depth": top1_by_depth(evaluation_ranks),
        "codes_per_call": {},
    }
    for budget in budgets:
        trees = trees_for(tune_ranks, budget, by_position, "comparison")
        calls = replay_calls(evaluation_ranks, trees)
        shape = trees if isinstance(trees, Tree) else trees[0]
        result["codes_per_call"][str(budget)] = {
            **summarize_calls(calls, list(data.evaluation_language), codes),
            "nodes_per_depth": [sum(len(p) == d for p in shape.paths) for d in range(1, shape.depth + 1)],
        }
    return result


def compare_drafters(
    synthesizer,
    calibration: Contexts,
    evaluation: Contexts,
    budgets: list[int],
    seed: int,
    training: TrainingConfig = TrainingConfig(),
    sampling: SamplingConfig = SamplingConfig(),
    variants: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Every drafter of rvqtts.tuning.drafters, trained where it has parameters, measured the same way; without
    `variants`, only the paper's three (reused heads, offsets, Medusa heads)."""
    data = comparison_data(synthesizer, calibration, evaluation, seed, sampling)
    weights = head_weights(synthesizer.code_predictor).to(data.tune.hidden.device)
    hidden, vocab, length = weights.shape[2], weights.shape[1], weights.shape[0]
    results: dict = {}
    frames = {"fit": len(data.fit_recorded), "tune": len(data.tune), "evaluation": len(data.evaluation)}

    def run(
        name: str,
        drafter: torch.nn.Module,
        fit: DraftData | None = None,
        config: TrainingConfig = training,
        by_position: bool = False,
        note: str = "",
    ) -> torch.nn.Module:
        started = time.perf_counter()
        drafter.to(weights.device)
        entry: dict = {"parameters": parameter_count(drafter), "note": note}
        if fit is not None:
            entry["training"] = train_drafter(drafter, weights, fit, data.tune, config, sampling)
        entry.update(measure_drafter(drafter, weights, data, budgets, by_position))
        entry["seconds"] = round(time.perf_counter() - started, 1)
        results[name] = entry
        figures = ", ".join(f"N={n} {entry['codes_per_call'][str(n)]['codes_per_call']:.3f}" for n in budgets)
        log(f"{name}: {figures} ({entry['seconds']} s)")
        return drafter

    run("reused heads", OffsetDrafter(3, hidden).requires_grad_(False), note="zero offsets: the frozen heads on h_k")
    offsets = run(
        "offsets",
        OffsetDrafter(3, hidden),
        data.fit_recorded,
        note="the paper's: K = 3, hard targets, teacher forcing on the recorded codes",
    )
    run(
        "medusa heads",
        MedusaDrafter(3, hidden, length),
        data.fit_recorded,
        note="a fresh residual block per position and depth before the frozen head",
    )
    if variants:
        _variants(run, offsets, data, hidden, vocab, training)
    return {"drafters": results, "frames": frames}


def _variants(run: Callable, offsets: torch.nn.Module, data, hidden: int, vocab: int, training: TrainingConfig) -> None:
    """The drafters beside the paper's three, each through `compare_drafters`'s `run`: the trained offsets with a
    tree per position, other targets and depths, and the tables and their mixtures."""
    run(
        "offsets, trees per position",
        offsets,
        by_position=True,
        note="the same offsets; a tree per root position k at the same N",
    )
    run(
        "offsets, soft targets",
        OffsetDrafter(3, hidden),
        data.fit_recorded,
        replace(training, target="soft"),
        note="KL to the sampling distribution at k + j",
    )
    run(
        "offsets, self-distilled",
        OffsetDrafter(3, hidden),
        data.fit_sampled,
        note="hard targets on codes the model sampled itself from the same frames",
    )
    for depth in (4, 5, 6):
        run(f"offsets, K = {depth}", OffsetDrafter(depth, hidden), data.fit_recorded, replace(training, depth=depth))
    prior = run(
        "frequency prior",
        PriorDrafter(data.fit_sampled.codes.cpu(), vocab, 3),
        note="per-position code frequencies of the model's own samples; no model call",
    )
    table = run(
        "table P(c_k+j | c_k)",
        TableDrafter(data.fit_sampled.codes.cpu(), vocab, 3),
        note="counted on the model's own samples, indexed by the root code",
    )
    for weight in (0.5, 1.0):
        run(
            f"offsets + {weight} x table",
            MixedDrafter(offsets, table, weight),
            note="log-probabilities of the offset heads plus the weighted table's",
        )
    run("offsets + 1.0 x prior", MixedDrafter(offsets, prior, 1.0))
