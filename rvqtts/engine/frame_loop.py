"""The frame loop: per 80 ms frame, one talker call that scores c0, then the inner loop's c1..c15.

Every code is drawn with keyed Gumbel noise, c0 included: (seed, utterance, frame, position 0) for the
talker's, positions 1..15 for the inner loop's. Nothing reads torch's global generator, so an utterance
is a pure function of seed, text, voice, settings, model, dtype and device, and a batch line's output
does not depend on the lines before it. Frames are numbered from 0 within an utterance, across its text
chunks, so no two frames share noise.

The order of work is qwen-tts's: the prefill's last hidden state h and logits give c0 of frame 0; the
inner loop turns [h, embedding of c0] into c1..c15; the frame's 16 code embeddings plus the next text
(or pad) embedding are the next talker step's input, whose output gives the next frame's h and c0. End of
speech (a c0) ends the utterance; at `budget` frames it is cut, without the step whose c0 would be unused.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from rvqtts.engine.devices import synchronize
from rvqtts.engine.inner_loop import InnerLoop
from rvqtts.engine.sampling import C0Rules, NonFiniteError, SamplingConfig, draw_checked, gumbel_noise
from rvqtts.engine.talker import TalkerRunner
from rvqtts.prompt import Prompt


class FrameLoop:
    """The frames of one utterance (one or more prompts, one per text chunk), and the time each loop took."""

    def __init__(
        self,
        talker: TalkerRunner,
        inner: InnerLoop,
        rules: C0Rules,
        talker_sampling: SamplingConfig,
        predictor_sampling: SamplingConfig,
        seed: int,
        utterance: int,
    ):
        self.talker, self.inner, self.rules = talker, inner, rules
        self.talker_sampling, self.predictor_sampling = talker_sampling, predictor_sampling
        self.seed, self.utterance = seed, utterance
        self.frame = 0  # the next frame's number within the utterance
        self.talker_calls = 0
        self.seconds = {"talker": 0.0, "predictor": 0.0}
        self.first_prefill: float | None = None  # seconds of the utterance's first prefill

    def run(self, prompt: Prompt, budget: int, forced: np.ndarray | None = None) -> Iterator[np.ndarray]:
        """The frame codes [G] (int64) the talker speaks for `prompt`, at most `budget` of them. With
        `forced` [frames, G], c0 is not drawn but read from it (teacher forcing; the inner loop then
        returns the recorded c1.. too) and the prompt ends after its frames."""
        device = self.talker.device
        started = time.perf_counter()
        limit = budget if forced is None else len(forced)
        self.talker.reserve(prompt.length + limit)  # room for every step at once: no growth mid-utterance
        hidden, logits = self.talker.prefill(prompt.embeds)
        self.talker_calls += 1
        if self.first_prefill is None:
            synchronize(device)
            self.first_prefill = time.perf_counter() - started
        seen = torch.zeros(self.talker.vocab_size, dtype=torch.bool, device=device)
        for step in range(limit):
            c0 = self.draw_c0(logits, seen, step) if forced is None else int(forced[step, 0])
            if c0 == self.rules.eos_id:
                break
            code = torch.tensor([c0], device=device)
            prefix = torch.cat([hidden[None], self.talker.code_embedding(code)])
            between = time.perf_counter()
            self.seconds["talker"] += between - started
            rest = self.inner.decode(prefix, self.predictor_sampling, self.utterance, self.frame)
            synchronize(device)
            started = time.perf_counter()
            self.seconds["predictor"] += started - between
            codes = np.array([c0, *rest], dtype=np.int64)
            seen[c0] = True
            self.frame += 1
            self.seconds["talker"] += time.perf_counter() - started
            yield codes
            started = time.perf_counter()
            if step + 1 < limit:
                step_input = self.talker.frame_input(torch.from_numpy(codes).to(device), prompt.text_after(step))
                hidden, logits = self.talker.step(step_input, prompt.length + step)
                self.talker_calls += 1
        self.seconds["talker"] += time.perf_counter() - started

    def draw_c0(self, logits: torch.Tensor, seen: torch.Tensor, draws: int) -> int:
        """c0 of the current frame (`draw_c0`)."""
        return draw_c0(self.rules, self.talker_sampling, logits, seen, draws, self.seed, self.utterance, self.frame)


def draw_c0(
    rules: C0Rules,
    sampling: SamplingConfig,
    logits: torch.Tensor,
    seen: torch.Tensor,
    draws: int,
    seed: int,
    utterance: int,
    frame: int,
) -> int:
    """c0 of an utterance's frame: qwen-tts's processors and warpers over the talker's logits [vocab], then
    the Gumbel-max draw with the noise of (seed, utterance, frame, position 0)."""
    noise = gumbel_noise(seed, utterance, frame, [0], logits.shape[-1])[0]
    code, finite = draw_checked(rules.scores(logits, seen, draws), torch.from_numpy(noise).to(logits.device), sampling)
    if not bool(finite):
        raise NonFiniteError("talker", logits.dtype)
    return int(code)
