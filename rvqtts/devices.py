"""Which device and dtype a run uses when the user says `auto`, and why.

On a CPU the dtype is a measured choice: bfloat16 where the CPU multiplies bfloat16 natively (AMX or
AVX512-BF16; docs/benchmarks.md has the costs and the agreement with float32), float32 elsewhere, where
bfloat16 is emulated and slower. CUDA takes bfloat16, MPS float16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of x86 CPUs that multiply bf16


class DeviceError(ValueError):
    """A device that cannot be used here; the message says what to do."""


def pick_device(device: str = "auto") -> str:
    """`auto`: cuda, then mps, then cpu. A named device must be present (DeviceError otherwise)."""
    if device not in ("auto", "cpu", "mps") and not device.startswith("cuda"):
        raise DeviceError(f"unknown --device {device!r}: choose auto, cpu, cuda or mps")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: " + (
            "this torch is built without CUDA; install a CUDA build of torch, or use --device cpu"
            if torch.version.cuda is None else "no CUDA GPU is visible; use --device cpu"))
    if device.startswith("cuda:"):
        index = device.removeprefix("cuda:")
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: this machine has CUDA devices 0 to {torch.cuda.device_count() - 1}")
    if device == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("--device mps: MPS is not available here (it needs a Mac with Apple silicon and a torch "
                          "built with MPS); use --device cpu")
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def native_bf16_flag(cpuinfo: str | None = None) -> str | None:
    """The CPU flag that says this CPU multiplies bfloat16 natively, or None (also off Linux, where
    /proc/cpuinfo does not exist)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text() if sys.platform.startswith("linux") else ""
        except OSError:
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)


def pick_dtype(dtype: str, device: str) -> tuple[str, str | None]:
    """The dtype for `auto` on this device, and why (None when the user chose it or nothing needs saying)."""
    if dtype != "auto":
        return dtype, None
    kind = device.split(":")[0]
    if kind == "cuda":
        return "bfloat16", None
    if kind == "mps":
        return "float16", None
    flag = native_bf16_flag()
    if flag:
        return "bfloat16", f"bfloat16: this CPU multiplies bfloat16 natively ({flag}); --dtype float32 overrides"
    return "float32", None
