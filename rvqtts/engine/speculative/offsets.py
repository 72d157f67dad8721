"""Draft offsets: K learned vectors b_1..b_K added to the hidden state before the frozen heads.

The draft for the code j places ahead of position k is LMH_{k+j}(h_k + b_j). Zero offsets are the
paper's "reused heads". A file is safetensors with one tensor, "offsets" [K, hidden], and string
metadata: the format tag, hidden size, K and the model the offsets were trained for (its name and a
fingerprint of its code-predictor config), plus whatever training provenance the writer adds.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rvqtts.support.files import write_atomically

OFFSETS_FORMAT = "rvqtts-offsets"
MAX_DEPTH = 14  # a frame has 15 residual codes, so at most 14 can be drafted ahead of a sampled one


class OffsetsFileError(ValueError):
    """An offsets file that cannot be used; the message names the file and the fault."""


@dataclass(frozen=True)
class Offsets:
    vectors: torch.Tensor
    model: str = ""
    model_fingerprint: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def depth(self) -> int:
        return self.vectors.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.vectors.shape[1]

    @property
    def is_zero(self) -> bool:
        return not bool(self.vectors.any())

    @classmethod
    def zeros(cls, depth: int, hidden_size: int) -> "Offsets":
        """Reused heads: the drafts are the frozen heads applied to the unchanged hidden state."""
        return cls(torch.zeros(depth, hidden_size), metadata={"source": "zeros (reused heads)"})


# The config fields a code predictor's fingerprint covers.
FINGERPRINT_CONFIG = """vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
    num_key_value_heads head_dim num_code_groups rope_theta rms_norm_eps"""


def predictor_fingerprint(code_predictor: torch.nn.Module) -> str:
    """A short hash that tells code predictors apart, so offsets and trees can be matched to a model.

    The config alone does not: the 0.6B and 1.7B models (and Base and CustomVoice) share the predictor's
    dimensions. So the hash also covers the talker width the predictor reads and a sample of the first
    head's weights, rounded to bfloat16 and of magnitude above 1e-3: for checkpoints stored in bfloat16,
    as Qwen3-TTS's are, loading in float32, bfloat16 or float16 gives the same fingerprint."""
    summary = {k: getattr(code_predictor.config, k, None) for k in FINGERPRINT_CONFIG.split()}
    summary["input_width"] = code_predictor.get_input_embeddings()[0].weight.shape[1]
    summary["weights"] = weight_digest(code_predictor.lm_head[0].weight)
    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16]


def weight_digest(weight: torch.Tensor) -> str:
    """A hash of a weight's first 512 values, rounded to bfloat16 and of magnitude above 1e-3: the same for
    a bfloat16 checkpoint loaded in float32, bfloat16 or float16."""
    sample = weight.detach().flatten()[:512].float().cpu().to(torch.bfloat16).float()
    return hashlib.sha256(sample[sample.abs() > 1e-3].numpy().tobytes()).hexdigest()


def save_offsets(offsets: Offsets, path: str | os.PathLike, **metadata: object) -> None:
    """Write an offsets file (atomically: a temporary file, then a rename)."""
    from safetensors.torch import save

    meta = {
        **offsets.metadata,
        **{k: str(v) for k, v in metadata.items()},
        "format": OFFSETS_FORMAT,
        "hidden_size": str(offsets.hidden_size),
        "depth": str(offsets.depth),
        "model": offsets.model,
        "model_fingerprint": offsets.model_fingerprint,
    }
    write_atomically(path, save({"offsets": offsets.vectors.detach().float().cpu().contiguous()}, metadata=meta))


def load_offsets(path: str | os.PathLike, hidden_size: int | None = None, fingerprint: str | None = None) -> Offsets:
    """Read and validate an offsets file; every fault raises OffsetsFileError naming the file.

    With `hidden_size` and `fingerprint` (predictor_fingerprint of the loaded model), offsets trained for
    a model of another hidden size or another code-predictor config are refused.
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            names = list(handle.keys())
            vectors = handle.get_tensor("offsets") if "offsets" in names else None
    except Exception as error:  # safetensors raises several types for missing and corrupt files
        raise OffsetsFileError(f"cannot read offsets file {path}: {error}") from error
    if meta.get("format") != OFFSETS_FORMAT:
        raise OffsetsFileError(f"offsets file {path} is not rvqtts offsets (metadata format != {OFFSETS_FORMAT!r})")
    if vectors is None:
        raise OffsetsFileError(f"offsets file {path} has no tensor named 'offsets' (found {names})")
    if vectors.dim() != 2:
        raise OffsetsFileError(f"offsets file {path}: 'offsets' must be [K, hidden], got shape {list(vectors.shape)}")
    depth, hidden = vectors.shape
    if not 1 <= depth <= MAX_DEPTH:
        raise OffsetsFileError(f"offsets file {path}: K = {depth}, but K must be between 1 and {MAX_DEPTH}")
    if meta.get("hidden_size") != str(hidden) or meta.get("depth") != str(depth):
        raise OffsetsFileError(
            f"offsets file {path}: metadata says hidden {meta.get('hidden_size')}, K {meta.get('depth')}, "
            f"but the tensor is [{depth}, {hidden}]"
        )
    if hidden_size is not None and hidden != hidden_size:
        raise OffsetsFileError(
            f"offsets file {path} has hidden size {hidden}, but the model's code predictor has {hidden_size}: "
            f"these offsets belong to another model (theirs: {meta.get('model') or 'unnamed'})"
        )
    theirs = meta.get("model_fingerprint")
    if fingerprint is not None and theirs and theirs != fingerprint:
        raise OffsetsFileError(
            f"offsets file {path} was trained for another model ({meta.get('model') or 'unnamed'}, code-predictor "
            f"fingerprint {theirs}; this model's is {fingerprint}): train offsets for this model with "
            f"rvqtts train-offsets"
        )
    if not torch.isfinite(vectors).all():
        raise OffsetsFileError(f"offsets file {path} holds NaN or infinite values")
    return Offsets(
        vectors.float(), model=meta.get("model", ""), model_fingerprint=meta.get("model_fingerprint", ""), metadata=meta
    )


SHIPPED_OFFSETS = Path(str(importlib.resources.files("rvqtts.data.offsets")))


def shipped_offsets_for(fingerprint: str, hidden_size: int) -> Offsets | None:
    """The shipped offsets trained for the model with this code-predictor fingerprint, if any."""
    for path in sorted(SHIPPED_OFFSETS.glob("*.safetensors")):
        offsets = load_offsets(path, hidden_size=None)
        if offsets.model_fingerprint == fingerprint and offsets.hidden_size == hidden_size:
            return offsets
    return None
