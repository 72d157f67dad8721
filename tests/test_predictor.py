"""The runner's logits equal qwen-tts's own code-predictor forward (float32, max abs difference <= 1e-4)."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prefix, stock_path_logits

from rvqtts.engine.model.kernels import kernel_choice
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.speculative.speculation import RoundPlan
from rvqtts.engine.speculative.tree import Tree
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.tuning.tiny import build_tiny_model

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    """The 1.7B layout: the code predictor is narrower than the talker and projects its inputs."""
    folder = build_tiny_model(
        tmp_path_factory.mktemp("models") / "projected", codebook=64, talker_hidden=96, predictor_hidden=64
    )
    return Synthesizer.from_checkpoint(folder)


@pytest.mark.parametrize("which", ["tiny", "projected", "released_06", "released_17"])
@torch.no_grad()
def test_prefill_and_steps_match_stock_cached_forward(which, request):
    synth = request.getfixturevalue(which)
    code_predictor = synth.code_predictor
    last = code_predictor.config.num_code_groups - 1
    runner = PredictorRunner(code_predictor, max_len=last + 1)
    prefix = random_prefix(synth, seed=1)
    # The stock path exactly as HF generate() drives it: a 2-token prefill, then cached single steps.
    stock = code_predictor(inputs_embeds=prefix[None], use_cache=True)
    hidden = runner.prefill(prefix)
    ours = runner.logits(hidden, 1)
    assert (ours - stock.logits[0, -1]).abs().max() <= TOLERANCE
    generator = torch.Generator().manual_seed(2)
    for index in range(1, last):
        code = torch.randint(0, code_predictor.config.vocab_size, (1,), generator=generator)
        stock = code_predictor(
            input_ids=code[None],
            past_key_values=stock.past_key_values,
            use_cache=True,
            generation_steps=stock.generation_steps,
        )
        hidden = runner.step(code, index)
        ours = runner.logits(hidden, index + 1)
        assert (ours - stock.logits[0, -1]).abs().max() <= TOLERANCE, f"step {index}"


@pytest.mark.parametrize("which", ["tiny", "released_17"])
@pytest.mark.parametrize("attention", ["rows", "groups"])
@pytest.mark.parametrize("committed", [1, 6])
@torch.no_grad()
def test_tree_call_matches_stock_forward_on_every_path(which, attention, committed, request):
    """A tree call at any depth of the frame, each query over its slots in position order (row attention, as
    the engine runs it on a CPU) or gathered per depth (elsewhere): each node's logits equal the stock forward
    over its own path."""
    tiny = request.getfixturevalue(which)
    code_predictor = tiny.code_predictor
    tree = Tree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)))
    runner = PredictorRunner(code_predictor, max_len=16 + tree.nodes + 1)
    prefix = random_prefix(tiny, seed=3)
    generator = torch.Generator().manual_seed(4)
    vocab = code_predictor.config.vocab_size
    committed_codes = torch.randint(0, vocab, (committed,), generator=generator).tolist()
    runner.prefill(prefix)
    for index, code in enumerate(committed_codes[:-1], start=1):
        runner.step(torch.tensor([code]), index)
    # Drafted codes per depth and rank, the root being the last committed code c_committed.
    drafts = torch.randint(0, vocab, (tree.depth, 3), generator=generator)
    buffers = tree.buffers
    node_codes = [committed_codes[-1]] + [int(drafts[len(p) - 1, p[-1]]) for p in tree.paths]
    length = committed + 1
    q = len(node_codes)
    codes = torch.tensor(node_codes)
    embeds = torch.cat(
        [
            code_predictor.get_input_embeddings()[committed - 1 + int(d)](codes[i : i + 1])
            for i, d in enumerate(buffers.depth)
        ]
    )
    plan = RoundPlan.build(tree, runner.device)
    runner.row_attention = attention == "rows"
    slots = {"rows": plan.row_slots(length, runner.width)} if attention == "rows" else {}
    attend = slots or {"groups": plan.attention_groups(length)}
    out = runner.forward_rows(embeds, committed + 1 + buffers.depth, length + torch.arange(q), attend)
    for slot in range(q):
        path = []
        node = slot
        while node > 0:
            path.insert(0, node_codes[node])
            node = buffers.parent[node]
        full = committed_codes + path
        expected = stock_path_logits(code_predictor, prefix, full)[-1]
        ours = runner.logits(out[slot], len(full) + 1)
        assert (ours - expected).abs().max() <= TOLERANCE, f"slot {slot} path {full}"


def test_keep_moves_accepted_entries():
    """Accepted tree slots are compacted right after the root; other slots are untouched."""

    runner = PredictorRunner.__new__(PredictorRunner)
    runner.device = torch.device("cpu")
    runner.k_cache = torch.arange(2 * 1 * 10 * 1, dtype=torch.float32).view(2, 1, 10, 1)
    runner.v_cache = runner.k_cache.clone() + 100
    before = runner.k_cache.clone()
    runner.keep([5, 8], 3)
    assert runner.k_cache[:, 0, 3:5, 0].tolist() == before[:, 0, [5, 8], 0].tolist()
    assert runner.v_cache[:, 0, 3:5, 0].tolist() == (before[:, 0, [5, 8], 0] + 100).tolist()
    assert torch.equal(runner.k_cache[:, :, :3], before[:, :, :3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_runs_close_to_float32(tiny_dir, dtype):
    synth32 = Synthesizer.from_checkpoint(tiny_dir)
    synth_half = Synthesizer.from_checkpoint(
        tiny_dir, dtype={torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    )
    prefix = random_prefix(synth32, seed=5)
    reference = PredictorRunner(synth32.code_predictor, 16)
    expected = reference.logits(reference.prefill(prefix), 1)
    runner = PredictorRunner(synth_half.code_predictor, 16)
    assert runner.dtype == dtype and runner.k_cache.dtype == dtype
    hidden = runner.prefill(prefix)
    logits = runner.logits(hidden, 1).float()
    assert torch.isfinite(logits).all()
    assert (logits - expected).abs().max() < 0.1 * expected.abs().max()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_measured_kernels_give_every_row_the_bits_it_gets_alone_at_the_released_shapes(
    released_06_kernels, dtype, measured
):
    """Whatever kernel the measurement picks for a map (rvqtts.engine.model.kernels), a call of any number of rows up to
    a 64-node round's 65 gives each row what a call of that row alone gives it: tree rounds compute what
    plain steps do. Where no kernel is invariant the choice says so, and the claim is not made."""
    runner = PredictorRunner(Synthesizer.from_checkpoint(released_06_kernels, dtype=dtype).code_predictor, 2)
    generator = torch.Generator().manual_seed(6)
    for linear in (runner.qkv[0], runner.gate_up[0], runner.out[0], runner.down[0], runner.heads[3]):
        choice = kernel_choice(tuple(linear.weight.shape), linear.weight.dtype)
        assert choice.kernel == linear.kernel and choice.source in ("measured", "cache")
        if not choice.row_invariant:
            assert not choice.invariant
            continue
        x = torch.randn(65, linear.weight.shape[1], generator=generator).to(linear.weight.dtype)
        with torch.inference_mode():
            alone = torch.cat([linear(x[i : i + 1]) for i in range(65)])
            for rows in (2, 3, 4, 7, 8, 16, 17, 32, 33, 64, 65):
                assert torch.equal(linear(x[:rows]), alone[:rows]), f"{linear.kernel.name}, {rows} rows"
