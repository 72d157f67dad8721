"""Draft offsets: K learned vectors b_1..b_K added to the hidden state before the frozen heads.

The draft for the code j places ahead of position k is LMH_{k+j}(h_k + b_j). Zero offsets are the
paper's "reused heads". A file is safetensors with one tensor, "offsets" [K, hidden], and string
metadata: the format tag, hidden size, K and the model the offsets were trained for (its name and a
fingerprint of its code-predictor config), plus whatever training provenance the writer adds.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

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


def predictor_fingerprint(code_predictor_config) -> str:
    """A short hash of the code-predictor config, so offsets and trees can be matched to a model."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_code_groups", "rope_theta", "rms_norm_eps")
    summary = {k: getattr(code_predictor_config, k, None) for k in keys}
    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16]


def save_offsets(offsets: Offsets, path: str | os.PathLike, **metadata: object) -> None:
    """Write an offsets file (atomically: a temporary file, then a rename)."""
    from safetensors.torch import save_file

    meta = {**offsets.metadata, **{k: str(v) for k, v in metadata.items()},
            "format": OFFSETS_FORMAT, "hidden_size": str(offsets.hidden_size), "depth": str(offsets.depth),
            "model": offsets.model, "model_fingerprint": offsets.model_fingerprint}
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    save_file({"offsets": offsets.vectors.detach().float().cpu().contiguous()}, str(partial), metadata=meta)
    partial.replace(path)


def load_offsets(path: str | os.PathLike, hidden_size: int | None = None) -> Offsets:
    """Read and validate an offsets file; every fault raises OffsetsFileError naming the file.

    With `hidden_size`, offsets for a model of another hidden size are refused.
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
            f"but the tensor is [{depth}, {hidden}]")
    if hidden_size is not None and hidden != hidden_size:
        raise OffsetsFileError(
            f"offsets file {path} has hidden size {hidden}, but the model's code predictor has {hidden_size}: "
            f"these offsets belong to another model (theirs: {meta.get('model') or 'unnamed'})")
    if not torch.isfinite(vectors).all():
        raise OffsetsFileError(f"offsets file {path} holds NaN or infinite values")
    return Offsets(vectors.float(), model=meta.get("model", ""), model_fingerprint=meta.get("model_fingerprint", ""),
                   metadata=meta)


SHIPPED_OFFSETS = Path(__file__).resolve().parent.parent / "offsets"


def shipped_offsets_for(fingerprint: str, hidden_size: int) -> Offsets | None:
    """The shipped offsets trained for the model with this code-predictor fingerprint, if any."""
    for path in sorted(SHIPPED_OFFSETS.glob("*.safetensors")):
        offsets = load_offsets(path, hidden_size=None)
        if offsets.model_fingerprint == fingerprint and offsets.hidden_size == hidden_size:
            return offsets
    return None
