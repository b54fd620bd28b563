"""torch_backend.attention_window on tiny_wan: each query attends to the latent frames within a few
of its own. A windowed layer attends exactly to its window's keys (against attention masked to
them), in 16 bits and in FP8; a window over every frame draws the dense video, the chosen
backbones and blocks alone are windowed, a compiled expert compiles once, evaluate.py scores a
windowed variant against the dense reference, and the settings no model or backend can take are
refused before any work. A recording writes each head's share of attention inside the window (its
softmax weight there, against the probabilities themselves), and with that file only the heads of
at least min_share attend within the window, the others to every key."""

from __future__ import annotations

import json

import pytest
import torch

from sdquant.api import load
from sdquant.runtime.attention import attend
from sdquant.runtime.attention_window import SHARES, WINDOW, WINDOW_HEADS, HeadSplit, ShareRecorder, TemporalWindow
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


@pytest.fixture(scope="module")
def shares_file(model_cache, tmp_path_factory) -> str:
    """Each head's share inside a window of 1 frame, recorded by infer_trt.py over one prompt."""
    out = tmp_path_factory.mktemp("window_shares")
    run_infer(compose_config("sd_xl_trt_inference", [
        "model=tiny_wan", "device=cpu", "backend=torch", f"out_path={out}", f"sampling.prompts={json.dumps([PROMPT])}",
        f"sampling.steps={STEPS}", "torch_backend.attention_window.frames=1",
        f"torch_backend.attention_window.record_to={out / 'shares.json'}"]))
    return str(out / "shares.json")


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


def test_a_layer_of_split_heads_attends_within_the_window_for_its_chosen_heads_alone():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 20, 4, 8) for _ in range(3))
    window = TemporalWindow(1, None)
    window.tokens_per_frame = 4
    layer = _Layer(window)
    setattr(layer, WINDOW_HEADS, HeadSplit(inside=(0, 2), outside=(1, 3)))
    got = attend(layer, q, k, v).unflatten(2, (4, 8))
    heads = [x.transpose(1, 2) for x in (q, k, v)]
    masked = torch.nn.functional.scaled_dot_product_attention(*heads, attn_mask=_frame_mask(20, 4, 1)).transpose(1, 2)
    dense = torch.nn.functional.scaled_dot_product_attention(*heads).transpose(1, 2)
    assert (got[:, :, [0, 2]] - masked[:, :, [0, 2]]).abs().max() < 1e-5
    assert (got[:, :, [1, 3]] - dense[:, :, [1, 3]]).abs().max() < 1e-5
    assert (masked - dense)[:, :, [0, 2]].abs().max() > 0.05


def test_a_recorder_takes_each_heads_softmax_weight_inside_the_window():
    """Against the attention probabilities: each query's weight on its window's keys, averaged per
    head over the queries; the recorder samples at most SAMPLED_QUERIES of a frame, here all."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 20, 3, 8), torch.randn(2, 20, 3, 8) * 2
    window = TemporalWindow(1, None)
    window.tokens_per_frame = 4
    recorder = ShareRecorder(window)
    recorder.add(q, k)
    recorder.add(q, k)
    probabilities = (torch.einsum("bqhd,bkhd->bhqk", q, k) * 8 ** -0.5).softmax(-1)
    inside = (probabilities * _frame_mask(20, 4, 1)).sum(-1).mean(dim=(0, 2))
    assert torch.allclose(torch.tensor(recorder.shares(), dtype=torch.float32), inside, atol=1e-5)
    assert recorder.queries == 2 * 2 * 20 and 0.2 < min(recorder.shares()) < max(recorder.shares()) < 1
    # A recorded layer attends to every key.
    layer = torch.nn.Module()
    setattr(layer, SHARES, ShareRecorder(window))
    dense = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, k))).transpose(1, 2)
    assert (attend(layer, q, k, k) - dense.flatten(2)).abs().max() < 1e-5


def test_a_recording_writes_each_windowable_heads_share(shares_file, tmp_path):
    recorded = json.loads(open(shares_file).read())
    assert recorded["frames"] == 1 and set(recorded["backbones"]) == {"transformer", "transformer_2"}
    for layers in recorded["backbones"].values():
        assert sorted(layers) == ["0", "1", "2", "3", "4"]
        # Of 3 latent frames the middle one's window holds every key, the others' two of three.
        assert all(len(heads) == 2 and all(0.5 < share < 1 for share in heads) for heads in layers.values())
    out = tmp_path / "every_frame"
    run_infer(compose_config("sd_xl_trt_inference", [
        "model=tiny_wan", "device=cpu", "backend=torch", f"out_path={out}", f"sampling.prompts={json.dumps([PROMPT])}",
        "sampling.steps=2", f"torch_backend.attention_window.frames={LATENT_FRAMES}",
        f"torch_backend.attention_window.record_to={out / 'shares.json'}"]))
    every_frame = json.loads((out / "shares.json").read_text())["backbones"]
    assert all(abs(share - 1) < 1e-6 for layers in every_frame.values() for heads in layers.values()
               for share in heads)


def test_a_window_over_every_frame_draws_the_dense_video_and_a_narrower_one_another(model_cache):
    dense = _drawn()
    assert (_drawn({"frames": LATENT_FRAMES}) - dense).abs().max() < 1e-4
    one_frame = _drawn({"frames": 1})
    assert (one_frame - dense).abs().max() > 1e-2
    # Every block kept dense: no layer is windowed.
    assert (_drawn({"frames": 1, "dense_blocks": [0, 1, 2, 3, 4]}) - dense).abs().max() < 1e-4
    low_noise = _drawn({"frames": 1, "backbones": ["transformer_2"]})
    assert (low_noise - dense).abs().max() > 1e-3 and (low_noise - one_frame).abs().max() > 1e-3


def test_heads_of_at_least_min_share_attend_within_the_window(shares_file):
    recorded = json.loads(open(shares_file).read())["backbones"]
    shares = sorted(share for layers in recorded.values() for heads in layers.values() for share in heads)
    middle = shares[len(shares) // 2]

    def marks(min_share: float) -> tuple[int, int]:
        window = {"frames": 1, "heads_file": shares_file, "min_share": min_share}
        with load("tiny_wan", backend="torch", device="cpu", torch_backend={"attention_window": window}) as pipeline:
            layers = [layer for module in pipeline.modules.values() for layer in module.modules()]
            split = [getattr(layer, WINDOW_HEADS) for layer in layers if hasattr(layer, WINDOW_HEADS)]
            assert all(layer.inside and layer.outside for layer in split)
            return sum(hasattr(layer, WINDOW) for layer in layers), len(split)

    windowed, split = marks(middle)
    assert 0 < windowed <= 10 and split > 0
    assert marks(shares[0]) == (10, 0)
    assert marks(1.0) == (0, 0)
    dense, every_head = _drawn(), _drawn({"frames": 1})
    assert (_drawn({"frames": 1, "heads_file": shares_file, "min_share": shares[0]}) - every_head).abs().max() < 1e-6
    assert (_drawn({"frames": 1, "heads_file": shares_file, "min_share": 1.0}) - dense).abs().max() < 1e-6
    some = _drawn({"frames": 1, "heads_file": shares_file, "min_share": middle})
    assert (some - dense).abs().max() > 1e-3 and (some - every_head).abs().max() > 1e-3


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
    # Split heads: each head's FP8 output is the windowed layer's or the dense one's.
    layer = _Layer(window, fp8)
    setattr(layer, WINDOW_HEADS, HeadSplit(inside=(1,), outside=(0,)))
    split = fp8.dequantize(attend(layer, q, k, v), torch.float32).unflatten(2, (2, 16))
    assert torch.equal(split[:, :, 1], fp8.dequantize(got, torch.float32).unflatten(2, (2, 16))[:, :, 1])
    assert torch.equal(split[:, :, 0], dense.unflatten(2, (2, 16))[:, :, 0])
    unwindowed = _drawn(quantized_backbone=fp8_l4, torch_backend={"quantized": "fp8"})
    assert torch.isfinite(narrow).all() and (narrow - unwindowed).abs().max() > 0.05


@pytest.mark.parametrize("split_heads", [False, True], ids=["every_head", "split_heads"])
def test_a_compiled_windowed_expert_compiles_once_and_draws_the_eager_video(model_cache, shares_file, split_heads):
    from torch._dynamo.utils import counters

    window = {"frames": 1}
    if split_heads:
        recorded = json.loads(open(shares_file).read())["backbones"]
        shares = sorted(share for layers in recorded.values() for heads in layers.values() for share in heads)
        window.update(heads_file=shares_file, min_share=shares[len(shares) // 2])
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
    (["torch_backend.attention_window.heads_file=shares.json"], "heads_file: give torch_backend.attention_window.frames"),
    (["torch_backend.attention_window.frames=1", "torch_backend.attention_window.min_share=0"],
     "min_share=0.0: give a share of attention in (0, 1]"),
    (["torch_backend.attention_window.frames=1", "torch_backend.attention_window.heads_file=no_such.json"],
     "heads_file=no_such.json is not a file of heads' shares: write one"),
    (["torch_backend.attention_window.frames=1", "torch_backend.attention_window.heads_file=a.json",
      "torch_backend.attention_window.record_to=b.json"], "record_to: a recording draws with every key"),
    (["torch_backend.attention_window.frames=1", "torch_backend.attention_window.record_to=b.json", "shard.count=2"],
     "record the heads' shares in one process"),
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


@pytest.mark.parametrize("recorded, message", [
    ("{not json", "is not a file of heads' shares"),
    ('{"frames": 1, "backbones": {"transformer": {"0": ["a"]}}}', "is not a file of heads' shares"),
    ('{"frames": 2, "backbones": {}}', "holds shares inside a window of 2 frames, not of frames=1"),
    ('{"frames": 1, "backbones": {"transformer": {"0": [0.9]}}}', "has 1 heads' shares for transformer's block 0, "
                                                                  "which has 2 heads"),
])
def test_a_heads_file_of_another_window_or_model_or_none_is_refused(tmp_path, capsys, tiny_pipeline, recorded,
                                                                    message):
    tiny_pipeline("tiny_wan")
    capsys.readouterr()
    heads_file = tmp_path / "shares.json"
    heads_file.write_text(recorded)
    out = tmp_path / "out"
    cfg = compose_config("sd_xl_trt_inference", ["model=tiny_wan", "device=cpu", "backend=torch", f"out_path={out}",
                                                 "torch_backend.attention_window.frames=1",
                                                 f"torch_backend.attention_window.heads_file={heads_file}"])
    assert message in refused_in_one_line(run_infer, cfg, capsys)
    assert not out.exists()


def test_a_recording_is_infer_trt_pys_alone(tmp_path, model_cache):
    from sdquant.errors import UserError

    window = {"frames": 1, "record_to": str(tmp_path / "shares.json")}
    with pytest.raises(UserError, match="a pipeline called per request draws with heads_file"):
        load("tiny_wan", backend="torch", device="cpu", torch_backend={"attention_window": window})
    with pytest.raises(UserError, match="variant_window.window.record_to: infer_trt.py records"):
        run_evaluate(compose_config("sd_xl_evaluate", [
            "model=tiny_wan", "device=cpu", f"out_path={tmp_path}", "+variants.window=null",
            "+variant_window={window:{frames:1,record_to:" + str(tmp_path / "shares.json") + "}}"]))
    assert not (tmp_path / "shares.json").exists()
