"""`rvqtts bench dtype` and `bench coreml`: a code predictor in another dtype, with 8-bit weights, or as a
fused Core ML package, against the reference engine on the same frames and noise: codes that agree, and
milliseconds per frame."""

from __future__ import annotations

import statistics
import time

import torch
from rich.table import Table

from rvqtts.engine.model.devices import synchronize
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.support.report import titled_table


def random_prefixes(talker: torch.nn.Module, frames: int, seed: int = 0) -> torch.Tensor:
    """Frame contexts [frames, 2, E] like the talker hands over: random h_t, and a random c0's embedding."""
    generator = torch.Generator().manual_seed(seed)
    embedding = talker.get_input_embeddings()
    h_t = torch.randn(frames, talker.config.hidden_size, generator=generator)
    c0 = torch.randint(0, talker.config.code_predictor_config.vocab_size, (frames,), generator=generator)
    with torch.inference_mode():
        return torch.stack([h_t.to(embedding.weight.dtype), embedding(c0.to(embedding.weight.device)).cpu()], dim=1)


def bench_dtype(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    prefixes: torch.Tensor,
    seed: int = 0,
    sampling: SamplingConfig = SamplingConfig(),
    candidate_weights: str = "native",
) -> dict:
    """A code predictor in another dtype or with 8-bit weights (`candidate`, `candidate_weights`) against the
    `reference` (float32, or the same model's own weights) on the same frames and noise, plain loops: codes drawn by
    the candidate given the reference's earlier codes (teacher forcing: how often the dtype changes a draw), frames
    whose 15 codes all agree when each runs free, and the codes a free-running frame gets right before its first
    difference; with the two loops' ms per frame, timed frame by frame in turn."""
    from rvqtts.engine.loop.inner_loop import InnerLoop, LoopParts
    from rvqtts.engine.model.sampling import draw, residual_noise

    loops = {
        "reference": InnerLoop(reference, None, seed),
        "candidate": InnerLoop(candidate, None, seed, parts=LoopParts.build(candidate, None, True, candidate_weights)),
    }
    runner = loops["candidate"].runner
    last = runner.code_groups - 1
    forced = agree = frames_equal = before_first = 0
    ms = {name: [] for name in loops}
    with torch.inference_mode():
        for frame, prefix in enumerate(prefixes):
            codes = {}
            for name, loop in loops.items():
                started = time.perf_counter()
                codes[name] = loop.frame(prefix.to(loop.runner.device, loop.runner.dtype), sampling, 0, frame)
                synchronize(loop.runner.device)
                ms[name].append((time.perf_counter() - started) * 1e3)
            ours, theirs = codes["candidate"], codes["reference"]
            frames_equal += ours == theirs
            before_first += next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), last)
            noise = residual_noise(seed, 0, frame, runner.code_groups, runner.vocab_size).to(runner.device)
            hidden = runner.prefill(prefix.to(runner.device, runner.dtype))
            for index in range(1, last + 1):  # c_index drawn by the candidate after the reference's c_<index
                if index > 1:
                    hidden = runner.step(torch.tensor([theirs[index - 2]], device=runner.device), index - 1)
                agree += int(draw(runner.logits(hidden, index), noise[index - 1], sampling)) == theirs[index - 1]
                forced += 1
    frames = len(prefixes)
    return {
        "frames": frames,
        "codes_per_frame": last,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "reference_dtype": str(loops["reference"].runner.dtype).removeprefix("torch."),
        "teacher_forced_code_agreement": round(agree / forced, 5),
        "free_running_frames_identical": round(frames_equal / frames, 4),
        "codes_before_first_difference": round(before_first / frames, 3),
        "ms_per_frame": {name: round(statistics.median(values), 2) for name, values in ms.items()},
        "device": str(runner.device),
        "weights": candidate_weights,
    }


def bench_fused(
    code_predictor: torch.nn.Module,
    speculation,
    candidate,
    prefixes: torch.Tensor,
    seed: int = 0,
    sampling: SamplingConfig = SamplingConfig(),
) -> dict:
    """A fused decoder (a Core ML package, or PyTorch in float16 standing in for one off macOS) against the
    float32 PyTorch engine on the same frames and noise: how many codes and whole frames agree, speculative
    and plain, the candidate's codes per call, and its milliseconds per frame both ways (interleaved)."""

    from rvqtts.engine.loop.inner_loop import InnerLoop, count_frame
    from rvqtts.engine.model.sampling import residual_noise
    from rvqtts.engine.speculative.speculation import LoopStats

    engine = InnerLoop(code_predictor, speculation, seed)
    spec_stats, plain_stats = LoopStats(), LoopStats()
    same = {"spec": [0, 0], "plain": [0, 0]}  # codes, frames
    seconds = {"spec": 0.0, "plain": 0.0}
    for frame, prefix in enumerate(prefixes):
        noise = residual_noise(seed, 0, frame, engine.runner.code_groups, engine.runner.vocab_size)
        reference = engine.frame(prefix, sampling, 0, frame)
        for mode, run, stats in (
            ("spec", candidate.frame, spec_stats),
            ("plain", candidate.plain_frame, plain_stats),
        ):
            started = time.perf_counter()
            done = run(prefix, noise.to(candidate.device))
            seconds[mode] += time.perf_counter() - started
            count_frame(stats, done)
            codes = done.codes
            same[mode][0] += sum(a == b for a, b in zip(codes, reference))
            same[mode][1] += codes == reference
    frames, codes = len(prefixes), len(prefixes) * (engine.runner.code_groups - 1)
    return {
        "frames": frames,
        **{f"{mode}_code_agreement": round(same[mode][0] / codes, 5) for mode in same},
        **{f"{mode}_frame_agreement": round(same[mode][1] / frames, 5) for mode in same},
        "codes_per_call": round(spec_stats.codes_per_call, 4),
        "engine_codes_per_call": round(engine.stats.codes_per_call, 4),
        **{f"{mode}_ms_per_frame": round(1e3 * seconds[mode] / frames, 3) for mode in seconds},
        "inner_loop_speedup": round(seconds["plain"] / seconds["spec"], 3) if seconds["spec"] else None,
    }


def dtype_table(result: dict) -> Table:
    """`rvqtts bench dtype`: a reduced dtype's codes and speed against float32 (or 8-bit weights' against
    the dtype's own)."""
    candidate = result["dtype"] + (
        f" with {result['weights']} weights" if result.get("weights", "native") != "native" else ""
    )
    table = titled_table(
        f"code predictor, {candidate} vs {result['reference_dtype']}, {result['frames']} frames",
        ("measure", "value"),
        left=("measure",),
    )
    table.add_row("codes agreeing, teacher forced", f"{100 * result['teacher_forced_code_agreement']:.2f} %")
    table.add_row("frames identical, free running", f"{100 * result['free_running_frames_identical']:.1f} %")
    table.add_row(
        "codes before the first difference",
        f"{result['codes_before_first_difference']:.2f} of {result['codes_per_frame']}",
    )
    for name, value in result["ms_per_frame"].items():
        table.add_row(
            f"plain loop ms/frame, {candidate if name == 'candidate' else result['reference_dtype']}", f"{value:.1f}"
        )
    return table


def coreml_table(result: dict) -> Table:
    """`rvqtts bench coreml`: a fused decoder against the float32 engine, measure by measure."""
    table = Table(title=f"{result['candidate']} vs PyTorch float32, N = {result['tree_nodes']}", min_width=64)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in result.items():
        if name not in ("model", "candidate", "frames_source"):
            table.add_row(name, str(value))
    return table
