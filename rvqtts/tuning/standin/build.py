"""`rvqtts standin build`: corpus, codec, trained stand-in, held-out contexts and the faithfulness report, all
from fixed seeds, into one folder (its files: docs/standin.md)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rvqtts.engine.speculative.offsets import Offsets, save_offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import ACCEPTANCE_SUFFIX, save_acceptance, save_tree
from rvqtts.support.audio import audio_bytes
from rvqtts.support.files import write_atomically
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.tuning.calibration import calibrate_trees, codes_per_call
from rvqtts.tuning.comparison import compare_drafters
from rvqtts.tuning.contexts import Contexts
from rvqtts.tuning.drafters import OffsetDrafter
from rvqtts.tuning.drafts import draft_ranks, frozen_draft_data, head_weights, top1_by_depth
from rvqtts.tuning.standin.codec import LEVELS, ResidualCodec, frame_features
from rvqtts.tuning.standin.corpus import LANGUAGES, build_corpus, default_sentences_dir
from rvqtts.tuning.standin.measure import chain_gain, entropy_by_position
from rvqtts.tuning.standin.model import ContextEncoder, FrameData, StandinConfig, teacher_forced_logits, train
from rvqtts.tuning.tiny import build_tiny_model
from rvqtts.tuning.training import TrainingConfig, fit_offsets

BUDGETS = (4, 8, 16, 32, 64)


@dataclass(frozen=True)
class BuildPlan:
    config: StandinConfig
    variants: int
    sentences_per_language: int | None
    calibration_frames: int
    evaluation_frames: int
    offsets: TrainingConfig
    training_frames: int | None = None  # of the calibration split, for the offsets and compared drafters (all)


FULL = BuildPlan(
    StandinConfig(),
    variants=6,
    sentences_per_language=None,
    calibration_frames=600,
    evaluation_frames=600,
    offsets=TrainingConfig(),
)
SMALL = BuildPlan(
    StandinConfig(entries=128, hidden=64, layers=2, copies=2, steps=150, batch=128),
    variants=2,
    sentences_per_language=4,
    calibration_frames=60,
    evaluation_frames=60,
    offsets=TrainingConfig(learning_rate=1e-2, max_steps=300, eval_every=50),
    training_frames=240,
)


def _split_frames(
    recordings,
    codec: ResidualCodec,
    pca: np.ndarray,
    pca_scale: np.ndarray,
    config: StandinConfig,
    split: str,
    copies: int,
    rng: np.random.Generator,
) -> FrameData:
    """Frames of one split (copies > 0 adds jittered, re-encoded copies of each frame). The coarse view is
    the frame's top principal components plus noise of `coarse_noise` times each component's spread."""
    languages = list(LANGUAGES)
    parts = []
    for recording in (r for r in recordings if r.split == split):
        features = frame_features(recording.audio)
        for copy in range(copies + 1):
            noisy = features if copy == 0 else features + rng.normal(0, config.jitter, features.shape) * codec.std
            codes = codec.encode(noisy.astype(np.float32))
            previous = np.vstack([np.full((1, LEVELS), config.entries), codes[:-1]])
            normalised = (noisy - codec.mean) / codec.std
            coarse = normalised @ pca + rng.normal(0, config.coarse_noise, (len(codes), pca.shape[1])) * pca_scale
            language = np.full(len(codes), languages.index(recording.language))
            parts.append((codes, previous, language, coarse.astype(np.float32)))
    return FrameData(*(np.concatenate(column) for column in zip(*parts)))  # int64 codes, float32 coarse


def build_standin(
    out: Path,
    small: bool = False,
    device: str = "cpu",
    sentences_dir: Path | None = None,
    steps: int | None = None,
    log=print,
) -> dict:
    """Run the whole pipeline into `out` and return the report (also written to out/report.json).

    `steps` overrides the plan's training steps (more on a GPU, to train to convergence)."""
    plan = SMALL if small else FULL
    config = plan.config if steps is None else replace(plan.config, steps=steps)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    report: dict = {"small": small, "config": asdict(config)}
    out.mkdir(parents=True, exist_ok=True)

    recordings = _corpus(plan, sentences_dir, report, log)

    codec, pca, pca_scale = _codec(recordings, config, rng, device, out, report, log)

    data = {
        split: _split_frames(
            recordings, codec, pca, pca_scale, config, split, config.copies if split == "train" else 0, rng
        )
        for split in ("train", "calibration", "evaluation")
    }

    synth, encoder = _model(out, config, data, device, report, log)
    calibration, evaluation = _held_out(_contexts(out, data, encoder), plan, rng)
    prefixes_eval = _measure(synth.code_predictor, synth.talker.get_input_embeddings(), evaluation, config, report)

    calibration_sample = calibration.take(rng.permutation(len(calibration))[: plan.calibration_frames])
    # Self-distilled (the model's own codes from the calibration frames): the recipe docs/usage.md gives for
    # real models, and the one acceptance is measured against; docs/acceptance.md compares the others.
    offsets, report["offsets_training"] = fit_offsets(
        synth, calibration, plan.offsets, self_distill=True, model_name="stand-in"
    )
    save_offsets(offsets, out / "offsets.safetensors")
    for name, drafting in (("reused_heads", Offsets.zeros(3, config.hidden)), ("offsets", offsets)):
        _trees(name, drafting, synth, calibration_sample, prefixes_eval, evaluation, config, out, report)
    report.update(_compared_drafters(synth, calibration, evaluation, plan, config, not small, log))
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    _write_sample(out, codec, recordings)
    return report


def _held_out(contexts: dict, plan: BuildPlan, rng: np.random.Generator) -> tuple[Contexts, Contexts]:
    """The calibration and evaluation splits' contexts, each a random sample of the plan's size: the evaluation
    split cut to `evaluation_frames`, the calibration split to `training_frames` where the plan gives it."""
    calibration, evaluation = (
        Contexts(*contexts[split], source=f"stand-in {split} split") for split in ("calibration", "evaluation")
    )
    evaluation = evaluation.take(rng.permutation(len(evaluation))[: plan.evaluation_frames])
    if plan.training_frames is not None:
        calibration = calibration.take(rng.permutation(len(calibration))[: plan.training_frames])
    return calibration, evaluation


def _compared_drafters(
    synth, calibration: Contexts, evaluation: Contexts, plan: BuildPlan, config: StandinConfig, variants: bool, log
) -> dict:
    """The report's comparison of drafters (rvqtts.tuning.comparison), trained on the calibration split and
    measured on the evaluation split at every budget (`variants`: their variants too, left out of a small build)."""
    compared = compare_drafters(
        synth, calibration, evaluation, list(BUDGETS), config.seed, plan.offsets, variants=variants, log=log
    )
    return {
        "drafters": compared["drafters"],
        "comparison_frames": compared["frames"],
        "medusa_codes_per_call": compared["drafters"]["medusa heads"]["codes_per_call"],
        "drafter_parameters": {name: entry["parameters"] for name, entry in compared["drafters"].items()},
    }


def _model(out: Path, config, data: dict, device: str, report: dict, log):
    """The stand-in's checkpoint (out/model): a tiny model whose code predictor and talker embedding are trained
    with a context encoder on the training frames; returns it loaded, and the encoder."""
    model_dir = out / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    build_tiny_model(
        model_dir,
        codebook=config.entries,
        code_groups=LEVELS,
        seed=config.seed,
        talker_hidden=config.hidden,
        predictor_layers=config.layers,
    )
    synth = Synthesizer.from_checkpoint(model_dir)
    code_predictor = synth.code_predictor
    talker_embedding = synth.talker.get_input_embeddings()
    encoder = ContextEncoder(config, len(LANGUAGES))
    report["training"] = train(code_predictor, talker_embedding, encoder, data["train"], config, device, log)
    report["training"]["parameters"] = {
        "code_predictor": sum(p.numel() for p in code_predictor.parameters()),
        "context_encoder": sum(p.numel() for p in encoder.parameters()),
    }
    for module in (code_predictor, talker_embedding, encoder):
        module.to("cpu")
    _save_weights(model_dir, synth)
    return synth, encoder


def _measure(code_predictor, talker_embedding, evaluation, config, report: dict):
    """How the trained model's codes behave on the evaluation frames (entropy by position, what the chain of
    codes tells, top-1 drafts by depth, c1's accuracy), into the report; returns the frames' prefixes."""
    h_eval, codes_eval = torch.from_numpy(evaluation.h_t), torch.from_numpy(evaluation.codes)
    report.update(entropy_by_position(code_predictor, talker_embedding, h_eval, codes_eval))
    report["chain_gain_bits"] = chain_gain(code_predictor, talker_embedding, h_eval, codes_eval)
    prefixes_eval = evaluation.prefixes(talker_embedding)
    truth = frozen_draft_data(code_predictor, prefixes_eval, evaluation.codes[:, 1:])
    ranks = draft_ranks(OffsetDrafter(3, config.hidden), head_weights(code_predictor), truth, 1)
    report["draft_top1_by_depth"] = top1_by_depth(ranks)
    report["c1_top1_accuracy"] = _c1_accuracy(code_predictor, talker_embedding, h_eval, codes_eval)
    report["chance_top1_accuracy"] = round(1 / config.entries, 6)
    return prefixes_eval


def _corpus(plan, sentences_dir: Path | None, report: dict, log) -> list:
    """The stand-in's recordings (its corpus, rvqtts.tuning.standin.corpus), their durations in the report."""
    started = time.perf_counter()
    recordings = build_corpus(sentences_dir or default_sentences_dir(), plan.variants, plan.sentences_per_language)
    seconds = {}
    for r in recordings:
        key = f"{r.language}/{r.split}"
        seconds[key] = seconds.get(key, 0.0) + r.audio.size / 24000
    report["corpus"] = {
        "seconds": {k: round(v, 1) for k, v in sorted(seconds.items())},
        "recordings": len(recordings),
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    log(f"corpus: {len(recordings)} recordings, {sum(seconds.values()) / 60:.1f} min of audio")
    return recordings


def _codec(recordings: list, config, rng, device: str, out: Path, report: dict, log):
    """The residual codec fitted on the training recordings' frames (saved to out/codec.npz), and the principal
    axes (and their scales) of its normalised frames, which the coarse context keeps."""
    started = time.perf_counter()
    train_features = np.concatenate([frame_features(r.audio) for r in recordings if r.split == "train"])
    # Jittered copies keep the deep codebooks from memorising the training frames' exact residuals.
    spread = train_features.std(0)
    jittered = [
        train_features + rng.normal(0, config.jitter, train_features.shape) * spread for _ in range(config.copies)
    ]
    codec = ResidualCodec.fit(
        np.concatenate([train_features, *jittered]).astype(np.float32), config.entries, seed=config.seed, device=device
    )
    codec.save(out / "codec.npz")
    normalised = (train_features - codec.mean) / codec.std
    _, singular, vt = np.linalg.svd(normalised - normalised.mean(0), full_matrices=False)
    pca = vt[: config.coarse_dims].T.astype(np.float32)
    pca_scale = (singular[: config.coarse_dims] / np.sqrt(len(normalised))).astype(np.float32)
    report["codec"] = {
        "entries": config.entries,
        "levels": LEVELS,
        "train_frames": int(len(train_features)),
        "seconds": round(time.perf_counter() - started, 1),
    }
    log(f"codec: {LEVELS} x {config.entries} entries on {len(train_features)} frames ({report['codec']['seconds']} s)")
    return codec, pca, pca_scale


def _contexts(out: Path, data: dict, encoder) -> dict:
    """The calibration and evaluation splits' (h_t, codes, language), h_t from the trained context encoder;
    written to out/contexts.npz."""
    contexts = {}
    with torch.no_grad():
        for split in ("calibration", "evaluation"):
            frames = data[split]
            h_t = encoder(*(torch.from_numpy(a) for a in (frames.previous, frames.language, frames.coarse)))
            contexts[split] = (h_t.numpy(), frames.codes, np.array(list(LANGUAGES))[frames.language])
    np.savez(
        out / "contexts.npz",
        **{
            f"{split}_{name}": value
            for split, arrays in contexts.items()
            for name, value in zip(("h_t", "codes", "language"), arrays)
        },
    )
    return contexts


def _trees(name: str, drafting, synth, calibration_sample, prefixes_eval, evaluation, config, out: Path, report: dict):
    """Trees calibrated for one drafter (`name`: reused heads or offsets) at every budget, saved with its acceptance
    table under out/trees, and each tree's codes per call measured on the evaluation frames."""
    code_predictor = synth.code_predictor
    table, trees = calibrate_trees(
        synth,
        calibration_sample,
        drafting,
        list(BUDGETS),
        config.seed,
        model_name="stand-in",
        offsets_name=name.replace("_", " "),
    )
    report[f"{name}_acceptance"] = table["acceptance"]
    report[f"{name}_codes_per_call"] = {}
    save_acceptance(table, out / "trees" / f"stand-in-{name.replace('_', '-')}{ACCEPTANCE_SUFFIX}")
    for budget, tree in trees.items():
        save_tree(tree, out / "trees" / f"stand-in-{name.replace('_', '-')}-n{budget}.json")
        measured = codes_per_call(
            code_predictor,
            Speculation(tree, drafting),
            prefixes_eval,
            list(evaluation.language),
            seed=config.seed + 1,
        )
        report[f"{name}_codes_per_call"][str(budget)] = {
            **measured,
            "tree": [list(p) for p in tree.paths],
            "predicted_per_round": tree.expected_codes_per_call,
        }


def _c1_accuracy(code_predictor, talker_embedding, h_t, codes) -> float:
    with torch.no_grad():
        logits = teacher_forced_logits(code_predictor, talker_embedding, h_t, codes[:, :3])[:, 0]
    return round(float((logits.argmax(-1) == codes[:, 1]).float().mean()), 4)


def _save_weights(model_dir: Path, synth) -> None:
    """Write the trained predictor and c0 embedding into the checkpoint's safetensors file."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    state = synth.model.state_dict()
    for name in tensors:
        if name.startswith("talker.code_predictor.") or name == "talker.model.codec_embedding.weight":
            tensors[name] = state[name].detach().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_sample(out: Path, codec: ResidualCodec, recordings) -> None:
    sample = next(r for r in recordings if r.split == "evaluation")
    audio = codec.to_audio(codec.encode(frame_features(sample.audio)))
    write_atomically(out / "sample.wav", audio_bytes(audio / max(1e-6, np.abs(audio).max()) * 0.9, 24000))
