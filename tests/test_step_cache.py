"""Step caching: DeepCache's two UNet passes, and sampling.cache in the pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdquant.config import ModelConfig, shipped_model_folder
from sdquant.families.sd.deep_cache import FullPass, ShallowPass
from sdquant.errors import UserError
from sdquant.families.sd.graphs import UNetGraph
from sdquant.load import load_pipeline
from sdquant.families.flux.family import BLOCK_STACKS
from sdquant.families.flux.sizes import TINY as TINY_FLUX
from sdquant.workflow.infer_trt import run_infer

from conftest import compose_config, infer_stages

PROMPTS = ["a red circle on the left and a blue square on the right, white background",
           "a small blue circle on the left, pink background"]


@pytest.fixture(scope="module")
def scene_unet():
    pipe = load_pipeline(ModelConfig(name="scenes_sdxl", family="sdxl", source=shipped_model_folder("scenes_sdxl")),
                         torch.device("cpu"), torch.float32)
    return pipe.unet


@pytest.mark.parametrize("latent", [(16, 16), (18, 14)], ids=["native", "odd"])
@pytest.mark.parametrize("branch", [0, 1])
def test_full_pass_is_the_unet_and_shallow_pass_with_its_feature_too(scene_unet, branch, latent):
    generator = torch.Generator().manual_seed(branch)
    args = (torch.randn(2, 4, *latent, generator=generator), torch.tensor([700.0, 700.0]),
            torch.randn(2, 77, 192, generator=generator), torch.randn(2, 176, generator=generator))
    with torch.no_grad():
        expected = UNetGraph(scene_unet)(*args)
        out, deep = FullPass(scene_unet, branch)(*args)
        shallow = ShallowPass(scene_unet, branch)(*args, deep)
    assert torch.equal(out, expected) and torch.equal(shallow, expected)
    # The cached feature is the one entering the first live up block: the deeper the branch, the
    # coarser and wider it is.
    assert deep.shape[1] == scene_unet.config.block_out_channels[branch + 1]
    # Another step's inputs with this feature: the shallow pass is no longer the UNet.
    with torch.no_grad():
        later = (args[0] * 0.9, torch.tensor([600.0, 600.0]), *args[2:])
        assert not torch.equal(ShallowPass(scene_unet, branch)(*later, deep), UNetGraph(scene_unet)(*later))


def _images(tmp_path, *overrides):
    run_infer(compose_config("sd_xl_trt_inference", [
        "model=scenes_sdxl", "backend=torch", "device=cpu", f"out_path={tmp_path}", f"sampling.prompts={PROMPTS}",
        "sampling.steps=20", "num_warmup_runs=0", "sampling.batch_size=2", *overrides]))
    return np.stack([np.asarray(Image.open(tmp_path / f"image_000_{i:02d}.png")) for i in range(2)])


def test_deepcache_at_interval_one_is_no_cache_and_every_second_step_stays_close(tmp_path):
    from skimage.metrics import peak_signal_noise_ratio

    plain = _images(tmp_path / "none")
    assert np.array_equal(_images(tmp_path / "every", "sampling.cache.method=deepcache", "sampling.cache.interval=1"),
                          plain)
    cached = _images(tmp_path / "cached", "sampling.cache.method=deepcache", "sampling.cache.interval=2")
    assert not np.array_equal(cached, plain)
    assert peak_signal_noise_ratio(plain, cached) > 20


@pytest.mark.parametrize("branch", [0, 1])
def test_each_branch_is_the_reference_packages_cache_branch_id(tmp_path, branch):
    """The DeepCache paper's own package (DeepCacheSDHelper on diffusers' SDXL pipeline) counts three
    layers to a block: its cache_branch_id 3 * branch + 2 caches what branch `branch` does here."""
    from DeepCache import DeepCacheSDHelper
    from skimage.metrics import peak_signal_noise_ratio

    ours = _images(tmp_path, "sampling.cache.method=deepcache", "sampling.cache.interval=2",
                   f"sampling.cache.branch={branch}")
    pipe = load_pipeline(ModelConfig(name="scenes_sdxl", family="sdxl", source=shipped_model_folder("scenes_sdxl")),
                         torch.device("cpu"), torch.float32)
    helper = DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=2, cache_branch_id=3 * branch + 2)
    helper.enable()
    try:
        reference = pipe(prompt=PROMPTS, num_inference_steps=20, guidance_scale=5.0, height=64, width=64,
                         generator=[torch.Generator().manual_seed(42 + i) for i in range(2)], output_type="np").images
    finally:
        helper.disable()
    # The same modules in the same order: the same 8-bit images (infinite PSNR where written). The
    # package's other ids cache other layers of this small model and land at 44-53 dB from these.
    assert peak_signal_noise_ratio(np.round(reference * 255).astype(np.uint8), ours) > 60


@pytest.mark.parametrize("overrides, message", [
    (["sampling.cache.method=deepcache", "sampling.cache.branch=2"], r"sampling.cache.branch=2: .* 0 to 1"),
    (["sampling.cache.method=deepcache", "sampling.cache.interval=0"], "sampling.cache.interval=0"),
    (["sampling.cache.method=fastest"], "sampling.cache.method='fastest' is unknown"),
    (["sampling.cache.method=deepcache", "model=tiny_flux"], "takes none or first_block or taylorseer"),
])
def test_a_cache_the_backbone_or_backend_cannot_take_is_refused_before_any_work(tmp_path, model_cache, overrides,
                                                                                message):
    with pytest.raises(UserError, match=message):
        run_infer(compose_config("sd_xl_trt_inference", ["model=scenes_sdxl", "backend=torch", "device=cpu",
                                                         f"out_path={tmp_path}", *overrides]))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_evaluate_scores_a_cached_variant_against_the_uncached_reference(tmp_path):
    from sdquant.workflow.evaluate import run_evaluate

    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=scenes_sdxl", f"out_path={tmp_path}", "device=cpu", f"sampling.prompts={PROMPTS}", "sampling.steps=6",
        "sampling.batch_size=2", "+variants.same=null", "+variants.cached=null",
        "+variant_cache={cached:{method:deepcache,interval:3}}"]))
    same, cached = report["variants"]["same"], report["variants"]["cached"]
    assert same["step_error"] == [0.0] * 6
    # Teacher-forced, the full passes (steps 0 and 3) are the UNet itself; the shallow ones are not.
    assert [error == 0.0 for error in cached["step_error"]] == [True, False, False, True, False, False]
    assert 0 < max(cached["step_error"]) < 1
    assert "cached (DeepCache" in cached["source"] and all(row["psnr"] < 100 for row in cached["per_prompt"])


def test_a_cached_graph_variant_is_refused_naming_the_key(tmp_path):
    from sdquant.workflow.evaluate import run_evaluate

    graph = tmp_path / "unet_xl.plan"
    graph.write_bytes(b"")
    with pytest.raises(UserError, match="variant_cache.x.method=deepcache runs on the diffusers modules"):
        run_evaluate(compose_config("sd_xl_evaluate", [
            "model=scenes_sdxl", f"out_path={tmp_path / 'q'}", "device=cpu", f"+variants.x={graph}",
            "+variant_cache={x:{method:deepcache}}"]))
    assert not (tmp_path / "q").exists()


@pytest.fixture(scope="module")
def cached_export(tmp_path_factory):
    """The scene model's graphs in fp32 with DeepCache's two UNet passes, and their TensorRT-RTX engines."""
    from sdquant.workflow.export_trt import run_export

    out = tmp_path_factory.mktemp("export")
    run_export(compose_config("sd_xl_export", [
        "model=scenes_sdxl", f"infer.out_path={out}", "device=cpu", "onnx.precision=fp32", "infer.batch_size=2",
        "trt.backend=tensorrt_rtx", "cache.method=deepcache"]))
    return out


def _engines(folder) -> list[str]:
    return [f"{name}={folder}/plan/{name}.plan" for name in ("clip1", "clip2", "unet_xl", "vae")]


def test_cached_passes_export_build_and_draw_in_onnx_runtime_what_torch_draws(cached_export, tmp_path):
    import json

    from skimage.metrics import peak_signal_noise_ratio

    engines = json.loads((cached_export / "plan" / "engines.json").read_text())
    assert {"unet_xl_full", "unet_xl_shallow"} <= set(engines)
    meta = json.loads((cached_export / "onnx" / "unet_xl_shallow" / "export.json").read_text())
    assert meta["inputs"] == ["x", "timesteps", "context", "y", "deep"] and meta["deep_cache_branch"] == 0
    cached = ["sampling.cache.method=deepcache", "sampling.cache.interval=3"]
    in_torch = _images(tmp_path / "torch", *cached)
    in_onnx_runtime = _images(tmp_path / "ort", "backend=onnxruntime", *cached, *_engines(cached_export))
    assert peak_signal_noise_ratio(in_torch, in_onnx_runtime) > 40
    # The plain graph still runs without the cache.
    assert peak_signal_noise_ratio(_images(tmp_path / "plain", "backend=onnxruntime", *_engines(cached_export)),
                                   _images(tmp_path / "plain_torch")) > 40


def test_missing_cached_passes_are_named_with_the_export_that_makes_them(cached_export, tmp_path):
    import shutil

    graphs = tmp_path / "graphs"
    shutil.copytree(cached_export, graphs)
    shutil.rmtree(graphs / "onnx" / "unet_xl_full")
    with pytest.raises(UserError, match="unet_xl_full"):
        _images(tmp_path / "ort", "backend=onnxruntime", "sampling.cache.method=deepcache", *_engines(graphs))
    with pytest.raises(UserError, match=r"unet_xl_full.plan: no such engine; build it with export_trt.py "
                                        r"cache.method=deepcache cache.branch=0"):
        (graphs / "plan" / "unet_xl_full.plan").unlink()
        infer_stages(compose_config("sd_xl_trt_inference", ["model=scenes_sdxl", "sampling.cache.method=deepcache",
                                                             *_engines(graphs)]))


def _flux_images(tmp_path, *overrides, prompts=("a red fox", "a lighthouse at dusk"), batch_size=2):
    run_infer(compose_config("sd_xl_trt_inference", [
        "model=tiny_flux", "backend=torch", "device=cpu", f"out_path={tmp_path}", f"sampling.prompts={list(prompts)}",
        "sampling.steps=6", "num_warmup_runs=0", f"sampling.batch_size={batch_size}", *overrides]))
    return np.stack([np.asarray(Image.open(path)) for path in sorted(tmp_path.glob("*.png"))])


def test_diffusers_cache_hooks_on_the_flux_transformer(tmp_path, model_cache):
    plain = _flux_images(tmp_path / "none")
    first_block = ["sampling.cache.method=first_block"]
    # Threshold 0 never skips: the hook is there, the image is the plain one.
    assert np.array_equal(_flux_images(tmp_path / "never", *first_block, "sampling.cache.threshold=0"), plain)
    assert not np.array_equal(_flux_images(tmp_path / "skips", *first_block, "sampling.cache.threshold=10"), plain)
    assert not np.array_equal(_flux_images(tmp_path / "taylor", "sampling.cache.method=taylorseer",
                                           "sampling.cache.interval=3"), plain)
    # Each generation starts the hook afresh: the second call's image is what a run of it alone draws.
    both = _flux_images(tmp_path / "both", *first_block, "sampling.cache.threshold=10", prompts=["a red fox"] * 2,
                        batch_size=1)
    alone = _flux_images(tmp_path / "alone", *first_block, "sampling.cache.threshold=10", "sampling.seed=43",
                         prompts=["a red fox"], batch_size=1)
    assert np.array_equal(both[1], alone[0])


def test_taylorseer_over_whole_blocks_at_interval_one_is_no_cache_and_restarts_with_each_generation(
        tmp_path, model_cache):
    blocks = ["sampling.cache.method=taylorseer_blocks"]
    plain = _flux_images(tmp_path / "none")
    assert np.array_equal(_flux_images(tmp_path / "every", *blocks, "sampling.cache.interval=1"), plain)
    assert not np.array_equal(_flux_images(tmp_path / "cached", *blocks, "sampling.cache.interval=2"), plain)
    both = _flux_images(tmp_path / "both", *blocks, prompts=["a red fox"] * 2, batch_size=1)
    alone = _flux_images(tmp_path / "alone", *blocks, "sampling.seed=43", prompts=["a red fox"], batch_size=1)
    assert np.array_equal(both[1], alone[0])


def _hooked_velocities(transformer, config, steps: int = 6) -> torch.Tensor:
    """The transformer's outputs over `steps` calls of a generation under the cache `config`."""
    sizes, tokens, text = transformer.config, 16, 8
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, tokens, sizes.in_channels, generator=generator)
    inputs = {"encoder_hidden_states": torch.randn(1, text, sizes.joint_attention_dim, generator=generator),
              "pooled_projections": torch.randn(1, sizes.pooled_projection_dim, generator=generator),
              "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(text, 3), "guidance": torch.tensor([3.5])}
    transformer.enable_cache(config)
    velocities = []
    with torch.no_grad(), transformer.cache_context("cond"):
        for step in range(steps):
            t = 1 - step / steps
            velocities.append(transformer(hidden_states=latents * t, timestep=torch.tensor([t]), return_dict=False,
                                          **inputs)[0])
    transformer.disable_cache()
    return torch.stack(velocities)


def test_predicting_only_the_last_block_draws_what_predicting_every_block_draws():
    from diffusers.hooks import TaylorSeerCacheConfig

    from sdquant.families.flux import FLUX
    from sdquant.runtime.cache_hooks import HookCache

    transformer = FLUX.build_pipeline(FLUX.sizes["tiny"]).transformer.eval()
    block_gemms = []
    for stack in ("transformer_blocks", "single_transformer_blocks"):
        for layer in getattr(transformer, stack).modules():
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_hook(lambda *_: block_gemms.append(1))
    ours = _hooked_velocities(transformer, HookCache("taylorseer_blocks", 2, 0.0, BLOCK_STACKS).config(transformer))
    ours_gemms = len(block_gemms)
    every_block = _hooked_velocities(transformer, TaylorSeerCacheConfig(
        cache_interval=2, cache_identifiers=[r"transformer_blocks\.\d+", r"single_transformer_blocks\.\d+"]))
    assert torch.equal(ours, every_block)
    # diffusers' schedule at its defaults: full passes at steps 0-2 and 4, predictions at 3 and 5,
    # which run no GEMM of any block.
    block_gemms.clear()
    plain = _hooked_velocities(transformer, TaylorSeerCacheConfig(cache_interval=1))
    assert [torch.equal(a, b) for a, b in zip(ours, plain)] == [True, True, True, False, True, False]
    assert ours_gemms * 6 == len(block_gemms) * 4


def test_a_compiled_hooked_transformer_draws_the_eager_image_with_every_block_compiled(tmp_path, model_cache):
    import torch._dynamo

    taylor = ["sampling.cache.method=taylorseer", "sampling.cache.interval=2"]
    eager = _flux_images(tmp_path / "eager", *taylor)
    compiled = _flux_images(tmp_path / "compiled", *taylor, "torch_backend.compile=true")
    assert np.abs(compiled.astype(int) - eager).max() <= 2
    # Each hooked block resumes its own compiled code after the hook's host-side decision: dynamo's
    # default limit of 8 would leave the full-size transformer's later blocks eager.
    blocks = TINY_FLUX.double_blocks + TINY_FLUX.single_blocks
    assert torch._dynamo.config.recompile_limit >= 2 * blocks + 8


def test_a_cache_hook_variant_is_scored_and_taken_off_again(tmp_path, model_cache):
    from sdquant.workflow.evaluate import run_evaluate

    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_flux", f"out_path={tmp_path}", "device=cpu", "sampling.prompts=[a red fox]", "sampling.steps=6",
        "+variants.hooked=null", "+variants.same=null", "+variant_cache={hooked:{method:first_block,threshold:10}}"]))
    hooked, same = report["variants"]["hooked"], report["variants"]["same"]
    assert hooked["step_error"][0] == 0.0 and max(hooked["step_error"]) > 0
    assert same["step_error"] == [0.0] * 6, "the hook is off the transformer for the next variant"


@pytest.mark.parametrize("overrides, message", [
    (["model=tiny_flux", "sampling.cache.method=first_block", "cuda_graph=true"], "set cuda_graph=false"),
    (["model=tiny_flux", "sampling.cache.method=taylorseer", "backend=onnxruntime"], "run it with backend=torch"),
    (["model=scenes_sdxl", "sampling.cache.method=first_block"], "takes none or deepcache"),
    (["model=scenes_sdxl", "sampling.cache.method=taylorseer_blocks"], "takes none or deepcache"),
    (["model=tiny_flux", "sampling.cache.method=taylorseer_blocks", "sampling.cache.interval=0"],
     "sampling.cache.interval=0: give a full pass every 1 or more steps"),
])
def test_a_cache_hook_where_it_cannot_run_is_refused(tmp_path, model_cache, overrides, message):
    with pytest.raises(UserError, match=message):
        run_infer(compose_config("sd_xl_trt_inference", ["backend=torch", "device=cpu", f"out_path={tmp_path}",
                                                         *overrides]))
