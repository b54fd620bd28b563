"""Bad input ends with one clear line naming the key and a non-zero exit, and writes nothing."""

from __future__ import annotations

import pytest

from sdquant.cli import exits_cleanly
from sdquant.errors import EXIT_USER_ERROR
from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config, refused_in_one_line

BAD_QUANTIZE = [
    (["quantize.quant_level=2.7"], "quantize.quant_level=2.7 is not a level of sdxl models"),
    (["quantize.quant_level=4"], "needs quantize.format=fp8"),
    (["quantize.calib_size=3"], "quantize.calib_size=3 must be a multiple of quantize.batch_size=2"),
    (["quantize.calib_size=4", "quantize.batch_size=8"], "quantize.calib_size=4 must be a multiple"),
    (["quantize.percentile=0"], "quantize.percentile=0.0 is outside (0, 1]"),
    (["quantize.percentile=1.5"], "quantize.percentile=1.5 is outside (0, 1]"),
    (["quantize.percentile=0.1"], "keeps no step"),
    (["quantize.alpha=1.2"], "quantize.alpha=1.2 is outside [0, 1]"),
    (["quantize.alpha=-0.1"], "quantize.alpha=-0.1 is outside [0, 1]"),
    (["quantize.collect_method=median"], "quantize.collect_method='median' is unknown"),
    (["model.tiny=false", "model.source=/nonexistent/sdxl"], "model.source=/nonexistent/sdxl: no such folder"),
    (["model.tiny=false", "model.source=/nonexistent/sdxl.safetensors"], "no such checkpoint file"),
    (["model.source=/nonexistent/model"], "model.source=/nonexistent/model: no tiny model there"),
    (["quantize.calib_size=400"], "holds 320 prompts but quantize.calib_size=400"),
    (["prompts_file=/nonexistent/prompts.txt"], "prompts_file=/nonexistent/prompts.txt: no such file"),
    (["model.family=sdxxl"], "model.family=sdxxl is not a family sdquant knows: choose one of sdxl, sd15, sd2, flux"),
]


@pytest.mark.parametrize("overrides,message", BAD_QUANTIZE, ids=[" ".join(o) for o, _ in BAD_QUANTIZE])
def test_bad_quantize_settings_are_refused(quantize_cfg, tmp_path, capsys, overrides, message):
    cfg = quantize_cfg(*overrides)
    with pytest.raises(SystemExit) as exit_info:
        exits_cleanly(run_quantize)(cfg)
    assert exit_info.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "quantized").exists()


def test_prompts_file_shorter_than_calib_size(quantize_cfg, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na dog\n")
    cfg = quantize_cfg(f"prompts_file={prompts}")
    with pytest.raises(SystemExit):
        exits_cleanly(run_quantize)(cfg)
    assert f"prompts_file={prompts} holds 2 prompts but quantize.calib_size=4" in capsys.readouterr().err


@pytest.mark.parametrize("override,message", [
    ("quantize.quant_levle=3", "quant_levle"),
    ("quantize.format=int4", "int4"),
    ("quantize.n_steps=many", "n_steps"),
])
def test_script_refuses_wrong_key_or_type_at_start(run_script, tmp_path, override, message):
    result = run_script("quantize.py", "model=tiny_sdxl", override, f"out_dir={tmp_path / 'q'}")
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "q").exists()


def test_script_reports_validation_error_without_traceback(run_script, tmp_path):
    result = run_script("quantize.py", "model=tiny_sdxl", "quantize.quant_level=4", f"out_dir={tmp_path / 'q'}")
    assert result.returncode == EXIT_USER_ERROR
    assert result.stderr.strip().splitlines()[-1].startswith("error: quantize.quant_level=4")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "q").exists()


def _onnx_file(path, input_name: str, truncated: bool = False):
    """A small valid ONNX graph taking `input_name` (or its first bytes only)."""
    from onnx import TensorProto, helper

    value = helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [1])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", [input_name], ["out"])], "g",
                                                [value], [out]))
    data = model.SerializeToString()
    path.write_bytes(data[:len(data) // 2] if truncated else data)
    return path


def test_steps_past_the_schedulers_training_timesteps_are_refused_before_any_image(tmp_path, capsys, model_cache):
    cfg = compose_config("sd_xl_trt_inference", ["model=scenes_sdxl", "backend=torch", "device=cpu",
                                                 "sampling.steps=1500", f"out_path={tmp_path / 'images'}"])
    err = refused_in_one_line(run_infer, cfg, capsys)
    assert "sampling.steps=1500 is more than the scheduler's 1000 training timesteps" in err
    assert not (tmp_path / "images").exists()


def test_an_export_size_the_vae_cannot_make_is_refused_before_the_first_graph(tmp_path, capsys, model_cache):
    cfg = compose_config("sd_xl_export", ["model=tiny_sdxl", "device=cpu", "infer.width=60",
                                          f"infer.out_path={tmp_path / 'export'}"])
    assert "infer.width=60 must be a positive multiple of 8" in refused_in_one_line(run_export, cfg, capsys)
    assert not (tmp_path / "export").exists()


def test_corrupt_or_foreign_artifacts_are_named_before_any_work(tmp_path, capsys, model_cache):
    evaluate = ["model=tiny_sdxl", "device=cpu", f"out_path={tmp_path / 'quality'}", 'sampling.prompts=["a cat"]']
    truncated = _onnx_file(tmp_path / "cut.onnx", "x", truncated=True)
    err = refused_in_one_line(run_evaluate, compose_config("sd_xl_evaluate", [*evaluate, f"+variants.cut={truncated}"]), capsys)
    assert f"variants.cut={truncated} is not a readable ONNX graph" in err
    text_encoder = _onnx_file(tmp_path / "clip.onnx", "input_ids")
    err = refused_in_one_line(run_evaluate, compose_config("sd_xl_evaluate", [*evaluate, f"+variants.te={text_encoder}"]), capsys)
    assert "is not a unet_xl graph (its inputs are input_ids" in err

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "unet.mto").write_bytes(b"the first bytes of a checkpoint")
    (checkpoint / "checkpoint.json").write_text('{"fingerprint": "0", "settings": {"quantize": {"percentile_layers": "auto"}}}')
    err = refused_in_one_line(run_export, compose_config("sd_xl_export", [
        "model=tiny_sdxl", "device=cpu", f"quantized_unet={checkpoint}", f"infer.out_path={tmp_path / 'export'}"]),
        capsys)
    assert f"quantized_unet={checkpoint}: {checkpoint / 'unet.mto'} is truncated or corrupt" in err
    err = refused_in_one_line(run_evaluate, compose_config("sd_xl_evaluate", [*evaluate, f"+variants.q={checkpoint}"]), capsys)
    assert "is truncated or corrupt" in err

    graphs = tmp_path / "graphs"
    (graphs / "onnx" / "clip1").mkdir(parents=True)
    _onnx_file(graphs / "onnx" / "clip1" / "model.onnx", "input_ids", truncated=True)
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_sdxl", "device=cpu", "backend=onnxruntime", f"clip1={graphs / 'plan' / 'clip1.plan'}",
        f"out_path={tmp_path / 'images'}"]), capsys)
    assert err.startswith(f"error: clip1={graphs / 'plan' / 'clip1.plan'}: its ONNX graph "
                          f"{graphs / 'onnx' / 'clip1' / 'model.onnx'} is not a readable ONNX graph")
    # An .onnx file given for an engine key is run itself, and named as given.
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_sdxl", "device=cpu", "backend=onnxruntime", f"clip1={truncated}",
        f"out_path={tmp_path / 'images'}"]), capsys)
    assert err.startswith(f"error: clip1={truncated} is not a readable ONNX graph")
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_sdxl", "device=cpu", "backend=onnxruntime", f"clip1={tmp_path / 'elsewhere' / 'clip1.plan'}",
        f"out_path={tmp_path / 'images'}"]), capsys)
    assert "backend=onnxruntime runs the ONNX graph export_trt.py writes beside that engine" in err
    assert not any((tmp_path / name).exists() for name in ("quality", "export", "images"))


def test_sizes_default_to_the_models_native_size(tmp_path, capsys, model_cache):
    from PIL import Image

    run_infer(compose_config("sd_xl_trt_inference", ["model=scenes_sdxl", "backend=torch", "device=cpu",
                                                     "sampling.steps=2", f"out_path={tmp_path}"]))
    assert "image size: 64x64 (the model's native size)" in capsys.readouterr().out
    assert Image.open(tmp_path / "image_000_00.png").size == (64, 64)
