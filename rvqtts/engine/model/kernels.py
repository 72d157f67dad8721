"""Which kernel applies each linear map of the hot loops on this machine, chosen by measurement: both loops are bound
by reading their weights, and CPUs differ in which kernel reads them fastest for a row or a few. For every map shape
the loops run, each candidate (`candidates`) is checked for row invariance (calls of 2 to CHUNK + 1 rows, padded to
its `pad`), which is what makes speculative and plain decoding give the same codes, and timed at one row and at 17;
of the invariant ones within STEP_TIE of the fastest at one row, the cheapest at 17 rows wins. Kept per machine in
the user's cache (`kernels.json`); RVQTTS_CHOICES=fixed restores the rules used before measurement.
docs/engine.md, "Same noise, same codes" (linear maps); docs/usage.md, "Choices measured on your machine"."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from rvqtts.engine.model import native
from rvqtts.engine.model.quantize import group_size, quantize_groups, quantize_rows
from rvqtts.support.measurements import KERNELS

CHUNK = 32  # rows per kernel call: a longer call goes in chunks, so invariance up to CHUNK + 1 rows covers all
PADS = (1, 2, 4, 8)  # zero-row paddings tried, smallest first, until a kernel's rows are invariant
TIMED_ROWS = (1, 17)  # a plain step, and a 16-node tree round
STEP_TIE = 1.20  # one-row costs within this factor of the fastest are in the running; 17 rows decide
PROMPT_ROWS = 64  # rows of a prompt's prefill, where the kernel of many rows is timed (`KernelChoice.bulk`)
COLD_BYTES = 96 << 20  # weight copies cycled through when timing: more than the last-level cache holds
TIMED_PASSES = 7
CHOICES_VARIABLE = "RVQTTS_CHOICES"  # "measured" (the default) or "fixed": the rules used before measurement


@dataclass(frozen=True)
class Kernel:
    """How a map applies rows: `multi` ("linear" for F.linear, "packed" for oneDNN's kernel over weights
    reordered once, "int8" and "int4" for torch's kernels over 8-bit and 4-bit weights, "bf16dot" and "int8dot" for
    rvqtts's own AVX512-BF16 kernel over bfloat16 or 8-bit weights, "bf16amx" and "int8amx" for its
    AMX one and "bf16avx2" and "int8avx2" for its AVX2 one, rvqtts.engine.model.native) in calls of at most CHUNK rows,
    each padded with zero rows to at least `pad`; a call of one row through torch.mv where `one_row_mv`."""

    multi: str
    pad: int = 1
    one_row_mv: bool = False

    @property
    def name(self) -> str:
        return ("mv+" if self.one_row_mv else "") + self.multi + (f"/pad{self.pad}" if self.pad > 1 else "")

    @classmethod
    def parse(cls, name: str) -> "Kernel":
        one_row_mv = name.startswith("mv+")
        multi, _, pad = name.removeprefix("mv+").partition("/pad")
        return cls(multi, int(pad or 1), one_row_mv)


def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of this dtype on this CPU: float32, or bfloat16 where oneDNN has its
    bfloat16 kernels."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def candidates(dtype: torch.dtype, weights: str, shape: tuple[int, int]) -> list[Kernel]:
    """The kernels that can apply a map of `shape` on this CPU, the rule used before measurement first
    (`fixed_kernel`)."""
    if weights == "int4" and group_size(shape) is None:
        weights = "int8"  # a map 4-bit groups cannot hold keeps 8-bit weights
    own = [name for name in native.map_kernels(weights) if native.supports(shape, dtype, name)]
    if weights in ("int8", "int4"):
        return [Kernel(weights)] + [Kernel(name) for name in own]
    multis = ["linear", "packed"] if packing_available(dtype) else ["linear"]
    found = [Kernel(multi, one_row_mv=True) for multi in multis] + [Kernel(multi) for multi in multis + own]
    fixed = fixed_kernel(torch.device("cpu"), dtype, weights)
    return [fixed] + [k for k in found if k != fixed]


def fixed_kernel(device: torch.device, dtype: torch.dtype, weights: str) -> Kernel:
    """The rule before measurement: one row through torch.mv, more through oneDNN's packed kernel in
    bfloat16 (where oneDNN has it) and F.linear otherwise; 8-bit and 4-bit weights through torch's kernels."""
    if device.type != "cpu":
        return Kernel("linear")
    if weights in ("int8", "int4"):
        return Kernel(weights)
    packed = dtype == torch.bfloat16 and packing_available(dtype)
    return Kernel("packed" if packed else "linear", one_row_mv=True)


class LinearMap:
    """A linear map (weight [out, in], optional bias) applied by a chosen `Kernel`. `weight` stays the module's own
    tensor (the Core ML export and the fused modules read it); calls read what the kernel needs: the weight, its
    oneDNN-packed copy (a second copy of its bytes) or 8-bit weights with a scale per output channel in the activations'
    dtype (W8A16, rvqtts.engine.model.quantize). Off the CPU every call is F.linear in calls of exactly CHUNK rows
    (`device_choice`); while tracing, F.linear as it comes."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: Kernel,
        row_invariant: bool | None = None,
        bulk: Kernel | None = None,
    ):
        self._weight, self._parts, self.bias, self.kernel = weight, None, bias, kernel
        self.row_invariant = row_invariant  # as measured for the kernel at this shape (None: not probed)
        # A prompt's rows at once (`many`): F.linear over the module's weight where that was measured faster
        # at PROMPT_ROWS, else the kernel's own calls. No other call's bits need to match a prefill's.
        self.bulk = bulk if bulk == Kernel("linear") and kernel != bulk else kernel
        self.out_features = weight.shape[0]
        with torch.no_grad():
            if kernel.multi == "packed":
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
                self.operands = [packed]
                self.apply = lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
            elif kernel.multi == "int4" and (group := group_size(tuple(weight.shape))):
                values, scales_zeros = quantize_groups(weight, group)
                packed = torch._convert_weight_to_int4pack_for_cpu(values, 1)
                scales_zeros = scales_zeros.transpose(0, 1).contiguous().to(weight.dtype)  # [groups, out, 2]
                self.operands = [packed, scales_zeros]
                self.apply = lambda rows: self._biased(
                    torch._weight_int4pack_mm_for_cpu(rows, packed, group, scales_zeros)
                )
            elif kernel.multi in native.INT4_KINDS:
                group = group_size(tuple(weight.shape))
                values, scales_zeros = quantize_groups(weight, group)
                operands = [native.pack_int4(values), native.pack_group_scales(scales_zeros)]
                self.operands = operands
                self.apply = lambda rows: self._biased(native.apply_int4(kernel.multi, rows, *operands, group))
            elif kernel.multi in ("int8", "int4"):  # int4 here: a map 4-bit groups cannot hold keeps 8-bit weights
                qweight, scales = quantize_rows(weight)
                scales = scales.to(weight.dtype)
                self.operands = [qweight, scales]
                self.apply = lambda rows: self._biased(torch._weight_int8pack_mm(rows, qweight, scales))
            elif kernel.multi in native.KINDS:
                if kernel.multi.startswith("int8"):
                    qweight, scales = quantize_rows(weight)
                    operands = [native.pack(qweight, kernel.multi), scales.to(weight.dtype).float()]  # its scales
                else:
                    operands = [native.pack(weight)]
                self.operands = operands
                self.apply = lambda rows: self._biased(native.apply(kernel.multi, rows, *operands))
            else:
                self.operands = [weight]
                self.apply = lambda rows: F.linear(rows, weight, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The map's weight [out, in]: its own tensor, or its parts stacked again (`keep_parts`) when asked for."""
        return torch.cat(self._parts) if self._weight is None else self._weight

    @property
    def reads_weight(self) -> bool:
        """Whether a call on the CPU reads `weight` itself (F.linear, torch.mv, a prompt's F.linear), not a copy."""
        return self.operands[0] is self._weight or self.kernel.one_row_mv or self.bulk != self.kernel

    def unread(self) -> list[torch.Tensor]:
        """The weight tensors no call on the CPU reads (a packed or 8-bit copy serves them): their checkpoint pages,
        if any, need not stay resident (rvqtts.support.memory.drop_file_pages, once per runner)."""
        return [] if self.reads_weight else self._parts or [self._weight]

    def keep_parts(self, parts: list[torch.Tensor]) -> None:
        """Hold the weight as `parts` (the tensors it stacks, rows in order) where no call reads it: the stacked copy
        goes (1.8 GiB of q|k|v and gate|up at 1.7B), and `weight` stacks them again for the few that ask (the off-CPU
        path, tracing)."""
        if not self.reads_weight:
            self._weight, self._parts = None, parts

    def _biased(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias

    def reads(self) -> list[torch.Tensor]:
        """The tensors a call reads (a packed copy holds the weight's bytes in another order)."""
        if self.kernel.multi == "packed" or self.kernel.multi in native.KINDS and self.kernel.multi.startswith("bf16"):
            return (self._parts or [self._weight]) + ([] if self.bias is None else [self.bias])
        return self.operands + ([] if self.bias is None else [self.bias])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1 and self.kernel.one_row_mv and self.bias is None:
            return torch.mv(self.weight, rows[0]).view(*x.shape[:-1], self.out_features)
        if rows.shape[0] <= CHUNK:  # one call (a step or a round): no split
            out = self._chunk(rows)
        else:
            out = torch.cat([self._chunk(chunk) for chunk in rows.split(CHUNK)])
        return out.view(*x.shape[:-1], self.out_features)

    def many(self, x: torch.Tensor) -> torch.Tensor:
        """The map over a prompt's rows (a prefill) by the kernel measured for many rows (`bulk`)."""
        if self.bulk == self.kernel and x.device.type == "cpu":
            return self(x)
        return F.linear(x, self.weight, self.bias)

    def _chunk(self, rows: torch.Tensor) -> torch.Tensor:
        count = rows.shape[0]
        if count >= self.kernel.pad:
            return self.apply(rows.contiguous())
        padding = rows.new_zeros(self.kernel.pad - count, rows.shape[1])
        return self.apply(torch.cat([rows, padding]))[:count]


def rows_are_invariant(linear: LinearMap, generator: torch.Generator) -> bool:
    """Whether every row of a call of 2 to CHUNK + 1 rows gets the bits it gets in a call of its own."""
    weight = linear.weight
    x = torch.randn(CHUNK + 1, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    alone: list[torch.Tensor] = []  # each row's own call, made as the calls reach it (a variant kernel fails early)
    with torch.inference_mode():
        for count in range(2, len(x) + 1):
            alone += [linear(x[i : i + 1]) for i in range(len(alone), count)]
            if not torch.equal(linear(x[:count]), torch.cat(alone)):
                return False
    return True


def invariant_pad(weight: torch.Tensor, kernel: Kernel) -> int | None:
    """The smallest padding in PADS that makes `kernel`'s rows invariant for this weight, or None."""
    padded = (LinearMap(weight, None, replace(kernel, pad=pad)) for pad in PADS)
    return next((m.kernel.pad for m in padded if rows_are_invariant(m, torch.Generator().manual_seed(1))), None)


def timed_call(kernel: Kernel, count: int) -> Kernel:
    """The kernel as it runs a call of `count` rows: candidates that run the same code for a row count share
    one timing (a single row goes through torch.mv for every `mv+` kernel; padding acts only below it)."""
    if count == 1 and kernel.one_row_mv:
        return Kernel("linear", one_row_mv=True)
    return Kernel(kernel.multi, kernel.pad if count < kernel.pad else 1)


def time_kernels(
    weight: torch.Tensor, kernels: list[Kernel], rows: tuple[int, ...] = TIMED_ROWS
) -> dict[str, dict[int, float]]:
    """Milliseconds per call of each kernel at each row count: the median of passes over copies of `weight`
    that together exceed the caches (a loop's maps are read from memory, not from cache), the calls' passes
    interleaved so that a busy spell on a shared machine falls on all of them alike. A call that several
    kernels make alike (`timed_call`) is timed once, so they differ there by nothing, not by noise."""
    copies = max(2, min(64, -(-COLD_BYTES // (weight.numel() * weight.element_size()))))
    passes: dict[tuple[Kernel, int], list[float]] = {(timed_call(k, n), n): [] for n in rows for k in kernels}
    sources = [weight.clone() for _ in range(copies)]  # one set for every call: a first run's peak memory
    maps = {call: [LinearMap(source, None, call) for source in sources] for call, _ in passes}
    generator = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        inputs = {count: torch.randn(count, weight.shape[1], generator=generator).to(weight.dtype) for count in rows}
        for turn in range(TIMED_PASSES + 1):  # the first turn warms up
            for (call, count), times in passes.items():
                x, start = inputs[count], time.perf_counter()
                for linear in maps[call]:
                    linear(x)
                if turn:
                    times.append((time.perf_counter() - start) / copies)
    medians = {key: round(statistics.median(times) * 1e3, 4) for key, times in passes.items()}
    return {kernel.name: {count: medians[timed_call(kernel, count), count] for count in rows} for kernel in kernels}


@dataclass(frozen=True)
class KernelChoice:
    """The kernel a map shape runs with here, whether its rows are invariant, and what was measured:
    milliseconds per call by candidate and row count, and the candidates whose rows are invariant."""

    kernel: Kernel
    row_invariant: bool | None  # None: not probed (RVQTTS_CHOICES=fixed)
    timings: dict[str, dict[int, float]]
    invariant: tuple[str, ...]
    source: str  # "measured" now, "cache" (kernels.json), "fixed" (RVQTTS_CHOICES=fixed), or "device"
    bulk: Kernel | None = None  # a prompt's prefill: the kernel, or F.linear where faster at PROMPT_ROWS

    def record(self) -> dict:
        return {
            "kernel": self.kernel.name,
            "row_invariant": self.row_invariant,
            "invariant": list(self.invariant),
            "bulk": (self.bulk or self.kernel).name,
            "ms": {name: {str(k): v for k, v in t.items()} for name, t in self.timings.items()},
        }

    @classmethod
    def from_record(cls, record: dict) -> "KernelChoice":
        timings = {name: {int(k): float(v) for k, v in t.items()} for name, t in record["ms"].items()}
        kernel, bulk = Kernel.parse(record["kernel"]), Kernel.parse(record["bulk"])
        return cls(kernel, record["row_invariant"], timings, tuple(record["invariant"]), "cache", bulk)


def measure_choice(shape: tuple[int, int], dtype: torch.dtype, weights: str) -> KernelChoice:
    """Probe every candidate kernel for a CPU map of this shape: row invariance (with the padding that
    gives it), then cost: of the invariant ones, the fastest at one row (within STEP_TIE), then at 17."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    kernels, invariant = [], []
    for kernel in candidates(dtype, weights, shape):
        pad = invariant_pad(weight, kernel)
        kernels.append(replace(kernel, pad=pad or 1))
        if pad is not None:
            invariant.append(kernels[-1].name)
    timings = time_kernels(weight, kernels)
    pool = invariant or list(timings)
    step = min(timings[name][1] for name in pool)
    fastest = min((name for name in pool if timings[name][1] <= STEP_TIE * step), key=lambda name: timings[name][17])
    kernel = bulk = Kernel.parse(fastest)
    if weights == "native" and kernel != Kernel("linear"):  # a prompt's rows: the kernel or F.linear, timed
        prompt = time_kernels(weight, [kernel, Kernel("linear")], rows=(PROMPT_ROWS,))
        bulk = min((kernel, Kernel("linear")), key=lambda k: prompt[k.name][PROMPT_ROWS])
    return KernelChoice(kernel, bool(invariant), timings, tuple(invariant), "measured", bulk)


ISA_CAP_VARIABLES = ("RVQTTS_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # caps that change what runs


def machine_key() -> str:
    """What a kernel choice holds for: the CPU model, torch's version and its thread count, and any instruction-set
    cap in force (rvqtts.engine.model.native, torch's and oneDNN's: a capped machine measures its own choices)."""
    caps = "".join(f" | {name}={os.environ[name]}" for name in ISA_CAP_VARIABLES if os.environ.get(name))
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads{caps}"


def device_key(device: torch.device) -> str:
    """What a measurement on `device` holds for: this CPU's `machine_key`, or the GPU's name with torch's and CUDA's
    versions (another GPU in the same machine measures its own)."""
    if device.type == "cpu":
        return machine_key()
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} | torch {torch.__version__} | CUDA {torch.version.cuda}"
    return f"{device.type} | torch {torch.__version__}"


@functools.cache
def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (/proc/cpuinfo on Linux), else platform's."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():
                break
    name = fields.get("model name") or platform.processor() or platform.machine()
    numbers = "/".join(fields[k] for k in ("cpu family", "model") if k in fields)
    return f"{name} ({numbers})" if numbers else name


_chosen: dict[tuple[str, str], KernelChoice] = {}  # this process's choices, by machine and shape key


def kernel_choice(
    shape: tuple[int, int], dtype: torch.dtype, weights: str = "native", device: torch.device = torch.device("cpu")
) -> KernelChoice:
    """The kernel for a map of this shape: measured once per machine and kept in the user's cache."""
    if not measured_choices():
        return KernelChoice(fixed_kernel(device, dtype, weights), None, {}, (), "fixed")
    if one_row_count(device):
        return device_choice(shape, dtype, device)
    return choose_kernels([shape], dtype, weights)[shape]


def one_row_count(device: torch.device) -> bool:
    """Whether the hot loops' maps and norms run every call at one row count on `device`: off the CPU, whose own
    kernels are measured row-invariant as they are (`measure_choice`)."""
    return device.type != "cpu"


def device_choice(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> KernelChoice:
    """A map's kernel on a GPU (or another device): F.linear in calls of exactly CHUNK rows, the last padded with
    zero rows. A GPU's BLAS picks its algorithm, and so a row's summation order, by the call's shape, and extra rows
    cost it next to nothing: at one shape a plain step, a tree round and a batch's rows run alike. Probed for row
    invariance on the device once per process (a few dozen calls), as a CPU's kernels are."""
    key = (str(device), str(dtype), shape)
    if key not in _device_chosen:
        kernel = Kernel("linear", pad=CHUNK)
        weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        invariant = rows_are_invariant(LinearMap(weight, None, kernel), torch.Generator().manual_seed(1))
        _device_chosen[key] = KernelChoice(kernel, invariant, {}, (kernel.name,) if invariant else (), "device")
    return _device_chosen[key]


_device_chosen: dict[tuple[str, str, tuple[int, int]], KernelChoice] = {}  # this process's, by device


def measured_choices() -> bool:
    """Whether machine-dependent choices (kernels, dtype) are measured, or fixed (RVQTTS_CHOICES=fixed)."""
    return os.environ.get(CHOICES_VARIABLE, "measured") != "fixed"


def choose_kernels(
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    weights: str = "native",
    progress: Callable[[str], None] | None = None,
) -> dict[tuple[int, int], KernelChoice]:
    """Choices for these CPU map shapes: this process's, else the cache's, else measured now (under a lock,
    so processes starting together measure once) and saved."""
    machine = machine_key()
    keys = {shape: f"{str(dtype).removeprefix('torch.')}/{weights}/{shape[0]}x{shape[1]}" for shape in shapes}
    missing = {key: shape for shape, key in keys.items() if (machine, key) not in _chosen}
    if missing:
        fresh: dict[str, KernelChoice] = {}

        def measure(key: str) -> dict:
            shape = missing[key]
            if progress:
                progress(f"measuring this CPU's kernels for {shape[0]} x {shape[1]} {key.split('/')[0]} maps (once)")
            fresh[key] = measure_choice(shape, dtype, weights)
            return fresh[key].record()

        for key, record in cached_records(list(missing), measure).items():
            _chosen[machine, key] = fresh.get(key) or KernelChoice.from_record(record)
    return {shape: _chosen[machine, key] for shape, key in keys.items()}


def cached_records(keys: list[str], measure: Callable[[str], dict]) -> dict[str, dict]:
    """This machine's records of `keys` in the kernels' store, each one missing measured (`measure(key)`) and saved,
    under the measurements' lock (so processes starting together measure once): kernel choices, and the speech
    decoder's cost per dtype (rvqtts.qwen.decoder_dtype)."""
    with KERNELS.update() as machines:
        stored = machines.setdefault(machine_key(), {})
        for key in keys:
            if key not in stored:
                stored[key] = {**measure(key), "measured": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        return {key: stored[key] for key in keys}


def forget_choices(dtype: torch.dtype | None = None, weights: str | None = None) -> None:
    """Drop this machine's choices, for one dtype and weight format or all, here and in the cache file,
    so that the next call measures them anew."""
    prefix = "" if dtype is None else f"{str(dtype).removeprefix('torch.')}/{weights or ''}"
    machine = machine_key()
    for key in [k for k in _chosen if k[0] == machine and k[1].startswith(prefix)]:
        del _chosen[key]
    forget_records(prefix)


def forget_records(prefix: str) -> None:
    """Drop this machine's records whose keys start with `prefix` from the kernels' store (measured anew when next
    asked for)."""
    machine = machine_key()
    with KERNELS.update() as machines:
        if machine in machines:
            machines[machine] = {k: v for k, v in machines[machine].items() if not k.startswith(prefix)}


def in_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over x [n, ...] in calls of exactly CHUNK rows along its first dimension, the last padded with zero rows:
    a GPU's reductions (an RMSNorm's mean) lay out their threads by how many rows a call has, so a row is summed
    alike only at one row count (`device_choice` for the maps)."""
    count = x.shape[0]
    padded = -(-count // CHUNK) * CHUNK
    if padded != count:
        x = torch.cat([x, x.new_zeros(padded - count, *x.shape[1:])])
    return torch.cat([fn(chunk) for chunk in x.split(CHUNK)])[:count]


def make_map(weight: torch.Tensor, bias: torch.Tensor | None, weights: str = "native") -> LinearMap:
    """The map of `weight` with the kernel chosen for its shape, dtype and `weights` format here."""
    choice = kernel_choice(tuple(weight.shape), weight.dtype, weights, weight.device)
    return LinearMap(weight, bias, choice.kernel, choice.row_invariant, choice.bulk)


def module_map(linear: torch.nn.Linear, weights: str = "native") -> LinearMap:
    return make_map(linear.weight, linear.bias, weights)


def kernels_used(maps: list[LinearMap]) -> dict:
    """What a loop's maps run with (for the stats): maps per kernel, and whether every map's rows were
    measured invariant (None where some were not probed)."""
    probed = [linear.row_invariant for linear in maps]
    counts = Counter(linear.kernel.name for linear in maps)
    return {"maps": dict(sorted(counts.items())), "row_invariant": None if None in probed else all(probed)}
