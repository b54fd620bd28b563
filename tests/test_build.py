"""TensorRT engines: profile logic (no build), trtexec command (golden), real TensorRT-RTX builds."""

from __future__ import annotations

import json
import os
import shutil
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from sdquant.export import engines, onnx_graphs
from sdquant import config
from sdquant.graphs.geometry import SampleGeometry
from sdquant.families.sd import SDXL
from sdquant.config import InferBlock, TrtBlock
from sdquant.errors import UserError
from sdquant.runs.export import settle_export
from sdquant.workflow.export_trt import build_engines, run_export
from sdquant.workflow.quantize import run_quantize

import standin_tensorrt
from conftest import compose_config, sdxl_profile_shapes

SDXL_UNET_DIMS = {"x": [None, 4, None, None], "timesteps": [None], "context": [None, None, 2048], "y": [None, 2816]}



def test_a_graph_name_two_families_share_is_sized_by_each_familys_own_network():
    """Flux and SD3.5 both call their backbone graph `transformer`, with other inputs and axes (packed
    tokens against a latent image, T5's tokens against CLIP + T5's): each engine profile comes from
    the family's own network, never from a lookup of the name across families."""
    from sdquant.families.flux import FLUX
    from sdquant.families.sd3 import SD3

    infer, trt = InferBlock(batch_size=1, height=64, width=64), TrtBlock()
    record = {"vae_scale_factor": 8, "text_tokens": 32}
    dims = {FLUX: {"hidden_states": [None, None, 64], "encoder_hidden_states": [None, None, 4096]},
            SD3: {"hidden_states": [None, 16, None, None], "encoder_hidden_states": [None, None, 4096]}}
    shapes = {family: engines.profile_shapes(infer, trt, family.network("transformer"), dims[family],
                                             family.profile_axis_sizes("transformer", SampleGeometry(1, 64, 64), record, trt))
              for family in (FLUX, SD3)}
    # Flux: a 64x64 image is 16 packed 2x2 latent tokens, and T5's 32 tokens are the text.
    assert [shape[1:] for shape in shapes[FLUX]["hidden_states"]] == [(16, 64)] * 3
    assert [shape[1:] for shape in shapes[FLUX]["encoder_hidden_states"]] == [(32, 4096)] * 3
    # SD3.5: the 8x8 latent itself, and CLIP's 77 tokens before T5's 32.
    assert [shape[1:] for shape in shapes[SD3]["hidden_states"]] == [(16, 8, 8)] * 3
    assert [shape[1:] for shape in shapes[SD3]["encoder_hidden_states"]] == [(109, 4096)] * 3

def _within(shape, profile) -> bool:
    low, _, high = profile
    return all(lo <= d <= hi for d, lo, hi in zip(shape, low, high))


def test_nemo_doc_shapes_fit_the_default_full_size_profile():
    shapes = sdxl_profile_shapes(InferBlock(width=1024, height=1024), TrtBlock(), "unet_xl", SDXL_UNET_DIMS)
    nemo = {"x": (8, 4, 128, 128), "timesteps": (8,), "context": (8, 80, 2048), "y": (8, 2816)}
    assert all(_within(nemo[name], shapes[name]) for name in nemo)
    assert shapes["x"] == ((1, 4, 128, 128), (4, 4, 128, 128), (16, 4, 128, 128))
    assert shapes["context"] == ((1, 77, 2048), (4, 77, 2048), (16, 154, 2048))


def test_guidance_doubles_unet_and_text_encoders_not_vae():
    infer, trt = InferBlock(batch_size=3), TrtBlock(min_batch_size=2, max_batch_size=5)
    assert engines.batch_range(infer, trt, SDXL.network("unet_xl")) == engines.BatchRange(2, 6, 10)
    assert engines.batch_range(infer, trt, SDXL.network("clip2")) == engines.BatchRange(2, 6, 10)
    assert engines.batch_range(infer, trt, SDXL.network("vae")) == engines.BatchRange(2, 3, 5)
    static = TrtBlock(static_batch=True)
    assert engines.batch_range(infer, static, SDXL.network("unet_xl")) == engines.BatchRange(6, 6, 6)
    assert engines.batch_range(infer, static, SDXL.network("vae")) == engines.BatchRange(3, 3, 3)


@pytest.mark.parametrize("infer,trt", [(InferBlock(batch_size=4), TrtBlock(max_batch_size=2)),
                                       (InferBlock(batch_size=1), TrtBlock(min_batch_size=2)),
                                       (InferBlock(batch_size=0), TrtBlock(static_batch=True))])
def test_impossible_batch_range_is_refused(infer, trt):
    with pytest.raises(UserError, match="batch"):
        config.validate_profile(infer, trt)


def test_trtexec_command_golden(tmp_path):
    infer, trt = InferBlock(batch_size=2, width=512, height=768), TrtBlock(max_batch_size=4, workspace_gb=8)
    shapes = sdxl_profile_shapes(infer, trt, "unet_xl", SDXL_UNET_DIMS)
    command = engines.trtexec_command(tmp_path / "unet_xl.onnx", tmp_path / "unet_xl.plan", shapes, trt,
                                    tmp_path / "timing.cache")
    assert command == [
        "trtexec", f"--onnx={tmp_path}/unet_xl.onnx", f"--saveEngine={tmp_path}/unet_xl.plan",
        "--minShapes=x:1x4x96x64,timesteps:1,context:1x77x2048,y:1x2816",
        "--optShapes=x:4x4x96x64,timesteps:4,context:4x77x2048,y:4x2816",
        "--maxShapes=x:8x4x96x64,timesteps:8,context:8x154x2048,y:8x2816",
        "--builderOptimizationLevel=4", f"--timingCacheFile={tmp_path}/timing.cache",
        "--memPoolSize=workspace:8192M", "--stronglyTyped", "--skipInference",
    ]


FAKE_TRTEXEC = """#!{python}
# Stands in for NVIDIA's trtexec: prints its banner as trtexec does, records its arguments and writes
# the engine file it is asked for.
import json, sys
print("&&&& RUNNING TensorRT.trtexec [TensorRT v{number}] [b35] # trtexec " + " ".join(sys.argv[1:]))
if "--help" in sys.argv:
    print("=== Model Options ===")
    sys.exit(0)
with open({log!r}, "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
for arg in sys.argv[1:]:
    if arg.startswith("--saveEngine="):
        open(arg.split("=", 1)[1], "wb").write(b"engine")
"""


@pytest.fixture
def fake_trtexec(tmp_path, monkeypatch):
    """Puts a trtexec printing the banner of TensorRT `number` (NV_TENSORRT_VERSION) first on PATH;
    returns the file its command lines go to, one JSON list a line."""

    def install(number: int):
        folder, log = tmp_path / "bin", tmp_path / "trtexec_args.jsonl"
        folder.mkdir(exist_ok=True)
        script = folder / "trtexec"
        script.write_text(FAKE_TRTEXEC.format(python=sys.executable, number=number, log=str(log)))
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
        return log

    return install


@pytest.mark.parametrize("number,version", [(101300, "10.13.0"), (100000, "10.0.0"), (101602, "10.16.2"),
                                            (110100, "11.1.0"), (8601, "8.6.1")])
def test_trtexec_version_is_read_from_its_banner(fake_trtexec, number, version):
    fake_trtexec(number)
    assert engines.trtexec_version() == version


@pytest.mark.parametrize("number,fp8,message", [
    (8601, False, "building strongly typed engines needs TensorRT >= 10.0, but trtexec is 8.6.1"),
    (100100, True, "FP8 engines needs TensorRT >= 10.2, but trtexec is 10.1.0")])
def test_old_trtexec_is_refused_in_one_line(fake_trtexec, number, fp8, message):
    fake_trtexec(number)
    with pytest.raises(UserError, match=message):
        engines.engine_builder(TrtBlock(builder="trtexec"), fp8)


def test_trtexec_builder_is_trtexecs_own_tensorrt(fake_trtexec):
    fake_trtexec(101000)
    assert engines.engine_builder(TrtBlock(builder="trtexec"), True) == \
        engines.EngineBuilder("trtexec", "tensorrt", "10.10.0")


def test_trtexec_builds_strongly_typed_without_benchmark_and_is_recorded(fp16_engines, fake_trtexec, tmp_path,
                                                                        monkeypatch):
    # A Python TensorRT 11 beside a trtexec 10: the flags follow trtexec, which needs --stronglyTyped.
    monkeypatch.setitem(sys.modules, "tensorrt", standin_tensorrt.module("11.1.0"))
    log = fake_trtexec(101300)
    shutil.copytree(onnx_graphs.onnx_path(fp16_engines[0].infer.out_path, "x").parent.parent, tmp_path / "onnx")
    cfg = _export_cfg(tmp_path, "trt.builder=trtexec", "run_onnx_export=false")
    run_export(cfg)
    commands = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(commands) == 4 and all("--stronglyTyped" in c and "--skipInference" in c for c in commands)
    saved = [arg.split("=", 1)[1] for c in commands for arg in c if arg.startswith("--saveEngine=")]
    assert all(".partial" in path for path in saved), "trtexec writes a temp file, renamed once it succeeds"
    assert engines.plan_path(tmp_path, "unet_xl").read_bytes() == b"engine"
    record = engines.engines_record(tmp_path)["unet_xl"]
    assert (record["flavour"], record["version"], record["builder"], record["fp8"]) == \
        ("tensorrt", "10.13.0", "trtexec", False)


def _export_cfg(out, *overrides, model="tiny_sdxl"):
    return compose_config("sd_xl_export", [f"model={model}", f"infer.out_path={out}", "device=cpu",
                                           "infer.width=64", "infer.height=64", "trt.max_batch_size=4",
                                           "trt.builder_optimization_level=0", *overrides])


@pytest.fixture(scope="module")
def fp16_engines(tmp_path_factory, model_cache):
    out = tmp_path_factory.mktemp("engines")
    cfg = _export_cfg(out)
    return cfg, run_export(cfg)


def test_fp16_pipeline_engines_build_with_profiles_from_config(fp16_engines):
    cfg, files = fp16_engines
    plans = {p.name for p in files if p.suffix == ".plan"}
    assert plans == {"clip1.plan", "clip2.plan", "unet_xl.plan", "vae.plan"}
    record = json.loads((engines.plan_path(cfg.infer.out_path, "x").parent / engines.ENGINES_FILE).read_text())
    assert record["unet_xl"]["flavour"] == "tensorrt_rtx" and record["unet_xl"]["targets"] == ["SM89"]
    unet = record["unet_xl"]["inputs"]
    assert unet["x"]["profile"] == [[1, 4, 8, 8], [4, 4, 8, 8], [8, 4, 8, 8]]
    assert unet["x"]["dtype"] == "HALF" and unet["timesteps"]["dtype"] == "FLOAT"
    assert record["clip1"]["inputs"]["input_ids"]["profile"] == [[1, 77], [4, 77], [8, 77]]
    assert record["vae"]["inputs"]["latent"]["profile"] == [[1, 4, 8, 8], [2, 4, 8, 8], [4, 4, 8, 8]]
    assert record["vae"]["inputs"]["latent"]["dtype"] == "FLOAT"
    assert all(engines.plan_path(cfg.infer.out_path, n).stat().st_size > 0 for n in ("clip1", "vae"))


def test_unet_engine_builds_for_a_size_no_multiple_of_64(fp16_engines, tmp_path):
    cfg, _ = fp16_engines
    onnx_file = onnx_graphs.onnx_path(cfg.infer.out_path, "unet_xl")
    infer = InferBlock(batch_size=1, width=72, height=56)
    shapes = sdxl_profile_shapes(infer, TrtBlock(max_batch_size=1), "unet_xl", engines.onnx_input_dims(onnx_file))
    assert shapes["x"][1] == (2, 4, 7, 9)
    info = engines.build_engine(engines.load_flavour("tensorrt_rtx"), onnx_file, shapes,
                              TrtBlock(builder_optimization_level=0), tmp_path / "unet_xl.plan", None)
    assert info["bytes"] > 0 and info["inputs"]["x"]["profile"][2] == [2, 4, 7, 9]


def test_existing_engines_are_reused(fp16_engines, capsys):
    cfg, _ = fp16_engines
    plan = engines.plan_path(cfg.infer.out_path, "unet_xl")
    mtime = plan.stat().st_mtime_ns
    capsys.readouterr()
    build_engines(settle_export(cfg))
    assert capsys.readouterr().out.count("  reused  ") == 4
    assert plan.stat().st_mtime_ns == mtime


# FP8 level 3 has its Q/DQ written by the export, level 4's attention ones by ModelOpt's tracing.
@pytest.mark.parametrize("fmt,level", [("int8", 2.5), ("int8", 3), ("fp8", 3), ("fp8", 4)])
def test_quantized_unet_engines_build(quantize_cfg, tmp_path, fmt, level):
    folder = run_quantize(quantize_cfg(f"quantize.format={fmt}", f"quantize.quant_level={level}", "quantize.n_steps=2"))
    cfg = _export_cfg(tmp_path, f"quantized_unet={folder}", "run_trt_export=false")
    run_export(cfg)
    onnx_file = onnx_graphs.onnx_path(tmp_path, "unet_xl")
    shapes = sdxl_profile_shapes(cfg.infer, cfg.trt, "unet_xl", engines.onnx_input_dims(onnx_file))
    info = engines.build_engine(engines.load_flavour("tensorrt_rtx"), onnx_file, shapes, cfg.trt,
                              tmp_path / "unet_xl.plan", None)
    assert (tmp_path / "unet_xl.plan").stat().st_size == info["bytes"] > 0
    assert engines.uses_fp8(onnx_file) == (fmt == "fp8")
    assert info["inputs"]["context"]["profile"] == [[1, 77, 64], [4, 77, 64], [8, 154, 64]]


def test_missing_onnx_names_the_step(tmp_path, model_cache):
    with pytest.raises(UserError, match="export the ONNX graphs first"):
        run_export(_export_cfg(tmp_path, "run_onnx_export=false"))


def test_bad_profile_is_refused_before_any_work(tmp_path, model_cache):
    with pytest.raises(UserError, match="trt.max_batch_size"):
        run_export(_export_cfg(tmp_path, "infer.batch_size=8"))
    assert not tmp_path.joinpath("onnx").exists()


def test_parser_error_names_node_op_and_file(tmp_path):
    node = helper.make_node("NoSuchOp", ["a"], ["b"], name="mystery_node", domain="example.custom")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19),
                                                      helper.make_opsetid("example.custom", 1)]), str(path))
    with pytest.raises(UserError) as error:
        engines.build_engine(engines.load_flavour("tensorrt_rtx"), path, {"a": ((1,), (1,), (1,))}, TrtBlock(),
                           tmp_path / "x.plan", None)
    assert "mystery_node" in str(error.value) and "NoSuchOp" in str(error.value) and str(path) in str(error.value)
    assert not (tmp_path / "x.plan").exists()


def test_backend_choice_and_install_hint():
    assert engines.load_flavour("auto").name == "tensorrt_rtx", "auto falls back to TensorRT for RTX here"
    with pytest.raises(UserError, match=r"no TensorRT is installed. Install TensorRT >= 10.1"):
        engines.load_flavour("tensorrt")
    with pytest.raises(UserError, match="trt.backend='tensorrt8' is unknown"):
        engines.load_flavour("tensorrt8")
