"""Build stage: TensorRT engines from the ONNX graphs, with dynamic batch profiles.

Works with ``tensorrt`` 10.x/11.x and with ``tensorrt_rtx`` (TensorRT for RTX GPUs, which
builds without a GPU for Ampere/Ada/Blackwell targets but cannot run on Hopper). They share one
Python API; the few differences live in ``Flavour``. Engines go to ``<out_path>/plan/<name>.plan``
with ``engines.json`` beside them describing each one, including the TensorRT that built it (the
one that must load it).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import re
import shlex
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..artifacts import atomic_path, read_json, write_json
from ..errors import UserError
from ..interrupts import interrupts_deferred
from ..graphs.networks import BATCH, Network, Role

PLAN_DIR = "plan"
ENGINES_FILE = "engines.json"
# Classifier-free guidance runs the conditional and unconditional halves in one batch.
GUIDANCE_FACTOR = 2


@dataclass(frozen=True)
class BatchRange:
    min: int
    opt: int
    max: int


def batch_range(infer, trt, network: Network) -> BatchRange:
    """The one place that decides each engine's batch range, in samples the graph sees.

    Images: min = trt.min_batch_size, opt = infer.batch_size, max = trt.max_batch_size (or all
    three infer.batch_size with static_batch). A network that runs guided (network.guided: it
    sees the negative and the positive prompt under classifier-free guidance) sees twice as many
    samples, so its opt and max are doubled; min stays in images, so a run without guidance at the
    smallest batch still fits. A static backbone takes exactly the doubled batch; text encoders
    keep min in images even then, because an empty negative prompt may be zeros, not encoded,
    which gives them only the prompts.
    """
    if trt.static_batch:
        images = BatchRange(infer.batch_size, infer.batch_size, infer.batch_size)
    else:
        images = BatchRange(trt.min_batch_size, infer.batch_size, trt.max_batch_size)
    if not network.guided:
        return images
    low = images.min * GUIDANCE_FACTOR if trt.static_batch and network.role == Role.backbone else images.min
    return BatchRange(low, images.opt * GUIDANCE_FACTOR, images.max * GUIDANCE_FACTOR)


def profile_shapes(infer, trt, network: Network, input_dims: dict[str, list],
                   axis_sizes: list[dict[str, int]]) -> dict[str, tuple]:
    """(min, opt, max) shape of every input of `network`'s graph, from its ONNX dims (None where
    dynamic): the batch from batch_range, every other dynamic axis from `axis_sizes` (min, opt,
    max: the sizes its family gives each label), static dims as the graph has them; a graph traced
    at fixed sizes takes its own shapes alone."""
    if network.fixed:
        return {name: (tuple(dims),) * 3 for name, dims in input_dims.items()}
    batch = batch_range(infer, trt, network)
    sizes = [{**axes, BATCH: samples} for samples, axes in zip((batch.min, batch.opt, batch.max), axis_sizes)]
    shapes = {}
    for name, dims in input_dims.items():
        per_profile = tuple(network.sized(name, dims, each) for each in sizes)
        if None in per_profile[0]:
            axis = per_profile[0].index(None)
            raise UserError(f"{network.name}: input {name} has a dynamic axis {axis} this tool cannot size")
        shapes[name] = per_profile
    return shapes


def _onnx_graph(onnx_file: Path):
    import onnx

    return onnx.load(str(onnx_file), load_external_data=False).graph


def onnx_input_dims(onnx_file: Path) -> dict[str, list]:
    return {i.name: [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
            for i in _onnx_graph(onnx_file).input}


def uses_fp8(onnx_file: Path) -> bool:
    """Whether the graph holds FP8 Q/DQ (written, as ModelOpt writes them, with TensorRT's own ops)."""
    return any(node.op_type in ("TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear")
               for node in _onnx_graph(onnx_file).node)


# The oldest TensorRT each task works with. TensorRT for RTX has had all of it since its first release.
MINIMUM_TENSORRT = {
    "building strongly typed engines": (10, 0),  # 8.x has no strong typing
    "running engines": (10, 1),                  # set_device_memory(ptr, size) and device_memory_size_v2
    "FP8 engines": (10, 2),                      # ModelOpt's FP8 Q/DQ (its deployment documentation)
}


def version_numbers(version: str) -> tuple[int, int, int]:
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise UserError(f"cannot read the TensorRT version {version!r}")
    return tuple(int(part or 0) for part in found.groups())


def require_tensorrt(found: str, version: str, task: str) -> None:
    """Refuses in one line a TensorRT older than `task` needs; `found` names what has that version."""
    needed = MINIMUM_TENSORRT[task]
    if version_numbers(version)[:2] < needed:
        raise UserError(f"{task} needs TensorRT >= {needed[0]}.{needed[1]}, but {found} is {version}: install a "
                        "newer TensorRT (pip install tensorrt --extra-index-url https://pypi.nvidia.com)")


@dataclass
class Flavour:
    """What differs between TensorRT and TensorRT for RTX, in one place."""

    module: object
    name: str
    version: str
    # TensorRT 10 builds strongly typed only when asked; 11 and RTX always do.
    needs_strongly_typed_flag: bool = field(init=False)
    has_timing_cache: bool = field(init=False)

    def __post_init__(self):
        self.needs_strongly_typed_flag = self.name == "tensorrt" and version_numbers(self.version)[0] < 11
        self.has_timing_cache = self.name == "tensorrt"

    def require(self, task: str) -> None:
        if self.name == "tensorrt":
            require_tensorrt(self.name, self.version, task)

    def network_flags(self) -> int:
        if self.needs_strongly_typed_flag:
            return 1 << int(self.module.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        return 0

    def set_targets(self, config, compute_capabilities: list[str]) -> list[str]:
        """RTX engines are compiled for chosen GPU generations; TensorRT's for the GPU at hand."""
        if self.name != "tensorrt_rtx":
            return []
        import torch

        targets = list(compute_capabilities) or (["CURRENT"] if torch.cuda.is_available() else ["SM89"])
        config.num_compute_capabilities = len(targets)
        for index, target in enumerate(targets):
            try:
                config.set_compute_capability(getattr(self.module.ComputeCapability, target), index)
            except AttributeError as error:
                known = [n for n in dir(self.module.ComputeCapability) if n.startswith("SM")]
                raise UserError(f"trt.rtx_compute_capabilities: {target} is unknown; choose from "
                                f"{', '.join(known)}") from error
        return targets


BACKENDS = ("tensorrt", "tensorrt_rtx")


def load_flavour(backend: str) -> Flavour:
    """`auto` takes TensorRT when importable, else TensorRT for RTX."""
    if backend not in ("auto", *BACKENDS):
        raise UserError(f"trt.backend={backend!r} is unknown: choose auto, tensorrt or tensorrt_rtx")
    for name in (BACKENDS if backend == "auto" else (backend,)):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return Flavour(module, name, module.__version__)
    raise UserError(
        f"trt.backend={backend}: no TensorRT is installed. Install TensorRT >= 10.1 from NVIDIA "
        "(pip install tensorrt --extra-index-url https://pypi.nvidia.com) or TensorRT for RTX "
        "(pip install 'sdquant[trt-rtx]')"
    )


def engine_record(plan: Path) -> dict:
    """What engines.json beside `plan` says of it; empty for a plan this tool did not build."""
    return (read_json(Path(plan).parent / ENGINES_FILE) or {}).get(Path(plan).stem, {})


def built_by(record: dict) -> str:
    return f"{record['flavour']} {record.get('version') or '(version not recorded)'}"


def deserialize(flavour: Flavour, runtime, plan: Path):
    """The engine at `plan`, loaded by `flavour`'s runtime; refused in one line where that TensorRT
    or this GPU cannot load it."""
    import torch

    if not plan.is_file():
        raise UserError(f"engine {plan} does not exist or cannot be read: build it with export_trt.py")
    engine = runtime.deserialize_cuda_engine(plan.read_bytes())
    if engine is None:
        record = engine_record(plan)
        maker = f"it was built by {built_by(record)}" if record.get("flavour") else \
            "it was built by another TensorRT version"
        raise UserError(f"engine {plan} cannot be loaded by {flavour.name} {flavour.version} on "
                        f"{torch.cuda.get_device_name()}: {maker}, or for another GPU; rebuild it with "
                        "export_trt.py force=true")
    return engine


def engine_flavour(plan: Path) -> Flavour:
    """The TensorRT that built `plan`, as engines.json records it: only that one can load it.
    A plan without a record is loaded by whichever TensorRT is installed."""
    record = engine_record(plan)
    if record.get("flavour") not in BACKENDS:
        flavour = load_flavour("auto")
    else:
        try:
            flavour = load_flavour(record["flavour"])
        except UserError:
            raise UserError(f"{plan} was built by {built_by(record)}, which is not installed here "
                            f"({_installed_tensorrt()}): install it, or rebuild the engine with "
                            "export_trt.py force=true") from None
    flavour.require("running engines")
    if record.get("fp8"):
        flavour.require("FP8 engines")
    return flavour


def _installed_tensorrt() -> str:
    try:
        flavour = load_flavour("auto")
    except UserError:
        return "no TensorRT is"
    return f"{flavour.name} {flavour.version} is"


def plan_path(out_path, graph: str) -> Path:
    return Path(out_path).expanduser() / PLAN_DIR / f"{graph}.plan"


@dataclass(frozen=True)
class EngineBuilder:
    """What builds the engines: trtexec or TensorRT's Python API, and the TensorRT behind it, which
    engines.json records as the one that must load them."""

    tool: str                    # python | trtexec
    flavour: str                 # tensorrt | tensorrt_rtx
    version: str | None          # None: trtexec is not on PATH, so its commands are only printed
    api: Flavour | None = None   # the module, for tool=python


def engine_builder(trt_cfg, fp8: bool) -> EngineBuilder:
    """The builder trt.builder names, refused in one line if its TensorRT is too old for the graphs."""
    tasks = ("building strongly typed engines", "FP8 engines") if fp8 else ("building strongly typed engines",)
    if trt_cfg.builder == "trtexec":
        version = trtexec_version()
        if version is not None:
            for task in tasks:
                require_tensorrt("trtexec", version, task)
        return EngineBuilder("trtexec", "tensorrt", version)
    flavour = load_flavour(trt_cfg.backend)
    for task in tasks:
        flavour.require(task)
    return EngineBuilder("python", flavour.name, flavour.version, flavour)


def free_gpu_memory_for_builder() -> None:
    """Hands PyTorch's cached GPU memory back before a build, as NVIDIA's demo does, and says what
    the builder then has: after calibration or export on the GPU in this process, the cache would
    hide gigabytes from TensorRT's tactics (or make it run out of memory on a 24 GB card)."""
    import torch

    gc.collect()
    if not torch.cuda.is_initialized():
        return  # PyTorch holds no GPU memory
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    print(f"GPU memory free for the TensorRT builder: {free / 1024**3:.1f} of {total / 1024**3:.1f} GiB")


def _parse(flavour: Flavour, network, logger, onnx_file: Path) -> None:
    parser = flavour.module.OnnxParser(network, logger)
    if parser.parse_from_file(str(onnx_file)):
        return
    error = parser.get_error(0)
    raise UserError(
        f"TensorRT cannot parse {onnx_file}: node {error.node_name() or error.node()} "
        f"(op {error.node_operator() or '?'}): {error.desc()}"
    )


def _attach_timing_cache(config, timing_cache: Path):
    """The timing cache in `timing_cache` attached to `config`; one made on another GPU or TensorRT
    is refused by TensorRT, which is said in one line, and a new one is started in its place."""
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
    if config.set_timing_cache(cache, ignore_mismatch=False):
        return cache
    warnings.warn(f"TensorRT refused the timing cache {timing_cache} (made on another GPU or TensorRT "
                  "version): building without it, and a new one replaces it")
    fresh = config.create_timing_cache(b"")
    return fresh if config.set_timing_cache(fresh, ignore_mismatch=False) else None


def make_refittable(flavour, network, config, names) -> None:
    """Makes exactly `names` refittable in the build of `network` (TensorRT's REFIT_INDIVIDUAL)."""
    import torch

    if flavour.name == "tensorrt_rtx" and not torch.cuda.is_available():
        # Its compiler runs CUDA code for refittable weights (seen with TensorRT-RTX 1.7).
        raise UserError("trt.refittable=true: TensorRT-RTX builds refittable engines only on a machine with a "
                        "GPU; build there, or set trt.refittable=false")
    mark_refittable(flavour, network, config, names)


def mark_refittable(flavour, network, config, names) -> None:
    """The marking itself: a name TensorRT knows no weights by would leave the refit without a
    source for them, so it is an error."""
    config.set_flag(flavour.module.BuilderFlag.REFIT_INDIVIDUAL)
    unknown = [name for name in names if not network.mark_weights_refittable(name)]
    if unknown:
        raise RuntimeError(f"TensorRT knows no weights named {unknown[:3]} in this graph")


@contextlib.contextmanager
def _stopped_by_ctrl_c(flavour: Flavour, config, logger):
    """Ctrl-C during a build stops it at TensorRT's next step, through its progress monitor, instead
    of after the whole build (minutes for a full-size UNet), and is raised once the builder returns;
    TensorRT's own report of the cancelled build is not printed."""
    if not hasattr(flavour.module, "IProgressMonitor"):
        yield
        return
    pressed = []

    class CancelOnCtrlC(flavour.module.IProgressMonitor):
        def __init__(self):
            flavour.module.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            pass

        def phase_finish(self, phase_name):
            pass

        def step_complete(self, phase_name, step):
            return not pressed  # False asks TensorRT to cancel the build

    config.progress_monitor = CancelOnCtrlC()

    def cancel():
        pressed.append(True)
        logger.min_severity = flavour.module.Logger.INTERNAL_ERROR

    with interrupts_deferred(on_press=cancel):
        yield


def build_engine(flavour: Flavour, onnx_file: Path, shapes: dict, trt_cfg, plan_file: Path,
                 timing_cache: Path | None, refittable_weights=()) -> dict:
    """Builds one engine with the Python API, with `refittable_weights` (names) refittable;
    returns what engines.json records of it."""
    trt = flavour.module
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(flavour.network_flags())
    _parse(flavour, network, logger, onnx_file)
    config = builder.create_builder_config()
    config.builder_optimization_level = trt_cfg.builder_optimization_level
    if trt_cfg.workspace_gb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(trt_cfg.workspace_gb * 1024**3))
    targets = flavour.set_targets(config, list(trt_cfg.rtx_compute_capabilities))
    if refittable_weights:
        make_refittable(flavour, network, config, refittable_weights)
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in shapes.items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    cache = None
    if flavour.has_timing_cache and timing_cache is not None:
        cache = _attach_timing_cache(config, timing_cache)

    start = time.perf_counter()
    with _stopped_by_ctrl_c(flavour, config, logger):
        serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise UserError(f"TensorRT could not build {onnx_file}: see the errors above")
    with atomic_path(plan_file) as temp:
        temp.write_bytes(serialized)
    if cache is not None:
        with atomic_path(timing_cache) as temp:
            temp.write_bytes(bytes(cache.serialize()))
    return {
        "plan": plan_file.name, "onnx": str(onnx_file), "build_seconds": round(time.perf_counter() - start, 2),
        "bytes": plan_file.stat().st_size,
        "inputs": {t.name: {"dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape),
                            "profile": [list(s) for s in profile.get_shape(t.name)]}
                   for t in (network.get_input(i) for i in range(network.num_inputs))},
        "outputs": {t.name: {"dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape)}
                    for t in (network.get_output(i) for i in range(network.num_outputs))},
        "targets": targets or [_current_gpu()],
        "refittable": bool(refittable_weights),
    }


def _current_gpu() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none visible"


def _shape_arg(shapes: dict, which: int) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims[which])}" for name, dims in shapes.items())


def trtexec_command(onnx_file: Path, plan_file: Path, shapes: dict, trt_cfg,
                    timing_cache: Path | None) -> list[str]:
    """The trtexec command line for the same build; precision comes from the graph itself."""
    command = ["trtexec", f"--onnx={onnx_file}", f"--saveEngine={plan_file}",
               f"--minShapes={_shape_arg(shapes, 0)}", f"--optShapes={_shape_arg(shapes, 1)}",
               f"--maxShapes={_shape_arg(shapes, 2)}",
               f"--builderOptimizationLevel={trt_cfg.builder_optimization_level}"]
    if timing_cache is not None:
        command.append(f"--timingCacheFile={timing_cache}")
    if trt_cfg.workspace_gb:
        command.append(f"--memPoolSize=workspace:{int(trt_cfg.workspace_gb * 1024)}M")
    # Every trtexec engine_builder accepts (10.0 on) takes --stronglyTyped: 10 needs it to keep
    # the graph's fp16 and Q/DQ types, 11 is strongly typed anyway. --skipInference: build only,
    # no benchmark after it (time, and a failure there would discard the engine just built).
    command += ["--stronglyTyped", "--skipInference"]
    return command


# trtexec's first line: "&&&& RUNNING TensorRT.trtexec [TensorRT v101300] [b35] # trtexec ...".
_TRTEXEC_BANNER = re.compile(r"\[TensorRT v(\d+)\]")


def trtexec_version() -> str | None:
    """The TensorRT version of the trtexec on PATH, from its banner; None when there is none.

    The banner holds NV_TENSORRT_VERSION: major*10000 + minor*100 + patch since 10.0 (101300 is
    10.13.0), major*1000 + minor*100 + patch before (8601 is 8.6.1).
    """
    path = shutil.which("trtexec")
    if path is None:
        return None
    result = subprocess.run([path, "--help"], capture_output=True, text=True)
    found = _TRTEXEC_BANNER.search(result.stdout + result.stderr)
    if found is None:
        raise UserError(f"{path} --help printed no '[TensorRT vNNNNNN]' banner, so its TensorRT version is "
                        "unknown: put NVIDIA's trtexec on PATH, or use trt.builder=python")
    number = int(found.group(1))
    major, rest = divmod(number, 10000 if number >= 100000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def run_trtexec(command: list[str], plan_file: Path) -> bool:
    """Prints the command, and runs it when trtexec is on PATH; the engine is renamed when done."""
    print("  " + shlex.join(command))
    if shutil.which("trtexec") is None:
        print("  trtexec is not on PATH: run the command above where TensorRT is installed")
        return False
    with atomic_path(plan_file) as temp:
        command = [arg if not arg.startswith("--saveEngine=") else f"--saveEngine={temp}" for arg in command]
        result = subprocess.run(command)
        if result.returncode != 0:
            raise UserError(f"trtexec failed with exit code {result.returncode} building {plan_file.name}")
    return True


def engines_record(out_path) -> dict:
    return read_json(Path(out_path).expanduser() / PLAN_DIR / ENGINES_FILE) or {}


def save_engines_record(out_path, record: dict) -> Path:
    path = Path(out_path).expanduser() / PLAN_DIR / ENGINES_FILE
    write_json(path, record)
    return path
