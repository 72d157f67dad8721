"""8-bit weights (W8A16): the linear maps of both loops' layers and their heads held as int8 with a scale per output
channel, activations in the model's dtype. On a CPU both loops are bound by reading their weights, so halving the
bytes is the lever that arithmetic cannot give. The int8 kernels keep rows invariant, so within the quantized model
speculative and plain decoding emit the same codes; the quantized model's codes differ from the unquantized one's
now and then. docs/engine.md, "Same noise, same codes" (8-bit weights)."""

from __future__ import annotations

import torch

WEIGHTS = ("native", "int8")


def check_weights(weights: str, device: torch.device) -> None:
    """Refuse what cannot run, with what to do instead."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}: choose {' or '.join(WEIGHTS)}")
    if weights == "int8" and device.type != "cpu":
        raise ValueError(
            f"8-bit weights run on CPUs only (torch's int8 matrix kernel), not on {device.type}: "
            "use --weights native there"
        )


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
