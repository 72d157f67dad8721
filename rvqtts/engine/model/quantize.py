"""8-bit and 4-bit weights (W8A16, W4A16): the linear maps of both loops' layers and their heads held as int8 with a
scale per output channel, or as 4-bit values in groups along the input with a scale and a zero point per group;
activations in the model's dtype. On a CPU both loops are bound by reading their weights, so the bytes read are the
lever that arithmetic cannot give. The kernels keep rows invariant, so within the quantized model speculative and
plain decoding emit the same codes; the quantized model's codes differ from the unquantized one's now and then.
docs/engine.md, "Same noise, same codes" (8-bit and 4-bit weights)."""

from __future__ import annotations

import torch

WEIGHTS = ("native", "int8", "int4")
WEIGHTS_CHOICES = f"{', '.join(WEIGHTS[:-1])} or {WEIGHTS[-1]}"  # as messages list them
GROUP_SIZES = (128, 64, 32)  # inputs per 4-bit group, the largest that divides a map's inputs (torch's kernel takes
# 32 to 256); 128 as gpt-fast's int4 uses, until rvqtts's own 4-bit kernels measure error against speed
BLOCK = 16  # a 4-bit map's outputs come in multiples of this (torch's packing, rvqtts's kernels)


def check_weights(weights: str, device: torch.device) -> None:
    """Refuse what cannot run, with what to do instead."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}: choose {WEIGHTS_CHOICES}")
    if weights != "native" and device.type != "cpu":
        bits = weights.removeprefix("int")
        raise ValueError(
            f"{bits}-bit weights run on CPUs only (rvqtts's and torch's CPU kernels), not on {device.type}: "
            "use --weights native there"
        )


def group_size(shape: tuple[int, int]) -> int | None:
    """The inputs per 4-bit group of a map of this [out, in] shape, or None where 4-bit weights cannot hold it (its
    outputs not a multiple of BLOCK, or no group size dividing its inputs): such a map keeps 8-bit weights."""
    out_features, in_features = shape
    if out_features % BLOCK:
        return None
    return next((size for size in GROUP_SIZES if in_features % size == 0), None)


QUANTIZED_ROWS = 256  # rows quantized at a time: float32 temporaries of a whole matrix (25 MB at 0.6B, below glibc's
# mmap threshold) stayed in the heap after the load, 1.77 GiB of them at 0.6B


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (int8 weights [out, in], float32 scales [out]) with weight ~ q * scale, computed
    QUANTIZED_ROWS rows at a time (each row alone, so the same as at once)."""
    quantized, scales = [], []
    for block in weight.detach().split(QUANTIZED_ROWS):
        values = block.float()
        scale = values.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        quantized.append(torch.round(values / scale[:, None]).clamp(-127, 127).to(torch.int8))
        scales.append(scale)
    return torch.cat(quantized).contiguous(), torch.cat(scales)


def quantize_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of `group` inputs (the last may be shorter): (values [out, in] int32 in 0..15, scales
    and zeros [out, groups, 2] float32) with weight ~ (q - 8) * scale + zero, each group spanning its own least to
    greatest weight (gpt-fast's int4 rule), QUANTIZED_ROWS rows at a time (each row alone, so the same as at once)."""
    in_features = weight.shape[1]
    values, scales_zeros = [], []
    for block in weight.detach().split(QUANTIZED_ROWS):
        grouped = _whole_groups(block.float(), group)  # the last group filled with its own last input: same span
        least, greatest = grouped.amin(dim=2), grouped.amax(dim=2)
        scale = ((greatest - least) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((grouped - least[..., None]) / scale[..., None]).clamp(0, 15)
        values.append(q.to(torch.int32).reshape(block.shape[0], -1)[:, :in_features])
        scales_zeros.append(torch.stack([scale, least + 8 * scale], dim=2))
    return torch.cat(values).contiguous(), torch.cat(scales_zeros)


def dequantized_groups(values: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weights [out, in] 4-bit groups of `group` inputs stand for: (q - 8) * scale + zero."""
    out_features, in_features = values.shape
    grouped = _whole_groups(values.float(), group) - 8
    return (grouped * scales_zeros[..., :1] + scales_zeros[..., 1:]).reshape(out_features, -1)[:, :in_features]


def _whole_groups(rows: torch.Tensor, group: int) -> torch.Tensor:
    """rows [n, in] as [n, groups, group], a last group that `group` does not fill filled with its last input."""
    short = -rows.shape[1] % group
    if short:
        rows = torch.cat([rows, rows[:, -1:].expand(-1, short)], dim=1)
    return rows.reshape(rows.shape[0], -1, group)
