"""`make-tiny-model --dims 0.6b --acceptance paper`: a code predictor whose own weights draft about as well as
the paper reports for the released model (docs/acceptance.md), measured as `rvqtts calibrate` measures it."""

from __future__ import annotations

import pytest
import torch
from exactness import paper_offsets
from helpers import run_cli

from rvqtts.engine.speculative.tree import frame_codes_per_call, grow_tree
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.tuning.calibration import measure_acceptance

FRAMES = 64


@pytest.fixture(scope="module")
def paper(paper_dir):
    """The shallow variant: the same embeddings and heads as the full checkpoint, two layers that barely act."""
    return Synthesizer.from_checkpoint(paper_dir)


def codes_per_call_at_32(synth: Synthesizer, offsets: torch.Tensor) -> tuple[float, list[float]]:
    """Expected codes per call of the N = 32 tree grown from the acceptance table of these offsets on
    free-running codes from random frames, and the drafts' top-1 accuracy by depth."""
    generator = torch.Generator().manual_seed(0)
    embedding = synth.talker.get_input_embeddings()
    c0 = torch.randint(0, synth.code_predictor.config.vocab_size, (FRAMES,), generator=generator)
    h_t = torch.randn(FRAMES, synth.talker.config.hidden_size, generator=generator)
    with torch.no_grad():
        prefixes = torch.stack([h_t.to(embedding.weight), embedding(c0)], 1)
    measured = measure_acceptance(synth.code_predictor, prefixes, offsets, seed=0)
    table = measured["acceptance"]
    return frame_codes_per_call(table, grow_tree(table, 32)), measured["top1_by_depth"]


@pytest.fixture(scope="module")
def reused_heads(paper):
    return codes_per_call_at_32(paper, torch.zeros(3, paper.hidden_size))


def test_reused_heads_accept_like_the_papers_where_random_weights_do_not(reused_heads, released_06):
    shaped, top1 = reused_heads
    random_weights, _ = codes_per_call_at_32(released_06, torch.zeros(3, released_06.hidden_size))
    assert 1.55 < shaped < 1.85  # the paper: 1.70 at N = 32
    assert random_weights < 1.3
    assert top1[0] > 2 * max(top1[1:])  # a reused head drafts worse the further ahead it looks


def test_an_offset_per_depth_recovers_the_deeper_drafts(paper, reused_heads):
    """The offset that moves a state one position on (the drift between consecutive positions' normed
    inputs, which train-offsets approaches) lifts codes per call towards the paper's offsets (2.47)."""
    shifted, top1 = codes_per_call_at_32(paper, paper_offsets(paper).vectors)
    assert shifted > reused_heads[0] + 0.5 and shifted > 2.2
    assert min(top1) > 0.4


def test_the_paper_shape_needs_the_released_06b_dimensions(tmp_path):
    result = run_cli("make-tiny-model", tmp_path / "tiny", "--acceptance", "paper")
    assert result.exit_code == 2
    assert "--acceptance paper is tuned for the released 0.6B code predictor: use it with --dims 0.6b" in result.output
    assert not (tmp_path / "tiny").exists()
