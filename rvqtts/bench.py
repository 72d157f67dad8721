"""Benchmarks: what one predictor call costs per query length, the inner-loop speedup that projects to
per tree size, and whole synthesis against stock qwen-tts. Timings, not tests: every comparison is
measured side by side in one run (alternatives interleaved repetition by repetition), because the
machines they run on are shared and noisy; report medians and ratios, never one-off times.
"""

from __future__ import annotations

import io
import statistics
import time
from functools import partial
from typing import Callable

import torch

from rvqtts.decode import RoundPlan, round_call, step_call
from rvqtts.files import write_atomically
from rvqtts.floor import (megabytes, module_weights, multiply_adds, peak_multiply_adds_per_ms, predictor_weights,
                          read_pass, round_heads, talker_weights)
from rvqtts.graphs import StaticCalls
from rvqtts.predictor import PredictorRunner
from rvqtts.sampling import SamplingConfig
from rvqtts.devices import synchronize
from rvqtts.tree import SHIPPED_TREES, Tree, frame_codes_per_call, grow_tree, load_acceptance

PREDICTOR_DIMS = {"0.6b": 1024, "1.7b": 2048}  # talker width in front of the (same) 1024-wide predictor
BUDGETS = (4, 7, 8, 15, 16, 31, 32, 63, 64)  # q = N + 1 of 8, 16, 32, 64 are kernel sweet spots on CPUs
# The paper's codes per call for its offsets drafter (Figure 4, N = 16 / 32 / 64): a labelled reference,
# used when no acceptance table of the model is given.
PAPER_CODES_PER_CALL = {16: 2.25, 32: 2.47, 64: 2.60}
KV_LENGTH = 8  # committed slots before a timed call: mid-frame (a frame holds 2 to 17)


def random_code_predictor(dims: str, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """qwen-tts's code predictor at the real dimensions with random weights (cost does not depend on them)."""
    from rvqtts.compat import qwen_tts

    qwen_tts()
    from qwen_tts.core.models.configuration_qwen3_tts import (Qwen3TTSTalkerCodePredictorConfig,
                                                               Qwen3TTSTalkerConfig)
    from qwen_tts.core.models.modeling_qwen3_tts import \
        Qwen3TTSTalkerCodePredictorModelForConditionalGeneration as CodePredictor

    if dims not in PREDICTOR_DIMS:
        raise ValueError(f"unknown dimensions {dims!r}; choose one of {', '.join(PREDICTOR_DIMS)}")
    config = Qwen3TTSTalkerCodePredictorConfig(num_code_groups=16)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = CodePredictor(config, Qwen3TTSTalkerConfig(hidden_size=PREDICTOR_DIMS[dims]))
    return model.to(device=device, dtype=dtype).eval()


def interleaved_ms(calls: dict[str, Callable[[], object]], device: torch.device, warmup: int = 5,
                   repeats: int = 30, reset: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Milliseconds of each call, `repeats` times, the calls taking turns so that load on a shared
    machine falls on all of them alike. `reset` runs untimed before every call."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(warmup + repeats):
        for name, call in calls.items():
            if reset:
                reset()
            synchronize(device)
            started = time.perf_counter()
            call()
            synchronize(device)
            if repeat >= warmup:
                times[name].append((time.perf_counter() - started) * 1e3)
    return times


def timing_tree(nodes: int) -> Tree:
    """A tree of `nodes` nodes shaped like a calibrated one (grown from the shipped prior table)."""
    prior = load_acceptance(SHIPPED_TREES / "prior-acceptance.json")["acceptance"]
    return grow_tree(prior, nodes)


def _talker_width(code_predictor: torch.nn.Module) -> int:
    """Width of what the talker hands the predictor (its embeddings), before any projection to 1024."""
    return getattr(code_predictor.small_to_mtp_projection, "in_features",
                   code_predictor.model.codec_embedding[0].weight.shape[1])


def _stock_step(code_predictor: torch.nn.Module, device: torch.device, dtype: torch.dtype):
    """qwen-tts's own forward for one code at KV length KV_LENGTH (its HF cache, its LM head), and a
    reset that crops the cache back after each call."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        code_predictor(inputs_embeds=torch.randn(1, KV_LENGTH, _talker_width(code_predictor), device=device,
                                                 dtype=dtype),
                       past_key_values=cache, use_cache=True)
    code = torch.tensor([[5]], device=device)

    def step() -> None:
        with torch.inference_mode():
            code_predictor(input_ids=code, past_key_values=cache, use_cache=True, generation_steps=KV_LENGTH - 1)

    return step, lambda: cache.crop(KV_LENGTH)


def _frame_loops(code_predictor: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 weight_format: str = "native") -> dict:
    """One frame's whole inner loop (15 codes, sampled with qwen-tts's defaults): qwen-tts's HF
    `generate()` as its talker calls it, and rvqtts's plain loop on the same prefix."""
    from rvqtts.decode import DecodeStats, decode_frame_plain

    groups = code_predictor.config.num_code_groups
    prefix = torch.randn(1, 2, _talker_width(code_predictor), device=device, dtype=dtype)
    runner = PredictorRunner(code_predictor, groups, weight_format)
    noise = torch.zeros(groups - 1, code_predictor.config.vocab_size, device=device)
    sampling = SamplingConfig()

    def stock() -> None:
        code_predictor.generate(inputs_embeds=prefix, max_new_tokens=groups - 1, do_sample=True, top_p=1.0,
                                top_k=50, temperature=0.9, output_hidden_states=True, return_dict_in_generate=True)

    static = StaticCalls.for_device(device)
    return {"stock_frame": stock,
            "plain_frame": lambda: decode_frame_plain(runner, prefix[0], noise, sampling, DecodeStats(), static)}


def bench_predictor(code_predictor: torch.nn.Module, queries: list[int], warmup: int = 5, repeats: int = 30,
                    weights: str = "random", progress: Callable[[int, int], None] | None = None,
                    weight_format: str = "native") -> dict:
    """Median and spread of one predictor call per query length q, as the engine makes it (q = 1: a plain
    step and its draw; q > 1: a verify round of a q - 1 node tree: drafts, forward with tree attention row by
    row, LM heads and draws at every slot; CUDA-graph replays on CUDA), and of qwen-tts's own q = 1 forward,
    interleaved in one run; also one whole frame's inner loop, qwen-tts's HF `generate()` against
    rvqtts's plain loop."""
    weight = code_predictor.lm_head[0].weight
    device, dtype = weight.device, weight.dtype
    depth = 3
    runner = PredictorRunner(code_predictor, code_predictor.config.num_code_groups + max(queries), weight_format)
    offsets = torch.zeros(depth, runner.hidden_size, device=device, dtype=dtype)
    hidden = torch.randn(runner.hidden_size, device=device, dtype=dtype)
    code = torch.tensor([5], device=device)
    noise = torch.zeros(runner.code_groups - 1, runner.vocab_size, device=device)
    sampling = SamplingConfig()
    index = KV_LENGTH - 1  # the call's root is c_index, after KV_LENGTH committed slots
    static = StaticCalls.for_device(device)

    def plain() -> None:
        static("step", partial(step_call, runner, index, sampling), code, noise)

    plans = {q: RoundPlan.build(timing_tree(q - 1), device) for q in queries if q > 1}

    def tree_round(q: int) -> Callable[[], object]:
        return lambda: static(("round", q), partial(round_call, runner, plans[q], offsets, index, sampling),
                              hidden, code, noise)

    calls = {f"q{q}": plain if q == 1 else tree_round(q) for q in queries}
    last = runner.code_groups - 1
    weights_read = {q: predictor_weights(runner, [index + 1] if q == 1 else round_heads(plans[q], index, last))
                    for q in queries}
    floors = {f"floor{q}": read_pass(tensors) for q, tensors in weights_read.items()}
    stock, reset_stock = _stock_step(code_predictor, device, dtype)
    with torch.inference_mode():
        for done, call in enumerate(calls.values()):  # compile-free warm-up of every shape's kernels
            call()
            if progress:
                progress(done + 1, len(calls))
        # Cropping the stock cache runs before every call (untimed); it is cheap and leaves ours untouched.
        times = interleaved_ms({**calls, **floors, "stock": stock}, device, warmup, repeats, reset=reset_stock)
        frames = interleaved_ms(_frame_loops(code_predictor, device, dtype, weight_format), device, 2,
                                max(3, repeats // 4))
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["q1"] if "q1" in medians else None
    peak = peak_multiply_adds_per_ms(dtype, device)
    compute = {q: q * multiply_adds(weights_read[q]) / peak for q in queries}  # every row through every weight
    return {
        "q": list(queries),
        "median_ms": [round(medians[f"q{q}"], 3) for q in queries],
        "floor_ms": [round(medians[f"floor{q}"], 4) for q in queries],
        "ratio_to_floor": [round(medians[f"q{q}"] / medians[f"floor{q}"], 4) for q in queries],
        "compute_floor_ms": [round(compute[q], 6) for q in queries],
        "ratio_to_larger_floor": [round(medians[f"q{q}"] / max(medians[f"floor{q}"], compute[q]), 4) for q in queries],
        "peak_gmac_per_s": round(peak / 1e6, 1),
        "weights_mb": [round(megabytes(weights_read[q]), 3) for q in queries],
        "p10_ms": [round(_quantile(times[f"q{q}"], 0.1), 3) for q in queries],
        "p90_ms": [round(_quantile(times[f"q{q}"], 0.9), 3) for q in queries],
        "ratio_to_q1": [round(medians[f"q{q}"] / base, 4) if base else None for q in queries],
        "ratio_to_stock_q1": [round(medians[f"q{q}"] / medians["stock"], 4) for q in queries],
        "stock_q1_ms": round(medians["stock"], 3),
        "stock_q1_p10_ms": round(_quantile(times["stock"], 0.1), 3),
        "stock_q1_p90_ms": round(_quantile(times["stock"], 0.9), 3),
        "stock_frame_ms": round(statistics.median(frames["stock_frame"]), 3),
        "plain_frame_ms": round(statistics.median(frames["plain_frame"]), 3),
        "kv_length": KV_LENGTH, "repeats": repeats, "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."), "device": str(device), "weights": weights,
        "weight_format": weight_format,
    }


def _quantile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def codes_per_call_by_budget(table: dict | None) -> tuple[dict[int, float], str]:
    """Codes per call per node budget: from an acceptance table (a greedy tree per budget, whole frames,
    rvqtts.tree.frame_codes_per_call), or the paper's figures when there is none."""
    if table is None:
        return dict(PAPER_CODES_PER_CALL), "paper, offsets drafter (Figure 4; reference, not measured here)"
    rates = table["acceptance"]
    figures = {n: round(frame_codes_per_call(rates, grow_tree(rates, n)), 4) for n in BUDGETS}
    source = table.get("source") or f"acceptance table of {table.get('model') or 'a model'}"
    return figures, source


def cost_at(predictor: dict, q: int, key: str = "ratio_to_q1") -> float:
    """A predictor bench figure at query length q (within the measured range), interpolated linearly
    between measured lengths."""
    lengths, values = predictor["q"], predictor[key]
    if q in lengths:
        return values[lengths.index(q)]
    below = max(x for x in lengths if x < q)
    above = min(x for x in lengths if x > q)
    low, high = values[lengths.index(below)], values[lengths.index(above)]
    return low + (high - low) * (q - below) / (above - below)


def project_speedup(codes_per_call: dict[int, float], predictor: dict) -> dict:
    """Projected inner-loop speedup per N: codes per call at N over the cost of a q = N + 1 call relative
    to a q = 1 call (against rvqtts's plain loop, and against qwen-tts's stock q = 1 call). The best N is
    the fastest, or 0 when none beats the plain loop."""
    measured = [n for n in sorted(codes_per_call) if min(predictor["q"]) <= n + 1 <= max(predictor["q"])]
    if not measured:
        raise ValueError(f"the predictor bench measured q = {min(predictor['q'])}..{max(predictor['q'])}, none of "
                         f"q = N + 1 for N = {', '.join(map(str, sorted(codes_per_call)))}: rerun `rvqtts bench "
                         f"predictor` with --q covering them")
    rows = []
    for n in measured:
        codes = codes_per_call[n]
        ratio, ratio_stock = cost_at(predictor, n + 1), cost_at(predictor, n + 1, "ratio_to_stock_q1")
        rows.append({"N": n, "codes_per_call": codes, "cost_ratio": round(ratio, 4),
                     "speedup": round(codes / ratio, 4), "speedup_vs_stock": round(codes / ratio_stock, 4)})
    best = max(rows, key=lambda row: row["speedup"])
    # best_N = 0: no tree beats the plain loop on this device with this acceptance.
    return {"rows": rows, "best_N": best["N"] if best["speedup"] > 1.0 else 0, "best_speedup": best["speedup"],
            "not_measured": [n for n in sorted(codes_per_call) if n not in measured],
            "device": predictor["device"], "dtype": predictor["dtype"], "weights": predictor["weights"],
            "weight_format": predictor.get("weight_format", "native")}


def plot_speedup(projection: dict, acceptance_source: str, path) -> None:
    """Two panels in the manner of the paper's Figure 4: the acceptance ceiling (codes per call) over N,
    and the projected speedup over N on the measured device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [row["N"] for row in projection["rows"]]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(budgets, [row["codes_per_call"] for row in projection["rows"]], "o-", color="tab:blue")
    left.set(xscale="log", xlabel="tree nodes N", ylabel="codes per call", title="acceptance ceiling")
    left.text(0.02, 0.02, acceptance_source[:70], transform=left.transAxes, fontsize=7, color="gray")
    label = f"{projection['device']} {projection['dtype']}"
    right.plot(budgets, [row["speedup"] for row in projection["rows"]], "o-", color="tab:red",
               label=f"vs rvqtts plain loop ({label})")
    right.plot(budgets, [row["speedup_vs_stock"] for row in projection["rows"]], "s--", color="tab:orange",
               label="vs stock qwen-tts q = 1 call")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set(xscale="log", xlabel="tree nodes N", ylabel="projected inner-loop speedup",
              title=f"{label}: " + (f"best N = {projection['best_N']}" if projection["best_N"] else "no N pays"))
    right.legend(fontsize=7)
    ticks = [n for n in budgets if n & (n - 1) == 0]  # powers of two; neighbours like 15 and 16 would collide
    for axis in (left, right):
        axis.set_xticks(ticks, [str(n) for n in ticks])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=120)
    plt.close(figure)
    write_atomically(path, image.getvalue())


TIMED_FIELDS = ("wall_seconds", "talker_seconds", "predictor_seconds", "decoder_seconds")


def fixed_variants(fixed: list) -> list[str]:
    """The names of `bench e2e`'s fixed-tree variants, `N=n` (their node counts), which must differ."""
    names = [f"N={speculation.tree.nodes}" for speculation in fixed]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"the fixed trees must differ in size, got {', '.join(names) or 'none'}")
    return names


def bench_e2e(tts: object, lines: list[tuple[str | None, str, str]], fixed: list, seed: int = 0, settings=None,
              progress: Callable[[int, int], None] | None = None, weight_format: str = "native",
              instruct: str | None = None, clone=None, default=None) -> dict:
    """Stock qwen-tts, rvqtts's plain loop, rvqtts's default (`default`: what `--tree auto` runs, decided
    online, rvqtts.online) and rvqtts's speculative loop with each fixed tree of `fixed` (a variant `N=n`
    each) on the same texts and seeds, taking turns text by text (the order rotating), each text spoken as
    one piece (lines of (text, speaker, language); `instruct` and a Base model's `clone`, an
    rvqtts.cloning.ClonedVoice, for all). Frame counts differ between variants (sampled codes decide where
    speech ends), so times are compared per frame."""
    from rvqtts.online import OnlineSpeculation
    from rvqtts.synthesis import GenerationSettings, Synthesizer

    settings = settings or GenerationSettings()
    names = fixed_variants(fixed)
    synthesizers = {"plain": Synthesizer(tts, None, weight_format), "auto": Synthesizer(tts, default, weight_format)}
    synthesizers |= {name: Synthesizer(tts, speculation, weight_format) for name, speculation in zip(names, fixed)}
    if isinstance(default, OnlineSpeculation):  # its one-time cost measurement is not part of any line
        default.start(synthesizers["auto"].inner_parts().runner, synthesizers["auto"].sampling(settings).predictor)
    variants = ("stock", "plain", "auto", *names)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    talker, runner = synthesizers["plain"].talker_runner(), synthesizers["plain"].inner_parts().runner
    floors = _e2e_floor_passes(talker, runner, dict(zip(names, fixed)), tts.model.talker)
    floor_times: dict[str, list[float]] = {name: [] for name in floors}
    for number, (text, speaker, language) in enumerate(lines):
        turn = number % len(variants)
        order = variants[turn:] + variants[:turn]
        for name in order:
            if name == "stock":
                record = synthesizers["plain"].synthesize_stock(text, speaker, language, seed, settings, instruct,
                                                                clone)
            else:
                record = synthesizers[name].synthesize(text, speaker, language, seed, settings=settings,
                                                       chunk_chars=None, instruct=instruct, clone=clone).record()
            runs[name].append({key: record[key] for key in ("frames", "audio_seconds", *TIMED_FIELDS, "rtf")}
                              | ({key: record[key] for key in ("codes_per_call", "predictor_calls", "talker_calls")}
                                 if name != "stock" else {}))
            if progress:
                progress(number * len(order) + order.index(name) + 1, len(lines) * len(order))
        for name, values in interleaved_ms(floors, talker.device, warmup=1, repeats=3).items():
            floor_times[name].extend(values)
    floor_ms = {name: round(statistics.median(values), 3) for name, values in floor_times.items()}
    totals = {name: _totals(records) | _floor_per_frame(name, records, floor_ms, runner.code_groups - 1)
              for name, records in runs.items()}
    online = synthesizers["auto"].speculation
    best = min(names, key=lambda name: totals[name]["predictor_ms_per_frame"] or float("inf"))
    return {"runs": runs, "totals": totals, "ratios": _e2e_ratios(totals, names, best), "seed": seed,
            "tree_nodes": [speculation.tree.nodes for speculation in fixed], "best_fixed": best,
            "texts": len(lines), "floor_ms": floor_ms, "weight_format": weight_format,
            "auto": online.record() if isinstance(online, OnlineSpeculation) else {
                "N": online.tree.nodes if online else 0}}


def _e2e_floor_passes(talker: object, runner: PredictorRunner, fixed: dict,
                      module: torch.nn.Module) -> dict[str, Callable[[], None]]:
    """Passes over what each kind of call reads: rvqtts's talker step, plain predictor step and verify round
    of each fixed tree mid-frame (KV_LENGTH committed slots; `fixed`: variant name -> speculation), as the
    runners hold their weights (8-bit ones too), and stock's talker and predictor steps over the modules'
    own weights."""
    index, last = KV_LENGTH - 1, runner.code_groups - 1
    predictor = module.code_predictor
    stock_predictor = [predictor.model.layers, predictor.model.norm, predictor.small_to_mtp_projection,
                       predictor.lm_head[index]]
    rounds = {}
    for name, speculation in fixed.items():
        plan = speculation.plan(min(speculation.tree.depth, last - index), runner.device)
        rounds[f"predictor_round {name}"] = read_pass(predictor_weights(runner, round_heads(plan, index, last)))
    return {"talker_step": read_pass(talker_weights(talker)),
            "predictor_step": read_pass(predictor_weights(runner, [index + 1])), **rounds,
            "stock_talker_step": read_pass(module_weights(module.model.layers, module.model.norm, module.codec_head)),
            "stock_predictor_step": read_pass(module_weights(*stock_predictor))}


def _floor_per_frame(variant: str, records: list[dict], floor_ms: dict[str, float], plain_calls: int) -> dict:
    """The floor of a variant's talker and inner loop per frame: the read passes of the calls it made (stock:
    one talker step and `plain_calls` predictor calls per frame; a fixed tree: a prefill, then rounds of its
    tree; auto, whose tree size changes, has none)."""
    frames = sum(r["frames"] for r in records)
    if not frames or variant == "auto":
        return {"talker_floor_ms_per_frame": None, "predictor_floor_ms_per_frame": None}
    talker_calls = sum(r.get("talker_calls", r["frames"]) for r in records)
    calls = sum(r.get("predictor_calls", 0) for r in records) or frames * plain_calls
    rounds = calls - frames if variant not in ("stock", "plain") else 0
    kind = "stock_" if variant == "stock" else ""  # stock reads the modules' own weights
    predictor = (calls - rounds) * floor_ms[f"{kind}predictor_step"]
    if rounds:
        predictor += rounds * floor_ms[f"predictor_round {variant}"]
    return {"talker_floor_ms_per_frame": round(talker_calls * floor_ms[f"{kind}talker_step"] / frames, 2),
            "predictor_floor_ms_per_frame": round(predictor / frames, 2)}


def _totals(records: list[dict]) -> dict:
    frames = sum(r["frames"] for r in records)
    audio = sum(r["audio_seconds"] for r in records)
    totals = {"frames": frames, "audio_seconds": round(audio, 3)}
    for key in TIMED_FIELDS:
        seconds = sum(r[key] for r in records)
        totals[key] = round(seconds, 3)
        totals[key.replace("_seconds", "_ms_per_frame")] = round(1e3 * seconds / frames, 2) if frames else None
    totals["rtf"] = round(totals["wall_seconds"] / audio, 4) if audio else None
    return totals


def _e2e_ratios(totals: dict, fixed: list[str], best: str) -> dict:
    """How many times faster the second variant is than the first, per frame (`best`: the fixed tree whose
    inner loop was fastest)."""
    def faster(slow: str, fast: str, part: str) -> float | None:
        a, b = totals[slow][f"{part}_ms_per_frame"], totals[fast][f"{part}_ms_per_frame"]
        return round(a / b, 3) if a and b else None

    pairs = [("stock", "auto"), ("plain", "auto"), (best, "auto"), ("stock", "plain")]
    pairs += [("plain", name) for name in fixed]
    return {f"{slow}/{fast} {part}": faster(slow, fast, part) for slow, fast in pairs
            for part in ("wall", "predictor", "talker")}


def bench_decoder(tts: object, lengths: list[int], repeats: int = 3, seed: int = 0) -> dict:
    """What the speech decoder costs per frame as an utterance grows: qwen-tts's `decode()` on random
    codes of each length (its cost does not depend on the codes), the lengths interleaved. Past 300
    frames qwen-tts decodes in chunks of 300 with 25 frames of left context."""
    tokenizer = tts.model.speech_tokenizer
    device = next(tokenizer.model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    groups = tts.model.config.talker_config.num_code_groups
    vocab = tts.model.config.talker_config.code_predictor_config.vocab_size
    items = {n: [{"audio_codes": torch.randint(0, vocab, (n, groups), generator=generator).to(device)}]
             for n in lengths}
    with torch.inference_mode():
        times = interleaved_ms({f"f{n}": partial(tokenizer.decode, items[n]) for n in lengths}, device,
                               warmup=1, repeats=repeats)
    rows = [{"frames": n, "ms": round(statistics.median(times[f"f{n}"]), 1),
             "ms_per_frame": round(statistics.median(times[f"f{n}"]) / n, 2)} for n in lengths]
    return {"rows": rows, "repeats": repeats, "device": str(device),
            "dtype": str(next(tokenizer.model.parameters()).dtype).removeprefix("torch.")}


def bench_talker(talker: torch.nn.Module, contexts: list[int], repeats: int = 20, seed: int = 0,
                 weight_format: str = "native") -> dict:
    """One talker step at each context length: rvqtts's runner (rvqtts.talker) against qwen-tts's talker
    transformer and codec head as its HF loop calls them (a dynamic cache, the attention mask and MRoPE
    positions of generate()), the two taking turns. The stock step's code-predictor call, which qwen-tts
    makes inside the same forward, is not part of it: this is the talker's share of a frame."""
    from transformers import DynamicCache

    from rvqtts.talker import TalkerRunner

    device, dtype = talker.codec_head.weight.device, talker.codec_head.weight.dtype
    generator = torch.Generator().manual_seed(seed)
    runner = TalkerRunner(talker, weights=weight_format)
    weights = talker_weights(runner)
    floor = read_pass(weights)
    rows = []
    for length in contexts:
        prompt = (0.02 * torch.randn(length, talker.config.hidden_size, generator=generator)).to(device, dtype)
        step = (0.02 * torch.randn(1, talker.config.hidden_size, generator=generator)).to(device, dtype)
        cache = DynamicCache()
        mask = torch.ones(1, length + 1, dtype=torch.long, device=device)
        positions = torch.full((3, 1, 1), length, dtype=torch.long, device=device)
        with torch.inference_mode():
            runner.prefill(prompt)
            talker.model(inputs_embeds=prompt[None], past_key_values=cache, use_cache=True)

            def stock() -> torch.Tensor:
                hidden = talker.model(inputs_embeds=step[None], attention_mask=mask, position_ids=positions,
                                      past_key_values=cache, use_cache=True).last_hidden_state
                return talker.codec_head(hidden)

            times = interleaved_ms({"stock": stock, "rvqtts": partial(runner.step, step, length), "floor": floor},
                                   device, warmup=3, repeats=repeats, reset=lambda: cache.crop(length))
        stock_ms, ours_ms, floor_ms = (statistics.median(times[name]) for name in ("stock", "rvqtts", "floor"))
        rows.append({"context": length, "stock_ms": round(stock_ms, 2), "rvqtts_ms": round(ours_ms, 2),
                     "ratio": round(ours_ms / stock_ms, 3), "floor_ms": round(floor_ms, 4),
                     "ratio_to_floor": round(ours_ms / floor_ms, 3)})
    peak = peak_multiply_adds_per_ms(dtype, device)
    return {"rows": rows, "repeats": repeats, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "layers": talker.config.num_hidden_layers, "hidden_size": talker.config.hidden_size,
            "weights_mb": round(megabytes(weights), 3), "weight_format": weight_format,
            "compute_floor_ms": round(multiply_adds(weights) / peak, 6),  # one row through every weight
            "peak_gmac_per_s": round(peak / 1e6, 1)}


def random_prefixes(talker: torch.nn.Module, frames: int, seed: int = 0) -> torch.Tensor:
    """Frame contexts [frames, 2, E] like the talker hands over: random h_t, and a random c0's embedding."""
    generator = torch.Generator().manual_seed(seed)
    embedding = talker.get_input_embeddings()
    h_t = torch.randn(frames, talker.config.hidden_size, generator=generator)
    c0 = torch.randint(0, talker.config.code_predictor_config.vocab_size, (frames,), generator=generator)
    with torch.inference_mode():
        return torch.stack([h_t.to(embedding.weight.dtype), embedding(c0.to(embedding.weight.device)).cpu()], dim=1)


def bench_dtype(reference: torch.nn.Module, candidate: torch.nn.Module, prefixes: torch.Tensor, seed: int = 0,
                sampling: SamplingConfig = SamplingConfig(), candidate_weights: str = "native") -> dict:
    """A code predictor in another dtype or with 8-bit weights (`candidate`, `candidate_weights`) against
    the `reference` (float32, or the same model's own weights) on the same frames and noise, plain loops:
    codes drawn by the candidate given the reference's earlier codes (teacher forcing: how often the dtype changes a draw), frames whose 15 codes all agree when each runs
    free, and the codes a free-running frame gets right before its first difference; with the two
    loops' ms per frame, timed frame by frame in turn."""
    from rvqtts.sampling import draw, gumbel_noise
    from rvqtts.inner_loop import InnerLoop, LoopParts

    loops = {"reference": InnerLoop(reference, None, seed),
             "candidate": InnerLoop(candidate, None, seed, parts=LoopParts.build(candidate, None, True,
                                                                                 candidate_weights))}
    runner = loops["candidate"].runner
    last = runner.code_groups - 1
    forced = agree = frames_equal = before_first = 0
    ms = {name: [] for name in loops}
    with torch.inference_mode():
        for frame, prefix in enumerate(prefixes):
            codes = {}
            for name, loop in loops.items():
                started = time.perf_counter()
                codes[name] = loop.decode(prefix.to(loop.runner.device, loop.runner.dtype), sampling, 0, frame)
                synchronize(loop.runner.device)
                ms[name].append((time.perf_counter() - started) * 1e3)
            ours, theirs = codes["candidate"], codes["reference"]
            frames_equal += ours == theirs
            before_first += next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), last)
            noise = torch.from_numpy(gumbel_noise(seed, 0, frame, list(range(1, last + 1)), runner.vocab_size))
            noise = noise.to(runner.device)
            hidden = runner.prefill(prefix.to(runner.device, runner.dtype))
            for index in range(1, last + 1):  # c_index drawn by the candidate after the reference's c_<index
                if index > 1:
                    hidden = runner.step(torch.tensor([theirs[index - 2]], device=runner.device), index - 1)
                agree += int(draw(runner.logits(hidden, index), noise[index - 1], sampling)) == theirs[index - 1]
                forced += 1
    frames = len(prefixes)
    return {"frames": frames, "codes_per_frame": last, "dtype": str(runner.dtype).removeprefix("torch."),
            "reference_dtype": str(loops["reference"].runner.dtype).removeprefix("torch."),
            "teacher_forced_code_agreement": round(agree / forced, 5),
            "free_running_frames_identical": round(frames_equal / frames, 4),
            "codes_before_first_difference": round(before_first / frames, 3),
            "ms_per_frame": {name: round(statistics.median(values), 2) for name, values in ms.items()},
            "device": str(runner.device), "weights": candidate_weights}


def bench_fused(code_predictor: torch.nn.Module, speculation, candidate, prefixes: torch.Tensor, seed: int = 0,
                sampling: SamplingConfig = SamplingConfig()) -> dict:
    """A fused decoder (a Core ML package, or PyTorch in float16 standing in for one off macOS) against the
    float32 PyTorch engine on the same frames and noise: how many codes and whole frames agree, speculative
    and plain, the candidate's codes per call, and its milliseconds per frame both ways (interleaved)."""
    import numpy as np

    from rvqtts.decode import DecodeStats
    from rvqtts.sampling import gumbel_noise
    from rvqtts.inner_loop import InnerLoop

    engine = InnerLoop(code_predictor, speculation, seed)
    positions = np.arange(1, engine.code_groups)
    spec_stats, plain_stats = DecodeStats(), DecodeStats()
    same = {"spec": [0, 0], "plain": [0, 0]}  # codes, frames
    seconds = {"spec": 0.0, "plain": 0.0}
    for frame, prefix in enumerate(prefixes):
        noise = torch.from_numpy(gumbel_noise(seed, 0, frame, positions, engine.vocab_size))
        reference = engine.decode(prefix, sampling, 0, frame)
        for mode, decode, stats in (("spec", candidate.decode, spec_stats), ("plain", candidate.decode_plain,
                                                                              plain_stats)):
            started = time.perf_counter()
            codes = decode(prefix, noise.to(candidate.device), stats)
            seconds[mode] += time.perf_counter() - started
            same[mode][0] += sum(a == b for a, b in zip(codes, reference))
            same[mode][1] += codes == reference
    frames, codes = len(prefixes), len(prefixes) * (engine.code_groups - 1)
    return {"frames": frames,
            **{f"{mode}_code_agreement": round(same[mode][0] / codes, 5) for mode in same},
            **{f"{mode}_frame_agreement": round(same[mode][1] / frames, 5) for mode in same},
            "codes_per_call": round(spec_stats.codes_per_call, 4),
            "engine_codes_per_call": round(engine.stats.codes_per_call, 4),
            **{f"{mode}_ms_per_frame": round(1e3 * seconds[mode] / frames, 3) for mode in seconds},
            "inner_loop_speedup": round(seconds["plain"] / seconds["spec"], 3) if seconds["spec"] else None}
