"""The TensorRT runtime on a GPU: `trt_stages` and `TrtStage` run unchanged, with NVIDIA's TensorRT
when it is importable, else with the stand-in module of standin_tensorrt.py (which honours TensorRT's
documented contract: kernels on the stream it is handed, inputs and outputs at the addresses set,
activations in the device memory given, work that takes time, failure by return value). Each test
names the defect it guards against; the ones needing behaviour no real engine can be asked for
(a failing enqueue, a refused capture, two TensorRT flavours) always use the stand-in.

Run on the GPU machine: python -m pytest -m gpu tests/test_trt_runtime_gpu.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import warnings

import numpy as np
import pytest
import torch

import standin_tensorrt
from conftest import sdxl_profile_shapes
from sdquant.export import engines as trt_engines
from sdquant.families.sd import SDXL
from sdquant.config import InferBlock, TrtBlock
from sdquant.errors import UserError
from sdquant.runtime.stages import StageTimer
from sdquant.runtime.trt_stages import trt_stages

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]

REAL_TENSORRT = importlib.util.find_spec("tensorrt") is not None


class StandInEngines:
    """Stand-in engines: x (B, 64, 64) float32 -> out = 2x + 1, about 30 ms of work per call."""

    sample = (64, 64)

    def __init__(self, folder):
        self.folder = folder
        self.flavour = trt_engines.Flavour(standin_tensorrt.module("10.13.0"), "tensorrt", "10.13.0")

    def make(self, name: str = "unet", batches: tuple[int, int, int] = (1, 2, 4), **options):
        profile = [[batch, *self.sample] for batch in batches]
        plan = standin_tensorrt.write_plan(self.folder / f"{name}.plan", {"x": {"dtype": "FLOAT", "profile": profile}},
                                           {"out": {"dtype": "FLOAT", "from": "x"}}, **options)
        return self.flavour, plan


class TensorRTEngines:
    """Real engines: x (B, 1024, 1024) float32 through 48 MatMuls with the identity, then 2x + 1:
    exact for small integers (TF32 keeps them) and long enough on the GPU for races to show."""

    sample = (1024, 1024)
    layers = 48

    def __init__(self, folder):
        self.folder = folder
        self.flavour = trt_engines.load_flavour("tensorrt")
        self.built = {}

    def make(self, name: str = "unet", batches: tuple[int, int, int] = (1, 2, 4)):
        if (name, batches) not in self.built:
            self.built[name, batches] = self._build(name, batches)
        return self.flavour, self.built[name, batches]

    def _build(self, name: str, batches: tuple[int, int, int]):
        import onnx
        from onnx import TensorProto, helper, numpy_helper

        nodes, previous = [], "x"
        for layer in range(self.layers):
            nodes.append(helper.make_node("MatMul", [previous, "identity"], [f"h{layer}"]))
            previous = f"h{layer}"
        nodes += [helper.make_node("Mul", [previous, "two"], ["twice"]),
                  helper.make_node("Add", ["twice", "one"], ["out"])]
        constants = [numpy_helper.from_array(np.eye(self.sample[1], dtype=np.float32), "identity"),
                     numpy_helper.from_array(np.array(2, dtype=np.float32), "two"),
                     numpy_helper.from_array(np.array(1, dtype=np.float32), "one")]
        io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", *self.sample]) for n in ("x", "out")]
        onnx_file = self.folder / f"{name}.onnx"
        onnx.save(helper.make_model(helper.make_graph(nodes, name, io[:1], io[1:], constants),
                                    opset_imports=[helper.make_opsetid("", 17)]), str(onnx_file))
        plan = self.folder / f"{name}.plan"
        shapes = {"x": tuple((batch, *self.sample) for batch in batches)}
        trt_engines.build_engine(self.flavour, onnx_file, shapes, TrtBlock(builder_optimization_level=0), plan, None)
        return plan


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """NVIDIA's TensorRT where it is installed, else the stand-in (built once for the module)."""
    return (TensorRTEngines if REAL_TENSORRT else StandInEngines)(tmp_path_factory.mktemp("engines"))


@pytest.fixture
def stand_in(tmp_path):
    return StandInEngines(tmp_path)


def _sample(engines, batch: int) -> torch.Tensor:
    """Small integers, different every call, so a stale buffer never passes for a result."""
    return torch.randint(-8, 9, (batch, *engines.sample), dtype=torch.float32)


def _expected(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_engine_scratch_memory_is_never_handed_to_other_tensors(engines):
    """Finding 1: the shared device-memory block lives as long as the stages."""
    stage = trt_stages(*_one(engines), ())["unet"]
    bystander = torch.full((stage.device_memory_size,), 7, dtype=torch.uint8, device="cuda")
    stage(x=_sample(engines, 2).cuda())
    torch.cuda.synchronize()
    assert bool((bystander == 7).all()), "the engine wrote its activations into another tensor's memory"


def _one(engines, **options):
    flavour, plan = engines.make("unet", **options)
    return flavour, {"unet": plan}


def test_engine_follows_its_producer_and_precedes_its_reader(engines):
    """Finding 2: the engine runs on the caller's stream, ordered with the work around it."""
    with torch.cuda.stream(torch.cuda.Stream()):  # a stream of the caller's own, as infer_trt.py runs
        stage = trt_stages(*_one(engines), ())["unet"]
        for _ in range(3):
            sample = _sample(engines, 2)
            source = sample.cuda()
            torch.cuda.synchronize()
            standin_tensorrt.spin(20)  # a slow producer: its output is written 20 ms from now
            x = source * 1
            out = stage(x=x)["out"].clone()  # read at once, on the caller's stream
            assert torch.equal(out.cpu(), _expected(sample))


def test_stage_timer_measures_the_engine(engines):
    """Finding 3: per-stage latency is the engine's own, not that of launching it."""
    stage = trt_stages(*_one(engines), ())["unet"]
    x = _sample(engines, 4).cuda()
    stage(x=x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    stage(x=x)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    timer = StageTimer(torch.device("cuda"))
    timer.time("unet", stage, x=x)
    (measured,) = timer.finish()["unet"]
    assert measured >= 0.5 * wall, f"the timer saw {measured * 1e3:.2f} ms of a {wall * 1e3:.2f} ms engine call"


def test_shape_outside_the_profile_is_one_clear_error(engines):
    """Finding 4: set_input_shape's refusal is an error naming engine, input, shape and profile."""
    from sdquant.graphs.networks import BATCH, Network
    from sdquant.runtime.trt_stages import check_within_profiles

    stage = trt_stages(*_one(engines), ())["unet"]
    rows, columns = engines.sample
    with pytest.raises(UserError, match=rf"^unet engine, input x: this run needs shape \(5, {rows}, {columns}\), "
                                        rf"but its profile admits \(1, {rows}, {columns}\) to \(4, {rows}, {columns}\)"):
        stage(x=_sample(engines, 5).cuda())
    with pytest.raises(UserError, match=r"^unet engine, input x: this run needs shape \(5, "):
        check_within_profiles({"unet": stage.profiles()}, {"unet": 5}, {},
                              {"unet": Network("unet", {"x": {0: BATCH}}, {"out": {0: BATCH}})})


def test_failed_enqueue_is_an_error(stand_in):
    """Finding 4: execute_async_v3's False is an error, not uninitialised outputs."""
    stage = trt_stages(*_one(stand_in, fail_enqueue=True), ())["unet"]
    with pytest.raises(UserError, match=r"^unet engine: TensorRT could not run it on x \(2, 64, 64\)"):
        stage(x=_sample(stand_in, 2).cuda())


def test_engine_that_cannot_be_captured_runs_without_graphs(stand_in):
    """Finding 4: an enqueue refused during capture leaves no empty graph to replay."""
    stage = trt_stages(*_one(stand_in, capturable=False), ("unet",))["unet"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            sample = _sample(stand_in, 2)
            assert torch.equal(stage(x=sample.cuda())["out"].cpu(), _expected(sample))
    assert any("cannot be captured in a CUDA graph" in str(w.message) for w in caught)


def test_static_text_encoder_takes_the_empty_negative_prompt_batch(stand_in):
    """Finding 5: with SDXL's empty negative prompt the text encoders get B samples, which an engine
    built with trt.static_batch admits and the stage runs."""
    import types

    from sdquant.families.pipeline import SamplingSettings
    from sdquant.families.sd.flow import SDXLTextToImage

    settings = SamplingSettings(prompts=["a", "b"], negative_prompt="", steps=1, guidance_scale=5.0, height=64,
                                width=64, seed=0)
    pipeline = SDXLTextToImage({}, [], None, types.SimpleNamespace(addition_time_embed_dim=256), 8,
                               torch.device("cuda"), "unet_xl")
    batch = pipeline.stage_batches(settings)["clip1"]
    profile = sdxl_profile_shapes(InferBlock(batch_size=2, height=64, width=64), TrtBlock(static_batch=True), "clip1",
                                  {"input_ids": [None, 77]})["input_ids"]
    plan = standin_tensorrt.write_plan(stand_in.folder / "clip1.plan",
                                       {"input_ids": {"dtype": "INT32", "profile": [list(s) for s in profile]}},
                                       {"hidden_states": {"dtype": "FLOAT", "from": "input_ids"}})
    stage = trt_stages(stand_in.flavour, {"clip1": plan}, ())["clip1"]
    ids = torch.randint(0, 1000, (batch, 77), dtype=torch.int32)
    assert torch.equal(stage(input_ids=ids.cuda())["hidden_states"].cpu(), _expected(ids.float()))


def test_each_engine_is_loaded_by_the_tensorrt_that_built_it(stand_in, monkeypatch):
    """Finding 6: with TensorRT and TensorRT for RTX both installed, an RTX-built engine is loaded
    by RTX (engines.json says so), not by whichever is importable first."""
    from conftest import compose_config, infer_stages

    rtx = standin_tensorrt.module("1.7.1", name="tensorrt_rtx")
    monkeypatch.setitem(sys.modules, "tensorrt", stand_in.flavour.module)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", rtx)
    plans = stand_in.folder / "plan"
    plans.mkdir()
    names = ("clip1", "clip2", "unet_xl", "vae")
    record = {}
    profile = [[1, 8], [2, 8], [8, 8]]
    for name in names:
        standin_tensorrt.write_plan(plans / f"{name}.plan", {"features": {"dtype": "FLOAT", "profile": profile}},
                                    {"out": {"dtype": "FLOAT", "from": "features"}},
                                    built_by=("tensorrt_rtx", "1.7.1"), work_ms=0)
        record[name] = {"flavour": "tensorrt_rtx", "version": "1.7.1", "inputs": {"features": {"profile": profile}}}
    (plans / trt_engines.ENGINES_FILE).write_text(json.dumps(record))
    cfg = compose_config("sd_xl_trt_inference", ["model=tiny_sdxl", "backend=trt",
                                                 *(f"{name}={plans / f'{name}.plan'}" for name in names)])
    stages = infer_stages(cfg)
    sample = torch.randint(-8, 9, (2, 8), dtype=torch.float32)
    assert torch.equal(stages["unet_xl"](features=sample.cuda())["out"].cpu(), _expected(sample))


def test_tensorrt_10_0_is_refused_at_start(tmp_path):
    """Finding 7: TensorRT 10.0 lacks set_device_memory(ptr, size) and device_memory_size_v2."""
    flavour = trt_engines.Flavour(standin_tensorrt.module("10.0.1"), "tensorrt", "10.0.1")
    plan = standin_tensorrt.write_plan(tmp_path / "unet.plan", {"x": {"dtype": "FLOAT", "profile": [[1, 8]] * 3}},
                                       {"out": {"dtype": "FLOAT", "from": "x"}}, built_by=("tensorrt", "10.0.1"))
    with pytest.raises(UserError, match=r"^running engines needs TensorRT >= 10.1, but tensorrt is 10.0.1"):
        trt_stages(flavour, {"unet": plan}, ())


def test_cuda_graph_per_input_shape(engines):
    """Finding 8: each shape replays a graph captured on a context that kept that shape."""
    stage = trt_stages(*_one(engines), ("unet",))["unet"]
    for batch in (2, 1, 2, 1, 4):
        sample = _sample(engines, batch)
        assert torch.equal(stage(x=sample.cuda())["out"].cpu(), _expected(sample)), f"batch {batch}"


def test_plan_of_another_tensorrt_version_names_both(stand_in):
    flavour, plan = stand_in.make(built_by=("tensorrt", "10.12.0"))
    (plan.parent / trt_engines.ENGINES_FILE).write_text(json.dumps({"unet": {"flavour": "tensorrt", "version": "10.12.0"}}))
    with pytest.raises(UserError, match=r"cannot be loaded by tensorrt 10.13.0 on .*: it was built by tensorrt 10.12.0"):
        trt_stages(flavour, {"unet": plan}, ())


def test_gpu_memory_is_freed_for_the_builder(capsys):
    """Finding 11: PyTorch's cache goes back to the GPU before a build in the same process."""
    # Memory that earlier tests of the session still hold (captured graphs' pools) stays reserved.
    torch.cuda.empty_cache()
    held_before = torch.cuda.memory_reserved()
    cached = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del cached
    assert torch.cuda.memory_reserved() >= held_before + (1 << 30)
    trt_engines.free_gpu_memory_for_builder()
    assert torch.cuda.memory_reserved() <= held_before
    free = torch.cuda.mem_get_info()[0] / 1024**3
    reported = float(capsys.readouterr().out.split("GPU memory free for the TensorRT builder: ")[1].split(" ")[0])
    assert abs(reported - free) < 0.5
