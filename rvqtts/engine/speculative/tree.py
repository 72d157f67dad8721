"""Sparse draft trees: rank paths, their JSON files, the buffers a round needs, and greedy growth.

A node is a rank path (r_1, ..., r_d): the rank-r_1 draft for the first code after the root, then the
rank-r_2 draft for the next one, and so on. A tree is a set of such paths closed under prefixes, with
N nodes and depth at most K (the number of drafted codes). The root, the code sampled last round, is
not a node. Like Medusa's `generate_medusa_buffers`, the runner derives from a tree the attention
mask, the depth (position offset) of every query slot and, for the walk, each node's children.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from rvqtts.support.files import read_json, read_records, write_atomically, write_json
from rvqtts.support.measurements import BEST_TREES

TREE_FORMAT = "rvqtts-tree"
Path_ = tuple[int, ...]


class TreeFileError(ValueError):
    """A tree file that cannot be used; the message names the file and the fault."""


@dataclass(frozen=True)
class Tree:
    """A prefix-closed set of rank paths in breadth-first order (shorter first, then lexicographic)."""

    paths: tuple[Path_, ...]
    source: str = ""
    expected_codes_per_call: float | None = None
    depth_limit: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problem = tree_problem(self.paths, self.depth_limit)
        if problem:
            raise ValueError(problem)
        object.__setattr__(self, "paths", tuple(sorted(self.paths, key=lambda p: (len(p), p))))

    @property
    def nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    def truncated(self, max_depth: int) -> "Tree":
        """The subtree of nodes at depth <= max_depth (drafts never pass the frame's last code)."""
        if max_depth >= self.depth:
            return self
        return Tree(tuple(p for p in self.paths if len(p) <= max_depth), self.source)

    def max_rank_by_depth(self) -> list[int]:
        """How many ranked drafts each depth needs: 1 + the largest rank used there."""
        return [1 + max(p[-1] for p in self.paths if len(p) == d) for d in range(1, self.depth + 1)]

    @cached_property
    def buffers(self) -> "TreeBuffers":
        return TreeBuffers.from_tree(self)


@dataclass(frozen=True)
class TreeBuffers:
    """What one round needs, per slot of the query [root, node_1, ..., node_N] (the root's rank and parent: -1)."""

    depth: torch.Tensor  # the position offset from the root
    rank: list[int]  # the node's rank at its depth
    parent: list[int]  # the parent's slot
    ancestor_mask: torch.Tensor  # [i, j]: slot i may attend to slot j (j is i or an ancestor of i)
    children: list[list[tuple[int, int]]]  # (rank, child slot) pairs, for walking the tree

    @classmethod
    def from_tree(cls, tree: Tree) -> "TreeBuffers":
        slots = ((), *tree.paths)
        slot = {path: i for i, path in enumerate(slots)}
        parent = [-1] + [slot[p[:-1]] for p in tree.paths]
        rank = [-1] + [p[-1] for p in tree.paths]
        children = [[(rank[j], j) for j in range(1, len(slots)) if parent[j] == i] for i in range(len(slots))]
        mask = torch.tensor([[path[: len(other)] == other for other in slots] for path in slots])
        depth = torch.tensor([0] + [len(p) for p in tree.paths], dtype=torch.long)
        return cls(depth=depth, rank=rank, parent=parent, ancestor_mask=mask, children=children)


def tree_problem(paths: tuple[Path_, ...] | list, depth_limit: int | None = None) -> str | None:
    """Why `paths` is not a valid tree, or None."""
    seen: set[Path_] = set()
    for path in paths:
        if (
            not isinstance(path, tuple)
            or not path
            or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)
        ):
            return f"node {list(path) if isinstance(path, tuple) else path!r} is not a non-empty list of ranks >= 0"
        if path in seen:
            return f"node {list(path)} appears twice"
        seen.add(path)
        if depth_limit is not None and len(path) > depth_limit:
            return f"node {list(path)} has depth {len(path)}, above the tree's depth K = {depth_limit}"
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            return f"not closed under prefixes: node {list(path)} has no parent {list(path[:-1])}"
    return None


def load_tree(path: str | os.PathLike) -> Tree:
    """Read and validate a tree file; every fault raises TreeFileError naming the file."""
    path = Path(path)
    data = read_json(path, "tree file", TreeFileError)
    if not isinstance(data, dict) or data.get("format") != TREE_FORMAT:
        raise TreeFileError(f'tree file {path} is not an rvqtts tree (expected "format": "{TREE_FORMAT}")')
    raw = data.get("paths")
    if not isinstance(raw, list) or not raw:
        raise TreeFileError(f'tree file {path} has no "paths" list of nodes')
    paths = tuple(tuple(p) if isinstance(p, list) else p for p in raw)
    depth = data.get("depth")
    if not isinstance(depth, int) or depth < 1:
        raise TreeFileError(f'tree file {path} needs "depth" (K, a positive integer), got {depth!r}')
    problem = tree_problem(paths, depth)
    if problem:
        raise TreeFileError(f"tree file {path}: {problem}")
    if data.get("nodes") != len(paths):
        raise TreeFileError(f'tree file {path} says "nodes": {data.get("nodes")!r} but lists {len(paths)} paths')
    known = {"format", "version", "paths", "depth", "nodes", "source", "expected_codes_per_call"}
    return Tree(
        paths,
        source=str(data.get("source", "")),
        expected_codes_per_call=data.get("expected_codes_per_call"),
        depth_limit=depth,
        extra={k: v for k, v in data.items() if k not in known},
    )


def save_tree(tree: Tree, path: str | os.PathLike) -> None:
    """Write a tree file (atomically: a temporary file, then a rename)."""
    header = {
        "format": TREE_FORMAT,
        "version": 1,
        "nodes": tree.nodes,
        "depth": tree.depth_limit or tree.depth,
        "source": tree.source,
        "expected_codes_per_call": tree.expected_codes_per_call,
        **tree.extra,
    }
    nodes = ",\n".join(f"  {json.dumps(list(p))}" for p in tree.paths)  # one node per line
    text = f'{json.dumps(header, indent=1)[:-2]},\n "paths": [\n{nodes}\n ]\n}}'
    write_atomically(path, (text + "\n").encode())


def path_value(acceptance: list[list[float]], path: Path_) -> float:
    """The chance a round reaches and accepts the node at `path`: the product of the acceptances along it."""
    factors = (acceptance[d][r] if d < len(acceptance) and r < len(acceptance[d]) else 0.0 for d, r in enumerate(path))
    return math.prod(factors)


def grow_tree(acceptance: list[list[float]], budget: int, source: str = "") -> Tree:
    """Greedy sparse tree of `budget` nodes from an acceptance table (`acceptance[d][r]`: how often the rank-r draft
    at depth d+1 is committed, given its path was): from the root, add the frontier node (a root child, a node's next
    sibling rank or first child) of largest `path_value`, its expected codes per call. Depth <= len(acceptance)."""
    if budget < 1:
        raise ValueError(f"a tree needs at least one node, got budget {budget}")
    depth_limit = len(acceptance)
    chosen: list[Path_] = []
    frontier = {(0,)}
    while len(chosen) < budget and frontier:
        best = max(frontier, key=lambda p: (path_value(acceptance, p), -len(p), [-r for r in p]))
        frontier.remove(best)
        chosen.append(best)
        if best[-1] + 1 < len(acceptance[len(best) - 1]):
            frontier.add(best[:-1] + (best[-1] + 1,))
        if len(best) < depth_limit:
            frontier.add(best + (0,))
    expected = 1.0 + sum(path_value(acceptance, p) for p in chosen)  # codes per verify round: y plus accepted nodes
    return Tree(tuple(chosen), source=source, expected_codes_per_call=round(expected, 4), depth_limit=depth_limit)


def frame_codes_per_call(acceptance: list[list[float]], tree: Tree, codes: int = 15) -> float:
    """Expected codes per predictor call over a whole frame of `codes` residual codes, under the table's
    model of acceptance (independent rounds): the prefill counts as a call, and near the frame's end the
    tree is cut to the codes that remain, as the engine cuts it. `tree.expected_codes_per_call` is the
    per-round figure without those two effects."""
    at_least = [sum(path_value(acceptance, p) for p in tree.paths if len(p) == d) for d in range(1, tree.depth + 1)]
    at_least = [1.0, *at_least]
    calls_from = [0.0] * (codes + 2)  # calls_from[k]: expected calls still to make when c_k is the round's root
    for k in range(codes - 1, 0, -1):
        depth = min(tree.depth, codes - k)
        expected = 1.0
        for accepted in range(depth + 1):
            chance = at_least[accepted] - (at_least[accepted + 1] if accepted < depth else 0.0)
            if k + accepted < codes:
                expected += chance * calls_from[k + accepted + 1]
        calls_from[k] = expected
    return codes / (1.0 + calls_from[1])


ACCEPTANCE_FORMAT = "rvqtts-acceptance"
ACCEPTANCE_SUFFIX = "-acceptance.json"  # `rvqtts calibrate` writes its table beside the trees it grows


class AcceptanceFileError(ValueError):
    """An acceptance-table file that cannot be used; the message names the file and the fault."""


def acceptance_problem(acceptance: object) -> str | None:
    """Why `acceptance` is not a per-depth, per-rank acceptance table, or None.

    Each depth's entries are probabilities of disjoint events (the committed code is the rank-r draft),
    so they lie in [0, 1] and sum to at most 1."""
    if not isinstance(acceptance, list) or not acceptance:
        return '"acceptance" must be a non-empty list with one list of rates per depth'
    for d, rates in enumerate(acceptance, 1):
        if (
            not isinstance(rates, list)
            or not rates
            or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0.0 <= a <= 1.0 for a in rates)
        ):
            return f'depth {d} of "acceptance" must be a non-empty list of rates between 0 and 1'
        if sum(rates) > 1.0 + 1e-4:
            return f'depth {d} of "acceptance" sums to {sum(rates):.4f}: rates of one depth sum to at most 1'
    return None


def save_acceptance(table: dict, path: str | os.PathLike) -> None:
    """Write an acceptance table (the `acceptance` rates plus provenance fields) atomically."""
    problem = acceptance_problem(table.get("acceptance"))
    if problem:
        raise ValueError(problem)
    write_json(path, {"format": ACCEPTANCE_FORMAT, "version": 1, **table})


def load_acceptance(path: str | os.PathLike) -> dict:
    """Read and validate an acceptance table that `rvqtts calibrate` wrote; every fault raises
    AcceptanceFileError naming the file. `grow_tree(table["acceptance"], N)` gives the tree for any N."""
    path = Path(path)
    data = read_json(path, "acceptance table", AcceptanceFileError)
    if not isinstance(data, dict) or data.get("format") != ACCEPTANCE_FORMAT:
        raise AcceptanceFileError(
            f'{path} is not an rvqtts acceptance table (expected "format": '
            f'"{ACCEPTANCE_FORMAT}"; `rvqtts calibrate` writes one as NAME{ACCEPTANCE_SUFFIX})'
        )
    problem = acceptance_problem(data.get("acceptance"))
    if problem:
        raise AcceptanceFileError(f"acceptance table {path}: {problem}")
    return data


SHIPPED_TREES = Path(str(importlib.resources.files("rvqtts.data.trees")))
# best-n.json, the user's (rvqtts.support.measurements.BEST_TREES) and the one shipped in trees/: {"cpu/bfloat16": {"N":
# ..., "source": ...}, "cpu/bfloat16/<fingerprint>": ...}
SHIPPED_BEST = SHIPPED_TREES / BEST_TREES.file
FALLBACK_BUDGET = 16  # a tree size to run when one is needed and nothing was measured
# Unmeasured platforms: accelerators run a 17-query call in about the time of one query; a CPU does not.
UNMEASURED_BUDGET = {"cpu": 0}


def platform_key(device_type: str, dtype: str, weights: str = "native") -> str:
    """The key of what best tree sizes are measured for: a kind of device and a dtype (cpu/bfloat16), and
    8-bit weights where the loops run them (cpu/bfloat16+int8: other kernels, other call costs)."""
    key = f"{device_type.split(':')[0]}/{str(dtype).removeprefix('torch.')}"
    return key if weights == "native" else f"{key}+{weights}"


def best_budget(platform: str, fingerprint: str | None = None) -> tuple[int, str]:
    """The tree size `--tree auto` means on this platform (`platform_key`: cpu/float32, cuda/bfloat16, ...),
    and the record it came from.

    A choice measured for this model (`platform/fingerprint`) wins over one for the platform; the user's
    own measurements (`rvqtts bench speedup --save`) win over the ones shipped in trees/. Unmeasured:
    no speculation on CPUs, 16 elsewhere. N = 0 means the plain loop (speculation does not pay)."""
    keys = ([f"{platform}/{fingerprint}"] if fingerprint else []) + [platform]
    records = [(BEST_TREES.path, BEST_TREES.read()), (SHIPPED_BEST, read_records(SHIPPED_BEST))]
    for key in keys:
        for path, data in records:
            entry = data.get(key)
            if isinstance(entry, dict) and isinstance(entry.get("N"), int) and entry["N"] >= 0:
                return entry["N"], f"{path} [{key}]"  # the entry's "source" says how it was measured
    return UNMEASURED_BUDGET.get(platform.split("/")[0], FALLBACK_BUDGET), f"nothing measured for {platform}"


def save_best_budget(platform: str, budget: int, source: str, fingerprint: str | None = None) -> Path:
    """Record the measured best tree size (0: no speculation) for this platform, and for one model when
    the acceptance came from it, in the user's cache; returns the file. A cache that cannot be written raises
    OSError (the user asked for this write)."""
    with BEST_TREES.update(asked=True) as records:
        records[platform + (f"/{fingerprint}" if fingerprint else "")] = {"N": budget, "source": source}
    return BEST_TREES.path


def resolve_tree(spec: str | os.PathLike, fingerprint: str | None = None, platform: str = "cpu/float32") -> Tree:
    """A `--tree` value: a node budget N, meaning a shipped tree of N nodes; `auto`, the best N measured
    for this model or platform (`best_budget`; N = 0 falls back to 16 here, callers that can run
    the plain loop check for it first); or a tree file's path.

    Among shipped trees of N nodes, one calibrated for the model (its `model_fingerprint` equals
    `fingerprint`) wins over a model-independent one; trees calibrated for other models are passed over.
    """
    text = str(spec)
    if text == "auto":
        text = str(best_budget(platform, fingerprint)[0] or FALLBACK_BUDGET)
    if not text.isdigit():
        return load_tree(text)
    files = sorted(SHIPPED_TREES.glob("*.json"))
    trees = [load_tree(p) for p in files if not p.name.endswith(ACCEPTANCE_SUFFIX) and p.name != BEST_TREES.file]
    usable = [t for t in trees if t.extra.get("model_fingerprint") in (None, fingerprint)]
    matching = sorted(
        (t for t in usable if t.nodes == int(text)), key=lambda t: t.extra.get("model_fingerprint") is None
    )
    if not matching:
        sizes = ", ".join(str(n) for n in sorted({t.nodes for t in usable})) or "none"
        raise TreeFileError(
            f"no shipped tree has N = {text} nodes (shipped: {sizes}); pass one of those or the path of a tree file"
        )
    return matching[0]
