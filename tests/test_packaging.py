"""The wheel holds every package and the data the code reads; scripts/wheel-check.sh (run by .ci/run) installs it
outside the checkout and runs it."""

from pathlib import Path

import pytest

from rvqtts.engine.speculative.offsets import SHIPPED_OFFSETS
from rvqtts.engine.speculative.tree import SHIPPED_TREES

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_of_the_source_tree():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "rvqtts").rglob("__init__.py")}
    data = set(setuptools["package-dir"]) - {""}
    assert set(setuptools["packages"]) == on_disk | data


def test_shipped_trees_and_offsets_are_found_through_the_package():
    assert (SHIPPED_TREES / "best-n.json").is_file() and (SHIPPED_TREES / "prior-acceptance.json").is_file()
    assert list(SHIPPED_OFFSETS.glob("*.safetensors"))
