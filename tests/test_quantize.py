"""Calibration end to end on the tiny models: determinism, SmoothQuant alpha, save and restore."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from sdquant import report
from sdquant.quantize import checkpoint
from sdquant.quantize.calibrate import activation_amax, quantize_backbones
from sdquant.families import family_of
from sdquant.errors import UserError
from sdquant.load import load_prompts
from sdquant.runs.quantize import settle_quantize
from sdquant.workflow.quantize import run_quantize


def _calibrate(tiny_pipeline, quantize_cfg, *overrides, model="tiny_sdxl"):
    cfg = quantize_cfg(*overrides, model=model)
    pipe = tiny_pipeline(model)
    quantize_backbones(pipe, family_of(cfg.model.family), load_prompts(None, cfg.quantize.calib_size),
                       settle_quantize(cfg).calibration.block, cfg.seed)
    return pipe


def _unet_inputs(unet, seed=0):
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randn(2, 4, 8, 8, generator=generator)
    context = torch.randn(2, 77, unet.config.cross_attention_dim, generator=generator)
    kwargs = {}
    if unet.config.addition_embed_type == "text_time":
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(2, 32, generator=generator),
            "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 2),
        }
    return (sample, torch.tensor([500.0, 500.0]), context), kwargs


def test_same_config_and_seed_give_identical_amax(tiny_pipeline, quantize_cfg):
    first = activation_amax(_calibrate(tiny_pipeline, quantize_cfg).unet)
    second = activation_amax(_calibrate(tiny_pipeline, quantize_cfg).unet)
    assert len(first) > 100
    assert first == second


def test_collect_method_and_percentile_change_amax(tiny_pipeline, quantize_cfg):
    base = activation_amax(_calibrate(tiny_pipeline, quantize_cfg, "quantize.quant_level=1").unet)
    max_like = activation_amax(_calibrate(tiny_pipeline, quantize_cfg, "quantize.quant_level=1",
                                          "quantize.collect_method=mean-max").unet)
    early = activation_amax(_calibrate(tiny_pipeline, quantize_cfg, "quantize.quant_level=1",
                                       "quantize.percentile=0.5").unet)
    assert all(max_like[name] >= base[name] for name in base)
    assert any(max_like[name] > base[name] for name in base)
    assert early != base


def _pre_quant_scales(unet) -> dict[str, torch.Tensor]:
    return {name: module.input_quantizer.pre_quant_scale.clone()
            for name, module in unet.named_modules()
            if hasattr(module, "input_quantizer") and module.input_quantizer.pre_quant_scale is not None}


def test_alpha_changes_smoothing_factors(tiny_pipeline, quantize_cfg):
    low = _pre_quant_scales(_calibrate(tiny_pipeline, quantize_cfg, "quantize.alpha=0.5").unet)
    high = _pre_quant_scales(_calibrate(tiny_pipeline, quantize_cfg, "quantize.alpha=1.0").unet)
    # The tiny SDXL at level 2.5 has 24 FFN and 72 QKV Linear layers, all smoothed.
    assert len(low) == len(high) == 96
    assert all(not torch.allclose(low[name], high[name]) for name in low)


def test_fp8_level4_calibrates_attention(tiny_pipeline, quantize_cfg):
    unet = _calibrate(tiny_pipeline, quantize_cfg, "quantize.format=fp8", "quantize.quant_level=4").unet
    amax = activation_amax(unet)
    q_bmm = [v for k, v in amax.items() if k.endswith("q_bmm_quantizer")]
    softmax = [v for k, v in amax.items() if k.endswith("softmax_quantizer")]
    # Self-attention only (attn1): cross-attention stays in 16 bits at level 4.
    assert len(q_bmm) == 12 and all(v > 0 for v in q_bmm)
    assert softmax and all(v == 1.0 for v in softmax)
    assert not _pre_quant_scales(unet), "ModelOpt smooths int8 only; fp8 must not be smoothed"


@pytest.mark.parametrize("model", ["tiny_sdxl", "tiny_sd15"])
def test_checkpoint_restores_identical_output(tiny_pipeline, quantize_cfg, tmp_path, model):
    pipe = _calibrate(tiny_pipeline, quantize_cfg, "quantize.quant_level=3", model=model)
    args, kwargs = _unet_inputs(pipe.unet)
    with torch.no_grad():
        expected = pipe.unet(*args, **kwargs).sample
    checkpoint.save({"unet": pipe.unet}, tmp_path / "ckpt", {"fingerprint": "x"})

    fresh = tiny_pipeline(model).unet
    with torch.no_grad():
        unquantized = fresh(*args, **kwargs).sample
    checkpoint.restore(fresh, tmp_path / "ckpt", "unet")
    with torch.no_grad():
        restored = fresh(*args, **kwargs).sample
    assert not torch.equal(unquantized, expected), "quantization must change the output"
    assert torch.equal(restored, expected)


def test_checkpoint_of_other_model_is_refused(tiny_pipeline, quantize_cfg, tmp_path):
    pipe = _calibrate(tiny_pipeline, quantize_cfg, "quantize.quant_level=1")
    checkpoint.save({"unet": pipe.unet}, tmp_path / "ckpt", {"fingerprint": "x"})
    with pytest.raises(UserError, match="does not belong to this model"):
        checkpoint.restore(tiny_pipeline("tiny_sd15").unet, tmp_path / "ckpt", "unet")


def test_out_of_memory_names_batch_size(tiny_pipeline, quantize_cfg):
    cfg = quantize_cfg()
    pipe = tiny_pipeline()

    def exhaust(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    pipe.unet.register_forward_pre_hook(exhaust)
    with pytest.raises(UserError, match="lower quantize.batch_size"):
        quantize_backbones(pipe, family_of(cfg.model.family), load_prompts(None, 4), settle_quantize(cfg).calibration.block, cfg.seed)


def test_run_writes_sidecar_and_reuses(quantize_cfg, capsys):
    cfg = quantize_cfg("quantize.quant_level=3")
    folder = run_quantize(cfg)
    # Two runs of four steps under NeMo's divisor: the convolutions' min-mean ranges are halved.
    assert "over 2 runs and divided by n_steps=4, as NeMo does: its ranges are 0.5x the runs' mean" in (
        capsys.readouterr().out)
    sidecar = json.loads((folder / checkpoint.RECORD_FILE).read_text())
    assert sidecar["settings"]["quantize"]["quant_level"] == 3.0
    assert sidecar["resolved_config"]["quantize"]["alpha"] == 0.8
    assert sidecar["calibration"]["batches"] == 2
    assert sidecar["calibration"]["backbone_calls"] == 2 * 4
    assert sidecar["calibration"]["algorithm"] == {"method": "smoothquant", "alpha": 0.8}
    assert sidecar["amax_summary"]["quantizers"] == len(sidecar["activation_amax"]) > 100
    assert "nvidia-modelopt" in sidecar["versions"]
    # The code it came from, as a digest of the package's source.
    assert sidecar["versions"]["sdquant_source"] == report.source_digest()
    mtime = checkpoint.backbone_file(folder, "unet").stat().st_mtime_ns

    capsys.readouterr()
    assert run_quantize(cfg) == folder
    assert "reused" in capsys.readouterr().out
    assert checkpoint.backbone_file(folder, "unet").stat().st_mtime_ns == mtime

    run_quantize(OmegaConf.merge(cfg, {"force": True}))
    assert checkpoint.backbone_file(folder, "unet").stat().st_mtime_ns != mtime
    capsys.readouterr()
    run_quantize(OmegaConf.merge(cfg, {"quantize": {"mean_divisor": "runs"}}))
    assert "as NeMo does" not in capsys.readouterr().out


def test_script_runs_on_tiny_model(run_script, tmp_path):
    result = run_script("quantize.py", "model=tiny_sd15", "quantize.quant_level=2", "quantize.n_steps=2",
                        "quantize.calib_size=2", "quantize.alpha=1.0", f"out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    written = list(tmp_path.glob("*/unet.mto"))
    assert len(written) == 1 and "tiny_sd15_int8_l2_a1" in written[0].parent.name
    assert "quantize finished" in result.stdout


def test_the_source_digest_follows_the_code(tmp_path):
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not code")
    before = report.source_digest.__wrapped__(tmp_path)
    (tmp_path / "notes.txt").write_text("still not code")
    assert report.source_digest.__wrapped__(tmp_path) == before
    (tmp_path / "stage" / "a.py").write_text("x = 2\n")
    assert report.source_digest.__wrapped__(tmp_path) != before
    assert len(before) == 12 and int(before, 16) >= 0
