"""torchao's dynamic FP8 on a small stack of Linear layers, in under three minutes: whether torchao
imports beside this torch and loads its C++ extensions, how long quantize_ and the first compiled
call take, and the compiled stack's time and error against the compiled 16-bit stack. Each step says when it
starts and ends; one that runs past --step-timeout dumps every thread's Python stack, so a hang
shows where it is, and the whole probe stops at --deadline. Needs torch and torchao only (not
sdquant); a CUDA GPU of compute capability 8.9 or newer for the timings (--device cpu, with small
sizes, only checks that the code runs).

    python benchmarks/torchao_probe.py --out benchmarks/results/torchao_probe_h100.json

The variants, each compiled with torch.compile(fullgraph=True) in the default mode, as the peers of
benchmarks/torch_backend_full_size.py and flux_full_size.py are: bf16 (the baseline), row and
tensor (Float8DynamicActivationFloat8WeightConfig with PerRow() / PerTensor() as the benchmarks
configure it: set_inductor_config=False, so that the compiler's settings are the baseline's, and
activation_value_lb=1e-12), tensor_fp16 (the per-tensor form on fp16 weights, as SDXL's fp16
pipeline would run it; per-row takes bf16 weights only), and last row_default: PerRow() with
torchao's defaults, whose set_inductor_config=True turns on inductor's coordinate descent tuning
with check_all_directions for the rest of the process (so it runs last) and whose activation scale
has no floor. The input's first row is all zeros, as SDXL's zeroed negative-prompt embeddings and
padded prompt rows are: without the floor a per-row scale is 0 and that row comes out NaN
(nonfinite_values). The first variant's first call also pays the process's one-time compiler
start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

# What diffusers' torchao quantizer imports to register torchao's tensors for torch.load; when one is
# gone it warns "Unable to import `torchao` Tensor objects" (about loading serialized checkpoints).
DIFFUSERS_SAFE_GLOBALS = ("torchao.dtypes:NF4Tensor", "torchao.dtypes.uintx.uintx_layout:UintxTensor")
VARIANTS = {  # name: (weight dtype, granularity, torchao's defaults instead of the benchmarks' settings)
    "bf16": (torch.bfloat16, None, False), "row": (torch.bfloat16, "PerRow", False),
    "tensor": (torch.bfloat16, "PerTensor", False), "tensor_fp16": (torch.float16, "PerTensor", False),
    "row_default": (torch.bfloat16, "PerRow", True)}


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


def import_torchao() -> tuple[object, dict]:
    """torchao and what its import said: its version, which of its C++ extensions it ships and which
    torch loaded, why it skipped them if it did, its log lines. Raises what the import raises."""
    collect = _Collect()
    logger = logging.getLogger("torchao")
    logger.addHandler(collect)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        import torchao
        import torchao.quantization  # noqa: F401
    finally:
        logger.removeHandler(collect)
        logger.setLevel(level)
    folder = Path(torchao.__file__).resolve().parent
    status = {"version": torchao.__version__,
              "cpp_extensions_shipped": sorted(path.name for path in folder.glob("_C*.so")),
              "cpp_extensions_loaded": sorted(Path(path).name for path in torch.ops.loaded_libraries
                                              if Path(path).resolve().parent == folder),
              "skip_reason": getattr(torchao, "_skip_reason", None), "import_log": collect.lines}
    return torchao, status


def diffusers_safe_globals() -> dict[str, str]:
    """Whether each torchao class diffusers registers for checkpoint loading still exists."""
    import importlib

    found = {}
    for target in DIFFUSERS_SAFE_GLOBALS:
        module, name = target.split(":")
        try:
            getattr(importlib.import_module(module), name)
            found[target] = "present"
        except (ImportError, AttributeError) as error:
            found[target] = f"{type(error).__name__}: {error}"
    return found


def torchao_granularity(name: str):
    from torchao.quantization import PerRow, PerTensor

    return {"PerRow": PerRow, "PerTensor": PerTensor}[name]()


def torchao_config(granularity: str, inductor_config: bool = True):
    """torchao's dynamic FP8 at `granularity` (PerRow or PerTensor) as the benchmarks run it: with
    the compiler settings torchao recommends (set_inductor_config, which turns on coordinate descent
    tuning for the whole process: each peer runs in a process of its own) unless `inductor_config`
    is false, and the activation scale floored, so that an all-zero row (0/0) does not come out NaN
    (torchao 0.18 has no floor: pytorch/ao issue 4713)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig

    return Float8DynamicActivationFloat8WeightConfig(granularity=torchao_granularity(granularity),
                                                     set_inductor_config=inductor_config, activation_value_lb=1e-12)


class Watchdog:
    """Names the step the probe is in: prints its start and end, a line every `beat` seconds while it
    runs, every thread's stack once it passes `step_timeout`, and exits the process at `deadline`."""

    def __init__(self, step_timeout: float, deadline: float, beat: float = 20.0):
        self.start = time.perf_counter()
        self.step_timeout, self.deadline, self.beat = step_timeout, deadline, beat
        self.current, self.since = "start", self.start
        threading.Thread(target=self._watch, daemon=True).start()

    def say(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", flush=True)

    @contextlib.contextmanager
    def step(self, name: str):
        self.current, self.since = name, time.perf_counter()
        self.say(f"start: {name}")
        faulthandler.dump_traceback_later(self.step_timeout, exit=False)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            self.say(f"done:  {name} ({time.perf_counter() - self.since:.1f} s)")
            self.current = "between steps"

    def _watch(self) -> None:
        while True:
            time.sleep(self.beat)
            now = time.perf_counter()
            if now - self.start > self.deadline:
                self.say(f"deadline of {self.deadline:.0f} s passed in step {self.current!r}: stacks, then exit")
                faulthandler.dump_traceback(all_threads=True)
                sys.stdout.flush()
                os._exit(3)
            if self.current != "between steps":
                self.say(f"still in {self.current!r} after {now - self.since:.0f} s")


def steady_ms(model, x: torch.Tensor, iterations: int) -> float:
    """Milliseconds per call after three warm-up calls."""
    with torch.no_grad():
        for _ in range(3):
            model(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            model(x)
        if x.is_cuda:
            torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / iterations


def run_variant(name: str, stack: torch.nn.Module, x: torch.Tensor, reference: torch.Tensor, args,
                dog: Watchdog) -> dict:
    dtype, granularity, torchao_defaults = VARIANTS[name]
    model = copy.deepcopy(stack).to(dtype)
    x = x.to(dtype)
    row = {"dtype": str(dtype).removeprefix("torch."), "granularity": granularity}
    torch._dynamo.reset()
    if granularity:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_

        config = (Float8DynamicActivationFloat8WeightConfig(granularity=torchao_granularity(granularity))
                  if torchao_defaults else torchao_config(granularity, inductor_config=False))
        row.update(set_inductor_config=config.set_inductor_config, activation_value_lb=config.activation_value_lb)
        with dog.step(f"{name}: quantize_"):
            start = time.perf_counter()
            quantize_(model, config)
            row["quantize_s"] = time.perf_counter() - start
        row["quantized_layers"] = sum(type(m.weight) is not torch.nn.Parameter for m in model.modules()
                                      if isinstance(m, torch.nn.Linear))
        with dog.step(f"{name}: eager calls"):
            row["eager_ms"] = steady_ms(model, x, 3)
    row["coordinate_descent_tuning"] = torch._inductor.config.coordinate_descent_tuning
    compiled = torch.compile(model, fullgraph=True)
    with dog.step(f"{name}: first compiled call (compiles)"):
        start = time.perf_counter()
        with torch.no_grad():
            compiled(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - start
    with dog.step(f"{name}: steady state"):
        row["ms"] = steady_ms(compiled, x, args.iterations)
        with torch.no_grad():
            out = compiled(x).float()
    finite = torch.isfinite(out)
    row["nonfinite_values"] = int(out.numel() - finite.sum())
    row["relative_error"] = ((out - reference)[finite].norm() / reference[finite].norm()).item()  # finite values
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the input (one 1024x1024 Flux image: 4096)")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--step-timeout", type=float, default=90, help="seconds before a step's stacks are dumped")
    parser.add_argument("--deadline", type=float, default=170, help="seconds before the probe exits (code 3)")
    parser.add_argument("--out", type=Path, help="a JSON file, rewritten after every variant")
    args = parser.parse_args()
    dog = Watchdog(args.step_timeout, args.deadline)
    device = torch.device(args.device)
    results = {"benchmark": "torchao_probe", "torch": torch.__version__, "cuda": torch.version.cuda,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "shape": {"layers": args.layers, "features": args.features, "tokens": args.tokens}, "variants": {}}

    def write() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")

    with dog.step("import torchao"):
        try:
            _, results["torchao"] = import_torchao()
        except Exception as error:  # an ImportError, or a torch it was not built for failing in the import
            results["torchao"] = {"error": f"{getattr(error, 'name', None) or 'torchao'}: "
                                           f"{type(error).__name__}: {error}"}
    dog.say(f"torch {torch.__version__}, {results['device']}; torchao: {json.dumps(results['torchao'])}")
    write()
    if "error" in results["torchao"]:
        sys.exit(1)
    results["diffusers_safe_globals"] = diffusers_safe_globals()
    dog.say(f"the classes diffusers registers for torchao checkpoints: {results['diffusers_safe_globals']}")
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.features, args.features), torch.nn.GELU(approximate="tanh")]
    stack = torch.nn.Sequential(*layers[:-1]).to(device).eval()
    x = torch.randn(1, args.tokens, args.features, device=device)
    x[:, 0] = 0  # a zeroed row, as zeroed negative-prompt embeddings or padded prompt rows are
    with torch.no_grad():
        reference = stack.to(torch.bfloat16)(x.to(torch.bfloat16)).float()
    for name in args.variants.split(","):
        try:
            row = run_variant(name, stack, x, reference, args, dog)
        except Exception as error:  # recorded, and the next variant runs
            dog.say(f"{name} failed: {type(error).__name__}: {error}")
            row = {"error": f"{type(error).__name__}: {error}"}
        results["variants"][name] = row
        dog.say(f"{name}: {json.dumps(row)}")
        write()
    base = results["variants"].get("bf16", {}).get("ms")
    for name, row in results["variants"].items():
        if "ms" in row:
            speed = f", {base / row['ms']:.2f}x bf16" if base else ""
            dog.say(f"{name:20s} first call {row['first_call_s']:6.1f} s, {row['ms']:7.3f} ms{speed}, "
                    f"rel. error {row['relative_error']:.2e}, non-finite {row['nonfinite_values']}")
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
