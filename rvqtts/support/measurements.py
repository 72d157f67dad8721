"""The measurements rvqtts keeps per user and machine (docs/usage.md, "Choices measured on your machine"): one JSON
file per kind in the user's cache (rvqtts.support.files.cache_dir), each read by `Measurements.read` (a missing, damaged
or other-version file reads as empty: measured anew) and changed only inside `Measurements.update`, under one lock for
them all, so processes starting together measure once and never lose one another's records, and a reader never
sees half a file. A cache that cannot be written keeps them in memory for the process (files.write_cache). (Native
builds and Core ML packages are files of their own, each written atomically by name: files.cache_file.)"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

from rvqtts.support.files import cache_dir, read_cache, unsaved, write_cache, write_json


@dataclass(frozen=True)
class Measurements:
    """One file of measurements in the user's cache: a JSON object of records (versioned: wrapped with its format
    and version, and read as empty under another version)."""

    file: str
    version: int | None = None
    folder: Path | None = None  # None: the user's cache as it is when read or written

    @property
    def path(self) -> Path:
        return (self.folder or cache_dir()) / self.file

    @property
    def kept(self) -> str:
        """Where the records are kept, as notices say it: in their file, or for this run only where the cache
        could not be written (files.write_cache)."""
        return "kept for this run only" if unsaved(self.path) else f"kept in {self.path}"

    def at(self, folder: Path) -> "Measurements":
        """The same measurements in `folder`: a run that saves later saves where it read."""
        return replace(self, folder=folder)

    @property
    def format(self) -> str:
        return "rvqtts-" + self.file.removesuffix(".json")

    def read(self) -> dict:
        """The records; empty where the file is missing, damaged or of another version (measured anew)."""
        data = read_cache(self.path)
        if self.version is None:
            return data
        records = data.get("records")
        valid = data.get("format") == self.format and data.get("version") == self.version
        return records if valid and isinstance(records, dict) else {}

    @contextlib.contextmanager
    def update(self, asked: bool = False) -> Iterator[dict]:
        """The records, read under the measurements' lock for the caller to change in place, then written back
        whole if they changed (nothing written if the block raises). A cache that cannot be written keeps them in
        memory, unless the user `asked` for the write (`bench speedup --save`): then its OSError is raised."""
        with measurements_lock(self.path.parent):
            records = self.read()
            before = copy.deepcopy(records)
            yield records
            if records != before:
                wrapped = {"format": self.format, "version": self.version, "records": records}
                (write_json if asked else write_cache)(self.path, records if self.version is None else wrapped)


@contextlib.contextmanager
def measurements_lock(folder: Path | None = None) -> Iterator[None]:
    """An exclusive lock beside the measurements in `folder` (None: the user's cache), where the platform has fcntl,
    held while one process reads, measures and writes them."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path = (folder or cache_dir()) / "measurements.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:  # an unwritable cache: measure without a lock (and keep what is measured in memory)
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# Each map shape's kernel and the speech decoder's cost per dtype, by machine (rvqtts.engine.model.kernels,
# rvqtts.qwen.decoder_dtype). Versions: 2: rvqtts's own kernel among the candidates; 3: the prompt kernel; 4: its AMX
# kernels; 5: its AVX2 kernels (older choices measured anew); 6: the AVX2 int8 kernel's even and odd sums; 7: kept in
# one store (rvqtts.support.measurements)
KERNELS = Measurements("kernels.json", version=7)
CALL_COSTS = Measurements("call-costs.json")  # predictor calls per query length and rows, by machine (engine.online)
ACCEPTANCE = Measurements("acceptance-online.json")  # by model, drafter and sampling (rvqtts.engine.speculative.online)
BATCH_SIZES = Measurements("batch-sizes.json")  # a frame's cost per batch size, by machine and model (batch_size)
BEST_TREES = Measurements("best-n.json")  # `bench speedup --save`'s best tree size, by platform (engine.tree)
