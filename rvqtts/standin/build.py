"""`rvqtts standin build`: corpus, codec, trained stand-in, held-out contexts and the faithfulness report,
all from fixed seeds, into one folder:

  OUT/model/          a Qwen3-TTS 12 Hz checkpoint whose code predictor is the trained stand-in
  OUT/codec.npz       the residual VQ codec
  OUT/contexts.npz    per held-out frame: h_t, the codes c0..c15, language and split
  OUT/sample.wav      an evaluation sentence through the codec, to listen to
  OUT/report.json     corpus, training, faithfulness per position, reused-heads codes per call per N
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from rvqtts.standin.codec import LEVELS, ResidualCodec, frame_features
from rvqtts.standin.corpus import LANGUAGES, build_corpus
from rvqtts.standin.model import ContextEncoder, FrameData, StandinConfig, train

BUDGETS = (4, 8, 16, 32, 64)
MAX_RANK = 16


@dataclass(frozen=True)
class BuildPlan:
    config: StandinConfig
    variants: int
    sentences_per_language: int | None
    calibration_frames: int
    evaluation_frames: int


FULL = BuildPlan(StandinConfig(), variants=6, sentences_per_language=None, calibration_frames=600,
                 evaluation_frames=600)
SMALL = BuildPlan(StandinConfig(entries=128, hidden=64, layers=2, copies=2, steps=150, batch=128),
                  variants=2, sentences_per_language=4, calibration_frames=120, evaluation_frames=120)


def _split_frames(recordings, codec: ResidualCodec, pca: np.ndarray, pca_scale: np.ndarray,
                  config: StandinConfig, split: str, copies: int, rng: np.random.Generator) -> FrameData:
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
            parts.append((codes, previous, np.full(len(codes), languages.index(recording.language)), coarse))
    stacked = [np.concatenate([p[i] for p in parts]) for i in range(4)]
    return FrameData(stacked[0].astype(np.int64), stacked[1].astype(np.int64), stacked[2].astype(np.int64),
                     stacked[3].astype(np.float32))


def build_standin(out: Path, small: bool = False, device: str = "cpu", sentences_dir: Path | None = None,
                  steps: int | None = None, log=print) -> dict:
    """Run the whole pipeline into `out` and return the report (also written to out/report.json).

    `steps` overrides the plan's training steps (more on a GPU, to train to convergence)."""
    from rvqtts.calibration import acceptance_table, codes_per_call, draft_ranks, frame_prefixes, sample_codes
    from rvqtts.decode import Speculation
    from rvqtts.offsets import Offsets
    from rvqtts.predictor import PredictorRunner
    from rvqtts.standin.corpus import default_sentences_dir
    from rvqtts.standin.measure import chain_gain, draft_top1, entropy_by_position
    from rvqtts.synthesis import Synthesizer
    from rvqtts.tiny import build_tiny_model
    from rvqtts.tree import grow_tree

    plan = SMALL if small else FULL
    config = plan.config if steps is None else replace(plan.config, steps=steps)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    report: dict = {"small": small, "config": asdict(config)}
    out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    recordings = build_corpus(sentences_dir or default_sentences_dir(), plan.variants, plan.sentences_per_language)
    seconds = {}
    for r in recordings:
        key = f"{r.language}/{r.split}"
        seconds[key] = seconds.get(key, 0.0) + r.audio.size / 24000
    report["corpus"] = {"seconds": {k: round(v, 1) for k, v in sorted(seconds.items())},
                        "recordings": len(recordings), "build_seconds": round(time.perf_counter() - started, 1)}
    log(f"corpus: {len(recordings)} recordings, {sum(seconds.values()) / 60:.1f} min of audio")

    started = time.perf_counter()
    train_features = np.concatenate([frame_features(r.audio) for r in recordings if r.split == "train"])
    # Jittered copies keep the deep codebooks from memorising the training frames' exact residuals.
    spread = train_features.std(0)
    jittered = [train_features + rng.normal(0, config.jitter, train_features.shape) * spread
                for _ in range(config.copies)]
    codec = ResidualCodec.fit(np.concatenate([train_features, *jittered]).astype(np.float32), config.entries,
                              seed=config.seed, device=device)
    codec.save(out / "codec.npz")
    normalised = (train_features - codec.mean) / codec.std
    _, singular, vt = np.linalg.svd(normalised - normalised.mean(0), full_matrices=False)
    pca = vt[:config.coarse_dims].T.astype(np.float32)
    pca_scale = (singular[:config.coarse_dims] / np.sqrt(len(normalised))).astype(np.float32)
    report["codec"] = {"entries": config.entries, "levels": LEVELS, "train_frames": int(len(train_features)),
                       "seconds": round(time.perf_counter() - started, 1)}
    log(f"codec: {LEVELS} x {config.entries} entries on {len(train_features)} frames "
        f"({report['codec']['seconds']} s)")

    data = {split: _split_frames(recordings, codec, pca, pca_scale, config, split,
                                 config.copies if split == "train" else 0, rng)
            for split in ("train", "calibration", "evaluation")}

    model_dir = out / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    build_tiny_model(model_dir, codebook=config.entries, code_groups=LEVELS, seed=config.seed,
                     talker_hidden=config.hidden, predictor_layers=config.layers)
    synth = Synthesizer.load(model_dir)
    code_predictor = synth.code_predictor
    talker_embedding = synth.talker.get_input_embeddings()
    encoder = ContextEncoder(config, len(LANGUAGES))
    report["training"] = train(code_predictor, talker_embedding, encoder, data["train"], config, device, log)
    report["training"]["parameters"] = {
        "code_predictor": sum(p.numel() for p in code_predictor.parameters()),
        "context_encoder": sum(p.numel() for p in encoder.parameters())}
    for module in (code_predictor, talker_embedding, encoder):
        module.to("cpu")
    _save_weights(model_dir, synth)

    contexts = {}
    with torch.no_grad():
        for split in ("calibration", "evaluation"):
            frames = data[split]
            h_t = encoder(*(torch.from_numpy(a) for a in (frames.previous, frames.language, frames.coarse)))
            contexts[split] = (h_t.numpy(), frames.codes, np.array(list(LANGUAGES))[frames.language])
    np.savez(out / "contexts.npz", **{f"{split}_{name}": value for split, arrays in contexts.items()
                                      for name, value in zip(("h_t", "codes", "language"), arrays)})

    evaluation_h, evaluation_codes, evaluation_languages = contexts["evaluation"]
    pick = rng.permutation(len(evaluation_codes))[:plan.evaluation_frames]
    h_eval = torch.from_numpy(evaluation_h[pick])
    codes_eval = torch.from_numpy(evaluation_codes[pick])
    report.update(entropy_by_position(code_predictor, talker_embedding, h_eval, codes_eval))
    report["chain_gain_bits"] = chain_gain(code_predictor, talker_embedding, h_eval, codes_eval)
    runner = PredictorRunner(code_predictor, LEVELS + 1)
    prefixes_eval = frame_prefixes(talker_embedding, evaluation_h[pick], evaluation_codes[pick, 0])
    report["draft_top1_by_depth"] = draft_top1(runner, prefixes_eval, evaluation_codes[pick])
    report["c1_top1_accuracy"] = _c1_accuracy(code_predictor, talker_embedding, h_eval, codes_eval)
    report["chance_top1_accuracy"] = round(1 / config.entries, 6)

    calibration_h, calibration_codes, _ = contexts["calibration"]
    take = rng.permutation(len(calibration_codes))[:plan.calibration_frames]
    prefixes_cal = frame_prefixes(talker_embedding, calibration_h[take], calibration_codes[take, 0])
    sampled = sample_codes(code_predictor, prefixes_cal, seed=config.seed)
    zeros = torch.zeros(3, config.hidden)
    table = acceptance_table(draft_ranks(runner, prefixes_cal, sampled, zeros, MAX_RANK), MAX_RANK)
    report["reused_heads_acceptance"] = table
    report["reused_heads_codes_per_call"] = {}
    for budget in BUDGETS:
        tree = grow_tree(table, budget, source=f"stand-in reused heads, calibration split ({len(take)} frames)")
        measured = codes_per_call(code_predictor, Speculation(tree, Offsets.zeros(3, config.hidden)), prefixes_eval,
                                  list(evaluation_languages[pick]), seed=config.seed + 1)
        report["reused_heads_codes_per_call"][str(budget)] = {
            **measured, "tree": [list(p) for p in tree.paths], "predicted_per_round": tree.expected_codes_per_call}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    _write_sample(out, codec, recordings)
    return report


def _c1_accuracy(code_predictor, talker_embedding, h_t, codes) -> float:
    from rvqtts.standin.model import teacher_forced_logits

    with torch.no_grad():
        logits = teacher_forced_logits(code_predictor, talker_embedding, h_t, codes[:, :3])[:, 0]
    return round(float((logits.argmax(-1) == codes[:, 1]).float().mean()), 4)


def _save_weights(model_dir: Path, synth) -> None:
    """Write the trained predictor and c0 embedding into the checkpoint's safetensors file."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    state = synth.model.state_dict()
    for name in tensors:
        if name.startswith("talker.code_predictor.") or name == "talker.model.codec_embedding.weight":
            tensors[name] = state[name].detach().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_sample(out: Path, codec: ResidualCodec, recordings) -> None:
    from rvqtts.audio import wav_bytes, write_atomically

    sample = next(r for r in recordings if r.split == "evaluation")
    audio = codec.to_audio(codec.encode(frame_features(sample.audio)))
    write_atomically(out / "sample.wav", wav_bytes(audio / max(1e-6, np.abs(audio).max()) * 0.9, 24000))
