"""infer_trt.py on the tiny models with the ONNX Runtime and torch backends."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from sdquant import report
from sdquant.errors import UserError
from sdquant.families.pipeline import warn_if_not_finite
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config

PROMPT = "a red fox in the snow, watercolor"
STEPS = 4


def _export(out, *overrides, model="tiny_sdxl"):
    return run_export(compose_config("sd_xl_export", [f"model={model}", f"infer.out_path={out}", "device=cpu",
                                                      "onnx.precision=fp32", "run_trt_export=false", *overrides]))


def _infer_cfg(export_dir, out, *overrides, model="tiny_sdxl"):
    return compose_config("sd_xl_trt_inference", [
        f"model={model}", f"engine_dir={export_dir}/plan", f"out_path={out}", "device=cpu",
        "backend=onnxruntime", f"sampling.prompts=['{PROMPT}']", f"sampling.steps={STEPS}",
        "sampling.width=64", "sampling.height=64", "num_warmup_runs=0", *overrides])


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import peak_signal_noise_ratio

    return float(peak_signal_noise_ratio(b, a, data_range=1.0))


@pytest.fixture(scope="module")
def fp32_graphs(tmp_path_factory, model_cache):
    out = tmp_path_factory.mktemp("graphs")
    _export(out)
    return out


def _read_png(path) -> np.ndarray:
    return np.asarray(Image.open(path)).astype(np.float64) / 255


def test_onnxruntime_image_matches_diffusers_pipeline(fp32_graphs, tmp_path, tiny_pipeline):
    run_infer(_infer_cfg(fp32_graphs, tmp_path))
    ours = _read_png(tmp_path / "image_000_00.png")
    pipe = tiny_pipeline()
    reference = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=5.0, height=64, width=64,
                     generator=torch.Generator().manual_seed(42), output_type="np").images[0]
    # Both write 8-bit images: quantising [0, 1] to 256 levels alone bounds PSNR near 59 dB, and
    # fp32 graph-vs-eager differences of ~1e-6 move few pixels across a level, so an exact
    # implementation of the same pipeline stays far above 40 dB; a wrong scheduler step,
    # embedding or guidance order falls far below it.
    assert _psnr(ours, np.round(reference * 255) / 255) >= 40


IMAGE_SETTINGS = SimpleNamespace(image_prompts=["a cat", "a dog"], seeds=[7, 8], negative_prompt="",
                                 steps=4, guidance_scale=5.0)


def test_image_writer_keeps_a_batch_queued_before_the_next_one_failed(tmp_path):
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="the next batch failed"):
        with report.ImageWriter(tmp_path, {"unet_xl": "unet.plan"}, "torch") as writer:
            writer.submit(images, 3, IMAGE_SETTINGS)
            raise RuntimeError("the next batch failed")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["image_003_00.png", "image_003_01.png"]
    for offset, image in enumerate(images):
        png = Image.open(tmp_path / f"image_003_{offset:02d}.png")
        expected = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        assert np.array_equal(np.asarray(png), expected)
        assert png.text["prompt"] == IMAGE_SETTINGS.image_prompts[offset] and png.text["seed"] == str(7 + offset)
        assert png.text["engines"] == "unet_xl=unet.plan"


def test_image_writer_stops_the_run_a_batch_after_a_failed_write(tmp_path):
    not_a_folder = tmp_path / "taken"
    not_a_folder.write_text("")
    images = torch.zeros(2, 3, 8, 8)
    with report.ImageWriter(not_a_folder, {}, "torch") as writer:
        writer.submit(images, 0, IMAGE_SETTINGS)
        writer.submit(images, 1, IMAGE_SETTINGS)
        with pytest.raises(OSError):
            writer.submit(images, 2, IMAGE_SETTINGS)
    assert [path.name for path in tmp_path.iterdir()] == ["taken"]


def test_report_holds_every_stage_and_png_metadata(fp32_graphs, tmp_path):
    latency = run_infer(_infer_cfg(fp32_graphs, tmp_path, "num_timed_runs=2"))
    saved = json.loads((tmp_path / "latency.json").read_text())
    assert set(saved["stage_ms"]) == {"clip1", "clip2", "unet_xl", "vae"}
    assert set(saved["ms"]) == {"text_encoders", "backbone_total", "backbone_per_step", "vae", "end_to_end",
                                "pipeline_overhead"}
    assert saved["timed_runs"] == 2 and saved["steps"] == STEPS
    assert saved["ms"]["backbone_per_step"] == pytest.approx(saved["ms"]["backbone_total"] / STEPS)
    assert 0 < saved["ms"]["end_to_end"] and saved["images_per_second"] > 0
    assert latency["backend"] == "onnxruntime"
    assert saved["setup_seconds"] >= 0
    # One prompt batch: it compiled or set up, so no batch after it gives a rate over the prompts.
    assert saved["after_first_batch"] == {"images": 0, "seconds": 0, "images_per_second": None}
    # The settings name the files of the model's own graphs, not Flux's.
    assert set(saved["settings"]["stage_files"]) == {"clip1", "clip2", "unet_xl", "vae"}
    info = Image.open(tmp_path / "image_000_00.png").text
    assert info["prompt"] == PROMPT and info["seed"] == "42" and info["steps"] == str(STEPS)
    assert "unet_xl=" in info["engines"]


def test_torch_backend_matches_onnxruntime(fp32_graphs, tmp_path):
    run_infer(_infer_cfg(fp32_graphs, tmp_path / "ort"))
    run_infer(_infer_cfg(fp32_graphs, tmp_path / "torch", "backend=torch"))
    assert _psnr(_read_png(tmp_path / "ort/image_000_00.png"), _read_png(tmp_path / "torch/image_000_00.png")) >= 40


def test_a_size_no_multiple_of_64_runs_as_diffusers_does(fp32_graphs, tmp_path, tiny_pipeline):
    # 72x56 is a 9x7 latent: no multiple of the tiny UNet's 2x upsampling, so its upsampler takes
    # the skip connection's size, in the exported graph as in diffusers.
    size = ["sampling.width=72", "sampling.height=56"]
    run_infer(_infer_cfg(fp32_graphs, tmp_path / "ort", *size))
    run_infer(_infer_cfg(fp32_graphs, tmp_path / "torch", *size, "backend=torch"))
    ours, torch_backend = _read_png(tmp_path / "ort/image_000_00.png"), _read_png(tmp_path / "torch/image_000_00.png")
    assert ours.shape == (56, 72, 3)
    reference = tiny_pipeline()(PROMPT, num_inference_steps=STEPS, guidance_scale=5.0, height=56, width=72,
                                generator=torch.Generator().manual_seed(42), output_type="np").images[0]
    assert _psnr(ours, np.round(reference * 255) / 255) >= 40
    assert _psnr(torch_backend, np.round(reference * 255) / 255) >= 40


def test_int8_unet_pipeline_runs_end_to_end(quantize_cfg, fp32_graphs, tmp_path):
    folder = run_quantize(quantize_cfg("quantize.quant_level=3"))
    _export(tmp_path / "int8", f"quantized_unet={folder}")
    run_infer(_infer_cfg(tmp_path / "int8", tmp_path / "out"))
    run_infer(_infer_cfg(fp32_graphs, tmp_path / "fp32"))
    int8, fp32 = _read_png(tmp_path / "out/image_000_00.png"), _read_png(tmp_path / "fp32/image_000_00.png")
    assert np.isfinite(int8).all()
    assert 10 < _psnr(int8, fp32) < 60, "8-bit images differ from fp32, but stay close"


def test_sd15_runs_with_onnxruntime(tmp_path, model_cache):
    _export(tmp_path / "graphs", model="tiny_sd15")
    run_infer(_infer_cfg(tmp_path / "graphs", tmp_path / "out", model="tiny_sd15"))
    assert (tmp_path / "out/image_000_00.png").is_file()


@pytest.mark.parametrize("override,message", [
    ("backend=tensorrt", "backend='tensorrt' is unknown"),
    ("sampling.width=100", "sampling.width=100 must be a positive multiple of 8, the model's VAE scale factor"),
    ("sampling.height=0", "sampling.height=0 must be positive"),
    ("sampling.scheduler=magic", "sampling.scheduler='magic' is unknown"),
])
def test_bad_inference_settings(fp32_graphs, tmp_path, override, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        run_infer(_infer_cfg(fp32_graphs, tmp_path, override))


def test_trt_backend_without_gpu_says_so(tmp_path, model_cache):
    plans = tmp_path / "plan"
    plans.mkdir()
    for name in ("clip1", "clip2", "unet_xl", "vae"):
        (plans / f"{name}.plan").write_bytes(b"not an engine")
    with pytest.raises(UserError, match="backend=trt needs a CUDA GPU"):
        run_infer(_infer_cfg(tmp_path, tmp_path / "out", "backend=trt"))


def test_missing_onnx_file_is_named(tmp_path, model_cache):
    with pytest.raises(UserError, match=r"clip1.plan: .*clip1/model.onnx, which does not exist: export it"):
        run_infer(_infer_cfg(tmp_path / "nothing", tmp_path))


def test_missing_engine_is_named(tmp_path, model_cache):
    with pytest.raises(UserError, match=r"engine_dir=.*clip1.plan: no such engine"):
        run_infer(_infer_cfg(tmp_path / "nothing", tmp_path, "backend=trt"))


def test_non_finite_vae_output_warns_naming_the_vae():
    with pytest.warns(UserWarning, match="the VAE produced NaN"):
        warn_if_not_finite(torch.zeros(1, 4, 8, 8), torch.tensor([[float("inf")]]))
    with pytest.warns(UserWarning, match="the backbone produced NaN"):
        warn_if_not_finite(torch.tensor([float("nan")]), torch.zeros(1))
