"""Core ML: export the fused inner loop (rvqtts.engine.backends.fused) to one multifunction .mlpackage (`prefill`,
`round` and `step`, their weights stored once), and run its calls on a Mac. Sampling is baked into the graph, and the
package's metadata records the model, tree, offsets and sampling it was built for: loading it for anything else is an
error that names the difference. The KV cache is an input, not Core ML state, since only the host's walk knows which
slots to keep. Export runs anywhere coremltools installs; running a package needs macOS. docs/coreml.md."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from rvqtts.engine.backends.fused import FusedCalls, FusedLoop
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.offsets import predictor_fingerprint
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import Tree
from rvqtts.support.files import cache_file

PRECISIONS = ("w8a16", "fp16")
COMPUTE_UNITS = {"all": "ALL", "cpu_and_ne": "CPU_AND_NE", "cpu_and_gpu": "CPU_AND_GPU", "cpu_only": "CPU_ONLY"}
FUNCTIONS = ("prefill", "round", "step")
INPUTS = ("index", "k_cache", "v_cache", "mask", "noise")  # after each function's first input
FIRST_INPUT = {"prefill": "embeds", "round": "codes", "step": "codes"}
OUTPUTS = {
    "prefill": ("draws", "ranks", "new_k", "new_v"),
    "round": ("draws", "ranks", "new_k", "new_v"),
    "step": ("draws", "new_k", "new_v"),
}
METADATA_KEY = "rvqtts"
FORMAT = "rvqtts-coreml-1"
QUANTIZE_FROM = 65536  # elements: W8A16 quantizes constants at least this large


class CoreMLError(ValueError):
    """Core ML cannot do what was asked here; the message says why and what to do."""


def coremltools():
    """The coremltools module, or a CoreMLError saying how to install it."""
    # Its import warns, through logging, that the runtime is missing off macOS and that this torch is newer
    # than it was tested with; the export is tested here, and running needs macOS anyway.
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    try:
        import coremltools as ct
    except ImportError as error:
        raise CoreMLError(
            "coremltools is not installed: pip install -e '.[coreml]' (from rvqtts's checkout folder)"
        ) from error
    return ct


def require_macos() -> None:
    if sys.platform != "darwin":
        raise CoreMLError(
            f"Core ML runs only on macOS and this is {platform.system()}: use --backend torch "
            f"(rvqtts export-coreml works here)"
        )


@dataclass(frozen=True)
class PackageKey:
    """What a package was built for. It runs only for the same model, tree, offsets and sampling."""

    model: str  # predictor fingerprint
    tree: tuple[tuple[int, ...], ...]
    offsets: str  # digest of the offsets' float32 values
    sampling: tuple[float, int, bool]  # temperature, top-k, do_sample
    precision: str
    min_target: str

    @classmethod
    def build(
        cls,
        code_predictor: torch.nn.Module,
        speculation: Speculation,
        sampling: SamplingConfig,
        precision: str,
        min_target: str,
    ) -> "PackageKey":
        check_sampling(sampling)
        vectors = speculation.offsets.vectors.detach().float().cpu().numpy()
        return cls(
            predictor_fingerprint(code_predictor),
            tuple(tuple(p) for p in speculation.tree.paths),
            hashlib.sha256(vectors.tobytes()).hexdigest()[:16],
            (float(sampling.temperature), int(sampling.top_k), bool(sampling.do_sample)),
            precision,
            min_target,
        )

    @property
    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:10]
        return f"rvqtts-n{len(self.tree)}-{self.precision}-{digest}.mlpackage"

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "tree": [list(p) for p in self.tree],
            "offsets": self.offsets,
            "temperature": self.sampling[0],
            "top_k": self.sampling[1],
            "do_sample": self.sampling[2],
            "precision": self.precision,
            "min_target": self.min_target,
        }

    @classmethod
    def from_json(cls, document: dict) -> "PackageKey":
        return cls(
            document["model"],
            tuple(tuple(p) for p in document["tree"]),
            document["offsets"],
            (float(document["temperature"]), int(document["top_k"]), bool(document["do_sample"])),
            document["precision"],
            document["min_target"],
        )

    def differences(self, other: "PackageKey") -> list[str]:
        """What a package built for `other` does not share with this run (precision and target may differ)."""
        named = {
            "model": "model (predictor fingerprint)",
            "tree": "tree",
            "offsets": "offsets",
            "sampling": "sampling (temperature, top-k, do_sample)",
        }
        return [
            f"{label}: package {getattr(other, field)!r:.60}, this run {getattr(self, field)!r:.60}"
            for field, label in named.items()
            if getattr(self, field) != getattr(other, field)
        ]


def check_sampling(sampling: SamplingConfig) -> None:
    """Raise CoreMLError for sampling the graph cannot do (it has no top-p filter)."""
    if sampling.top_p < 1.0:
        raise CoreMLError(
            f"the Core ML graph samples with temperature and top-k only; top-p {sampling.top_p} "
            f"needs --top-p 1 (or --backend torch)"
        )


def check_export_settings(sampling: SamplingConfig, precision: str, min_target: str) -> None:
    """Raise CoreMLError for settings the exported graph cannot honour."""
    check_sampling(sampling)
    if precision not in PRECISIONS:
        raise CoreMLError(f"unknown precision {precision!r}: choose {' or '.join(PRECISIONS)}")
    ct = coremltools()
    usable = [
        name
        for name, target in ct.target.__members__.items()
        if name.startswith("macOS") and target >= ct.target.macOS15
    ]
    if min_target not in usable:
        raise CoreMLError(
            f"unknown or too old --min-target {min_target!r}: the package holds several functions, "
            f"which needs macOS15 or later: choose {' or '.join(usable)}"
        )


def example_inputs(loop: FusedLoop, function: str, embed_width: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Inputs of the right shapes and types for one function (values do not matter to the trace)."""
    queries = {"prefill": 2, "round": loop.tree.nodes + 1, "step": 1}[function]
    block = {"prefill": loop.causal, "round": loop.ancestors, "step": loop.itself}[function]
    first = torch.zeros(queries, embed_width) if function == "prefill" else torch.zeros(queries, dtype=torch.long)
    cache = torch.zeros(loop.calls.cache_shape)
    return first, torch.tensor([1]), cache, cache.clone(), loop.mask(2, block), torch.zeros(queries, vocab)


def cpu_runner(code_predictor: torch.nn.Module, dtype: torch.dtype) -> PredictorRunner:
    """A runner over a copy of the predictor on the CPU in `dtype`, its weights constants (no gradients)."""
    predictor = copy.deepcopy(code_predictor).to("cpu", dtype).requires_grad_(False)
    return PredictorRunner(predictor, predictor.config.num_code_groups)


def trace_calls(
    code_predictor: torch.nn.Module, tree: Tree, offsets: torch.Tensor, sampling: SamplingConfig
) -> tuple[FusedCalls, dict[str, tuple[torch.Tensor, ...]]]:
    """The traced graphs Core ML converts (float32, CPU), as a FusedCalls, with each one's example inputs."""
    runner = cpu_runner(code_predictor, torch.float32)
    calls = FusedCalls.modules(runner, tree, offsets.detach().to("cpu", torch.float32), sampling)
    decoder = FusedLoop(calls, tree, sampling)
    embed_width = runner.embeddings[0].weight.shape[1]
    examples = {name: example_inputs(decoder, name, embed_width, runner.vocab_size) for name in FUNCTIONS}
    with torch.no_grad():
        traced = {
            name: torch.jit.trace(getattr(calls, name).eval(), examples[name], check_trace=False) for name in FUNCTIONS
        }
    return dataclasses.replace(calls, **traced), examples


def _convert(
    ct,
    traced: torch.jit.ScriptModule,
    example: tuple[torch.Tensor, ...],
    function: str,
    precision: str,
    min_target: str,
):
    """One traced call to a float16 ML program (weights int8 per channel for w8a16)."""
    names = (FIRST_INPUT[function], *INPUTS)
    inputs = [
        ct.TensorType(name=name, shape=tuple(value.shape), dtype=np.int32 if value.dtype == torch.long else np.float16)
        for name, value in zip(names, example)
    ]
    outputs = [
        ct.TensorType(name=name, dtype=np.int32 if name in ("draws", "ranks") else np.float16)
        for name in OUTPUTS[function]
    ]
    with warnings.catch_warnings():  # the top-k filter's -inf is cast to float16 through float32's lowest
        warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)
        model = ct.convert(
            traced,
            inputs=inputs,
            outputs=outputs,
            convert_to="mlprogram",
            minimum_deployment_target=getattr(ct.target, min_target),
            compute_precision=ct.precision.FLOAT16,
        )
    if precision == "w8a16":
        from coremltools.optimize.coreml import OpLinearQuantizerConfig, OptimizationConfig, linear_quantize_weights

        # Small constants stay float16: the offsets (K x hidden, zero rows for reused heads, whose per-channel
        # scale would be 0), norms and rotary tables; the matrices and the stacked heads and tables are int8.
        config = OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=QUANTIZE_FROM
        )
        model = linear_quantize_weights(model, OptimizationConfig(global_config=config))
    return model


def package_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


@dataclass(frozen=True)
class Export:
    path: Path
    seconds: float
    bytes: int
    reused: bool = False


def export_package(
    code_predictor: torch.nn.Module,
    speculation: Speculation,
    sampling: SamplingConfig,
    out_dir: str | Path,
    precision: str = "w8a16",
    min_target: str = "macOS15",
    report: Callable[[str], None] = lambda message: None,
    force: bool = False,
) -> Export:
    """Export the fused calls for this tree into `out_dir`/<name>.mlpackage (named by what it was built
    for, so an existing package of that name is reused unless `force`). Written whole or not at all."""
    check_export_settings(sampling, precision, min_target)
    ct = coremltools()
    key = PackageKey.build(code_predictor, speculation, sampling, precision, min_target)
    out_dir = Path(out_dir).expanduser()
    final = out_dir / key.file_name
    if final.exists() and not force:
        return Export(final, 0.0, package_bytes(final), reused=True)
    started = time.perf_counter()
    report(f"tracing the fused calls for a tree of N = {speculation.tree.nodes}")
    traced, examples = trace_calls(code_predictor, speculation.tree, speculation.offsets.vectors, sampling)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".rvqtts-export-", dir=out_dir) as work:
        descriptor = ct.utils.MultiFunctionDescriptor()
        for name in FUNCTIONS:
            report(f"converting {name} ({precision})")
            model = _convert(ct, getattr(traced, name), examples[name], name, precision, min_target)
            model.save(f"{work}/{name}.mlpackage")
            descriptor.add_function(f"{work}/{name}.mlpackage", src_function_name="main", target_function_name=name)
        descriptor.default_function_name = "round"
        report("saving the package (weights shared by the functions)")
        ct.utils.save_multifunction(descriptor, f"{work}/joined.mlpackage")
        package = ct.models.MLModel(f"{work}/joined.mlpackage", skip_model_load=True)
        package.user_defined_metadata[METADATA_KEY] = json.dumps(key.to_json())
        package.short_description = (
            f"rvqtts fused inner loop: Qwen3-TTS code predictor {key.model}, tree N = {len(key.tree)}, {precision}"
        )
        package.save(f"{work}/done.mlpackage")
        if final.exists():
            shutil.rmtree(final)
        Path(f"{work}/done.mlpackage").rename(final)
    return Export(final, time.perf_counter() - started, package_bytes(final))


_DTYPES = {"FLOAT16": np.float16, "FLOAT32": np.float32, "INT32": np.int32}


@dataclass(frozen=True)
class Signature:
    """A function's inputs (name, shape, numpy type) and output names, as the package declares them."""

    inputs: tuple[tuple[str, tuple[int, ...], type], ...]
    outputs: tuple[str, ...]


def read_package(path: str | Path) -> tuple[PackageKey, dict[str, Signature]]:
    """The key a package was built for and its functions' signatures (no Core ML runtime needed)."""
    ct = coremltools()
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CoreMLError(f"no Core ML package at {path}: export one with rvqtts export-coreml")
    try:
        spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
        key = PackageKey.from_json(json.loads(spec.description.metadata.userDefined[METADATA_KEY]))
    except (KeyError, ValueError, TypeError, OSError) as error:
        raise CoreMLError(
            f"{path} is not a package rvqtts exported ({error}): export one with rvqtts export-coreml"
        ) from error
    data_types = {value: name for name, value in ct.proto.FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.items()}
    signatures = {}
    for function in spec.description.functions:
        inputs = tuple(
            (item.name, tuple(item.type.multiArrayType.shape), _DTYPES[data_types[item.type.multiArrayType.dataType]])
            for item in function.input
        )
        signatures[function.name] = Signature(inputs, tuple(item.name for item in function.output))
    missing = set(FUNCTIONS) - set(signatures)
    if missing:
        raise CoreMLError(f"{path} lacks the functions {', '.join(sorted(missing))}: export it again")
    return key, signatures


def check_package(path: str | Path, expected: PackageKey) -> dict[str, Signature]:
    """The package's signatures, if it was built for `expected`'s model, tree, offsets and sampling."""
    key, signatures = read_package(path)
    differences = expected.differences(key)
    if differences:
        raise CoreMLError(
            f"{path} was exported for another setup ({'; '.join(differences)}): export it again "
            f"for this one, or leave out the package to export into the cache"
        )
    return signatures


class PackageFunction:
    """One function of a package as a fused call: tensors in, named arrays of the declared shapes and
    types to `predict`, tensors out."""

    def __init__(self, predict: Callable[[dict], dict], signature: Signature):
        self.predict, self.signature = predict, signature

    def feed(self, *args: torch.Tensor) -> dict[str, np.ndarray]:
        feed = {}
        for (name, shape, dtype), value in zip(self.signature.inputs, args, strict=True):
            if tuple(value.shape) != shape:
                raise CoreMLError(f"input {name} has shape {tuple(value.shape)}; the package expects {shape}")
            feed[name] = value.detach().cpu().numpy().astype(dtype)
        return feed

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        result = self.predict(self.feed(*args))
        return tuple(torch.from_numpy(np.array(result[name])) for name in self.signature.outputs)  # a writable copy


def package_calls(signatures: dict[str, Signature], predictors: dict[str, Callable[[dict], dict]]) -> FusedCalls:
    """FusedCalls over a package's functions, given a predict function for each."""
    cache_shape = dict((name, shape) for name, shape, _ in signatures["round"].inputs)["k_cache"]
    functions = {name: PackageFunction(predictors[name], signatures[name]) for name in FUNCTIONS}
    return FusedCalls(**functions, cache_shape=cache_shape, dtype=torch.float16, device=torch.device("cpu"))


def load_loop(
    path: str | Path, expected: PackageKey, tree: Tree, sampling: SamplingConfig, compute_units: str = "all"
) -> FusedLoop:
    """A fused loop running a package's functions through Core ML (macOS). The package must have been
    built for `expected`'s model, tree, offsets and sampling."""
    require_macos()
    if compute_units not in COMPUTE_UNITS:
        raise CoreMLError(f"unknown compute units {compute_units!r}: choose {', '.join(COMPUTE_UNITS)}")
    signatures = check_package(path, expected)
    ct = coremltools()
    units = getattr(ct.ComputeUnit, COMPUTE_UNITS[compute_units])
    predictors = {
        name: ct.models.MLModel(str(path), compute_units=units, function_name=name).predict for name in FUNCTIONS
    }
    return FusedLoop(package_calls(signatures, predictors), tree, sampling)


def float16_stand_in(code_predictor: torch.nn.Module, speculation: Speculation, sampling: SamplingConfig) -> FusedLoop:
    """The fused calls in PyTorch float16 on the CPU: where Core ML cannot run, a proxy for how often float16
    rounding flips a draw (Core ML's kernels round differently, so only a Mac measures the package)."""
    tree, runner = speculation.tree, cpu_runner(code_predictor, torch.float16)
    return FusedLoop(FusedCalls.modules(runner, tree, speculation.offsets.vectors, sampling), tree, sampling)


def coreml_loop(
    code_predictor: torch.nn.Module,
    speculation: Speculation,
    sampling: SamplingConfig,
    package: str | Path | None = None,
    precision: str = "w8a16",
    compute_units: str = "all",
    report: Callable[[str], None] = lambda message: None,
) -> FusedLoop:
    """The Core ML inner loop for this model, tree, offsets and sampling (macOS): `package`, or the package
    exported for them into the cache folder (exported on first use). `Synthesizer.using(speculation, loop)` runs it."""
    require_macos()
    key = PackageKey.build(code_predictor, speculation, sampling, precision, "macOS15")
    if package is None:
        folder = cache_file("coreml", key.file_name).parent  # the process's own where the cache cannot be written
        exported = export_package(code_predictor, speculation, sampling, folder, precision, report=report)
        package = exported.path
        if not exported.reused:
            report(f"exported {package} in {exported.seconds:.0f} s")
    return load_loop(package, key, speculation.tree, sampling, compute_units)
