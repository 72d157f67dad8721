"""The bench commands run on the tiny checkpoint and write well-formed output; the projection's
arithmetic and the measured-choice default for `--tree auto` are checked exactly. (Benchmarks are not
tests: no timing is asserted.)"""

from __future__ import annotations

import json

import pytest
from helpers import run_cli as run
from helpers import run_cli_json as run_json
from rich.console import Console

from rvqtts.bench import e2e as e2e_module
from rvqtts.bench.predictor import predictor_table
from rvqtts.bench.speedup import BUDGETS, PAPER_CODES_PER_CALL, codes_per_call_by_budget, cost_at, project_speedup
from rvqtts.engine.speculative.offsets import predictor_fingerprint
from rvqtts.engine.speculative.policy import choose_speculation
from rvqtts.engine.speculative.tree import (
    FALLBACK_BUDGET,
    SHIPPED_TREES,
    best_budget,
    frame_codes_per_call,
    grow_tree,
    save_acceptance,
    save_best_budget,
)
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.synthesis.synthesizer import Synthesizer


@pytest.fixture(scope="module")
def predictor_json(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "predictor.json"
    result = run(
        "bench",
        "predictor",
        "--model",
        tiny_dir,
        "--dtype",
        "float32",
        "--q",
        "3,9,17",
        "--repeats",
        "2",
        "--json",
        path,
    )
    assert result.exit_code == 0, result.output
    return path


def test_bench_predictor_writes_its_figures(predictor_json):
    result = json.loads(predictor_json.read_text())
    assert result["q"] == [1, 3, 9, 17]  # q = 1 is always timed: ratios are taken against it
    for key in ("median_ms", "p10_ms", "p90_ms", "ratio_to_q1", "ratio_to_stock_q1"):
        assert len(result[key]) == 4 and all(v > 0 for v in result[key])
    assert result["ratio_to_q1"][0] == 1.0 and result["stock_q1_ms"] > 0
    assert result["stock_frame_ms"] > 0 and result["plain_frame_ms"] > 0
    for i in range(4):
        assert result["p10_ms"][i] <= result["median_ms"][i] <= result["p90_ms"][i]
        assert result["ratio_to_stock_q1"][i] == pytest.approx(result["median_ms"][i] / result["stock_q1_ms"], rel=0.01)
    assert (result["dtype"], result["device"]) == ("float32", "cpu") and result["weights"].endswith("tiny")


def test_bench_predictor_sets_each_call_beside_a_pass_over_its_weights(predictor_json, tiny):
    """A plain step reads the layers, the input projection and one LM head; a round of a 3-deep tree rooted
    at c_k drafts with heads k+1..k+3 and scores with heads k+1..k+4: four heads (the floor is a pass over
    exactly those bytes, each once)."""
    result = json.loads(predictor_json.read_text())
    predictor = tiny.code_predictor
    shared = sum(
        p.numel()
        for module in (predictor.model.layers, predictor.model.norm, predictor.small_to_mtp_projection)
        for p in module.parameters()
    )
    head = predictor.lm_head[0].weight.numel()
    assert result["weights_mb"][0] == pytest.approx(4 * (shared + head) / 1e6, abs=1e-3)
    assert result["weights_mb"][-1] == pytest.approx(4 * (shared + 4 * head) / 1e6, abs=1e-3)  # q = 17, depth 3
    assert all(f > 0 for f in result["floor_ms"])
    assert result["ratio_to_floor"] == [
        pytest.approx(m / f, rel=0.01) for m, f in zip(result["median_ms"], result["floor_ms"])
    ]
    # The compute floor: every row through every weight matrix read, at the peak timed in the run.
    matrices = sum(
        p.numel()
        for module in (predictor.model.layers, predictor.small_to_mtp_projection)
        for p in module.parameters()
        if p.dim() == 2
    )
    peak = result["peak_gmac_per_s"] * 1e6  # multiply-adds per ms
    assert result["compute_floor_ms"][0] == pytest.approx((matrices + head) / peak, rel=0.01)
    assert result["compute_floor_ms"][-1] == pytest.approx(17 * (matrices + 4 * head) / peak, rel=0.01)
    assert result["ratio_to_larger_floor"] == [
        pytest.approx(m / max(f, c), rel=0.01)
        for m, f, c in zip(result["median_ms"], result["floor_ms"], result["compute_floor_ms"])
    ]
    console = Console(width=220, record=True)
    console.print(predictor_table(result))
    assert "x larger floor" in console.export_text()


def test_the_compute_floor_takes_the_faster_of_the_dtype_and_float32_on_a_cpu(monkeypatch):
    """A kernel may widen bfloat16 to float32 in registers (the AVX2 ones do), and torch's capped bfloat16
    product runs far below the FMA peak: on a CPU the peak is the faster of the two products; on a GPU the
    dtype's own."""
    import torch

    from rvqtts.bench import floor

    rates = {torch.bfloat16: 0.2, torch.float32: 80.0}
    monkeypatch.setattr(floor, "_dense_multiply_adds_per_ms", lambda dtype, device, size, repeats: rates[dtype])
    assert floor.peak_multiply_adds_per_ms(torch.bfloat16, torch.device("cpu")) == 80.0
    assert floor.peak_multiply_adds_per_ms(torch.bfloat16, torch.device("cuda")) == 0.2
    rates[torch.bfloat16] = 300.0
    assert floor.peak_multiply_adds_per_ms(torch.bfloat16, torch.device("cpu")) == 300.0


def test_a_read_pass_reads_every_byte_once_and_off_the_cpu_in_one_kernel(monkeypatch):
    """The read floor: each tensor's bytes once on a CPU; off it one copy of them all, read by one kernel (a GPU
    reading a few hundred tensors one launch each would time the launches)."""
    import torch

    from rvqtts.bench.floor import read_pass

    tensors = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16)]
    reads, amax = [], torch.Tensor.amax
    monkeypatch.setattr(torch.Tensor, "amax", lambda self, *args: reads.append(self.numel()) or amax(self, *args))
    read_pass(tensors)()
    assert reads == [48, 10]
    reads.clear()
    read_pass(tensors, one_buffer=True)()
    assert reads == [58]


def test_projection_arithmetic():
    predictor = {
        "q": [1, 5, 9, 33],
        "ratio_to_q1": [1.0, 1.2, 1.4, 2.0],
        "ratio_to_stock_q1": [0.5, 0.6, 0.7, 1.0],
        "device": "cpu",
        "dtype": "bfloat16",
        "weights": "w",
    }
    assert cost_at(predictor, 17) == pytest.approx(1.4 + 0.6 * 8 / 24)  # between q = 9 and q = 33
    projection = project_speedup({4: 1.5, 8: 1.8, 16: 2.0, 64: 3.0}, predictor)
    rows = {row["N"]: row for row in projection["rows"]}
    assert set(rows) == {4, 8, 16} and projection["not_measured"] == [64]
    assert rows[4]["speedup"] == pytest.approx(1.5 / 1.2) and rows[4]["speedup_vs_stock"] == pytest.approx(1.5 / 0.6)
    assert rows[16]["speedup"] == pytest.approx(2.0 / 1.6, abs=1e-4)
    assert projection["best_N"] == 8 and projection["best_speedup"] == pytest.approx(1.8 / 1.4, abs=1e-4)
    with pytest.raises(ValueError, match="rerun `rvqtts bench predictor`"):
        project_speedup({64: 3.0}, predictor)


def test_codes_per_call_from_a_table_or_the_paper():
    figures, source = codes_per_call_by_budget(None)
    assert figures == PAPER_CODES_PER_CALL and "paper" in source
    table = {"acceptance": [[0.5, 0.2], [0.5, 0.1], [0.5]], "source": "hand"}
    figures, source = codes_per_call_by_budget(table)
    assert source == "hand" and list(figures) == list(BUDGETS)
    assert figures[8] == pytest.approx(
        frame_codes_per_call(table["acceptance"], grow_tree(table["acceptance"], 8)), abs=1e-4
    )


def write_costs(path):
    """Fixed call costs (as `bench predictor --json` writes them), so that the best N is known."""
    path.write_text(
        json.dumps(
            {
                "q": [1, 5, 8, 9, 16, 17],
                "ratio_to_q1": [1.0, 1.1, 1.15, 1.2, 1.25, 1.4],
                "ratio_to_stock_q1": [0.9, 0.99, 1.035, 1.08, 1.125, 1.26],
                "device": "cpu",
                "dtype": "float32",
                "weights": "hand",
            }
        )
    )
    return path


def test_bench_speedup_plots_saves_and_synth_follows(tmp_path, user_cache, tiny):
    table = tmp_path / "t-acceptance.json"
    save_acceptance({"acceptance": [[0.6, 0.2, 0.1], [0.6, 0.1], [0.6]], "source": "hand table"}, table)
    predictor_json = write_costs(tmp_path / "predictor.json")
    shipped = json.loads((SHIPPED_TREES / "best-n.json").read_text())["cpu/float32"]["N"]
    assert best_budget("cpu/float32")[0] == shipped and "trees/best-n.json" in best_budget("cpu/float32")[1]
    plot = tmp_path / "figure.png"
    result, projection = run_json(
        tmp_path / "speedup.json",
        "bench",
        "speedup",
        "--predictor",
        predictor_json,
        "--acceptance",
        table,
        "--plot",
        plot,
        "--save",
    )
    assert [row["N"] for row in projection["rows"]] == [4, 7, 8, 15, 16]
    best = max(projection["rows"], key=lambda row: row["speedup"])
    assert projection["not_measured"] == [31, 32, 63, 64] and projection["best_N"] == best["N"]
    assert best["speedup"] > 1 and projection["acceptance_source"] == "hand table"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert best_budget("cpu/float32")[0] == projection["best_N"]  # saved for the device and dtype measured
    assert best_budget("cuda/bfloat16")[0] == FALLBACK_BUDGET and best_budget("cpu/float16")[0] == 0  # unmeasured
    assert f"defaults to --tree {projection['best_N']}" in result.output
    assert json.loads((user_cache / "best-n.json").read_text())["cpu/float32"]["N"] == projection["best_N"]
    speculation, _ = choose_speculation(tiny.code_predictor, "auto")
    assert speculation.tree.nodes == projection["best_N"]


@pytest.mark.parametrize(
    "contents, message",
    [
        ("{", "is not valid JSON"),
        ('{"q": [1]}', "is not the JSON of `rvqtts bench predictor --json`"),
    ],
)
def test_bench_speedup_refuses_bad_input(tmp_path, contents, message):
    path = tmp_path / "p.json"
    path.write_text(contents)
    result = run("bench", "speedup", "--predictor", path)
    assert result.exit_code == 2 and message in result.output


def test_bench_speedup_refuses_a_bad_acceptance_table(predictor_json, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "rvqtts-acceptance", "acceptance": [[0.9, 0.9]]}))
    result = run("bench", "speedup", "--predictor", predictor_json, "--acceptance", bad)
    assert result.exit_code == 2 and "sums to 1.8000" in result.output


def test_bench_e2e_runs_every_variant(tiny_dir, tmp_path, measured, monkeypatch):
    # measured kernels: auto chooses the tree size online, as synth does
    texts = tmp_path / "texts.txt"
    texts.write_text("Hello there.\nA second line.\n")
    turns = []  # (variant, max frames) of every turn, the untimed warm-up ones first
    record = e2e_module._variant_record

    def counted(synthesizers, name, text, voice, seed, settings):
        turns.append((name, settings.max_frames))
        return record(synthesizers, name, text, voice, seed, settings)

    monkeypatch.setattr(e2e_module, "_variant_record", counted)
    _, report = run_json(
        tmp_path / "e2e.json",
        "bench",
        "e2e",
        "--model",
        tiny_dir,
        "--texts",
        texts,
        "--max-frames",
        "6",
        "--tree",
        "4,8",
        "--dtype",
        "float32",
    )
    assert set(report["runs"]) == {"stock", "plain", "auto", "N=4", "N=8"} and report["tree_nodes"] == [4, 8]
    assert sorted(turns[:5]) == sorted((name, 2) for name in report["runs"]) and {n for _, n in turns[5:]} == {6}
    best = report["best_fixed"]
    assert best == min(("N=4", "N=8"), key=lambda name: report["totals"][name]["predictor_ms_per_frame"])
    assert report["ratios"][f"{best}/auto predictor"] == pytest.approx(
        report["totals"][best]["predictor_ms_per_frame"] / report["totals"]["auto"]["predictor_ms_per_frame"], rel=0.01
    )
    assert sum(report["auto"]["frames_by_N"].values()) == report["totals"]["auto"]["frames"]
    assert report["ratios"]["plain/auto wall"] > 0 and report["totals"]["auto"]["predictor_floor_ms_per_frame"] is None
    for name, runs in report["runs"].items():
        assert len(runs) == 2 and all(0 < r["frames"] <= 6 and r["wall_seconds"] > 0 for r in runs)
        total = report["totals"][name]
        assert total["frames"] == sum(r["frames"] for r in runs)
        assert total["wall_ms_per_frame"] == pytest.approx(1e3 * total["wall_seconds"] / total["frames"], rel=0.01)
    # rvqtts's loops make the same codes, so they stop at the same frame.
    frames = {name: [r["frames"] for r in report["runs"][name]] for name in ("plain", "auto", "N=4", "N=8")}
    assert len({tuple(counts) for counts in frames.values()}) == 1
    assert report["ratios"]["stock/plain wall"] > 0
    # Where the inner loop's time went (CPU: eager calls): plain steps alone, or prefills and rounds by part.
    assert set(report["totals"]["plain"]["inner_loop_ms_by_part"]) == {"plain"}
    assert "inner_loop_ms_by_part" not in report["totals"]["stock"]
    for name in ("N=4", "N=8"):
        spec = report["totals"][name]
        parts = spec["inner_loop_ms_by_part"]
        assert {"prefill", "layout", "drafts", "forward", "heads", "draws", "walk"} <= set(parts)
        rounds = spec["calls_per_frame"] - 1
        assert spec["round_ms"] == pytest.approx((sum(parts.values()) - parts["prefill"]) / rounds, rel=0.01)
        assert 0 < spec["round_forward_ms"] < spec["round_ms"]
        plain_step = report["totals"]["plain"]["predictor_ms_per_frame"] / 15
        assert spec["round_per_plain_step"] == pytest.approx(spec["round_ms"] / plain_step, rel=0.02)
    memory = report["memory"]  # the process's peak, and what each rvqtts variant's engine keeps beside the model
    assert memory["peak_rss_mib"] >= memory["rss_mib"] > 100
    assert set(memory["caches_mib"]) == set(report["runs"]) - {"stock"}
    assert all(caches > 0 for caches in memory["caches_mib"].values())
    # Floors: the plain loop's inner loop reads a step's weights 15 times a frame, stock's the same.
    floor = report["floor_ms"]
    assert floor["talker_step"] > 0 and floor["predictor_round N=8"] > 0 and floor["predictor_round N=4"] > 0
    for name, kind in (("stock", "stock_"), ("plain", "")):
        total = report["totals"][name]
        assert total["predictor_floor_ms_per_frame"] == pytest.approx(15 * floor[f"{kind}predictor_step"], abs=0.01)
    for name in ("N=4", "N=8"):
        spec = report["totals"][name]
        rounds = sum(r["predictor_calls"] for r in report["runs"][name]) - spec["frames"]
        assert spec["predictor_floor_ms_per_frame"] == pytest.approx(
            (spec["frames"] * floor["predictor_step"] + rounds * floor[f"predictor_round {name}"]) / spec["frames"],
            abs=0.01,
        )


def test_stock_timing_reads_its_clock_once_the_device_is_done(tiny, monkeypatch):
    """Stock qwen-tts's split (forward hooks) synchronizes the device before every clock read: a GPU's calls are
    queued, and an unsynchronized hook would time their launch."""
    from rvqtts.bench import stock

    synced = []
    monkeypatch.setattr(stock, "synchronize", synced.append)
    record = stock.stock_synthesis(tiny, "Hello there.", "vivian", settings=GenerationSettings(max_frames=4))
    assert len(synced) >= 2 + 4 * record["frames"] and {str(device) for device in synced} == {"cpu"}


def test_bench_e2e_refuses_repeated_tree_sizes(tiny_dir, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("Hello there.\n")
    result = run(
        "bench",
        "e2e",
        "--model",
        tiny_dir,
        "--texts",
        texts,
        "--tree",
        "4,4",
        "--dtype",
        "float32",
        "--max-frames",
        "2",
    )
    assert result.exit_code == 2 and "must differ in size" in result.output


def test_bench_decoder_times_each_length_each_way(tiny_dir, tmp_path):
    result, report = run_json(
        tmp_path / "decoder.json",
        "bench",
        "decoder",
        "--model",
        tiny_dir,
        "--frames",
        "4,12",
        "--repeats",
        "1",
        "--stream-frames",
        "3",
        "--streams",
        "2",
        "--dtype",
        "float32",
    )
    assert [row["frames"] for row in report["rows"]] == [4, 12] and report["dtype"] == "float32"
    assert report["streams"] == 2 and [row["frames"] for row in report["together"]] == [1, 3]
    for row in report["together"]:
        assert row["one_by_one_ms"] > 0 and row["ratio"] == pytest.approx(
            row["together_ms"] / row["one_by_one_ms"], rel=0.02
        )
    assert "2 streams' pieces" in result.output and "together / one by one" in result.output
    assert report["stream_frames"] == 3
    for row in report["rows"]:
        for way in ("stock", "rvqtts", "streamed"):
            assert row[f"{way}_ms"] > 0
            assert row[f"{way}_ms_per_frame"] == pytest.approx(row[f"{way}_ms"] / row["frames"], abs=0.05)
        assert row["ratio"] == pytest.approx(row["rvqtts_ms"] / row["stock_ms"], rel=0.01)
    assert "rvqtts / stock" in result.output and "streamed by 3" in result.output


def test_bench_talker_times_both_steps_at_each_context(tiny_dir, tmp_path):
    result, report = run_json(
        tmp_path / "talker.json",
        "bench",
        "talker",
        "--model",
        tiny_dir,
        "--contexts",
        "8,300",
        "--repeats",
        "2",
        "--dtype",
        "float32",
    )
    assert [row["context"] for row in report["rows"]] == [8, 300] and report["dtype"] == "float32"
    assert all(
        row["stock_ms"] > 0 and row["ratio"] == pytest.approx(row["rvqtts_ms"] / row["stock_ms"], rel=0.05)
        for row in report["rows"]
    )
    assert "rvqtts / stock" in result.output and "rvqtts / floor" in result.output
    talker = Synthesizer.from_checkpoint(tiny_dir).talker
    weights = sum(
        p.numel() for module in (talker.model.layers, talker.model.norm, talker.codec_head) for p in module.parameters()
    )
    assert report["weights_mb"] == pytest.approx(4 * weights / 1e6, abs=1e-3)
    assert all(
        row["ratio_to_floor"] == pytest.approx(row["rvqtts_ms"] / row["floor_ms"], rel=0.05) for row in report["rows"]
    )
    matrices = sum(
        p.numel() for module in (talker.model.layers, talker.codec_head) for p in module.parameters() if p.dim() == 2
    )
    assert report["compute_floor_ms"] == pytest.approx(matrices / (report["peak_gmac_per_s"] * 1e6), rel=0.01)
    assert "multiply-adds at this device's peak" in result.output


def test_bench_dtype_compares_codes_with_float32(tiny_dir, tmp_path):
    _, report = run_json(tmp_path / "dtype.json", "bench", "dtype", "--model", tiny_dir, "--frames", "6")
    assert report["dtype"] == "bfloat16" and report["reference_dtype"] == "float32" and report["frames"] == 6
    # bfloat16 changes a draw now and then; a broken comparison would agree on about 1 code in 50.
    forced, identical = report["teacher_forced_code_agreement"], report["free_running_frames_identical"]
    before = report["codes_before_first_difference"]
    assert 0.8 < forced <= 1 and 6 * identical == pytest.approx(round(6 * identical), abs=1e-3)
    # A free-running frame draws as the teacher-forced one until their first difference, which the teacher-forced
    # draws show too: at most 15 * 6 * (1 - forced) frames differ. An identical frame counts its 15 codes before a
    # difference; another, 14 at most.
    assert 1 - 15 * (1 - forced) - 1e-3 <= identical and 15 * identical - 1e-3 <= before <= 14 + identical + 1e-3
    assert set(report["ms_per_frame"]) == {"reference", "candidate"}
    refused = run("bench", "dtype", "--model", tiny_dir, "--dtype", "float32")
    assert refused.exit_code == 2 and "--dtype must be bfloat16 or float16" in refused.output


def test_bench_refuses_unknown_dimensions():
    result = run("bench", "predictor", "--dims", "7b")
    assert result.exit_code == 2 and "unknown --dims '7b'" in result.output


def test_a_measured_no_speculation_choice_runs_the_plain_loop(tmp_path, tiny, narrow):
    fingerprint = predictor_fingerprint(tiny.code_predictor)
    table = tmp_path / "never-acceptance.json"
    save_acceptance(
        {"acceptance": [[0.0], [0.0], [0.0]], "model_fingerprint": fingerprint, "source": "drafts never accepted"},
        table,
    )
    costs = tmp_path / "predictor.json"  # fixed costs: a tree call dearer than a plain step, as it always is
    costs.write_text(
        json.dumps(
            {
                "q": [1, 65],
                "ratio_to_q1": [1.0, 2.0],
                "ratio_to_stock_q1": [0.9, 1.8],
                "device": "cpu",
                "dtype": "float32",
                "weights": "hand",
            }
        )
    )
    result, projection = run_json(
        tmp_path / "speedup.json", "bench", "speedup", "--predictor", costs, "--acceptance", table, "--save"
    )
    assert projection["best_N"] == 0
    assert "runs the plain loop (no tree pays) for this model" in result.output
    assert best_budget("cpu/float32", fingerprint)[0] == 0
    save_best_budget("cpu/float32", 8, "a platform measurement")  # for every other model
    speculation, notice = choose_speculation(tiny.code_predictor, "auto", allow_plain=True)
    assert speculation is None and "no tree was measured to pay for this model on cpu/float32" in notice
    assert choose_speculation(tiny.code_predictor, "auto")[0].tree.nodes == FALLBACK_BUDGET  # a tree is needed
    assert choose_speculation(tiny.code_predictor, "7", allow_plain=True)[0].tree.nodes == 7  # an explicit N wins
    assert choose_speculation(narrow.code_predictor, "auto", allow_plain=True)[0].tree.nodes == 8
