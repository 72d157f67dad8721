"""rvqtts.support.measurements: every per-machine measurement read, merged and written by one function under one
lock."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from rvqtts.support.measurements import KERNELS, Measurements

HOLDER = """
import pathlib, sys, time
from rvqtts.support.measurements import Measurements
folder = pathlib.Path(sys.argv[1])
with Measurements("costs.json").update() as records:
    (folder / "holding").touch()
    while not (folder / "other-started").exists():
        time.sleep(0.01)
    time.sleep(0.5)  # the other process asks for the records meanwhile
    records["first"] = 1
"""

OTHER = """
import pathlib, sys
from rvqtts.support.measurements import Measurements
(pathlib.Path(sys.argv[1]) / "other-started").touch()
with Measurements("costs.json").update() as records:
    records["second"] = 2
"""


def test_processes_updating_together_keep_each_others_records(user_cache, tmp_path):
    """One process holds the records while another asks for them: the second waits and adds to the first's
    (without the lock it would read the file before the first wrote, and one of the two records would be lost)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)])
    deadline = time.monotonic() + 60
    while not (tmp_path / "holding").exists():
        assert holder.poll() is None and time.monotonic() < deadline, "the first process never took the records"
        time.sleep(0.01)
    other = subprocess.run([sys.executable, "-c", OTHER, str(tmp_path)], timeout=120)
    assert holder.wait(timeout=120) == 0 and other.returncode == 0
    assert json.loads((user_cache / "costs.json").read_text()) == {"first": 1, "second": 2}


def test_damaged_or_other_version_files_read_as_empty_and_a_failed_update_writes_nothing(user_cache):
    store = Measurements("costs.json")
    assert store.read() == {}  # missing
    user_cache.mkdir(parents=True)
    store.path.write_text("{not json")
    assert store.read() == {}
    with store.update() as records:
        records["a"] = 1
    assert store.read() == {"a": 1}
    with pytest.raises(RuntimeError), store.update() as records:
        records["b"] = 2
        raise RuntimeError("measuring failed")
    assert store.read() == {"a": 1}
    with KERNELS.update() as records:
        records["machine"] = {"shape": {"kernel": "linear"}}
    document = json.loads(KERNELS.path.read_text())
    assert document["format"] == "rvqtts-kernels" and document["version"] == KERNELS.version
    assert KERNELS.read() == {"machine": {"shape": {"kernel": "linear"}}}
    KERNELS.path.write_text(json.dumps({**document, "version": KERNELS.version - 1}))  # an older rvqtts's
    assert KERNELS.read() == {}
