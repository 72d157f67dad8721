"""8-bit weights (W8A16): the linear maps of the talker's and the code predictor's layers and their heads
held as int8, activations in the model's dtype (the 1.7B predictor's small input projection stays as it is).

On a CPU both loops are bound by reading their weights (rvqtts.bench.floor), so halving the bytes is the lever
that arithmetic cannot give. Each output channel (a row of the weight) gets its own scale, the largest
magnitude in the row over 127, and its weights are rounded to the nearest step: symmetric, no zero point,
as the paper's W8A16 deployment. The maps run through torch's int8 matrix kernel (rvqtts.engine.kernels, which
checks on each machine that it gives each row the same bits in a call of any number of rows, padding
calls where that makes it hold; tests/test_quantize.py checks it up to 65 rows at the released map
shapes, bfloat16 and float32), so a tree round's rows equal plain steps within the quantized model and
speculative and plain decoding emit the same codes.
Quantization changes the model: its codes differ from the unquantized model's now and then
(`rvqtts bench dtype --weights int8` measures how often).
"""

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
