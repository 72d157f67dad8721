"""Which device and dtype a run uses when the user says `auto`, and why.

On a CPU the dtype is measured on the machine at hand: the linear maps one frame applies (a talker step
and the code predictor's 15 calls, at the model's shapes, each with the kernel rvqtts.engine.model.kernels measured
fastest for it) are timed in bfloat16 and in float32, once, and the cheaper wins. A CPU flag does not
decide it: on an AMD EPYC with AVX512-BF16 the kernel that had made bfloat16 pay on an AMX Xeon was the
slowest there. CUDA takes bfloat16, MPS float16. With RVQTTS_CHOICES=fixed the rule before measurement
holds: bfloat16 where /proc/cpuinfo lists a native bfloat16 flag, else float32.
"""

from __future__ import annotations

from typing import Callable

import torch

from rvqtts.engine.model.kernels import TIMED_ROWS, choose_kernels, measured_choices
from rvqtts.engine.model.native import cpu_flags
from rvqtts.support.measurements import KERNELS

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of x86 CPUs that multiply bf16


class DeviceError(ValueError):
    """A device that cannot be used here; the message says what to do."""


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that host clocks measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def pick_device(device: str = "auto") -> str:
    """`auto`: cuda, then mps, then cpu. A named device must be present (DeviceError otherwise)."""
    if device not in ("auto", "cpu", "mps") and not device.startswith("cuda"):
        raise DeviceError(f"unknown --device {device!r}: choose auto, cpu, cuda or mps")
    if device.startswith("cuda") and not torch.cuda.is_available():
        unbuilt = "this torch is built without CUDA; install a CUDA build of torch, or"
        why = unbuilt if torch.version.cuda is None else "no CUDA GPU is visible;"
        raise DeviceError(f"--device {device}: {why} use --device cpu")
    if device.startswith("cuda:"):
        index = device.removeprefix("cuda:")
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: this machine has CUDA devices 0 to {torch.cuda.device_count() - 1}")
    if device == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(
            "--device mps: MPS is not available here (it needs a Mac with Apple silicon and a torch "
            "built with MPS); use --device cpu"
        )
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def unvalidated_notice(device: str) -> str | None:
    """What a run on a device rvqtts has never run on should say (None on the CPU): CUDA's graphs and MPS's
    float16 are tested only emulated on a CPU, so their speed and exactness are unknown."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return None
    name = {"cuda": "CUDA (graphs on by default)", "mps": "MPS (float16 by default)"}.get(kind, kind)
    return (
        f"{name} has not been validated: speed and same-seed codes there are unmeasured; "
        "--device cpu runs the tested CPU path"
    )


def native_bf16_flag(cpuinfo: str | None = None) -> str | None:
    """The CPU flag that says this CPU multiplies bfloat16 natively, or None (also off Linux, where
    /proc/cpuinfo does not exist, and above $RVQTTS_ISA's cap: rvqtts.engine.model.native)."""
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags(cpuinfo)), None)


def frame_maps(talker_config: object) -> list[tuple[str, tuple[int, int], int]]:
    """The linear maps one frame applies, as (loop, weight shape, calls per frame): the talker's layers and
    codec head once, the code predictor's layers and one LM head for each of its G - 1 calls."""

    def layers(config: object) -> list[tuple[int, int]]:
        width = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or width // config.num_attention_heads
        queries, keys = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        return [
            (queries + 2 * keys, width),
            (width, queries),
            (2 * config.intermediate_size, width),
            (width, config.intermediate_size),
        ]

    predictor = talker_config.code_predictor_config
    calls = predictor.num_code_groups - 1
    maps = [("talker", shape, talker_config.num_hidden_layers) for shape in layers(talker_config)]
    maps.append(("talker", (talker_config.vocab_size, talker_config.hidden_size), 1))
    maps += [("predictor", shape, predictor.num_hidden_layers * calls) for shape in layers(predictor)]
    maps.append(("predictor", (predictor.vocab_size, predictor.hidden_size), calls))
    if predictor.hidden_size != talker_config.hidden_size:  # the input projection (1.7B), once a call
        maps.append(("predictor", (predictor.hidden_size, talker_config.hidden_size), calls))
    return maps


def frame_map_ms(
    talker_config: object,
    dtype: torch.dtype,
    weights: str = "native",
    progress: Callable[[str], None] | None = None,
    rows: int = 1,
) -> float:
    """Milliseconds one frame step spends in its linear maps on this CPU, each map `rows` rows (a batch's lines
    share every call) through the kernel measured fastest for its shape (rvqtts.engine.model.kernels; measured once,
    then read from the user's cache). A call's cost: its kernel's timings at 1 and 17 rows (`TIMED_ROWS`), straight
    between them and on past 17 (a kernel's cost grows about linearly in rows once its weights are read)."""
    maps, (low, high) = frame_maps(talker_config), TIMED_ROWS
    choices = choose_kernels([shape for _, shape, _ in maps], dtype, weights, progress)
    timings = {shape: choice.timings[choice.kernel.name] for shape, choice in choices.items()}
    return sum(
        count * (timings[shape][low] + (timings[shape][high] - timings[shape][low]) * (rows - low) / (high - low))
        for _, shape, count in maps
    )


def pick_dtype(
    dtype: str,
    device: str,
    talker_config: object | None = None,
    weights: str = "native",
    progress: Callable[[str], None] | None = None,
    rows: int = 1,
) -> tuple[str, str | None]:
    """The dtype for `auto` on this device, and why (None when the user chose it or nothing needs saying).
    On a CPU, the cheaper of bfloat16 and float32 for one frame's maps at `talker_config`'s shapes, each call
    `rows` rows (a batch's lines: torch's bfloat16 kernels can win at one row and lose at many)."""
    if dtype != "auto":
        return dtype, None
    kind = device.split(":")[0]
    if kind == "cuda":
        return "bfloat16", None
    if kind == "mps":
        return "float16", None
    if not measured_choices() or talker_config is None:
        flag = native_bf16_flag()
        if flag:
            return "bfloat16", f"bfloat16: this CPU multiplies bfloat16 natively ({flag}); --dtype float32 overrides"
        return "float32", None
    costs = {
        name: frame_map_ms(talker_config, getattr(torch, name), weights, progress, rows)
        for name in ("bfloat16", "float32")
    }
    chosen = min(costs, key=costs.get)
    other = "float32" if chosen == "bfloat16" else "bfloat16"
    lines = f" for {rows} lines a call" if rows > 1 else ""
    return chosen, (
        f"{chosen}: one frame's linear maps{lines} take {costs[chosen]:.1f} ms in {chosen} against "
        f"{costs[other]:.1f} ms in {other} on this CPU (measured once, {KERNELS.kept}); "
        f"--dtype {other} overrides"
    )
