"""rvqtts's native CPU kernels (native.cpp), for x86-64 CPUs with AVX2 and FMA (AVX512-BF16 and AMX where the CPU has
them): a few rows through a linear map with weights packed once, and the row-wise steps of a layer (RMSNorm, q/k
norms with RoPE, attention, whole layers) that torch runs as dozens of small operations. Each output is one fixed
sequence of operations whatever the call's rows or threads, so rows are invariant by construction (and still probed,
like every candidate, by rvqtts.engine.model.kernels). The library is compiled once per machine and level into the
user's cache and loaded with ctypes; where it cannot be, torch's kernels run and `unavailable()` says why.
docs/engine.md, "The native library"."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from rvqtts.support.files import cache_file

SOURCE = Path(__file__).with_name("native.cpp")
# No contraction: a multiply then an add stay two roundings wherever they are written, so both levels' builds compute
# the same bits (fused multiply-adds are written out where wanted).
FLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp")
# RVQTTS_SANITIZE=address builds the library with AddressSanitizer, for tests: every read or write out of bounds aborts
# with its place (run Python with the compiler's libasan preloaded, ASAN_OPTIONS=detect_leaks=0; tests/test_native.py).
SANITIZE_VARIABLE = "RVQTTS_SANITIZE"
SANITIZERS = {"address": ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")}


class Level(NamedTuple):
    """A level the library is built at: the CPU flags it needs, its compiler flags and the map kernels it builds."""

    cpu_flags: tuple[str, ...]
    compiler_flags: tuple[str, ...]
    kernels: tuple[str, ...]


# The levels, best first (the AVX-512 build has the AVX2 kernels too, so that every machine with AVX-512 tests them).
LEVELS = {
    "avx512": Level(
        ("avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_bf16"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vbmi", "-mavx512bf16", "-mfma"),
        ("bf16dot", "int8dot", "int4dot", "bf16amx", "int8amx", "bf16avx2", "int8avx2", "int4avx2"),
    ),
    "avx2": Level(("avx2", "fma"), ("-mavx2", "-mfma"), ("bf16avx2", "int8avx2", "int4avx2")),
}
BLOCK = 16  # output channels per vector: a map's output count must be a multiple
MAX_HEAD_DIM = 1024  # attention_inputs' scratch row


KINDS = {"bf16dot": 0, "int8dot": 1, "bf16amx": 2, "int8amx": 3, "bf16avx2": 4, "int8avx2": 5}  # the library's numbers
INT4_KINDS = {"int4dot": 0, "int4avx2": 1}  # 4-bit maps: their own entry point's numbers (rvqtts_map_int4)
AMX_FLAGS = ("amx_tile", "amx_bf16")
ISA_VARIABLE = "RVQTTS_ISA"
# Each cap and the CPU flag prefixes it hides ("none": no native kernel at all, as on a CPU without AVX2).
ISA_CAPS = {"avx2": ("avx512", "amx"), "avx512": ("amx",), "none": ("avx", "fma", "amx")}
AMX_CHUNK = 32  # inputs per tile multiply: an AMX map's input count must be a multiple


def supports(shape: tuple[int, int], dtype: torch.dtype, kind: str) -> bool:
    """Whether a map of this [out, in] shape and activation dtype can run here by kernel `kind`."""
    out_features, in_features = shape
    return (
        dtype == torch.bfloat16
        and out_features % BLOCK == 0
        and in_features % (AMX_CHUNK if kind.endswith("amx") else 4 if kind == "int8dot" else 2) == 0
        and runs(kind)
    )


def runs(kind: str) -> bool:
    """Whether kernel `kind` runs here: built at this level, and the CPU (and Linux) let its instructions run."""
    return kind in built_kernels() and (amx_unavailable() if kind.endswith("amx") else unavailable()) is None


def map_kernels(weights: str) -> tuple[str, ...]:
    """The library's map kernels a map of `weights` (--weights: "native", the model's own, "int8" or "int4") may
    choose from here: those of the level built (none where the library does not run), the AVX2 ones only at the AVX2
    level (above it, VDPBF16PS does their work in a quarter of the instructions)."""
    return tuple(
        name
        for name in built_kernels()
        if kernel_weights(name) == weights and (level() == "avx2" or name not in LEVELS["avx2"].kernels)
    )


def kernel_weights(name: str) -> str:
    """The --weights a map kernel reads: "int8" or "int4" for those, "native" for those over the model's bfloat16."""
    return name[:4] if name.startswith(("int8", "int4")) else "native"


def built_kernels() -> tuple[str, ...]:
    """The map kernels the library here has (none where it does not run)."""
    return LEVELS[level()].kernels if level() else ()


def unavailable() -> str | None:
    """Why the kernel cannot run on this machine, or None where it can."""
    return _load()[1]


def level() -> str | None:
    """The instruction-set level the library is built at here (a key of `LEVELS`), or None where it does not run."""
    return _load()[3]


def amx_unavailable() -> str | None:
    """Why the AMX kernels cannot run here (no AMX, or Linux did not grant its tile data), or None."""
    return unavailable() or _load()[2]


PAIRS = {torch.bfloat16: torch.int32, torch.int8: torch.int16}  # a weight dtype, and the dtype of two of it


def pack(weight: torch.Tensor, kind: str | None = None) -> torch.Tensor:
    """Weights [out, in] (bfloat16 or int8) in the kernels' order [out/16, in/2, 16, 2]: a pair of inputs per output
    channel, 16 channels a block. For kernel `int8dot`, its groups instead: int8 weights in [-127, 127] as
    sign-magnitude bytes (0x80 | |w| for negative w), each block's pairs p and p + 1 (p even) one 64-byte group with
    channels 0-3 of pair p, then of pair p + 1, then channels 4-7 of each, and so on (native.cpp, `widen_group`).
    Each pair of inputs moves as one element of twice the width: torch copies it 6.5x faster than rows of two
    (bfloat16, 2-vCPU Xeon)."""
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    if kind == "int8dot":  # quantize_rows's weights: -128 never comes (its magnitude would read as 0)
        weight = (weight.abs().view(torch.uint8) | (weight.view(torch.uint8) & 0x80)).view(torch.int8)
        pairs = weight.view(PAIRS[weight.dtype])  # [out, in/2]
        # [blocks, channel / 4, channel % 4, group, pair in group] -> the groups' order
        order = pairs.reshape(out_features // BLOCK, 4, 4, in_features // 4, 2).permute(0, 3, 1, 4, 2)
    else:
        pairs = weight.view(PAIRS[weight.dtype])  # [out, in/2]
        order = pairs.reshape(out_features // BLOCK, BLOCK, in_features // 2).transpose(1, 2)
    return order.contiguous().view(weight.dtype).reshape(out_features // BLOCK, in_features // 2, BLOCK, 2)


def apply(kind: str, rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, in] bfloat16 (contiguous) through packed weights by kernel `kind` (`KINDS`; the int8 ones
    with float32 scales [out]): [M, out] bfloat16."""
    if not runs(kind):
        why = unavailable() or (amx_unavailable() if kind.endswith("amx") else None) or f"built for {level()}"
        raise ValueError(f"rvqtts's {kind} kernel does not run here ({why})")
    out = rows.new_empty(rows.shape[0], packed.shape[0] * BLOCK)
    _load()[0].rvqtts_map(
        KINDS[kind],
        rows.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        packed.data_ptr(),
        _address(scales),
        out.shape[1],
        out.data_ptr(),
    )
    return out


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in] (0 .. 15, rvqtts.engine.model.quantize.quantize_groups) in `int4dot`'s order
    [out/16, in/2, 16] uint8: per block of 16 output channels and pair of inputs, a byte per channel, its low nibble
    the pair's first input, its high nibble the second."""
    out_features, in_features = values.shape
    nibbles = values.to(torch.uint8)
    paired = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # [out, in/2]
    return paired.reshape(out_features // BLOCK, BLOCK, in_features // 2).transpose(1, 2).contiguous()


def pack_group_scales(scales_zeros: torch.Tensor) -> torch.Tensor:
    """Groups' scales and zeros [out, groups, 2] as `int4dot` reads them: [out/16, groups, 2, 16] float32."""
    out_features, groups, _ = scales_zeros.shape
    blocks = scales_zeros.float().reshape(out_features // BLOCK, BLOCK, groups, 2)
    return blocks.permute(0, 2, 3, 1).contiguous()


def apply_int4(
    kind: str, rows: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """rows [M, in] bfloat16 (contiguous) through 4-bit weights (`pack_int4`, `pack_group_scales`) in groups of
    `group` inputs by kernel `kind` (`INT4_KINDS`): [M, out] bfloat16."""
    if not runs(kind):
        raise ValueError(f"rvqtts's {kind} kernel does not run here ({unavailable() or f'built for {level()}'})")
    out = rows.new_empty(rows.shape[0], packed.shape[0] * BLOCK)
    operands = (rows.data_ptr(), rows.shape[0], rows.shape[1], packed.data_ptr(), scales_zeros.data_ptr(), group)
    _load()[0].rvqtts_map_int4(INT4_KINDS[kind], *operands, out.shape[1], out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """qwen-tts's RMSNorm over the last dimension of bfloat16 x (any leading shape)."""
    rows = x.contiguous()
    out = torch.empty_like(rows)
    _load()[0].rvqtts_rms_norm(
        rows.data_ptr(), rows.numel() // rows.shape[-1], rows.shape[-1], weight.data_ptr(), eps, out.data_ptr()
    )
    return out


def attention_inputs(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write: slice | torch.Tensor,
) -> torch.Tensor:
    """A fused q|k|v map's output [q, width] to queries [heads, q, d], and its keys and values into a
    layer's caches [kv_heads, length, d] (contiguous) at the slots `write` (a slice, or a tensor of slot
    indices): the q/k RMSNorms, then RoPE with cos, sin [q, d] (bfloat16, contiguous)."""
    rows, head_dim = qkv.shape[0], cos.shape[-1]
    q = qkv.new_empty(heads, rows, head_dim)
    slots, start = _write_slots(write)  # held through the call
    outside = _load()[0].rvqtts_attention_inputs(
        qkv.data_ptr(),
        rows,
        heads,
        kv_heads,
        head_dim,
        q_weight.data_ptr(),
        k_weight.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        eps,
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        _address(slots),
        start,
    )
    _check_slots(outside, k_cache.shape[1], write)
    return q


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    width: int,
    slots: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries q [heads, n, d] over a layer's cache [kv_heads, length, d] (bfloat16, contiguous): query r
    over `width` slots, `slots[r]` [n, width] where given (else the first `width`), those where
    `visible[r]` [n, width] is true (all where None), scores and softmax in float32. Returns [heads, n, d],
    a view of [n, heads, d] memory (what the output map reads, with no copy)."""
    heads, n, head_dim = q.shape
    q = q.contiguous()
    out = q.new_empty(n, heads, head_dim)
    slots, visible = _slot_list(slots), _bytes(visible)  # held in names until the call returns
    outside = _load()[0].rvqtts_attend(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        n,
        heads,
        k_cache.shape[0],
        head_dim,
        k_cache.shape[1],
        _address(slots),
        width,
        _address(visible),
        head_dim**-0.5,
        out.data_ptr(),
    )
    _check_slots(outside, k_cache.shape[1], slots if slots is not None else slice(0, width))
    return out.transpose(0, 1)


def silu_times_up(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation of the fused gate|up map's output [q, 2 n]: silu(gate) * up [q, n], rounded
    as torch's bfloat16 operations round (the exponential is this library's own)."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    _load()[0].rvqtts_silu_times_up(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def draw(
    logits: torch.Tensor,  # [rows, vocab] bfloat16 or float32
    noise: torch.Tensor,  # [sources, vocab] float32
    temperatures: list[float],  # [rows]: 0 draws greedily
    top_ks: list[int],  # [rows]: 0 keeps every code
    noise_rows: torch.Tensor | None = None,  # [rows]: row r's noise is noise[noise_rows[r]] (None: noise[r])
) -> tuple[torch.Tensor, torch.Tensor]:  # codes [rows] int64, finite [rows] bool
    """Each row's code drawn as rvqtts.engine.model.sampling draws it with torch's operations (top-p off), bit for
    bit, in one call: the dozen small operations of a draw cost more than the work where a pass over the weights has
    just left the caches cold."""
    logits, noise = logits.contiguous(), noise.contiguous()
    rows, vocab = logits.shape
    sources = noise.shape[0] if noise.dim() == 2 and noise.shape[1] == vocab else 0
    uncovered = ValueError(f"noise {list(noise.shape)} does not cover {rows} rows of {vocab} codes by its row indices")
    if noise_rows is not None and noise_rows.shape != (rows,):
        raise uncovered
    codes = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.bool)
    index = _slot_list(noise_rows)  # held through the call
    outside = _load()[0].rvqtts_draw(
        logits.data_ptr(),
        int(logits.dtype == torch.bfloat16),
        rows,
        vocab,
        noise.data_ptr(),
        sources,
        _address(index),
        (ctypes.c_float * rows)(*temperatures),
        (ctypes.c_int64 * rows)(*top_ks),
        codes.data_ptr(),
        finite.data_ptr(),
    )
    if outside:  # a caller's bug; the library read nothing outside the noise (it checks the indices first)
        raise uncovered
    return codes, finite


def layer_maps(maps: list) -> tuple | None:
    """A layer's q|k|v, output, gate|up and down maps (rvqtts.engine.model.kernels.LinearMap) as `layer` takes them, or
    None where they do not all run this library's kernel in one weight format, without biases."""
    kinds = {linear.kernel.multi for linear in maps}
    if len(kinds) != 1 or kinds & set(INT4_KINDS) or not all(map(runs, kinds)):
        return None
    if any(linear.bias is not None for linear in maps):
        return None
    kind = kinds.pop()
    int8 = kind.startswith("int8")
    return (
        (ctypes.c_void_p * 4)(*[linear.operands[0].data_ptr() for linear in maps]),
        (ctypes.c_void_p * 4)(*[linear.operands[1].data_ptr() if int8 else None for linear in maps]),
        (ctypes.c_int64 * 4)(*[linear.out_features for linear in maps]),
        KINDS[kind],
    )


def layer(
    x: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    maps: tuple,
    shape: tuple[int, int, int],
    qk_norms: tuple[torch.Tensor, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    write: slice | torch.Tensor,
    width: int,
    slots: torch.Tensor | None,
    visible: torch.Tensor | None,
) -> None:
    """One decoder layer over bfloat16 states x [q, hidden] (contiguous; updated in place) in one call,
    computing what the calls above compute step by step, bit for bit: `maps` from `layer_maps`, `shape`
    (heads, kv_heads, head_dim), keys and values written to the caches at `write`, attention as
    `attend`, the MLP through `silu_times_up`."""
    rows, hidden = x.shape
    heads, kv_heads, head_dim = shape
    packed, scales, widths, kind = maps
    (write_slots, start), slots, visible = _write_slots(write), _slot_list(slots), _bytes(visible)
    k_cache, v_cache = caches
    outside = _load()[0].rvqtts_layer(
        x.data_ptr(),
        rows,
        hidden,
        norms[0].data_ptr(),
        norms[1].data_ptr(),
        eps,
        packed,
        scales,
        widths,
        kind,
        heads,
        kv_heads,
        head_dim,
        qk_norms[0].data_ptr(),
        qk_norms[1].data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        _address(write_slots),
        start,
        width,
        _address(slots),
        _address(visible),
        head_dim**-0.5,
    )
    _check_slots(outside, k_cache.shape[1], write, slots)


def _check_slots(outside: int, length: int, *slots: slice | torch.Tensor | None) -> None:
    """Raise where the library found a cache slot outside the `length` slots of the caches (it wrote nothing):
    a layout built for other caches, a bug, never to be run past."""
    if outside:
        spans = [
            (s.start, s.stop - 1) if isinstance(s, slice) else (int(s.min()), int(s.max()))
            for s in slots
            if s is not None
        ]
        raise IndexError(f"cache slots {spans} (first, last) outside a cache of {length} slots")


def _write_slots(write: slice | torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """Cache slots to write as the library takes them: slot indices (int64), or none and the first slot."""
    return (None, write.start) if isinstance(write, slice) else (_slot_list(write), 0)


def _slot_list(slots: torch.Tensor | None) -> torch.Tensor | None:
    return None if slots is None else slots.to(torch.int64).contiguous()


def _bytes(visible: torch.Tensor | None) -> torch.Tensor | None:
    """A boolean mask as the library's bytes (a bool tensor's own bytes: no copy)."""
    return None if visible is None else visible.to(torch.bool).contiguous().view(torch.uint8)


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def isa_cap() -> str | None:
    """The instruction set $RVQTTS_ISA caps rvqtts at (None: what the CPU has); a value it does not know is an
    error that says what to set."""
    cap = os.environ.get(ISA_VARIABLE, "").strip().lower() or None
    if cap is not None and cap not in ISA_CAPS:
        raise ValueError(f"{ISA_VARIABLE}={cap!r}: choose {' or '.join(ISA_CAPS)}, or unset it for what the CPU has")
    return cap


def capped_flags(flags: set[str]) -> set[str]:
    """The CPU flags rvqtts may use: all of `flags`, less those above $RVQTTS_ISA's cap."""
    hidden = ISA_CAPS.get(isa_cap(), ())
    return {flag for flag in flags if not flag.startswith(hidden)} if hidden else set(flags)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None, str | None, str | None]:
    """The built library, or None and why not; why its AMX kernels cannot run, or None; and its level (once per
    process: a process must ask Linux for AMX's tile data before its first tile instruction)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the CPU is {platform.machine()}, not x86-64", None, None
    try:
        isa_cap()
    except ValueError as error:
        return None, str(error), None, None
    flags = cpu_flags()
    built = next((name for name, at in LEVELS.items() if all(flag in flags for flag in at.cpu_flags)), None)
    capped = f" (capped at {isa_cap()} by {ISA_VARIABLE})" if isa_cap() else ""
    if built is None:
        missing = [flag for flag in LEVELS["avx2"].cpu_flags if flag not in flags]
        return None, f"the CPU lacks {', '.join(missing)}{capped}: torch's kernels run instead", None, None
    try:
        library = ctypes.CDLL(str(_build(built)))
    except (OSError, RuntimeError) as error:
        return None, str(error), None, None
    _declare(library)
    amx_missing = [flag for flag in AMX_FLAGS if flag not in flags]
    if built != "avx512" or amx_missing:
        return library, None, f"the CPU lacks {', '.join(amx_missing or ['avx512_bf16'])}{capped}", built
    denied = library.rvqtts_amx_permit() != 0
    why = "Linux did not grant AMX tile data to this process (arch_prctl ARCH_REQ_XCOMP_PERM)" if denied else None
    return library, None, why, built


# Each function's arguments, as native.cpp declares them: p a pointer, s an int64, f a float, i an int.
SIGNATURES = {
    "rvqtts_map": "ipssppsp",
    "rvqtts_map_int4": "ipsspppsp",
    "rvqtts_rms_norm": "psspfp",
    "rvqtts_attention_inputs": "pssssppppfpppsps",
    "rvqtts_attend": "pppssssspspfp",
    "rvqtts_silu_times_up": "pssp",
    "rvqtts_layer": "pssppfpppisssppppppspssppf",
    "rvqtts_draw": "pisspsppppp",
}
# 1: an index out of bounds (a cache slot, a noise row), nothing written
CHECKED = ("rvqtts_attention_inputs", "rvqtts_attend", "rvqtts_layer", "rvqtts_draw", "rvqtts_map_int4")
_TYPES = {"p": ctypes.c_void_p, "s": ctypes.c_int64, "f": ctypes.c_float, "i": ctypes.c_int}


def _declare(library: ctypes.CDLL) -> None:
    """The library's functions' argument and result types (`SIGNATURES`)."""
    for name, arguments in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = [_TYPES[a] for a in arguments]
        function.restype = ctypes.c_int if name in CHECKED else None
    library.rvqtts_amx_permit.restype = ctypes.c_int


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """This CPU's flags (/proc/cpuinfo, or the text `cpuinfo`; none off Linux), as far as $RVQTTS_ISA lets rvqtts
    use them."""
    if cpuinfo is None:
        with contextlib.suppress(OSError):
            cpuinfo = Path("/proc/cpuinfo").read_text()
    line = next((line for line in (cpuinfo or "").splitlines() if line.startswith("flags")), "")
    return capped_flags(set(line.partition(":")[2].split()))


@functools.cache
def source_digest() -> str:
    """A short digest of the library's source: measurements that depend on its kernels' speed name it."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8]


def sanitizer_flags() -> tuple[str, ...]:
    """The compiler flags of the sanitizer $RVQTTS_SANITIZE names (none where unset)."""
    name = os.environ.get(SANITIZE_VARIABLE, "")
    if name and name not in SANITIZERS:
        raise RuntimeError(f"{SANITIZE_VARIABLE}={name!r}: choose {' or '.join(SANITIZERS)}, or unset it")
    return SANITIZERS.get(name, ())


def _build(at: str) -> Path:
    """The library compiled at level `at` in the cache (a folder of this process's own where the cache cannot be
    written: files.cache_file), built now if this source, level and compiler have not been built."""
    compiler = os.environ.get("CXX") or next(filter(None, map(shutil.which, ("g++", "c++", "clang++"))), None)
    if not compiler:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    flags = (*FLAGS, *LEVELS[at].compiler_flags, *sanitizer_flags())
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    target = cache_file("build", f"native-{at}-{digest}.so")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        try:
            result = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=300
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {error}") from error
        if result.returncode:
            last = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {last}")
        os.replace(built, target)  # atomic: processes building together each leave a whole library
    return target
