"""The frame loop rvqtts owns: the talker runner against qwen-tts's talker, c0 drawn as qwen-tts's generate()
draws it, and utterances that are pure functions of their inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rvqtts.engine.loop.frame_loop import FrameDone, Work, draw_c0
from rvqtts.engine.model.graphs import StaticCalls
from rvqtts.engine.model.kernels import Kernel, LinearMap
from rvqtts.engine.model.sampling import C0Rules, FrameSampling
from rvqtts.engine.model.talker import TalkerRunner
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.synthesis.synthesizer import Synthesizer

TEXT = "Hello there, how are you?"


def stock_logits(talker, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """qwen-tts's talker transformer and codec head, call after call over a Hugging Face cache."""
    cache, logits = DynamicCache(), []
    with torch.inference_mode():
        for embeds in inputs:
            hidden = talker.model(inputs_embeds=embeds[None], past_key_values=cache, use_cache=True).last_hidden_state
            logits.append(talker.codec_head(hidden[0, -1]))
    return logits


@pytest.mark.parametrize("name", ["tiny", "released_06", "released_17"])
def test_talker_runner_matches_the_stock_talker_over_a_whole_utterance(name, request):
    synth = request.getfixturevalue(name)
    codes = synth.synthesize(TEXT, "vivian", "english", seed=2, settings=GenerationSettings(max_frames=30)).codes
    prompt = synth.prompt(TEXT, "vivian", "english")
    runner = TalkerRunner(synth.talker)
    inputs = [prompt.embeds] + [
        runner.frame_input(torch.from_numpy(codes[n]), prompt.text_after(n)) for n in range(len(codes))
    ]
    ours = [runner.prefill(prompt.embeds)[1]] + [runner.step(x, prompt.length + n)[1] for n, x in enumerate(inputs[1:])]
    stock = stock_logits(synth.talker, inputs)
    assert len(codes) >= 20 and prompt.length > 10
    assert max(float((a - b).abs().max()) for a, b in zip(ours, stock)) <= 1e-4


def test_the_talker_cache_grows_past_its_first_allocation_without_losing_what_it_holds(tiny):
    """Steps far past the first 256 slots, the cache growing mid-utterance, against the stock talker."""
    prompt = tiny.prompt(TEXT, "vivian", "english")
    generator = torch.Generator().manual_seed(1)
    inputs = [prompt.embeds] + [torch.randn(1, tiny.talker.config.hidden_size, generator=generator) for _ in range(300)]
    runner = TalkerRunner(tiny.talker)
    ours = [runner.prefill(prompt.embeds)[1]] + [runner.step(x, prompt.length + n)[1] for n, x in enumerate(inputs[1:])]
    assert runner.max_len == 512 and prompt.length + 300 > 256
    assert max(float((a - b).abs().max()) for a, b in zip(ours, stock_logits(tiny.talker, inputs))) <= 1e-4


def test_talker_steps_replayed_through_static_calls_equal_eager_steps(tiny):
    prompt = tiny.prompt(TEXT, "vivian", "english")
    eager, static = TalkerRunner(tiny.talker), TalkerRunner(tiny.talker, calls=StaticCalls("emulated"))
    generator = torch.Generator().manual_seed(0)
    for runner in (eager, static):
        runner.prefill(prompt.embeds)
    for n in range(6):
        x = torch.randn(1, eager.hidden_size, generator=generator)
        (h_eager, l_eager), (h_static, l_static) = (r.step(x, prompt.length + n) for r in (eager, static))
        assert torch.allclose(h_eager, h_static, atol=1e-5) and torch.allclose(l_eager, l_static, atol=1e-5)
    assert list(static.calls.entries) == [("talker", 256)]  # one capture serves every position in its span


def greedy(synth, penalty: float) -> FrameSampling:
    sampling = synth.sampling(GenerationSettings(repetition_penalty=penalty))
    return FrameSampling(
        dataclasses.replace(sampling.talker, do_sample=False),
        dataclasses.replace(sampling.predictor, do_sample=False),
        penalty,
    )


@pytest.mark.parametrize("name, penalty", [("tiny", 1.05), ("small", 1.05), ("small", 3.0)])
def test_greedy_frames_equal_stock_qwen_tts(name, penalty, request):
    """Without noise both loops are deterministic: prompt, talker, step inputs, penalty, suppression and
    minimum length must all be qwen-tts's for every code of every frame to agree (the small model has 8
    codes, so c0 repeats and the penalty binds)."""
    tiny = request.getfixturevalue(name)
    tts, frames = tiny.tts, 40
    sampling = greedy(tiny, penalty)
    ids = tts._tokenize_texts([tts._build_assistant_text(TEXT)])
    stock, _ = tts.model.generate(
        input_ids=ids,
        instruct_ids=[None],
        languages=["english"],
        speakers=["vivian"],
        non_streaming_mode=True,
        **sampling.generate_kwargs(frames),
    )
    ours = loop_frames(tiny, sampling, tiny.prompt(TEXT, "vivian", "english"), frames)
    assert np.array_equal(stock[0].numpy(), ours)
    if penalty > 2:  # the penalty binds: without it, greedy decoding goes elsewhere
        unpenalized = loop_frames(tiny, greedy(tiny, 1.0), tiny.prompt(TEXT, "vivian", "english"), frames)
        assert not np.array_equal(unpenalized[:, 0], ours[:, 0])


def loop_frames(synth, sampling, prompt, budget: int) -> np.ndarray:
    """The frame codes [frames, G] the frame loop speaks for one prompt (seed 0, utterance 0)."""
    events = synth.runners.frame_loop().run([Work(0, 0, iter([(prompt, budget)]), sampling)])
    return np.stack([event.codes for event in events if isinstance(event, FrameDone)])


def hf_c0_probs(logits: torch.Tensor, history: list[int], eos: int, sampling, penalty: float) -> torch.Tensor:
    """The c0 distribution as Hugging Face's generate() computes it, with the processors qwen-tts asks for."""
    vocab = logits.shape[-1]
    processors = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(penalty),
            MinNewTokensLengthLogitsProcessor(0, 2, eos),
            SuppressTokensLogitsProcessor([i for i in range(vocab - 1024, vocab) if i != eos]),
            TemperatureLogitsWarper(sampling.temperature),
            TopKLogitsWarper(sampling.top_k),
            TopPLogitsWarper(sampling.top_p),
        ]
    )
    scores = processors(torch.tensor([history]), logits[None].float().clone())
    return scores.softmax(-1)[0]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    kept = expected >= 5
    observed = np.append(counts[kept], counts[~kept].sum())
    expected = np.append(expected[kept], expected[~kept].sum())
    return float((((observed - expected) ** 2) / np.maximum(expected, 1e-12)).sum())


def test_c0_follows_qwen_tts_distribution_with_the_repetition_penalty_active(small):
    """Keyed draws of c0 over many frames against the enumerated distribution (8 codes and end of speech):
    a sampler that skips the penalty must fail the same test."""
    sampling = small.sampling(GenerationSettings(temperature=0.1, repetition_penalty=2.0, top_k=6, top_p=0.95))
    runner = small.runners.talker()
    _, logits = runner.prefill(small.prompt("Hello there.", "vivian", "english").embeds)
    eos = small.talker.config.codec_eos_token_id
    favourites = logits[:8].topk(2).indices.tolist()
    history = [favourites[0], favourites[1], favourites[0], 5, 5]
    seen = torch.zeros(runner.vocab_size, dtype=torch.bool)
    seen[history] = True
    probs = hf_c0_probs(logits, history, eos, sampling.talker, 2.0).numpy()
    unpenalized = hf_c0_probs(logits, history, eos, sampling.talker, 1.0).numpy()
    assert np.abs(probs - unpenalized).max() > 0.1 and probs[eos] > 0.01

    def counts(rules: C0Rules, draws: int = 5, frames: int = 3000) -> np.ndarray:
        tally = np.zeros(runner.vocab_size)
        for frame in range(frames):
            tally[draw_c0(rules, sampling.talker, logits, seen, draws, seed=9, utterance=0, frame=frame)] += 1
        return tally

    vocab = runner.vocab_size
    assert chi_square(counts(C0Rules(vocab, eos, 2.0, logits.device)), probs) < 26.1  # p = 0.001 at <= 8 df
    assert chi_square(counts(C0Rules(vocab, eos, 1.0, logits.device)), probs) > 100
    assert counts(C0Rules(vocab, eos, 2.0, logits.device), draws=1, frames=300)[eos] == 0  # the minimum length


def test_an_utterance_depends_only_on_its_own_inputs_and_not_on_torch_generator(tiny):
    settings = GenerationSettings(max_frames=12)
    first = tiny.synthesize(TEXT, "vivian", "english", seed=5, utterance=3, settings=settings)
    tiny.synthesize("Something else entirely.", "ryan", "english", seed=5, utterance=2, settings=settings)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    again = tiny.synthesize(TEXT, "vivian", "english", seed=5, utterance=3, settings=settings)
    assert torch.equal(state, torch.get_rng_state()), "nothing may draw from torch's global generator"
    assert np.array_equal(first.codes, again.codes) and np.array_equal(first.audio, again.audio)
    other = tiny.synthesize(TEXT, "vivian", "english", seed=5, utterance=4, settings=settings)
    assert not np.array_equal(first.codes[:4], other.codes[:4])


def test_no_upstream_method_is_replaced_while_synthesizing(tiny):
    parts = {
        "talker": tiny.talker,
        "code predictor": tiny.code_predictor,
        "speech tokenizer": tiny.model.speech_tokenizer,
        "model": tiny.model,
    }
    seen: list[str] = []

    def look(prefix, codes) -> None:
        for name, part in parts.items():
            seen.extend(f"{name}.{key}" for key in ("forward", "generate", "decode") if key in vars(part))
        seen.extend("talker hook" for _ in tiny.talker._forward_pre_hooks)

    tiny.synthesize(TEXT, "vivian", "english", settings=GenerationSettings(max_frames=4), on_frame=look)
    assert seen == []


def test_cut_utterances_skip_the_unused_last_step(tiny):
    result = tiny.synthesize(TEXT, "vivian", "english", settings=GenerationSettings(max_frames=7))
    assert result.codes.shape[0] == 7 and result.talker_calls == 7  # prefill and 6 steps; no 8th c0 is needed
    assert result.warnings and "cut at 7 frames" in result.warnings[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_run_through_f_linear_prefills_what_the_step_kernels_do(released_06_dir, dtype, monkeypatch):
    """Where F.linear measured faster for a prompt's many rows (`LinearMap.many`), the prefill runs every map
    through it (in bfloat16 outside the one-call native layers) and its state is the model's within
    rounding; the steps after it keep their kernels."""
    synth = Synthesizer.from_checkpoint(released_06_dir, dtype=dtype)
    prompt = synth.prompt(TEXT, "vivian", "english")
    step_kernels, prompt_kernels = TalkerRunner(synth.talker), TalkerRunner(synth.talker)
    for linear in prompt_kernels.layer_maps():
        linear.bulk = Kernel("linear") if linear.kernel != Kernel("linear") else Kernel("packed")
    assert prompt_kernels.prompt_maps_differ and not step_kernels.prompt_maps_differ
    h_step, l_step = step_kernels.prefill(prompt.embeds)
    calls = []
    many, call = LinearMap.many, LinearMap.__call__
    monkeypatch.setattr(LinearMap, "many", lambda self, x: calls.append(("many", x.shape[0])) or many(self, x))
    monkeypatch.setattr(LinearMap, "__call__", lambda self, x: calls.append(("call", x.shape[0])) or call(self, x))
    h_prompt, l_prompt = prompt_kernels.prefill(prompt.embeds)
    maps = len(prompt_kernels.layer_maps())
    assert calls[:maps] == [("many", prompt.length)] * maps and [kind for kind, _ in calls[maps:]] == ["call"]
    tolerance = 1e-4 if dtype == "float32" else 0.1
    assert float((l_step - l_prompt).abs().max()) <= tolerance * max(1.0, float(l_step.abs().max()))
    calls.clear()
    prompt_kernels.step(torch.randn(1, synth.talker.config.hidden_size), prompt.length)
    assert calls and {kind for kind, _ in calls} == {"call"}  # steps keep their kernels


def test_a_static_talkers_batch_rows_get_the_bits_of_its_captured_one_row_step(tiny_dir, monkeypatch):
    """With static calls (a GPU's CUDA graphs; emulated here, with the maps and norms at one row count as off the CPU),
    each row of a batched step attends as the captured one-row step does (its static span, masked beyond its
    position), so a batch's row gets the bits of that line's one-line run."""
    import rvqtts.engine.model.kernels as kernels
    from rvqtts.engine.model import transformer

    monkeypatch.setenv("RVQTTS_CHOICES", "measured")
    monkeypatch.setattr(kernels, "_device_chosen", {})
    for module in (kernels, transformer):
        monkeypatch.setattr(module, "one_row_count", lambda device: True)
    synth = Synthesizer.from_checkpoint(tiny_dir)
    prompts = [synth.prompt(text, "vivian", "english") for text in (TEXT, "A shorter one.", "And a third line here.")]
    batch = TalkerRunner(synth.talker, calls=StaticCalls("emulated"))
    alone = [TalkerRunner(synth.talker, calls=StaticCalls("emulated")) for _ in prompts]
    for row, (prompt, runner) in enumerate(zip(prompts, alone)):
        batch.prefill(prompt.embeds, row=row)
        runner.prefill(prompt.embeds)
    generator = torch.Generator().manual_seed(0)
    for n in range(4):
        x = torch.randn(len(prompts), batch.hidden_size, generator=generator)
        positions = [prompt.length + n for prompt in prompts]
        hidden, logits = batch.step_rows(x, positions, [0, 1, 2])
        for row, runner in enumerate(alone):
            h, out = runner.step(x[row : row + 1], positions[row])
            assert torch.equal(hidden[row], h) and torch.equal(logits[row], out)


def test_a_frames_noise_is_made_while_the_talker_call_before_it_runs(tiny, monkeypatch):
    """The host's share of a frame kept off the device's path: each frame's residual noise is made after the
    talker call before it (the prefill or the last step) is issued and before the wait for it, not after c0's draw,
    which waits for the device, and before the inner loop."""
    import rvqtts.engine.loop.frame_loop as frame_loop

    events = []

    def logged(name, function):
        def call(*args, **kwargs):
            events.append(name)
            return function(*args, **kwargs)

        return call

    for name in ("residual_noise", "synchronize", "inner_frames"):
        monkeypatch.setattr(frame_loop, name, logged(name, getattr(frame_loop, name)))
    result = tiny.synthesize(TEXT, "vivian", "english", seed=2, settings=GenerationSettings(max_frames=5))
    noise = [i for i, event in enumerate(events) if event == "residual_noise"]
    frames = len(result.codes)  # and the noise of a frame that an end code stops before its inner loop
    assert events.count("inner_frames") == frames and len(noise) in (frames, frames + 1)
    assert all(events[i + 1] == "synchronize" for i in noise)


def test_joins_per_frame_starts_that_many_utterances_before_each_frame(tiny):
    """Four utterances waiting for four rows: with two joins a frame, only the first two are prefilled before the first
    frame, the others before the second (a server's burst: the first ones heard after their own prefills and a frame);
    with no limit all four are. A row whose text fails counts as a join. Every utterance is spoken whole."""
    sampling, prompt = tiny.sampling(GenerationSettings()), tiny.prompt(TEXT, "vivian", "english")

    def started_at_first_frames(joins: int | None, failing: int | None = None) -> tuple[dict, dict]:
        """The utterances prefilled when each one's first frame came, and the frames each spoke."""

        def chunks(seed: int):
            if seed == failing:
                raise ValueError("this text cannot be spoken")
            yield prompt, 3

        works = [Work(seed, 0, chunks(seed), sampling) for seed in range(4)]
        started, frames = {}, {}
        for event in tiny.runners.frame_loop(rows=4).run(works, joins_per_frame=joins):
            if isinstance(event, FrameDone):
                started.setdefault(event.work.seed, {w.seed for w in works if w.talker_calls})
                frames[event.work.seed] = event.work.frame
        return started, frames

    first, all_four, whole = {0, 1}, {0, 1, 2, 3}, {seed: 3 for seed in range(4)}
    assert started_at_first_frames(2) == ({0: first, 1: first, 2: all_four, 3: all_four}, whole)
    assert started_at_first_frames(None) == ({seed: all_four for seed in range(4)}, whole)
    assert started_at_first_frames(2, failing=1) == ({0: {0}, 2: {0, 2, 3}, 3: {0, 2, 3}}, {0: 3, 2: 3, 3: 3})
    with pytest.raises(ValueError, match="at least one utterance must start"):
        next(tiny.runners.frame_loop(rows=4).run([], joins_per_frame=0))
