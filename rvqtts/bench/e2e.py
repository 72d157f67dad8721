"""`rvqtts bench e2e`: whole synthesis, stock qwen-tts against rvqtts's plain loop, its default and fixed
trees, text by text in turn after an untimed short turn of each (a GPU's graph captures and first calls are not
timed), per frame and against the floors of the calls each made."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from rich.console import Group
from rich.table import Table

from rvqtts.bench.floor import module_weights, predictor_weights, read_pass, round_heads, talker_weights
from rvqtts.bench.harness import KV_LENGTH, interleaved_ms
from rvqtts.bench.stock import stock_synthesis
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.support.report import ms_by_part, titled_table
from rvqtts.synthesis.settings import GenerationSettings

TIMED_FIELDS = ("wall_seconds", "talker_seconds", "predictor_seconds", "decoder_seconds")
WARM_UP = GenerationSettings(max_frames=2)  # each variant's untimed first turn


def fixed_variants(fixed: list) -> list[str]:
    """The names of `bench e2e`'s fixed-tree variants, `N=n` (their node counts), which must differ."""
    names = [f"N={speculation.tree.nodes}" for speculation in fixed]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"the fixed trees must differ in size, got {', '.join(names) or 'none'}")
    return names


def bench_e2e(
    tts: object,
    lines: list[tuple[str | None, str, str]],
    fixed: list,
    seed: int = 0,
    settings=None,
    progress: Callable[[int, int], None] | None = None,
    weight_format: str = "native",
    instruct: str | None = None,
    clone=None,
    default=None,
) -> dict:
    """Stock qwen-tts, rvqtts's plain loop, rvqtts's default (`default`: what `--tree auto` runs, decided
    online, rvqtts.engine.speculative.online) and rvqtts's speculative loop with each fixed tree of `fixed` (a variant
    `N=n` each) on the same texts and seeds, taking turns text by text (the order rotating), each text spoken as
    one piece (lines of (text, speaker, language); `instruct` and a Base model's `clone`, an
    rvqtts.qwen.cloning.ClonedVoice, for all). Frame counts differ between variants (sampled codes decide where
    speech ends), so times are compared per frame."""
    settings = settings or GenerationSettings()
    names = fixed_variants(fixed)
    synthesizers = _variant_synthesizers(tts, dict(zip(names, fixed)), weight_format, default, settings)
    variants = ("stock", "plain", "auto", *names)
    text, speaker, language = lines[0]
    for name in variants:  # one short turn of each first: no variant's first text pays for first calls (captures)
        _variant_record(synthesizers, name, text, (speaker, language, instruct, clone), seed, WARM_UP)
    online = synthesizers["auto"].speculation
    warmed = dict(getattr(online, "frames_by_budget", {}))  # the online choice's frames by N before the timed turns
    talker, runner = synthesizers["plain"].runners.talker(), synthesizers["plain"].runners.inner_parts().runner
    floors = _e2e_floor_passes(talker, runner, dict(zip(names, fixed)), tts.model.talker)
    turns = _TimedTurns(synthesizers, variants, (instruct, clone), seed, settings)
    runs, floor_ms = turns.run(lines, floors, talker.device, progress)
    totals = _e2e_totals(runs, floor_ms, runner.code_groups - 1)
    best = min(names, key=lambda name: totals[name]["predictor_ms_per_frame"] or float("inf"))
    return {
        "runs": runs,
        "totals": totals,
        "ratios": _e2e_ratios(totals, names, best),
        "seed": seed,
        "tree_nodes": [speculation.tree.nodes for speculation in fixed],
        "best_fixed": best,
        "texts": len(lines),
        "floor_ms": floor_ms,
        "weight_format": weight_format,
        "auto": _online_record(online, warmed),
        "memory": _e2e_memory(synthesizers),
    }


def _variant_synthesizers(tts: object, fixed: dict, weight_format: str, default, settings) -> dict:
    """One synthesizer per rvqtts variant on the one loaded model: plain, auto (`default`) and each fixed tree
    (`fixed`: variant name -> speculation). The online choice's one-time cost measurement runs here, so that it
    is part of no timed line."""
    from rvqtts.synthesis.synthesizer import Synthesizer

    synthesizers = {"plain": Synthesizer(tts, None, weight_format), "auto": Synthesizer(tts, default, weight_format)}
    synthesizers |= {name: Synthesizer(tts, speculation, weight_format) for name, speculation in fixed.items()}
    if default is not None:
        auto = synthesizers["auto"]
        default.start(auto.runners.inner_parts().runner, auto.sampling(settings).predictor)
    return synthesizers


@dataclass(frozen=True)
class _TimedTurns:
    """The timed turns of `bench e2e`: every variant speaks every text, in an order rotating text by text (no
    variant always first), all in one voice's `instruct` and `clone` (`extra`), with the same seed and settings."""

    synthesizers: dict
    variants: tuple[str, ...]
    extra: tuple
    seed: int
    settings: GenerationSettings

    def run(
        self, lines: list, floors: dict, device: object, progress: Callable[[int, int], None] | None
    ) -> tuple[dict[str, list[dict]], dict[str, float]]:
        """Each variant's records, text by text, and each floor's median ms; the floors' read passes are timed
        after every text's turn, so that they see the device as the variants did."""
        runs: dict[str, list[dict]] = {name: [] for name in self.variants}
        floor_times: dict[str, list[float]] = {name: [] for name in floors}
        for number, line in enumerate(lines):
            for done, (name, record) in enumerate(self.turn(number, line), 1):
                runs[name].append(record)
                if progress:
                    progress(number * len(self.variants) + done, len(lines) * len(self.variants))
            for name, values in interleaved_ms(floors, device, warmup=1, repeats=3).items():
                floor_times[name].extend(values)
        return runs, {name: round(statistics.median(values), 3) for name, values in floor_times.items()}

    def turn(self, number: int, line: tuple[str, str | None, str]) -> Iterator[tuple[str, dict]]:
        """Text `number` (text, speaker, language) spoken by every variant, starting `number` variants along."""
        text, speaker, language = line
        start = number % len(self.variants)
        for name in self.variants[start:] + self.variants[:start]:
            voice = (speaker, language, *self.extra)
            yield name, _variant_record(self.synthesizers, name, text, voice, self.seed, self.settings)


def _e2e_totals(runs: dict[str, list[dict]], floor_ms: dict[str, float], plain_calls: int) -> dict:
    """Each variant's totals over its records: times per frame, the floors of the calls it made (`plain_calls`:
    the plain loop's predictor calls per frame) and, for the speculative variants, a round's cost."""
    totals = {
        name: _totals(records) | _floor_per_frame(name, records, floor_ms, plain_calls)
        for name, records in runs.items()
    }
    add_round_costs(totals, plain_calls)
    return totals


def _online_record(online: object, warmed: dict[int, int]) -> dict:
    """What `--tree auto` ran in the timed turns: the online choice's record over the frames it chose since the
    warm-up (`warmed`: its frames by N then), or its one tree size (0: none)."""
    timed = {n: frames - warmed.get(n, 0) for n, frames in getattr(online, "frames_by_budget", {}).items()}
    return (online and online.record(timed)) or {"N": online.budget if online else 0}


def _e2e_memory(synthesizers: dict) -> dict:
    """The process's memory and what each rvqtts variant's engine keeps beside the model (its caches). The
    variants share one loaded model in one process, so the peak is theirs together (`synth --stats-json` gives one
    variant's alone)."""
    from rvqtts.support.memory import memory_record

    caches = {name: round(sum(synth.cache_mib().values()), 3) for name, synth in synthesizers.items()}
    return memory_record() | {"caches_mib": caches}


def _variant_record(synthesizers: dict, name: str, text: str, voice: tuple, seed: int, settings) -> dict:
    """One variant's figures for one text in one voice (speaker, language, instruct, clone): stock qwen-tts's (on
    the plain variant's model) or rvqtts's."""
    speaker, language, instruct, clone = voice
    if name == "stock":
        record = stock_synthesis(synthesizers["plain"], text, speaker, language, seed, settings, instruct, clone)
        return {key: record[key] for key in ("frames", "audio_seconds", *TIMED_FIELDS, "rtf")}
    spoken = synthesizers[name].synthesize(
        text, speaker, language, seed, settings=settings, chunk_chars=None, instruct=instruct, clone=clone
    )
    record = spoken.record()
    kept = ("frames", "audio_seconds", *TIMED_FIELDS, "rtf", "codes_per_call", "predictor_calls", "talker_calls")
    kept += ("inner_loop_ms_by_part",)
    return {key: record[key] for key in kept}


def _e2e_floor_passes(
    talker: object, runner: PredictorRunner, fixed: dict, module: torch.nn.Module
) -> dict[str, Callable[[], None]]:
    """Passes over what each kind of call reads: rvqtts's talker step, plain predictor step and verify round
    of each fixed tree mid-frame (KV_LENGTH committed slots; `fixed`: variant name -> speculation), as the
    runners hold their weights (8-bit ones too), and stock's talker and predictor steps over the modules'
    own weights."""
    index, last = KV_LENGTH - 1, runner.code_groups - 1
    predictor = module.code_predictor
    stock_predictor = [
        predictor.model.layers,
        predictor.model.norm,
        predictor.small_to_mtp_projection,
        predictor.lm_head[index],
    ]
    rounds = {}
    for name, speculation in fixed.items():
        plan = speculation.plan(min(speculation.tree.depth, last - index), runner.device)
        rounds[f"predictor_round {name}"] = read_pass(predictor_weights(runner, round_heads(plan, index, last)))
    return {
        "talker_step": read_pass(talker_weights(talker)),
        "predictor_step": read_pass(predictor_weights(runner, [index + 1])),
        **rounds,
        "stock_talker_step": read_pass(module_weights(module.model.layers, module.model.norm, module.codec_head)),
        "stock_predictor_step": read_pass(module_weights(*stock_predictor)),
    }


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
    return {
        "talker_floor_ms_per_frame": round(talker_calls * floor_ms[f"{kind}talker_step"] / frames, 2),
        "predictor_floor_ms_per_frame": round(predictor / frames, 2),
    }


def _totals(records: list[dict]) -> dict:
    frames = sum(r["frames"] for r in records)
    audio = sum(r["audio_seconds"] for r in records)
    totals = {"frames": frames, "audio_seconds": round(audio, 3)}
    if any("inner_loop_ms_by_part" in r for r in records):  # rvqtts's variants
        totals["inner_loop_ms_by_part"] = ms_by_part(records, frames)
        totals["calls_per_frame"] = round(sum(r["predictor_calls"] for r in records) / frames, 3) if frames else None
    for key in TIMED_FIELDS:
        seconds = sum(r[key] for r in records)
        totals[key] = round(seconds, 3)
        totals[key.replace("_seconds", "_ms_per_frame")] = round(1e3 * seconds / frames, 2) if frames else None
    totals["rtf"] = round(totals["wall_seconds"] / audio, 4) if audio else None
    return totals


def add_round_costs(totals: dict, plain_calls: int) -> None:
    """What a tree round costs inside the loop, beside a plain step there: each speculative variant's inner loop
    less its prefills, per round (`round_ms`), its forward pass alone (`round_forward_ms`), and the round against
    the plain variant's inner loop per call (`round_per_plain_step`). Needs the loop's time by part (CPUs)."""
    plain = totals.get("plain", {}).get("predictor_ms_per_frame")
    step = plain / plain_calls if plain else None
    for total in totals.values():
        parts, calls = total.get("inner_loop_ms_by_part"), total.get("calls_per_frame")
        if not parts or "prefill" not in parts or not calls or calls <= 1:
            continue
        rounds = calls - 1  # a prefill, then rounds
        total["round_ms"] = round((sum(parts.values()) - parts["prefill"]) / rounds, 3)
        total["round_forward_ms"] = round(parts.get("forward", 0.0) / rounds, 3)
        total["round_per_plain_step"] = round(total["round_ms"] / step, 3) if step else None


def _e2e_ratios(totals: dict, fixed: list[str], best: str) -> dict:
    """How many times faster the second variant is than the first, per frame (`best`: the fixed tree whose
    inner loop was fastest)."""

    def faster(slow: str, fast: str, part: str) -> float | None:
        a, b = totals[slow][f"{part}_ms_per_frame"], totals[fast][f"{part}_ms_per_frame"]
        return round(a / b, 3) if a and b else None

    pairs = [("stock", "auto"), ("plain", "auto"), (best, "auto"), ("stock", "plain")]
    pairs += [("plain", name) for name in fixed]
    return {
        f"{slow}/{fast} {part}": faster(slow, fast, part)
        for slow, fast in pairs
        for part in ("wall", "predictor", "talker")
    }


def e2e_table(result: dict) -> Group:
    """`rvqtts bench e2e`: per-frame times of stock qwen-tts, the plain loop, the default and fixed trees, and where
    the inner loop's time went."""
    return Group(_variants_table(result), _parts_table(result["totals"]))


PART_ORDER = ("plain", "prefill", "layout", "drafts", "forward", "heads", "draws", "walk")  # as a frame runs them
ROUND_FIGURES = {"round ms": "round_ms", "its forward": "round_forward_ms", "x plain step": "round_per_plain_step"}


def _parts_table(totals: dict) -> Table:
    """The inner loop's milliseconds per frame by part, and a round's cost inside it against a plain step's: a
    column per rvqtts variant."""
    variants = [name for name, total in totals.items() if "inner_loop_ms_by_part" in total]
    found = {part for name in variants for part in totals[name]["inner_loop_ms_by_part"]}
    parts = sorted(found, key=lambda part: (PART_ORDER + (part,)).index(part))
    table = titled_table("inner loop by part, ms per frame", ("", *variants), left=("",))
    table.add_row("calls per frame", *(f"{totals[name]['calls_per_frame']:.2f}" for name in variants))
    for part in parts:
        by_part = [totals[name]["inner_loop_ms_by_part"].get(part) for name in variants]
        table.add_row(part, *("-" if ms is None else f"{ms:.1f}" for ms in by_part))
    for label, key in ROUND_FIGURES.items():
        table.add_row(label, *("-" if totals[n].get(key) is None else f"{totals[n][key]:.2f}" for n in variants))
    table.caption = (
        "round ms: the inner loop less its prefills, per round (drafts, layout, call, heads, draws, walk); its "
        "forward: the layers' pass alone; x plain step: the round against the plain loop's time per call (CPUs)"
    )
    return table


def _variants_table(result: dict) -> Table:
    table = titled_table(
        f"end to end, {result['texts']} texts, seed {result['seed']}, fastest fixed tree: "
        f"{result['best_fixed']}, auto: {_online_summary(result['auto'])}",
        ("variant", "frames", "wall ms/frame", "talker", "floor", "inner loop", "floor", "decoder", "RTF"),
        left=("variant",),
    )
    for name, total in result["totals"].items():
        table.add_row(
            name,
            str(total["frames"]),
            *(
                "-" if total[key] is None else f"{total[key]:.1f}"
                for key in (
                    "wall_ms_per_frame",
                    "talker_ms_per_frame",
                    "talker_floor_ms_per_frame",
                    "predictor_ms_per_frame",
                    "predictor_floor_ms_per_frame",
                    "decoder_ms_per_frame",
                )
            ),
            f"{total['rtf'] or 0:.3f}",
        )
    table.caption = (
        "; ".join(f"{name}: {ratio}x" for name, ratio in result["ratios"].items())
        + "; floor: read passes over the weights of the calls made, timed in the same run"
    )
    return table


def _online_summary(auto: dict) -> str:
    """What `--tree auto` ran: frames per tree size where it chose online, else its one tree size."""
    if "frames_by_N" not in auto:
        return f"N = {auto['N']}"
    return "frames by N " + ", ".join(f"{n}: {frames}" for n, frames in auto["frames_by_N"].items())
