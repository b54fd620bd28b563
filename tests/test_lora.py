"""LoRA adapters fused into the tiny SDXL: against diffusers' own fusing, through quantize and export,
and the refit's weight mapping checked against TensorRT-RTX's parsed network."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from sdquant.export import engines, onnx_graphs, refit
from sdquant.quantize import checkpoint
from sdquant import lora
from sdquant.config import LoraAdapter
from sdquant.families.encoders import ClipGraph
from sdquant.families.sd import SDXL
from sdquant.cli import exits_cleanly
from sdquant.errors import EXIT_USER_ERROR, UserError
from sdquant.load import ensure_tiny_model, load_pipeline, resolve_device
from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.infer_trt import run_infer
from sdquant.runs.quantize import settle_quantize
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config, refused_in_one_line, save_random_lora
from test_export import _rel_err, _session, _torch_unet, _unet_feeds
from test_infer import _infer_cfg, _psnr, _read_png

RANK = 4


ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]


@pytest.fixture(scope="module")
def lora_files(model_cache, tmp_path_factory):
    """A: UNet attention and the first text encoder; B: UNet feed-forward and the second text
    encoder; sd15: a LoRA for the tiny SD 1.5 UNet."""
    folder = tmp_path_factory.mktemp("loras")
    cpu = resolve_device("cpu")
    sdxl = load_pipeline(compose_config("sd_xl_quantize", ["model=tiny_sdxl"]).model, cpu, torch.float32)
    sd15 = load_pipeline(compose_config("sd_xl_quantize", ["model=tiny_sd15"]).model, cpu, torch.float32)
    return {
        "a": save_random_lora(folder / "a", sdxl, 1, {"unet": ATTENTION, "text_encoder": TEXT_ATTENTION}),
        "b": save_random_lora(folder / "b", sdxl, 2, {"unet": ["ff.net.0.proj", "ff.net.2"], "text_encoder_2": TEXT_ATTENTION}),
        "sd15": save_random_lora(folder / "sd15", sd15, 3, {"unet": ATTENTION}),
    }


def _loras(*entries) -> str:
    """model.loras as a command-line override: entries of (file, scale)."""
    return "model.loras=[" + ",".join(f"{{path:'{path}',scale:{scale}}}" for path, scale in entries) + "]"


def _pipeline(*overrides, dtype=torch.float32):
    cfg = compose_config("sd_xl_quantize", ["model=tiny_sdxl", *overrides])
    return load_pipeline(cfg.model, resolve_device("cpu"), dtype)


def _unet_out(pipe, feeds) -> np.ndarray:
    return _torch_unet(pipe.unet, feeds)


def _diffusers_fused(file, scale: float):
    """diffusers' own recipe, as its documentation gives it."""
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(
        str(ensure_tiny_model(compose_config("sd_xl_quantize", ["model=tiny_sdxl"]).model)))
    pipe.load_lora_weights(str(file.parent), weight_name=file.name)
    pipe.fuse_lora(lora_scale=scale)
    pipe.unload_lora_weights()
    return pipe


def _state_delta(fused, base) -> dict[str, torch.Tensor]:
    return {k: v - base[k] for k, v in fused.items()}


def test_fused_unet_equals_diffusers_fuse_lora_and_differs_from_base(lora_files):
    feeds = _unet_feeds(_pipeline().unet)
    base = _unet_out(_pipeline(), feeds)
    ours = _pipeline(_loras((lora_files["a"], 0.7)))
    theirs = _diffusers_fused(lora_files["a"], 0.7)
    assert _rel_err(_unet_out(ours, feeds), base) > 1e-2
    assert _rel_err(_unet_out(ours, feeds), _unet_out(theirs, feeds)) < 1e-6
    ids = torch.randint(0, 200, (2, 77))
    with torch.no_grad():
        encoded = ours.text_encoder(ids).last_hidden_state
        assert torch.allclose(encoded, theirs.text_encoder(ids).last_hidden_state, atol=1e-6)
        assert not torch.allclose(encoded, _pipeline().text_encoder(ids).last_hidden_state, atol=1e-3)
    # Plain modules remain: nothing of PEFT is left for ModelOpt or the export to meet.
    assert not any("lora" in name for name in ours.unet.state_dict())


def _as_kohya(diffusers_file, folder):
    """The same adapter under kohya/A1111 key names (lora_unet_*, lora_te1_*, with alphas)."""
    from safetensors.torch import load_file, save_file

    kohya = {}
    for key, tensor in load_file(diffusers_file).items():
        component, rest = key.split(".", 1)
        path, role = rest.rsplit(".lora.", 1) if component == "unet" else rest.rsplit(".lora_linear_layer.", 1)
        prefix = "lora_unet_" if component == "unet" else "lora_te1_text_model_"
        name = prefix + path.replace(".", "_")
        kohya[f"{name}.lora_{role.split('.')[0]}.weight"] = tensor
        kohya[f"{name}.alpha"] = torch.tensor(float(RANK))
    folder.mkdir()
    save_file(kohya, folder / "adapter.safetensors")
    return folder


def test_kohya_keys_fuse_like_diffusers_keys(lora_files, tmp_path):
    kohya_folder = _as_kohya(lora_files["a"], tmp_path / "kohya")
    ours, kohya = _pipeline(_loras((lora_files["a"], 0.7))), _pipeline(_loras((kohya_folder, 0.7)))
    for component in ("unet", "text_encoder"):
        expected, got = getattr(ours, component).state_dict(), getattr(kohya, component).state_dict()
        assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_scale_zero_gives_the_base_model(lora_files):
    fused = _pipeline(_loras((lora_files["a"], 0))).unet.state_dict()
    base = _pipeline().unet.state_dict()
    assert fused.keys() == base.keys()
    assert all(torch.equal(fused[k], base[k]) for k in base)


def test_several_adapters_add_up(lora_files):
    base = _pipeline().unet.state_dict()
    both = _state_delta(_pipeline(_loras((lora_files["a"], 0.5), (lora_files["b"], 1.5))).unet.state_dict(), base)
    only_a = _state_delta(_pipeline(_loras((lora_files["a"], 0.5))).unet.state_dict(), base)
    only_b = _state_delta(_pipeline(_loras((lora_files["b"], 1.5))).unet.state_dict(), base)
    assert all(torch.allclose(both[k], only_a[k] + only_b[k], atol=1e-6) for k in base)
    assert any(only_a[k].abs().max() > 0 for k in base) and any(only_b[k].abs().max() > 0 for k in base)


# One calibration run of four steps: NeMo's divisor (n_steps) would put the convolution ranges at a
# quarter of the runs' mean, so these checkpoints take the true mean.
SMALL_CALIBRATION = ["quantize.n_steps=4", "quantize.calib_size=2", "quantize.batch_size=2",
                     "quantize.mean_divisor=runs"]


@pytest.fixture(scope="module")
def quantized_with_a(lora_files, model_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized")
    cfg = compose_config("sd_xl_quantize", ["model=tiny_sdxl", f"out_dir={out}", "device=cpu", *SMALL_CALIBRATION,
                                            _loras((lora_files["a"], 0.7))])
    return cfg, run_quantize(cfg)


def test_checkpoint_fingerprint_names_each_adapter_and_scale(quantized_with_a, lora_files):
    cfg, folder = quantized_with_a
    sidecar = json.loads((folder / checkpoint.RECORD_FILE).read_text())
    sha_a = lora.adapters([LoraAdapter(path=str(lora_files["a"]))])[0].sha256
    assert sidecar["settings"]["model"]["loras"] == [{"sha256": sha_a, "scale": 0.7}]
    others = [[], [(lora_files["a"], 0.5)], [(lora_files["b"], 0.7)], [(lora_files["a"], 0.7), (lora_files["b"], 1)]]
    names = {_folder(cfg, *([_loras(*entries)] if entries else [])).name for entries in others}
    assert len(names) == len(others) and folder.name not in names
    # The same adapter renamed is the same adapter.
    renamed = lora_files["a"].parent / "renamed.safetensors"
    renamed.write_bytes(lora_files["a"].read_bytes())
    assert _folder(cfg, _loras((renamed, 0.7))) == folder


def _folder(cfg, *overrides: str):
    """The checkpoint folder quantize.py settles for the tiny SDXL with these overrides."""
    return settle_quantize(compose_config("sd_xl_quantize", [
        "model=tiny_sdxl", f"out_dir={cfg.out_dir}", *SMALL_CALIBRATION, *overrides])).calibration.folder


def test_another_scale_calibrates_again(quantized_with_a, lora_files, capsys):
    cfg, folder = copy.deepcopy(quantized_with_a)
    cfg.model.loras[0].scale = 0.5
    assert run_quantize(cfg) != folder
    assert "  reused  " not in capsys.readouterr().out


@pytest.fixture(scope="module")
def fp32_exports(lora_files, model_cache, tmp_path_factory):
    """The fp32 graphs of the base model, then of the model with A, into the same folder."""
    out = tmp_path_factory.mktemp("lora_export")
    base = compose_config("sd_xl_export", ["model=tiny_sdxl", f"infer.out_path={out}", "device=cpu",
                                           "run_trt_export=false", "onnx.precision=fp32"])
    run_export(base)
    metas = {name: json.loads((out / "onnx" / name / onnx_graphs.META_FILE).read_text())
             for name in SDXL.graph_names()}
    with_a = compose_config("sd_xl_export", ["model=tiny_sdxl", f"infer.out_path={out}", "device=cpu",
                                             "run_trt_export=false", "onnx.precision=fp32",
                                             _loras((lora_files["a"], 0.7))])
    run_export(with_a)
    return out, metas


def test_fused_onnx_matches_fused_torch_in_onnx_runtime(fp32_exports, lora_files):
    out, _ = fp32_exports
    fused = _pipeline(_loras((lora_files["a"], 0.7)))
    feeds = _unet_feeds(fused.unet)
    onnx_out = _session(onnx_graphs.onnx_path(out, "unet_xl")).run(None, feeds)[0]
    assert _rel_err(onnx_out, _unet_out(fused, feeds)) < 1e-4
    assert _rel_err(onnx_out, _unet_out(_pipeline(), feeds)) > 1e-2


def test_torch_backend_with_the_adapter_matches_its_graphs(fp32_exports, lora_files, tmp_path):
    out, _ = fp32_exports
    run_infer(_infer_cfg(out, tmp_path / "ort"))
    run_infer(_infer_cfg(out, tmp_path / "torch", "backend=torch", _loras((lora_files["a"], 0.7))))
    run_infer(_infer_cfg(out, tmp_path / "base", "backend=torch"))
    graphs, fused, base = (_read_png(tmp_path / f"{name}/image_000_00.png") for name in ("ort", "torch", "base"))
    assert _psnr(graphs, fused) >= 40 and _psnr(base, fused) < 40


def test_vae_graph_is_reused_across_adapters(fp32_exports):
    out, base_metas = fp32_exports
    metas = {name: json.loads((out / "onnx" / name / onnx_graphs.META_FILE).read_text()) for name in base_metas}
    assert metas["vae"] == base_metas["vae"]
    for name in ("clip1", "clip2", "unet_xl"):
        assert metas[name]["fingerprint"] != base_metas[name]["fingerprint"] and len(metas[name]["loras"]) == 1


def test_quantized_export_takes_the_adapter_into_the_text_encoders_only(quantized_with_a, lora_files, tmp_path):
    _, folder = quantized_with_a
    overrides = ["model=tiny_sdxl", f"infer.out_path={tmp_path}", "device=cpu", "run_trt_export=false",
                 "onnx.precision=fp32", f"quantized_unet={folder}"]
    run_export(compose_config("sd_xl_export", [*overrides, _loras((lora_files["a"], 0.7))]))
    ids = np.random.default_rng(0).integers(0, 200, (2, 77)).astype(np.int32)
    clip1 = _session(onnx_graphs.onnx_path(tmp_path, "clip1")).run(None, {"input_ids": ids})[0]
    fused = _pipeline(_loras((lora_files["a"], 0.7)))
    with torch.no_grad():
        expected = ClipGraph(fused.text_encoder, penultimate=True)(torch.from_numpy(ids))
    assert _rel_err(clip1, expected.numpy()) < 1e-5


def test_evaluate_compares_a_checkpoint_with_the_fused_model(quantized_with_a, lora_files, tmp_path):
    _, folder = quantized_with_a
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_sdxl", f"out_path={tmp_path}", "device=cpu", "sampling.prompts=['a red fox']",
        "sampling.steps=2", "sampling.width=64", "sampling.height=64", f"+variants.int8={folder}",
        "metrics.lpips_net=null", "metrics.clip_model=null", _loras((lora_files["a"], 0.7))]))
    # The reference is the fused model: the 8-bit UNet calibrated on it gives 37 dB against it, 27 dB
    # against the base model.
    assert 32 < report["variants"]["int8"]["mean"]["psnr"] < 80


def test_checkpoint_of_other_adapters_is_refused(quantized_with_a, lora_files, tmp_path, capsys):
    _, folder = quantized_with_a
    overrides = ["model=tiny_sdxl", f"infer.out_path={tmp_path / 'out'}", "device=cpu", "run_trt_export=false",
                 f"quantized_unet={folder}"]
    for loras in ([], [_loras((lora_files["a"], 0.5))]):
        with pytest.raises(SystemExit) as exit_info:
            exits_cleanly(run_export)(compose_config("sd_xl_export", [*overrides, *loras]))
        assert exit_info.value.code == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "was calibrated with" in err and "model.loras gives" in err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def fp16_graphs(lora_files, model_cache, tmp_path_factory):
    """fp16 graphs of the model with A and, in another folder, with B."""
    outs = {}
    for name, scale in (("a", 0.7), ("b", 1.0)):
        outs[name] = tmp_path_factory.mktemp(f"fp16_{name}")
        run_export(compose_config("sd_xl_export", ["model=tiny_sdxl", f"infer.out_path={outs[name]}", "device=cpu",
                                                   "run_trt_export=false", _loras((lora_files[name], scale))]))
    return outs


def test_refit_mapping_covers_every_refittable_weight(fp16_graphs, lora_files):
    """Built with A, refitted with B: every weight the build marks refittable is one TensorRT's
    parsed network knows by that name, and the refit's source for it is exactly what a graph
    exported with B holds."""
    trt = engines.load_flavour("tensorrt_rtx")
    logger = trt.module.Logger(trt.module.Logger.ERROR)
    pipe_b = _pipeline(_loras((lora_files["b"], 1.0)), dtype=torch.float16)
    specs = {spec.name: spec for spec in SDXL.graph_specs(pipe_b, 1, None, 8, torch.float16, torch.float32)}
    for name in ("clip1", "clip2", "unet_xl"):
        onnx_a = onnx_graphs.onnx_path(fp16_graphs["a"], name)
        expected = refit.refittable_weights(onnx_a)
        builder = trt.module.Builder(logger)
        network = builder.create_network(trt.network_flags())
        assert trt.module.OnnxParser(network, logger).parse_from_file(str(onnx_a))
        config = builder.create_builder_config()
        engines.mark_refittable(trt, network, config, list(expected))
        assert config.get_flag(trt.module.BuilderFlag.REFIT_INDIVIDUAL)
        assert all(network.are_weights_marked_refittable(weight) for weight in expected)

        sources = refit.refit_sources(expected, onnx_graphs.graph_weights(specs[name].module))
        assert sources.keys() == expected.keys()
        graph_b = onnx.load(str(onnx_graphs.onnx_path(fp16_graphs["b"], name))).graph.initializer
        initializers_b = {t.name: numpy_helper.to_array(t) for t in graph_b if t.name in expected}
        assert initializers_b.keys() == expected.keys()
        assert all(np.array_equal(sources[w].numpy().reshape(initializers_b[w].shape), initializers_b[w])
                   for w in expected)
        graph_a = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(onnx_a)).graph.initializer}
        assert any(not np.array_equal(graph_a[w], initializers_b[w]) for w in expected)


def test_refit_refuses_engines_that_cannot_take_other_adapters(tmp_path):
    held, wanted = [{"sha256": "a" * 64, "scale": 1.0}], [{"sha256": "b" * 64, "scale": 1.0}]
    plan = tmp_path / "unet_xl.plan"
    with pytest.raises(UserError, match="is an 8-bit backbone made with .* needs quantize.py with them"):
        refit.needs_refit({"loras": held, "refittable": False, "quantized_unet": "q/int8"}, plan, wanted)
    with pytest.raises(UserError, match="built without trt.refittable=true"):
        refit.needs_refit({"loras": held, "refittable": False, "quantized_unet": None}, plan, wanted)
    assert refit.needs_refit({"loras": held, "refittable": True}, plan, wanted)
    assert not refit.needs_refit({"loras": held, "quantized_unet": "q/int8"}, plan, held)


def _graphs_of(source, out):
    """A fresh export folder whose ONNX graphs are those in `source`."""
    (out / "onnx").mkdir(parents=True)
    for name in SDXL.graph_names():
        (out / "onnx" / name).symlink_to(onnx_graphs.onnx_path(source, name).parent)
    return out


def _engine_cfg(out, *overrides):
    return compose_config("sd_xl_export", ["model=tiny_sdxl", f"infer.out_path={out}", "device=cpu",
                                           "run_onnx_export=false", "trt.backend=tensorrt_rtx", "infer.batch_size=1",
                                           "trt.max_batch_size=1", "infer.width=64", "infer.height=64", *overrides])


def test_refittable_build_needs_a_gpu_with_tensorrt_rtx(fp16_graphs, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a host without a GPU")
    out = _graphs_of(fp16_graphs["a"], tmp_path / "engines")
    err = refused_in_one_line(run_export, _engine_cfg(out, "trt.refittable=true"), capsys)
    assert "builds refittable engines only on a machine with a GPU" in err
    assert not list(out.glob("plan/*.plan"))


def test_refit_of_engines_built_without_refit_is_refused_untouched(fp16_graphs, lora_files, tmp_path, capsys):
    out = _graphs_of(fp16_graphs["a"], tmp_path / "engines")
    assert refused_in_one_line(run_export, _engine_cfg(out, "run_refit=true"), capsys).endswith(
        "does not exist: build the engines first (export_trt.py trt.refittable=true)")
    run_export(_engine_cfg(out))
    plans = {plan: plan.read_bytes() for plan in out.glob("plan/*.plan")}
    same = _engine_cfg(out, "run_refit=true", _loras((lora_files["a"], 0.7)))
    assert run_export(same) == []
    err = refused_in_one_line(run_export, _engine_cfg(out, "run_refit=true", _loras((lora_files["b"], 1.0))), capsys)
    assert "clip1.plan was built without trt.refittable=true" in err
    assert {plan: plan.read_bytes() for plan in out.glob("plan/*.plan")} == plans


@pytest.mark.parametrize("lora,message", [
    ("missing", "model.loras[0].path={}: no such LoRA file or folder"),
    ("sd15", "model.loras[0].path={} does not fit this model"),
])
def test_bad_adapter_is_refused_in_one_line(quantize_cfg, lora_files, tmp_path, capsys, lora, message):
    path = lora_files.get(lora, tmp_path / "missing.safetensors")
    cfg = quantize_cfg(_loras((path, 1)))
    with pytest.raises(SystemExit) as exit_info:
        exits_cleanly(run_quantize)(cfg)
    assert exit_info.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message.format(path) in err and len(err.splitlines()) == 1
    assert not (tmp_path / "quantized").exists()


def test_script_refuses_a_scale_that_is_no_number(run_script, lora_files, tmp_path):
    result = run_script("quantize.py", "model=tiny_sdxl", f"out_dir={tmp_path / 'q'}",
                        _loras((lora_files["a"], "strong")))
    assert result.returncode == EXIT_USER_ERROR
    assert result.stderr.strip() == ("error: model.loras[0].scale='strong' is not a number: give the adapter's "
                                     "weight, e.g. 0.8 (0 leaves the model as it is)")
    assert not (tmp_path / "q").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a refit runs on the GPU its engines are for")
def test_gpu_refit_gives_the_engines_a_rebuild_would(lora_files, tmp_path):
    """Engines built with A and refitted with B make B's images; a second refit has nothing to do.
    TensorRT-RTX engines do not load on Hopper: there only the refittable build is checked."""
    flavour = engines.load_flavour("auto")
    on_hopper = flavour.name == "tensorrt_rtx" and torch.cuda.get_device_capability()[0] == 9
    common = ["model=tiny_sdxl", "device=cpu", "infer.batch_size=1", "trt.max_batch_size=1", "infer.width=64",
              "infer.height=64", "trt.refittable=true", *(["trt.rtx_compute_capabilities=[SM89]"] if on_hopper else [])]
    adapters = {"a": (lora_files["a"], 0.7), "b": (lora_files["b"], 1.0)}
    for name, adapter in adapters.items():
        run_export(compose_config("sd_xl_export", [*common, f"infer.out_path={tmp_path / name}", _loras(adapter)]))
    record = engines.engines_record(tmp_path / "a")
    assert [graph for graph, info in record.items() if info["refittable"]] == ["clip1", "clip2", "unet_xl"]
    unet_plan = engines.plan_path(tmp_path / "a", "unet_xl")
    built = unet_plan.read_bytes()
    refit_cfg = compose_config("sd_xl_export", [*common, f"infer.out_path={tmp_path / 'a'}", "run_refit=true",
                                                _loras(adapters["b"])])
    try:
        refitted = run_export(refit_cfg)
    except UserError as error:
        if not on_hopper:
            raise
        pytest.skip(f"refittable engines built; the refit cannot run here: {error}")
    assert refitted == [engines.plan_path(tmp_path / "a", graph) for graph in ("clip1", "clip2", "unet_xl")]
    assert unet_plan.read_bytes() != built
    assert engines.engines_record(tmp_path / "a")["unet_xl"]["loras"] == lora.identities([{"path": str(lora_files["b"])}])
    assert run_export(refit_cfg) == []
    for name in adapters:
        run_infer(_infer_cfg(tmp_path / name, tmp_path / f"images_{name}", "backend=trt", "device=cuda"))
    assert _psnr(_read_png(tmp_path / "images_a/image_000_00.png"), _read_png(tmp_path / "images_b/image_000_00.png")) >= 40
