"""This process's memory, as the stats (`--stats-json`), `rvqtts tune` and the server's /health report it: what is
resident now and the most that was resident at once (the peak a user's machine must have free)."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path
from typing import Iterable


def resident_mib() -> float | None:
    """Resident memory now, in MiB (Linux; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def peak_resident_mib() -> float:
    """The most memory this process has had resident at once, in MiB: Linux's VmHWM, else getrusage's ru_maxrss
    (bytes on macOS). On Linux ru_maxrss would also count the launching process's resident memory at the fork."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**10, 1)
    except (OSError, IndexError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def tensors_mib(tensors: Iterable) -> float:
    """MiB the tensors hold (None skipped): what a cache that grows by use adds to the resident memory."""
    return round(sum(t.numel() * t.element_size() for t in tensors if t is not None) / 2**20, 3)


def memory_record() -> dict:
    """Both figures, for a report's `memory` section."""
    return {"peak_rss_mib": peak_resident_mib(), "rss_mib": resident_mib()}


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter: blocks this large or larger are mapped apart from the heap
MEASURING_THRESHOLD = 1 << 20  # while measuring and loading: every weight-sized block apart, returned when freed
RUNNING_THRESHOLD = 32 << 20  # after: where glibc's own rule ends up (its maximum), the loops' blocks on the heap


@contextlib.contextmanager
def large_blocks_apart():
    """Measuring and loading with every block of a MiB or more mapped apart from glibc's heap, then the threshold where
    glibc's own rule would leave it (nothing elsewhere). By default the threshold rises with each large block freed, and
    later blocks of up to that size come from the heap, which keeps their pages when they are freed: measuring a
    model's kernels (hundreds of MiB of weight copies, made and freed) left a first run's peak 600 MiB above a cached
    run's at 0.6B, over stock qwen-tts's (docs/benchmarks.md). The loops then run as before: a threshold kept at a MiB
    mapped and faulted a batch's larger tensors afresh at every call."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        mallopt = None
    if mallopt:
        mallopt(M_MMAP_THRESHOLD, MEASURING_THRESHOLD)
    try:
        yield
    finally:
        if mallopt:
            mallopt(M_MMAP_THRESHOLD, RUNNING_THRESHOLD)


MADV_DONTNEED = 4  # Linux's madvise advice: drop the pages (a file's are read again from it on the next touch)


def drop_file_pages(tensors: list) -> int:
    """Drop from resident memory the pages of `tensors` that are views of a memory-mapped file (a checkpoint loaded
    in its stored dtype), once the engine holds its own copy of what its calls read (docs/benchmarks.md). Only
    tensors whose pages are all still the file's own are dropped (Linux's pagemap says which), so anything that
    reads them again reads the file's bytes. Linux only; returns the bytes dropped."""
    import ctypes

    import numpy as np

    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    mapped = [  # mappings of files: (start, end)
        tuple(int(value, 16) for value in fields[0].split("-"))
        for fields in map(str.split, lines)
        if len(fields) >= 6 and fields[5].startswith("/")
    ]
    libc, page, dropped = ctypes.CDLL(None, use_errno=True), os.sysconf("SC_PAGE_SIZE"), 0
    with contextlib.suppress(OSError), open("/proc/self/pagemap", "rb") as pagemap:
        for tensor in tensors:
            if tensor.device.type != "cpu":
                continue
            address = tensor.data_ptr()
            first = -(-address // page) * page  # whole pages inside the tensor only
            last = (address + tensor.numel() * tensor.element_size()) // page * page
            if last <= first or not any(start <= first and last <= end for start, end in mapped):
                continue
            pagemap.seek(first // page * 8)
            entries = np.frombuffer(pagemap.read((last - first) // page * 8), dtype=np.uint64)
            present, from_file = (entries >> np.uint64(63)) & np.uint64(1), (entries >> np.uint64(61)) & np.uint64(1)
            if np.any(present & (np.uint64(1) - from_file)):  # a page copied on write: its bytes are not the file's
                continue
            if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) == 0:
                dropped += last - first
    return dropped
