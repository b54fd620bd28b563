"""torch_backend.attention_window on tiny_wan: each query attends to the latent frames within a few
of its own. A windowed layer attends exactly to its window's keys (against attention masked to
them), in 16 bits and in FP8; a window over every frame draws the dense video, the chosen
backbones and blocks alone are windowed, a compiled expert compiles once, evaluate.py scores a
windowed variant against the dense reference, and the settings no model or backend can take are
refused before any work."""

from __future__ import annotations

import json

import pytest
import torch

from sdquant.api import load
from sdquant.runtime.attention import attend
from sdquant.runtime.attention_window import WINDOW, TemporalWindow
from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config, refused_in_one_line

PROMPT = "a red fox runs through the snow"
STEPS = 4
# tiny_wan draws 9 frames of 32x32: 3 latent frames of 2x2 patches, 4 tokens each.
LATENT_FRAMES = 3


@pytest.fixture(scope="module")
def fp8_l4(model_cache, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("window_quantized")
    return run_quantize(compose_config("sd_xl_quantize", [
        "model=tiny_wan", "device=cpu", "quantize.n_steps=4", "quantize.calib_size=2", "quantize.batch_size=2",
        "quantize.format=fp8", "quantize.quant_level=4", f"out_dir={out}"]))


def _drawn(window: dict | None = None, **settings) -> torch.Tensor:
    backend = settings.pop("torch_backend", {})
    if window is not None:
        backend = {**backend, "attention_window": window}
    with load("tiny_wan", backend="torch", device="cpu", torch_backend=backend, **settings) as pipeline:
        return pipeline(PROMPT, seed=2, steps=STEPS).samples


def _windowed_layers(window: dict) -> dict[str, int]:
    with load("tiny_wan", backend="torch", device="cpu", torch_backend={"attention_window": window}) as pipeline:
        return {attribute: sum(hasattr(layer, WINDOW) for layer in module.modules())
                for attribute, module in pipeline.modules.items()}


def _frame_mask(tokens: int, per_frame: int, frames: int) -> torch.Tensor:
    """(tokens, tokens) True where key j's latent frame is within `frames` of query i's."""
    frame = torch.arange(tokens) // per_frame
    return (frame[:, None] - frame[None, :]).abs() <= frames


class _Layer(torch.nn.Module):
    """An attention layer as attend reads one: its window, and FP8 attention where given."""

    def __init__(self, window: TemporalWindow, fp8=None):
        super().__init__()
        setattr(self, WINDOW, window)
        if fp8 is not None:
            self.fp8_attention = fp8


def test_a_windowed_layer_attends_to_the_keys_of_its_frames_alone():
    """16 bits: attend against attention masked to the frames within the window; 5 frames of 4 tokens."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 20, 2, 8) for _ in range(3))
    window = TemporalWindow(1, None)
    window.tokens_per_frame = 4
    got = attend(_Layer(window), q, k, v).unflatten(2, (2, 8))
    mask = _frame_mask(20, 4, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                                attn_mask=mask).transpose(1, 2)
    assert (got - expected).abs().max() < 1e-5
    dense = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert (got - dense).abs().max() > 0.05
    window.tokens_per_frame = 3
    with pytest.raises(RuntimeError, match="20 tokens of 3 a frame"):
        attend(_Layer(window), q, k, v)


def test_a_window_over_every_frame_draws_the_dense_video_and_a_narrower_one_another(model_cache):
    dense = _drawn()
    assert (_drawn({"frames": LATENT_FRAMES}) - dense).abs().max() < 1e-4
    one_frame = _drawn({"frames": 1})
    assert (one_frame - dense).abs().max() > 1e-2
    # Every block kept dense: no layer is windowed.
    assert (_drawn({"frames": 1, "dense_blocks": [0, 1, 2, 3, 4]}) - dense).abs().max() < 1e-4
    low_noise = _drawn({"frames": 1, "backbones": ["transformer_2"]})
    assert (low_noise - dense).abs().max() > 1e-3 and (low_noise - one_frame).abs().max() > 1e-3


def test_the_window_marks_the_chosen_backbones_self_attention_but_the_dense_blocks():
    assert _windowed_layers({"frames": 1}) == {"transformer": 5, "transformer_2": 5}
    assert _windowed_layers({"frames": 1, "backbones": ["transformer_2"], "dense_blocks": [0, 4]}) == \
        {"transformer": 0, "transformer_2": 3}


def test_fp8_kernels_take_the_window(fp8_l4, model_cache):
    """Level 4 keeps blocks 0-2 in 16 bits and runs blocks 3 and 4's self-attention in FP8: all five
    are windowed; an FP8 layer's windowed output is, frame by frame, its FP8 attention over the
    window's keys alone; the video moves off the unwindowed FP8 one."""
    kernels_asked = {"quantized": "fp8", "attention_window": {"frames": 1}}
    with load("tiny_wan", backend="torch", device="cpu", quantized_backbone=fp8_l4,
              torch_backend=kernels_asked) as pipeline:
        windowed = [layer for layer in pipeline.modules["transformer_2"].modules() if hasattr(layer, WINDOW)]
        in_fp8 = [layer.fp8_attention for layer in windowed if hasattr(layer, "fp8_attention")]
        assert (len(windowed), len(in_fp8)) == (5, 2)
        narrow = pipeline(PROMPT, seed=2, steps=STEPS).samples
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    fp8 = in_fp8[0]
    window = TemporalWindow(1, None)
    window.tokens_per_frame = 4
    got = attend(_Layer(window, fp8), q, k, v)
    frames = []
    for frame in range(3):
        keys = slice(max(0, frame - 1) * 4, min(3, frame + 2) * 4)
        alone = fp8(*(x.transpose(1, 2) for x in (q[:, frame * 4:(frame + 1) * 4], k[:, keys], v[:, keys])))
        frames.append(fp8.dequantize(alone, torch.float32).transpose(1, 2))
    assert torch.equal(fp8.dequantize(got, torch.float32), torch.cat(frames, dim=1).flatten(2))
    dense = fp8.dequantize(fp8(*(x.transpose(1, 2) for x in (q, k, v))), torch.float32).transpose(1, 2).flatten(2)
    assert (fp8.dequantize(got, torch.float32) - dense).abs().max() > 0.05
    unwindowed = _drawn(quantized_backbone=fp8_l4, torch_backend={"quantized": "fp8"})
    assert torch.isfinite(narrow).all() and (narrow - unwindowed).abs().max() > 0.05


def test_a_compiled_windowed_expert_compiles_once_and_draws_the_eager_video(model_cache):
    from torch._dynamo.utils import counters

    window = {"frames": 1}
    with load("tiny_wan", backend="torch", device="cpu",
              torch_backend={"compile": True, "attention_window": window}) as compiled:
        compiled(PROMPT, seed=1, steps=2)
        warm = counters["stats"]["unique_graphs"]
        drawn = compiled(PROMPT, seed=2, steps=STEPS).samples
        assert counters["stats"]["unique_graphs"] == warm
    assert (drawn - _drawn(window)).abs().max() < 1e-3


def test_evaluate_scores_a_windowed_variant_against_the_dense_reference(tmp_path, model_cache):
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_wan", "device=cpu", f"out_path={tmp_path}", f"sampling.prompts={json.dumps([PROMPT])}",
        f"sampling.steps={STEPS}", "+variants.self=null", "+variants.window=null",
        "+variant_window={window:{frames:1}}"]))
    window, self_check = report["variants"]["window"], report["variants"]["self"]
    assert self_check["mean"]["psnr"] == float("inf")
    assert 10 < window["mean"]["psnr"] < 80
    assert "attention within 1 frames" in (tmp_path / "quality.md").read_text()


@pytest.mark.parametrize("overrides, message", [
    (["torch_backend.attention_window.frames=0"], "torch_backend.attention_window.frames=0: give the latent frames"),
    (["torch_backend.attention_window.frames=1", "torch_backend.attention_window.dense_blocks=[1,1]"],
     "dense_blocks=[1, 1]: give each block's index"),
    (["torch_backend.attention_window.frames=1", "torch_backend.attention_window.dense_blocks=[5]"],
     "have blocks 0 to 4"),
    (["torch_backend.attention_window.frames=1", "torch_backend.attention_window.backbones=[unet]"],
     "unet is not among model=tiny_wan's backbones (transformer, transformer_2)"),
    (["torch_backend.attention_window.frames=1", "model=tiny_sdxl"], "draws images, which have no frames"),
    (["torch_backend.attention_window.frames=1", "backend=onnxruntime"], "run it with backend=torch"),
    (["torch_backend.attention_window.frames=1", "parallel.ulysses=2"], "with parallel.ulysses=2: the window runs"),
])
def test_windows_no_model_or_backend_can_take_are_refused_before_any_work(tmp_path, capsys, tiny_pipeline, overrides,
                                                                           message):
    # The tiny models' folders built first, whose writing would print before the refusal.
    tiny_pipeline("tiny_wan"), tiny_pipeline("tiny_sdxl")
    capsys.readouterr()
    out = tmp_path / "out"
    cfg = compose_config("sd_xl_trt_inference", ["model=tiny_wan", "device=cpu", "backend=torch",
                                                 f"out_path={out}", *overrides])
    assert message in refused_in_one_line(run_infer, cfg, capsys)
    assert not out.exists()


def test_a_checkpoint_under_fake_quantization_is_refused(fp8_l4, tmp_path, capsys):
    out = tmp_path / "out"
    cfg = compose_config("sd_xl_trt_inference", ["model=tiny_wan", "device=cpu", "backend=torch", f"out_path={out}",
                                                 "torch_backend.attention_window.frames=1",
                                                 f"quantized_backbone={fp8_l4}"])
    assert "set torch_backend.quantized=fp8" in refused_in_one_line(run_infer, cfg, capsys)
    assert not out.exists()
