"""Tree and offset files: hand-computed buffers, greedy growth, round trips, and every refusal."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rvqtts.engine.speculative.offsets import Offsets, OffsetsFileError, load_offsets, save_offsets
from rvqtts.engine.speculative.tree import (
    ACCEPTANCE_SUFFIX,
    SHIPPED_TREES,
    AcceptanceFileError,
    Tree,
    TreeFileError,
    frame_codes_per_call,
    grow_tree,
    load_acceptance,
    load_tree,
    save_acceptance,
    save_tree,
)


def test_buffers_of_a_branching_tree():
    tree = Tree(((1,), (0, 0), (0,), (0, 1), (1, 0), (0, 0, 0)))
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (tree.nodes, tree.depth) == (6, 3)
    buffers = tree.buffers
    assert buffers.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert buffers.parent == [-1, 0, 0, 1, 1, 2, 3]
    assert buffers.rank == [-1, 0, 1, 0, 1, 0, 0]
    visible = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 3, 6}]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for row, columns in enumerate(visible):
        expected[row, list(columns)] = True
    assert torch.equal(buffers.ancestor_mask, expected)
    assert buffers.children == [[(0, 1), (1, 2)], [(0, 3), (1, 4)], [(0, 5)], [(0, 6)], [], [], []]
    assert tree.max_rank_by_depth() == [2, 2, 1]
    assert tree.truncated(1).paths == ((0,), (1,))


def test_buffers_of_a_chain_are_causal():
    buffers = Tree(((0,), (0, 0), (0, 0, 0))).buffers
    assert torch.equal(buffers.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())


def test_greedy_growth_on_a_hand_made_table():
    table = [[0.6, 0.2, 0.1], [0.5, 0.1], [0.4]]
    # Values: (0)=.6, (0,0)=.3, (1)=.2, (0,0,0)=.12, then the tie (2)=.1 / (1,0)=.1 goes to the shallower node.
    tree = grow_tree(table, 4)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 0, 0))
    assert tree.expected_codes_per_call == pytest.approx(1 + 0.6 + 0.3 + 0.2 + 0.12)
    assert grow_tree(table, 6).paths == ((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0))
    assert grow_tree(table, 100).nodes == 3 + 3 * 2 + 3 * 2 * 1  # every rank the table has, depth 3


def test_tree_file_round_trip(tmp_path):
    tree = grow_tree([[0.6, 0.2], [0.5]], 3, source="hand table")
    save_tree(tree, tmp_path / "t.json")
    loaded = load_tree(tmp_path / "t.json")
    assert loaded.paths == tree.paths and loaded.source == "hand table"
    assert loaded.depth_limit == 2 and loaded.expected_codes_per_call == tree.expected_codes_per_call


def write_tree(path, **fields):
    data = {"format": "rvqtts-tree", "version": 1, "depth": 3, "nodes": 2, "paths": [[0], [0, 0]]}
    data.update(fields)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"paths": [[0], [1, 0]]}, "not closed under prefixes: node [1, 0] has no parent [1]"),
        ({"paths": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "nodes": 4}, "has depth 4, above the tree's depth K = 3"),
        ({"paths": [[0], [-1]]}, "is not a non-empty list of ranks"),
        ({"paths": [[0], [0]]}, "appears twice"),
        ({"paths": [[0], []]}, "is not a non-empty list of ranks"),
        ({"nodes": 5}, 'says "nodes": 5 but lists 2 paths'),
        ({"depth": 0}, 'needs "depth"'),
        ({"format": "medusa"}, "is not an rvqtts tree"),
        ({"paths": []}, 'has no "paths" list'),
    ],
)
def test_invalid_tree_files_are_refused_with_their_fault(tmp_path, fields, message):
    path = write_tree(tmp_path / "bad.json", **fields)
    with pytest.raises(TreeFileError) as error:
        load_tree(path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_unreadable_tree_files(tmp_path):
    with pytest.raises(TreeFileError, match="cannot read tree file"):
        load_tree(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TreeFileError, match="is not valid JSON"):
        load_tree(tmp_path / "broken.json")


def test_acceptance_file_round_trip(tmp_path):
    table = {"acceptance": [[0.6, 0.2, 0.1], [0.5, 0.1], [0.4]], "frames": 10, "model": "m"}
    save_acceptance(table, tmp_path / f"x{ACCEPTANCE_SUFFIX}")
    loaded = load_acceptance(tmp_path / f"x{ACCEPTANCE_SUFFIX}")
    assert {k: loaded[k] for k in table} == table and loaded["format"] == "rvqtts-acceptance"
    assert grow_tree(loaded["acceptance"], 4).paths == ((0,), (1,), (0, 0), (0, 0, 0))
    with pytest.raises(ValueError, match="sums to 1.2"):
        save_acceptance({"acceptance": [[0.6, 0.6]]}, tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()


@pytest.mark.parametrize("name", ["stand-in", "prior"])
def test_the_shipped_acceptance_tables_regrow_the_shipped_trees(name):
    table = load_acceptance(SHIPPED_TREES / f"{name}-acceptance.json")
    for n in (4, 7, 8, 15, 16, 31, 32, 63, 64):
        shipped = load_tree(SHIPPED_TREES / f"{name}-n{n}.json")
        grown = grow_tree(table["acceptance"], n)
        assert (grown.paths, grown.expected_codes_per_call) == (shipped.paths, shipped.expected_codes_per_call)
        assert shipped.extra.get("model_fingerprint") == table.get("model_fingerprint")


def test_frame_codes_per_call_counts_the_prefill_and_the_frame_end():
    never, always = [[0.0], [0.0], [0.0]], [[1.0], [1.0], [1.0]]
    assert frame_codes_per_call(never, grow_tree(never, 4)) == 1.0
    # Always accepted: the prefill gives c1, rounds give c2-c5, c6-c9, c10-c13, then c14-c15: 15 codes, 5 calls.
    assert frame_codes_per_call(always, grow_tree(always, 3)) == 3.0
    assert frame_codes_per_call(always, grow_tree(always, 3), codes=3) == 1.5  # prefill c1, then c2-c3
    half = [[0.5], [0.5], [0.5]]
    chain = grow_tree(half, 3)
    assert 1.0 < frame_codes_per_call(half, chain) < chain.expected_codes_per_call


@pytest.mark.parametrize(
    "document, message",
    [
        ({"format": "rvqtts-tree", "acceptance": [[0.5]]}, "is not an rvqtts acceptance table"),
        ({"format": "rvqtts-acceptance"}, "must be a non-empty list with one list of rates per depth"),
        ({"format": "rvqtts-acceptance", "acceptance": [[0.5], []]}, 'depth 2 of "acceptance" must be'),
        ({"format": "rvqtts-acceptance", "acceptance": [[0.5, -0.1]]}, "rates between 0 and 1"),
        ({"format": "rvqtts-acceptance", "acceptance": [[0.7, 0.4]]}, 'depth 1 of "acceptance" sums to 1.1000'),
        ([1, 2], "is not an rvqtts acceptance table"),
    ],
)
def test_invalid_acceptance_files_are_refused_with_their_fault(tmp_path, document, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(AcceptanceFileError) as error:
        load_acceptance(path)
    assert message in str(error.value) and str(path) in str(error.value)
    with pytest.raises(AcceptanceFileError, match="cannot read acceptance table"):
        load_acceptance(tmp_path / "missing.json")
    path.write_text("{")
    with pytest.raises(AcceptanceFileError, match="is not valid JSON"):
        load_acceptance(path)


def test_offsets_round_trip_and_zeros(tmp_path):
    vectors = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    save_offsets(Offsets(vectors, model="tiny", model_fingerprint="abc"), tmp_path / "o.safetensors", steps=10)
    loaded = load_offsets(tmp_path / "o.safetensors", hidden_size=64)
    assert torch.equal(loaded.vectors, vectors)
    assert (loaded.depth, loaded.hidden_size, loaded.model, loaded.model_fingerprint) == (3, 64, "tiny", "abc")
    assert loaded.metadata["steps"] == "10" and not loaded.is_zero
    assert Offsets.zeros(3, 64).is_zero


def write_offsets(path, tensor, **meta):
    metadata = {
        "format": "rvqtts-offsets",
        "hidden_size": str(tensor.shape[-1]),
        "depth": str(tensor.shape[0]) if tensor.dim() == 2 else "1",
    }
    metadata.update(meta)
    save_file({"offsets": tensor}, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize(
    "tensor, meta, message",
    [
        (torch.zeros(64), {}, "must be [K, hidden]"),
        (torch.zeros(15, 64), {}, "K = 15, but K must be between 1 and 14"),
        (torch.zeros(3, 64), {"hidden_size": "32"}, "metadata says hidden 32"),
        (torch.zeros(3, 32), {}, "has hidden size 32, but the model's code predictor has 64"),
        (torch.full((3, 64), float("nan")), {}, "NaN or infinite"),
        (torch.zeros(3, 64), {"format": "other"}, "is not rvqtts offsets"),
        (
            torch.zeros(3, 64),
            {"model": "other-model", "model_fingerprint": "0123"},
            "was trained for another model (other-model, code-predictor fingerprint 0123; this model's is abcd)",
        ),
    ],
)
def test_invalid_offsets_are_refused_with_their_fault(tmp_path, tensor, meta, message):
    path = write_offsets(tmp_path / "bad.safetensors", tensor, **meta)
    with pytest.raises(OffsetsFileError) as error:
        load_offsets(path, hidden_size=64, fingerprint="abcd")
    assert message in str(error.value) and str(path) in str(error.value)


def test_unreadable_offsets(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x00\x01 not safetensors")
    for path in (tmp_path / "junk.safetensors", tmp_path / "missing.safetensors"):
        with pytest.raises(OffsetsFileError, match="cannot read offsets file"):
            load_offsets(path)
    save_file({"other": torch.zeros(3, 4)}, str(tmp_path / "named.safetensors"), metadata={"format": "rvqtts-offsets"})
    with pytest.raises(OffsetsFileError, match="no tensor named 'offsets'"):
        load_offsets(tmp_path / "named.safetensors")


def test_fingerprints_tell_models_apart_but_not_dtypes(tiny_dir, tiny, narrow):
    from rvqtts.engine.speculative.offsets import predictor_fingerprint
    from rvqtts.synthesis.synthesizer import Synthesizer

    again = Synthesizer.from_checkpoint(tiny_dir, dtype="bfloat16")
    assert predictor_fingerprint(again.code_predictor) == predictor_fingerprint(tiny.code_predictor)
    assert predictor_fingerprint(narrow.code_predictor) != predictor_fingerprint(tiny.code_predictor)
