"""This process's memory, as the stats (`--stats-json`), `rvqtts tune` and the server's /health report it: what is
resident now and the most that was resident at once (the peak a user's machine must have free)."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path


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


def memory_record() -> dict:
    """Both figures, for a report's `memory` section."""
    return {"peak_rss_mib": peak_resident_mib(), "rss_mib": resident_mib()}
