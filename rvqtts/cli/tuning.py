"""Measured choices, offsets and trees for a model: `tune`, `train-offsets`, `calibrate`, `accept`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rvqtts.cli.common import (
    DEFAULT_MODEL,
    DEVICE_HELP,
    app,
    check_new_file,
    ensure_writable,
    fail,
    json_option,
    list_of_ints,
    load_synthesizer,
    progress_bar,
    publish,
    refused,
    say,
)
from rvqtts.cli.frames import (
    CONTEXTS_HELP,
    INSTRUCT_HELP,
    SPEAKER_HELP,
    SPLIT_HELP,
    TEXTS_HELP,
    VOICE_HELP,
    check_source,
    drafting_offsets,
    recorded_frames,
)


@app.command()
def tune(
    model: str = typer.Option(
        DEFAULT_MODEL, help="Hub id or local folder of the model (its config gives the shapes; no weights load)."
    ),
    dtype: str = typer.Option(
        "auto", help="auto (bfloat16 and float32, and which `--dtype auto` picks), float32 or bfloat16."
    ),
    weights: str = typer.Option("native", help="native, or int8 (8-bit weights, W8A16)."),
    again: bool = typer.Option(False, "--again", help="Measure anew, replacing what the cache holds for this machine."),
    texts: Optional[Path] = typer.Option(
        None,
        help="Also speak these lines (.txt, or .jsonl as synth -f takes) with --tree auto: the run measures this "
        "model's acceptance (kept for later runs) and shows the tree sizes it chose from.",
    ),
    offsets: Optional[Path] = typer.Option(
        None,
        help="With --texts: the offsets to draft with (default: shipped offsets matching the model, else zero "
        "offsets).",
    ),
    speaker: Optional[str] = typer.Option(None, help="With --texts: " + SPEAKER_HELP),
    max_frames: Optional[int] = typer.Option(None, help="With --texts: most frames per line."),
    seed: int = typer.Option(0, help="With --texts: seed of synthesis."),
    json_out: Optional[Path] = json_option(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table."),
) -> None:
    """Measure this CPU's kernel for every linear map shape of the model's frame (row invariance, then cost
    at 1 and 17 rows; the fastest invariant one runs), the dtype `--dtype auto` picks from them and the speech
    decoder's (a frame decoded in each dtype); with --texts, also the tree size `--tree auto` chooses on them.

    Measured once per machine (CPU model, torch, threads) and kept in the user's cache; every command
    reads it from there, so this only shows it (or, with --again, measures anew).
    """
    import torch

    from rvqtts.engine.model import native
    from rvqtts.engine.model.devices import pick_dtype
    from rvqtts.engine.model.kernels import forget_records, machine_key
    from rvqtts.engine.model.quantize import WEIGHTS, WEIGHTS_CHOICES
    from rvqtts.qwen.checkpoints import ModelLoadError, model_config
    from rvqtts.qwen.decoder_dtype import pick_decoder_dtype
    from rvqtts.support.measurements import KERNELS
    from rvqtts.support.memory import memory_record
    from rvqtts.support.report import tune_table

    if dtype not in ("auto", "float32", "bfloat16"):
        fail(f"unknown --dtype {dtype!r}: rvqtts tune measures CPU kernels in auto, float32 or bfloat16")
    if weights not in WEIGHTS:
        fail(f"unknown --weights {weights!r}: choose {WEIGHTS_CHOICES}")
    with refused(ModelLoadError):
        talker_config = model_config(model).talker_config
    result = {
        "model": model,
        "machine": machine_key(),
        "cache": str(KERNELS.path),
        "weights": weights,
        "native": native.unavailable(),
        "native_level": native.level(),
        "dtypes": {},
    }
    for name in ["bfloat16", "float32"] if dtype == "auto" else [dtype]:
        result["dtypes"][name] = _measured_maps(talker_config, getattr(torch, name), weights, again, quiet)
    if dtype == "auto":
        result["auto"], result["reason"] = pick_dtype("auto", "cpu", talker_config, weights)
        if again:
            forget_records("decoder/")
        with refused(ModelLoadError):
            decoder = pick_decoder_dtype("auto", "auto", result["auto"], "cpu", model, lambda line: say(line, quiet))
        result["decoder_dtype"], result["decoder_reason"] = decoder
    if texts is not None:  # the lines spoken with --tree auto on the CPU: what the online choice measured and chose
        engine = dict(device="cpu", dtype=result.get("auto", dtype), weights=weights, offsets=offsets)
        result["trees"] = _online_choice(model, engine, texts, speaker, seed, max_frames, quiet)
    result["memory"] = memory_record()  # this process's peak: the measurements' (and --texts' synthesis)
    publish(result, json_out, tune_table, quiet)


def _measured_maps(talker_config, dtype, weights: str, again: bool, quiet: bool) -> dict:
    """The kernel chosen for every linear map of a frame in `dtype` (measured anew with `again`), and the frame's
    cost of linear maps."""
    import torch

    from rvqtts.engine.model.devices import frame_map_ms, frame_maps
    from rvqtts.engine.model.kernels import choose_kernels, fixed_kernel, forget_choices

    if again:
        forget_choices(dtype, weights)
    maps = frame_maps(talker_config)
    choices = choose_kernels([shape for _, shape, _ in maps], dtype, weights, lambda line: say(line, quiet))
    fixed = fixed_kernel(torch.device("cpu"), dtype, weights)
    rows = [
        {"loop": loop, "shape": list(shape), "per_frame": count, "fixed": fixed.name, **choices[shape].record()}
        for loop, shape, count in maps
    ]
    return {"frame_map_ms": round(frame_map_ms(talker_config, dtype, weights), 3), "maps": rows}


def _online_choice(model: str, engine: dict, texts: Path, speaker, seed: int, max_frames, quiet: bool) -> dict:
    """`texts`' lines spoken with --tree auto by the engine `engine` describes: what the online choice measured and
    chose (its counts saved for later runs)."""
    from rvqtts.engine.speculative.online import OnlineSpeculation
    from rvqtts.synthesis.batch_files import read_batch
    from rvqtts.synthesis.settings import GenerationSettings

    with refused(ValueError):  # BatchFileError too
        lines = read_batch(texts)
        settings = GenerationSettings(max_frames=max_frames)
    synthesizer = load_synthesizer(model, quiet, **engine)
    if not isinstance(synthesizer.speculation, OnlineSpeculation):
        fail("rvqtts tune --texts decides the tree size online, which RVQTTS_CHOICES=fixed turns off")
    with progress_bar(quiet) as progress:
        task = progress.add_task(f"speaking {len(lines)} lines with --tree auto", total=len(lines))
        for line in lines:
            with refused(ValueError, prefix=f"{texts}: "):
                voice = dict(speaker=line.speaker or speaker, language=line.language or "auto", instruct=line.instruct)
                synthesizer.synthesize(line.text, **voice, seed=seed, settings=settings)
            progress.advance(task)
    synthesizer.speculation.save()
    return synthesizer.speculation.record()


@app.command("train-offsets")
def train_offsets_command(
    out: Path = typer.Option(..., help="Offsets file to write (.safetensors)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    texts: Optional[Path] = typer.Option(
        None, help=TEXTS_HELP + " Self-distillation: the offsets learn from the model's own codes."
    ),
    contexts: Optional[Path] = typer.Option(None, help=CONTEXTS_HELP + " Teacher forcing on their codes."),
    audio: Optional[Path] = typer.Option(
        None,
        help='Recordings and transcripts: a .jsonl file of {"audio": WAV, "text": transcript} (optional speaker, '
        "language). Teacher forcing on the codes of the model's speech tokenizer.",
    ),
    split: str = typer.Option("calibration", help=SPLIT_HELP),
    resample: bool = typer.Option(
        False,
        "--resample",
        help="With --contexts: train on codes the model samples itself from each frame's h_t and c0.",
    ),
    depth: int = typer.Option(3, help="K, codes drafted ahead (1..14)."),
    target: str = typer.Option("hard", help="hard: the codes; soft: the distribution they are sampled from."),
    learning_rate: float = typer.Option(1e-3, help="Adam's learning rate."),
    batch: int = typer.Option(32, help="Frames per step."),
    max_steps: int = typer.Option(
        20000, help="Most training steps (training stops earlier when the held-out loss stops falling)."
    ),
    held_out: float = typer.Option(0.1, help="Fraction of the frames held out for early stopping."),
    speaker: Optional[str] = typer.Option(None, help="With --texts or --audio: " + SPEAKER_HELP),
    language: str = typer.Option("auto", help="With --texts or --audio: language of lines that name none."),
    instruct: Optional[str] = typer.Option(None, help="With --texts or --audio: " + INSTRUCT_HELP),
    voice: Optional[Path] = typer.Option(None, help="With --texts or --audio: " + VOICE_HELP),
    seed: int = typer.Option(0, help="Seed of synthesis, the split and the batches."),
    save_contexts: Optional[Path] = typer.Option(
        None, help="With --texts or --audio: also keep the recorded frames (.npz) for rvqtts calibrate and accept."
    ),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Train the draft offsets (K x hidden numbers) of a frozen model; backbone and heads stay frozen.

    Codes do not change: the verifier never reads an offset state. The file records the model, K, the
    data and the losses; rvqtts synth uses it when given with --offsets.
    """
    from rvqtts.engine.speculative.offsets import save_offsets
    from rvqtts.tuning.contexts import save_contexts as write_contexts
    from rvqtts.tuning.training import TrainingConfig, fit_offsets

    check_source(texts, contexts, audio, audio_allowed=True)
    check_new_file(out, ".safetensors", force)
    if save_contexts is not None:
        check_new_file(save_contexts, ".npz", force)
    with refused(ValueError):
        config = TrainingConfig(
            depth=depth, learning_rate=learning_rate, batch=batch, max_steps=max_steps, target=target, seed=seed
        )
    if not 0 < held_out < 1:
        fail(f"--held-out must be between 0 and 1, got {held_out}")
    synthesizer = load_synthesizer(model, quiet, device=device, dtype=dtype, spec=False)
    frames = recorded_frames(
        synthesizer, texts, contexts, split, speaker, language, seed, quiet, audio, instruct, voice
    )
    if save_contexts is not None:
        write_contexts(frames, save_contexts)
    with progress_bar(quiet) as progress:
        task = progress.add_task("training offsets", total=max_steps)

        def report(step: int, total: int, train_loss: float, held_loss: float) -> None:
            progress.update(
                task, completed=step, description=f"training offsets (loss {train_loss:.3f}, held out {held_loss:.3f})"
            )

        with refused(ValueError):
            offsets, record = fit_offsets(
                synthesizer,
                frames,
                config,
                held_out=held_out,
                self_distill=resample,
                model_name=model,
                on_progress=report,
            )
    save_offsets(offsets, out)
    say(
        f"held-out loss {record['initial_held_out_loss']:.4f} -> {record['held_out_loss']:.4f} nats "
        f"(top-1 by depth {record['initial_held_out_top1']} -> {record['held_out_top1']}) after "
        f"{record['steps']} steps; wrote {out}",
        quiet,
    )


@app.command()
def calibrate(
    out_dir: Path = typer.Option(..., help="Folder for the acceptance table and one tree file per budget."),
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    offsets: Optional[Path] = typer.Option(None, help="Offsets file; default: zero offsets (reused heads)."),
    texts: Optional[Path] = typer.Option(None, help=TEXTS_HELP),
    contexts: Optional[Path] = typer.Option(None, help=CONTEXTS_HELP),
    split: str = typer.Option("calibration", help=SPLIT_HELP),
    budgets: str = typer.Option(
        "4,7,8,15,16,31,32,63,64",
        help="Node budgets N, comma-separated: one tree each (N + 1 a multiple of 8 or 16 is often cheaper to run).",
    ),
    name: Optional[str] = typer.Option(
        None, help="File name prefix; default: the offsets file's name, or reused-heads."
    ),
    speaker: Optional[str] = typer.Option(None, help="With --texts: " + SPEAKER_HELP),
    language: str = typer.Option("auto", help="With --texts: language of lines that name none."),
    instruct: Optional[str] = typer.Option(None, help="With --texts: " + INSTRUCT_HELP),
    voice: Optional[Path] = typer.Option(None, help="With --texts: " + VOICE_HELP),
    seed: int = typer.Option(0, help="Seed of synthesis and of the codes sampled for the table."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    force: bool = typer.Option(False, "--force", help="Replace files that exist."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Measure the per-depth, per-rank acceptance table on free-running codes and grow one sparse tree
    per node budget (depth capped at K), each with its expected codes per call."""
    from rvqtts.engine.speculative.tree import ACCEPTANCE_SUFFIX, save_acceptance, save_tree
    from rvqtts.tuning.calibration import calibrate_trees

    check_source(texts, contexts)
    sizes = list_of_ints(budgets, "--budgets")
    prefix = name or (offsets.stem if offsets else "reused-heads")
    table_path = out_dir / f"{prefix}{ACCEPTANCE_SUFFIX}"
    tree_paths = {n: out_dir / f"{prefix}-n{n}.json" for n in sizes}
    existing = [str(p) for p in (table_path, *tree_paths.values()) if p.exists()]
    if existing and not force:
        fail(f"{', '.join(existing)} already exist: --force replaces them")
    ensure_writable(out_dir, folder=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    synthesizer = load_synthesizer(model, quiet, device=device, dtype=dtype, spec=False)
    drafting = drafting_offsets(synthesizer, offsets, 3)
    frames = recorded_frames(synthesizer, texts, contexts, split, speaker, language, seed, quiet, None, instruct, voice)
    with progress_bar(quiet) as progress:
        progress.add_task(f"sampling {len(frames)} frames and ranking drafts", total=None)
        table, trees = calibrate_trees(
            synthesizer, frames, drafting, sizes, seed, model_name=model, offsets_name=offsets.name if offsets else ""
        )
    save_acceptance(table, table_path)
    for size, tree in trees.items():
        save_tree(tree, tree_paths[size])
    summary = ", ".join(f"N={n}: {t.expected_codes_per_call}" for n, t in trees.items())
    entropy = " ".join(f"{bits:.2f}" for bits in table["entropy_bits"])
    say(
        f"expected codes per call {summary}; sampling entropy of c1..c{len(table['entropy_bits'])} in bits: "
        f"{entropy}; wrote {table_path} and {len(trees)} trees in {out_dir}",
        quiet,
    )


@app.command()
def accept(
    model: str = typer.Option(DEFAULT_MODEL, help="Hub id or local folder of the model."),
    offsets: Optional[Path] = typer.Option(
        None, help="Offsets file; default: shipped offsets matching the model, else zero offsets."
    ),
    tree: str = typer.Option("16", help="A node budget N (a shipped tree) or a tree file."),
    texts: Optional[Path] = typer.Option(None, help=TEXTS_HELP),
    contexts: Optional[Path] = typer.Option(None, help=CONTEXTS_HELP),
    split: str = typer.Option("evaluation", help=SPLIT_HELP),
    json_out: Optional[Path] = json_option(),
    speaker: Optional[str] = typer.Option(None, help="With --texts: " + SPEAKER_HELP),
    language: str = typer.Option("auto", help="With --texts: language of lines that name none."),
    instruct: Optional[str] = typer.Option(None, help="With --texts: " + INSTRUCT_HELP),
    voice: Optional[Path] = typer.Option(None, help="With --texts: " + VOICE_HELP),
    seed: int = typer.Option(0, help="Seed of synthesis and of the speculative decoding's draws."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    dtype: str = typer.Option("auto", help="Model dtype: auto, float32, bfloat16 or float16."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
) -> None:
    """Measure codes per predictor call of the speculative inner loop on these frames: overall and per
    language, with a 95 % confidence interval."""
    from rvqtts.engine.speculative.policy import choose_speculation
    from rvqtts.support.report import codes_per_call_table
    from rvqtts.tuning.calibration import codes_per_call

    check_source(texts, contexts)
    synthesizer = load_synthesizer(model, quiet, device=device, dtype=dtype, spec=False)
    with refused(ValueError):  # TreeFileError, OffsetsFileError too
        speculation, notice = choose_speculation(synthesizer.code_predictor, tree, offsets)
    say(notice, quiet)
    frames = recorded_frames(synthesizer, texts, contexts, split, speaker, language, seed, quiet, None, instruct, voice)
    with progress_bar(quiet) as progress:
        progress.add_task(f"decoding {len(frames)} frames", total=None)
        result = codes_per_call(
            synthesizer.code_predictor,
            speculation,
            frames.prefixes(synthesizer.talker.get_input_embeddings()),
            list(frames.language),
            seed,
        )
    publish(
        result,
        json_out,
        codes_per_call_table,
        quiet,
        model=model,
        tree=tree,
        tree_nodes=speculation.tree.nodes,
        offsets=str(offsets) if offsets else speculation.offsets.metadata.get("source", "shipped"),
        frames_source=frames.source,
    )
