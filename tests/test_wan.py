"""Wan2.2 text-to-video through every script on the tiny models: tiny_wan (two WanTransformer3DModel
experts of five blocks split at the A14B's boundary, a tiny UMT5 and Wan VAE) and tiny_wan_ti2v (one
transformer with its timestep per token, the 48-channel Wan2.2 VAE): videos equal diffusers'
WanPipeline's, each expert calibrated on the steps it serves, the levels against ModelOpt's Wan
filter, ONNX graphs equal to torch, TensorRT-RTX builds, the FP8 kernels, MP4s with their settings,
evaluate.py's video scores, and the refusals of frames, sizes and checkpoints that do not fit."""

from __future__ import annotations

import collections
import json
import shutil

import numpy as np
import pytest
import torch

from sdquant.load import load_pipeline
from sdquant.runtime.stages import StageTimer
from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.infer_trt import run_infer
from sdquant.runs.infer import settle_infer
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config, enabled_quantizers, flow_over, refused_in_one_line, restored_backbones

CPU = torch.device("cpu")
PROMPTS = ["a red fox runs through the snow", "a paper boat on a pond"]
STEPS = 4
GUIDANCE = ["sampling.guidance_scale=4.0", "sampling.negative_prompt='blurry, static'"]
QUICK = ["model=tiny_wan", "device=cpu", "quantize.n_steps=4", "quantize.calib_size=2", "quantize.batch_size=2"]
GRAPHS = {"umt5", "transformer", "transformer_2", "vae"}


def _sampling(model: str, *overrides):
    return compose_config("sd_xl_trt_inference", [
        f"model={model}", "device=cpu", "backend=torch", f"sampling.prompts={json.dumps(PROMPTS)}",
        f"sampling.steps={STEPS}", *GUIDANCE, *overrides])


def _ours(model: str, *overrides) -> tuple[torch.Tensor, object]:
    """Our torch stages' videos (B, F, 3, H, W) of the run's first prompt batch, and its settings."""
    cfg = _sampling(model, "sampling.batch_size=2", *overrides)
    run = settle_infer(cfg)
    pipe = load_pipeline(cfg.model, CPU, torch.float32)
    pipeline = flow_over(run, run.pipeline.family.torch_stages(pipe, torch.float32))
    return pipeline(run.sampling.first, StageTimer(CPU), progress=False), run.sampling.first


@pytest.mark.parametrize("model, second", [("tiny_wan", 3.0), ("tiny_wan", 1.0), ("tiny_wan_ti2v", None)])
def test_torch_stages_draw_diffusers_wan_pipelines_videos(model_cache, model, second):
    """Two experts with their own guidance (or one with its timestep per token), the guidance halves
    as one batch where WanPipeline runs them one after the other: the same videos. At scale 1 the
    second expert takes the conditional half alone, where WanPipeline runs both."""
    overrides = [] if second is None else [f"sampling.guidance_scale_2={second}"]
    ours, sampling = _ours(model, *overrides)
    geometry = sampling.geometry
    reference = load_pipeline(compose_config("sd_xl_quantize", [f"model={model}"]).model, CPU, torch.float32)(
        prompt=PROMPTS, negative_prompt="blurry, static", num_inference_steps=STEPS, guidance_scale=4.0,
        **({} if second is None else {"guidance_scale_2": second}), height=geometry.height, width=geometry.width,
        num_frames=geometry.frames, max_sequence_length=64, output_type="pt",
        generator=[torch.Generator().manual_seed(42 + i) for i in range(len(PROMPTS))]).frames
    assert ours.shape == reference.shape == (2, geometry.frames, 3, geometry.height, geometry.width)
    assert (ours - reference).abs().max() < 1e-4 and reference.std() > 0.01


@pytest.mark.parametrize("second", [None, 1.0])
def test_the_torch_backend_runs_each_guidance_half_in_turn_with_its_own_cache_state(model_cache, second):
    """The torch backend calls the expert once per guidance half, as WanPipeline does, each half in
    a cache context of its own: under TaylorSeer (a fixed schedule, no thresholds) one video is
    WanPipeline's under the same hooks, number for number within rounding; halves sharing one
    context would predict each from the other's history. At guidance scale 1 the second expert is
    called with the conditional half alone, whose context then holds that half's history only."""
    from sdquant.config import TorchBackendBlock
    from sdquant.runtime import torch_backend
    from sdquant.runtime.stages import InTurn

    taylorseer = ["sampling.cache.method=taylorseer", "sampling.cache.interval=2", "sampling.cache.warmup=1"]
    scale_2 = [] if second is None else [f"sampling.guidance_scale_2={second}"]
    cfg = _sampling("tiny_wan", "sampling.prompts=['a red fox runs through the snow']", "sampling.steps=6",
                    *taylorseer, *scale_2)
    run = settle_infer(cfg)
    family, first = run.pipeline.family, run.sampling.first
    geometry, cache = first.geometry, first.cache
    pipe = load_pipeline(cfg.model, CPU, torch.float32)
    stages = torch_backend.speed_up(pipe, family, family.torch_stages(pipe, torch.float32, cache),
                                    TorchBackendBlock(), cuda_graph=False, quantized=False)
    experts = (stages["transformer"], stages["transformer_2"])
    assert all(isinstance(stage, InTurn) and stage.size == 1 for stage in experts)
    samples = {name: [] for name in ("transformer", "transformer_2")}
    for name, calls in samples.items():
        stages[name] = _counted(stages[name], calls)
    ours = flow_over(run, stages)(first, StageTimer(CPU), progress=False)
    assert set(samples["transformer"]) == {2} and set(samples["transformer_2"]) == {1 if second == 1.0 else 2}

    def reference(cached: bool) -> torch.Tensor:
        pipe = load_pipeline(cfg.model, CPU, torch.float32)
        for expert in (pipe.transformer, pipe.transformer_2):
            if cached:
                expert.enable_cache(cache.config(expert))
        return pipe(prompt=PROMPTS[:1], negative_prompt="blurry, static", num_inference_steps=6, guidance_scale=4.0,
                    **({} if second is None else {"guidance_scale_2": second}),
                    height=geometry.height, width=geometry.width, num_frames=geometry.frames, max_sequence_length=64,
                    output_type="pt", generator=[torch.Generator().manual_seed(42)]).frames

    cached, uncached = reference(True), reference(False)
    assert (ours - cached).abs().max() < 1e-4
    # The hooks predicted steps: the cached video is not the uncached one.
    assert (cached - uncached).abs().max() > 1e-3


def _counted(stage, samples: list):
    """`stage`, noting the samples in each call's batch in `samples`."""

    def call(**inputs):
        samples.append(inputs["hidden_states"].shape[0])
        return stage(**inputs)

    call.reset = stage.reset
    return call


def test_the_vae_decodes_in_fp32_as_wanpipelines_documentation_loads_it(model_cache):
    model = compose_config("sd_xl_quantize", ["model=tiny_wan"]).model
    pipe = load_pipeline(model, CPU, torch.bfloat16)
    assert pipe.transformer.dtype == pipe.transformer_2.dtype == torch.bfloat16 and pipe.vae.dtype == torch.float32
    faster = compose_config("sd_xl_quantize", ["model=tiny_wan", "model.vae_dtype=bf16"]).model
    assert load_pipeline(faster, CPU, torch.bfloat16).vae.dtype == torch.bfloat16


def test_infer_writes_each_video_with_its_settings_and_a_poster(tmp_path, model_cache):
    import av
    from PIL import Image

    out = tmp_path / "videos"
    run_infer(_sampling("tiny_wan", f"out_path={out}", "num_warmup_runs=0", "sampling.fps=12",
                        "sampling.num_frames=13", "sampling.guidance_scale_2=3.0"))
    names = sorted(path.name for path in out.iterdir())
    assert names == ["latency.json", "video_000_00.mp4", "video_000_00.png", "video_001_00.mp4", "video_001_00.png"]
    with av.open(str(out / "video_001_00.mp4")) as video:
        frames = [frame.to_ndarray(format="rgb24") for frame in video.decode(video=0)]
        stream = video.streams.video[0]
        assert (len(frames), stream.average_rate, stream.width) == (13, 12, 32)
        assert video.metadata["prompt"] == PROMPTS[1] and video.metadata["seed"] == "43"
        assert video.metadata["guidance_scale_2"] == "3.0" and video.metadata["frames"] == "13"
    poster = np.asarray(Image.open(out / "video_001_00.png")).astype(int)
    # H.264 (constant quality 17, colour at half resolution) keeps the first frame of this noisy tiny
    # video within a few levels of the lossless poster (3.3 on average).
    assert np.abs(poster - frames[0].astype(int)).mean() < 8
    latency = json.loads((out / "latency.json").read_text())
    assert latency["output"] == "video" and latency["nonfinite_values"] == 0
    # What the attention kernel setting settled on (auto: torch's on the CPU) is on record.
    assert latency["attention_kernel_setting"] == "torch"
    # Each expert serves its own steps: 2 and 2 of 4 at UniPC's flow shift of 3.
    assert latency["stage_calls"]["transformer"] == latency["stage_calls"]["transformer_2"] == 2


@pytest.fixture(scope="module")
def checkpoints(model_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("wan_quantized")
    recipes = {"fp8_l3": ["quantize.format=fp8", "quantize.quant_level=3"],
               "fp8_l4": ["quantize.format=fp8", "quantize.quant_level=4"],
               "int8_l3": ["quantize.quant_level=3"],
               "fp8_l3_block_1": ["quantize.format=fp8", "quantize.quant_level=3", "quantize.high_precision_blocks=[1]"]}
    return {name: run_quantize(compose_config("sd_xl_quantize", [*QUICK, f"out_dir={out}", *recipe]))
            for name, recipe in recipes.items()}


def test_each_expert_is_calibrated_on_the_steps_it_serves(checkpoints):
    folder = checkpoints["fp8_l4"]
    assert {path.name for path in folder.iterdir()} == {"transformer.mto", "transformer_2.mto", "checkpoint.json"}
    record = json.loads((folder / "checkpoint.json").read_text())
    assert record["backbones"] == ["transformer", "transformer_2"]
    assert record["calibration"]["steps_served"] == {"transformer": [0, 1], "transformer_2": [2, 3]}
    assert set(record["activation_amax"]) == {"transformer", "transformer_2"}


def _enabled(checkpoint) -> collections.Counter:
    """Enabled quantizers of each expert, by their block and layer group."""
    counts = collections.Counter()
    for attribute in ("transformer", "transformer_2"):
        def group(owner: str) -> str:
            stack, _, rest = owner.partition(".")
            index, _, layer = rest.partition(".")
            return f"block {index}: {layer}" if stack == "blocks" else f"top: {owner}"

        counts.update(enabled_quantizers("tiny_wan", checkpoint, group, attribute))
    return counts


def test_levels_keep_modelopts_wan_filter_in_high_precision(checkpoints):
    level3 = _enabled(checkpoints["fp8_l3"])
    # ModelOpt's filter: the embedders, proj_out and the first three (and last three of 40) blocks.
    assert not [group for group in level3 if group.startswith(("top", "block 0", "block 1", "block 2"))]
    layers = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
              "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
    # Blocks 3 and 4 of both experts, a weight and an input quantizer a layer.
    assert level3 == {f"block {index}: {layer}": 4 for index in (3, 4) for layer in layers}
    assert _enabled(checkpoints["int8_l3"]) == level3
    level4 = _enabled(checkpoints["fp8_l4"])
    # FP8 attention: q, k and v of the attention in each of blocks 3 and 4 of both experts...
    assert {group: n for group, n in level4.items() if "bmm" in group} == {
        f"{role}_bmm_quantizer": 2 * 2 for role in "qkv"}
    # ... which is the self-attention (attn1): the cross-attention over the text stays 16-bit.
    assert _fp8_attention_layers(checkpoints["fp8_l4"]) == {f"blocks.{index}.attn1" for index in (3, 4)}


def test_high_precision_blocks_names_the_blocks_kept_in_16_bits_instead_of_the_recipes(checkpoints):
    level3 = _enabled(checkpoints["fp8_l3"])
    only_block_1 = _enabled(checkpoints["fp8_l3_block_1"])
    assert {group.partition(":")[0] for group in only_block_1} == {"block 0", "block 2", "block 3", "block 4"}
    assert {group: n for group, n in only_block_1.items() if group.startswith(("block 3", "block 4"))} == level3
    assert checkpoints["fp8_l3_block_1"].name != checkpoints["fp8_l3"].name


@pytest.mark.parametrize("model, blocks, message", [
    ("tiny_sdxl", "[0]", "keeps no numbered blocks in 16 bits; leave it null"),
    ("tiny_wan", "[5]", "model=tiny_wan's backbone has blocks 0 to 4"),
    ("tiny_wan", "[1,1]", "give each block's index"),
    ("tiny_wan", "[-1]", "give each block's index"),
])
def test_high_precision_blocks_the_model_cannot_take_are_refused_before_any_work(model_cache, tmp_path, capsys,
                                                                                model, blocks, message):
    cfg = compose_config("sd_xl_quantize", [f"model={model}", "device=cpu", f"out_dir={tmp_path}",
                                            f"quantize.high_precision_blocks={blocks}"])
    assert message in refused_in_one_line(run_quantize, cfg, capsys)
    assert not any(tmp_path.iterdir())


def _fp8_attention_layers(checkpoint) -> set[str]:
    from modelopt.torch.quantization.nn import TensorQuantizer

    backbones = restored_backbones("tiny_wan", checkpoint)
    return {name.rsplit(".", 1)[0] for module in backbones.values() for name, quantizer in module.named_modules()
            if isinstance(quantizer, TensorQuantizer) and quantizer.is_enabled and name.endswith("q_bmm_quantizer")}


def test_the_compiled_torch_backend_draws_the_eager_video(model_cache):
    """Compiled, without the channels-last layout the 3-D convolutions have no form for. Every frame
    is compared: the Wan VAE decodes the first frame from the first latent frame alone (it is causal
    in time), so a decoder that gets its time axis wrong still draws that frame right."""
    eager, compiled = (_clip({"steps": 2}, backend="torch", torch_backend={"compile": compile})
                       for compile in (False, True))
    # Under half a level of 255 in every pixel of every frame, which an 8-bit file cannot show
    # (measured under a thousandth of a level on each frame).
    assert np.abs(eager - compiled).max() < 0.5 and eager.std() > 1


@pytest.mark.parametrize("model, compiled", [("tiny_wan", {"transformer": True, "transformer_2": True, "vae": False}),
                                             ("tiny_sdxl", {"unet_xl": True, "vae": True})])
def test_the_compiled_backend_compiles_a_video_familys_experts_and_leaves_its_decoder_eager(
        model_cache, model, compiled):
    """The Wan VAE decodes a few frames a call with a cache of the last in Python, which compiled
    code served 11x slower at 720p (benchmarks/results/wan_vae_h200.json); an image family's decoder
    compiles."""
    from torch._dynamo.eval_frame import OptimizedModule

    from sdquant.api import load

    def is_compiled(graph) -> bool:
        while not isinstance(graph, OptimizedModule) and hasattr(graph, "graph"):
            graph = graph.graph
        return isinstance(graph, OptimizedModule)
    with load(model, device="cpu", backend="torch", torch_backend={"compile": True}) as pipe:
        assert {name: is_compiled(pipe.stages[name].graph) for name in compiled} == compiled


def _clip(call: dict, **settings) -> np.ndarray:
    """The first prompt's clip (frames, 3, H, W) in levels of 255, drawn on the CPU by the pipeline
    the API loads with `settings`, in one call at this file's guidance and the `call`'s values."""
    from sdquant.api import load

    with load("tiny_wan", device="cpu", **settings) as pipe:
        drawn = pipe(PROMPTS[0], guidance_scale=4.0, negative_prompt="blurry, static", seed=42, **call)
    [clip] = drawn.samples.numpy() * 255
    assert clip.shape[0] == drawn.settings.frames > 1
    return clip


def test_onnx_graphs_run_as_torch_and_build_with_tensorrt_rtx(tmp_path, model_cache, capsys):
    out = tmp_path / "export"
    run_export(compose_config("sd_xl_export", ["model=tiny_wan", "device=cpu", f"infer.out_path={out}",
                                               "onnx.precision=fp32", "infer.batch_size=1",
                                               "trt.backend=tensorrt_rtx"]))
    record = json.loads((out / "plan" / "engines.json").read_text())
    assert set(record) == GRAPHS
    # Fixed at the engines' geometry: both guidance halves of one 9-frame 32x32 video (3 latent frames).
    assert record["transformer_2"]["inputs"]["hidden_states"]["profile"] == [[2, 16, 3, 4, 4]] * 3
    # Every frame, not the first alone, which the causal VAE decodes from the first latent frame only;
    # within half a level of 255, as the compiled backend (measured under a thousandth).
    call = {"guidance_scale_2": 3.0, "steps": STEPS}
    graphs = _clip(call, backend="onnxruntime", engine_dir=str(out / "plan"))
    modules = _clip(call, backend="torch")
    assert np.abs(graphs - modules).max() < 0.5 and modules.std() > 1
    run = ["num_warmup_runs=0", "sampling.prompts=['a red fox runs through the snow']",
           "sampling.guidance_scale_2=3.0"]
    # The graphs take the geometry they were traced at: another frame count is refused before any work.
    capsys.readouterr()
    err = refused_in_one_line(run_infer, _sampling("tiny_wan", *run, "backend=onnxruntime", "sampling.num_frames=13",
                                                   f"engine_dir={out / 'plan'}", f"out_path={tmp_path / 'ort13'}"),
                              capsys)
    assert "its ONNX graph" in err and "is fixed at 9 frames of 32x32" in err and "this run draws 13 frames" in err
    assert "infer.num_frames" in err and not (tmp_path / "ort13").exists()


@pytest.mark.parametrize("recipe, level, attention, tolerance", [("fp8_l3", 3.0, 0, 1e-5), ("fp8_l4", 4.0, 2, 2e-2)])
def test_fp8_kernels_compute_what_fake_quantization_does(checkpoints, recipe, level, attention, tolerance):
    from sdquant.families.wan import WAN
    from sdquant.runtime import torch_backend

    experts = []
    for kernels in (False, True):
        backbones = restored_backbones("tiny_wan", checkpoints[recipe])
        expert = backbones["transformer_2"].to(torch.float32)
        if kernels:
            conversion = torch_backend.convert_quantized(expert, WAN, "quantized_backbone", "fp8", "auto", level)
            # Blocks 3 and 4: ten Linear layers each; their self-attention in FP8 at level 4.
            assert (conversion.layers, conversion.attention) == (20, attention)
        experts.append(expert)
    torch.manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, 16, 3, 4, 6), "timestep": torch.tensor([500.0, 500.0]),
              "encoder_hidden_states": torch.randn(2, 64, 32)}
    with torch.no_grad():
        expected, got = (expert(**inputs, return_dict=False)[0] for expert in experts)
    assert (got - expected).norm() / expected.norm() < tolerance


def test_an_expert_split_by_tokens_over_two_processes_computes_the_whole_call(tmp_path, checkpoints):
    """Ulysses over two gloo processes: diffusers' processors (blocks 0-2 stay 16-bit at level 4)
    and the torch backend's FP8 ones (blocks 3 and 4, their self-attention in FP8) each attend over
    every token; the expert's output is the one-process output."""
    import socket

    from cpu_context_parallel import expert_over_processes
    from sdquant.families.wan import WAN
    from sdquant.runtime import torch_backend

    torch.manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, 16, 3, 4, 6), "timestep": torch.tensor([500.0, 500.0]),
              "encoder_hidden_states": torch.randn(2, 64, 32)}
    backbones = restored_backbones("tiny_wan", checkpoints["fp8_l4"])
    expert = backbones["transformer_2"].to(torch.float32)
    torch_backend.convert_quantized(expert, WAN, "quantized_backbone", "fp8", "auto", 4.0)
    with torch.no_grad():
        expected = expert(**inputs, return_dict=False)[0]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "split.pt"
    torch.multiprocessing.spawn(expert_over_processes, args=(2, port, str(checkpoints["fp8_l4"]), inputs, str(out)),
                                nprocs=2)
    split = torch.load(out)
    # 3 latent frames of 2x3 patches: 18 tokens, 9 a process; the four FP8 layers of blocks 3 and 4.
    assert split["block_output"] == (2, 9, 32) and split["split_processors"] == 4
    assert (split["output"] - expected).abs().max() < 1e-5 * expected.abs().max()


def _frames(path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]).astype(int)


def test_a_whole_call_beside_a_split_one_keeps_diffusers_processors_on_torchs_kernel():
    """wan_full_size.py --split compares a whole call with the split one: the whole call gives
    diffusers' own processors FlashAttention-3's backend only where context parallelism will not
    split them afterwards (it refuses that backend), as infer_trt.py's split calls have them."""
    from sdquant.families.wan.sizes import TINY, expert
    from sdquant.runtime.attention import DIFFUSERS_FLASH3, FLASH3, attention_modules, use_attention_kernel

    for split_later, backend in ((False, DIFFUSERS_FLASH3), (True, None)):
        module = expert(TINY).to(torch.bfloat16)
        use_attention_kernel(module, "flash3", split_later=split_later)
        layers = attention_modules(module)
        assert layers and all(getattr(attn, FLASH3) for attn in layers)
        assert {attn.processor._attention_backend for attn in layers} == {backend}


SPLITS = {"cfg": {"cfg": 2, "ulysses": 1}, "cfg_ulysses": {"cfg": 2, "ulysses": 2},
          "ulysses_compiled": {"cfg": 1, "ulysses": 2}}


def test_guidance_halves_and_tokens_split_over_processes_draw_the_one_process_video(tmp_path, checkpoints):
    """infer_trt.py under torchrun: parallel.cfg=2 on two processes, cfg=2 x ulysses=2 on four, and
    ulysses=2 compiled (the all-to-all inside the compiled graph) on two draw the one-process video
    of the FP8 level 4 experts; one process of each writes it."""
    import os
    import subprocess
    import sys

    from PIL import Image

    from conftest import REPO

    settings = ["model=tiny_wan", "backend=torch", "device=cpu", "num_warmup_runs=0", f"sampling.steps={STEPS}",
                *GUIDANCE, f"quantized_backbone={checkpoints['fp8_l4']}", "torch_backend.quantized=fp8"]
    runs = {"one": [str(REPO / "infer_trt.py")],
            "cfg": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "infer_trt.py"),
                    "parallel.cfg=2"],
            "cfg_ulysses": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                            str(REPO / "tests" / "cpu_context_parallel.py"), "parallel.cfg=2", "parallel.ulysses=2"],
            "ulysses_compiled": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(REPO / "tests" / "cpu_context_parallel.py"), "parallel.ulysses=2",
                                 "torch_backend.compile=true"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, command in runs.items():
        result = subprocess.run([sys.executable, *command, *settings, f"out_path={tmp_path / name}",
                                 f"hydra.run.dir={tmp_path / ('h' + name)}"], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    expected = _frames(tmp_path / "one" / "video_000_00.mp4")
    written = json.loads((tmp_path / "one" / "latency.json").read_text())["images_written"]
    for name in ("cfg", "cfg_ulysses", "ulysses_compiled"):
        assert sorted(path.name for path in (tmp_path / name).iterdir()) == \
            ["latency.json", "video_000_00.mp4", "video_000_00.png"]
        # Halves and token shares reduce in other orders than one batch: a level of rounding in the
        # lossless poster at most, and in the H.264 frames (where one level can move a block) little.
        poster = [np.asarray(Image.open(tmp_path / run / "video_000_00.png")).astype(int) for run in ("one", name)]
        assert np.abs(poster[0] - poster[1]).max() <= 1
        assert np.abs(_frames(tmp_path / name / "video_000_00.mp4") - expected).mean() <= 0.5
        latency = json.loads((tmp_path / name / "latency.json").read_text())
        assert latency["images_written"] == written
        assert latency["settings"]["parallel"] == SPLITS[name]
        assert latency["settings"]["torch_backend"]["compile"] == (name == "ulysses_compiled")


def test_splits_a_run_cannot_take_are_refused(tmp_path, capsys, monkeypatch, tiny_pipeline):
    # Built first: a tiny model's first use writes its progress, which would precede the one line
    # each refusal prints.
    for model in ("tiny_wan", "tiny_flux", "tiny_sdxl"):
        tiny_pipeline(model)
    capsys.readouterr()

    def refused(*overrides, processes: int = 2) -> str:
        monkeypatch.setenv("WORLD_SIZE", str(processes))
        return refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
            "model=tiny_wan", "device=cpu", "backend=torch", f"out_path={tmp_path / 'out'}", *overrides]), capsys)

    assert "parallel.cfg=3: 1, or 2 to run the conditional and unconditional halves" in refused("parallel.cfg=3")
    assert "run them with backend=torch, not backend=onnxruntime" in refused("parallel.cfg=2", "backend=onnxruntime")
    assert "makes groups of 2 processes, which 3 process(es) do not divide" in refused("parallel.cfg=2", processes=3)
    assert "parallel.cfg=2 runs the guidance halves of each backbone call apart, and model=tiny_wan's calls here " \
           "hold none" in refused("parallel.cfg=2", "sampling.guidance_scale=1.0")
    # Flux.1-dev's guidance is an input of one call, not a batch of two.
    assert "model=tiny_flux's calls here hold none" in refused("parallel.cfg=2", "model=tiny_flux")
    assert "parallel.ulysses=2: model=tiny_sdxl's backbones are not split by sequence here" in \
        refused("parallel.ulysses=2", "model=tiny_sdxl")
    # tiny_wan: 2 heads; 9 frames of 32x32 make 3 latent frames of 2x2 patches, 12 tokens.
    assert "parallel.ulysses=4 must divide the backbone's 2 attention heads and its 12 tokens" in \
        refused("parallel.ulysses=4", processes=4)
    assert "parallel.cfg=1 parallel.ulysses=2 runs without step caching and CUDA graphs" in \
        refused("parallel.ulysses=2", "cuda_graph=true")
    assert "parallel.cfg=2 parallel.ulysses=1 runs without step caching and CUDA graphs" in \
        refused("parallel.cfg=2", "torch_backend.compile=true", "torch_backend.compile_mode=reduce-overhead")
    if torch.accelerator.device_count() == 0:
        assert "diffusers' context parallelism places each process on a GPU, and none is visible" in \
            refused("parallel.ulysses=2")
    assert not (tmp_path / "out").exists()


def test_evaluate_scores_each_frame_motion_and_each_expert(tmp_path, checkpoints):
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_wan", "device=cpu", f"out_path={tmp_path}", f"sampling.prompts={json.dumps(PROMPTS)}",
        f"sampling.steps={STEPS}", *GUIDANCE, f"+variants.fp8={checkpoints['fp8_l4']}", "+variants.self=null"]))
    fp8, self_check = report["variants"]["fp8"], report["variants"]["self"]
    assert 20 < fp8["mean"]["psnr"] < 80 and 20 < fp8["mean"]["temporal_psnr"] < 80
    assert self_check["mean"]["temporal_psnr"] == float("inf")
    assert set(fp8["step_error_by_backbone"]) == {"transformer", "transformer_2"}
    assert all(0 < error < 0.5 for errors in fp8["step_error_by_backbone"].values() for error in errors)
    assert "frame-to-frame changes" in (tmp_path / "quality.md").read_text()


def test_frames_sizes_and_checkpoints_that_do_not_fit_are_refused(tmp_path, checkpoints, capsys, model_cache):
    def refused(run, config: str, *overrides) -> str:
        return refused_in_one_line(run, compose_config(config, list(overrides)), capsys)

    images = f"out_path={tmp_path / 'images'}"
    wan = ["model=tiny_wan", "device=cpu", "backend=torch", images]
    assert "sampling.num_frames=10: model=tiny_wan's VAE takes 4k + 1 frames (1, 5, 9, ..., 81): choose 9 or 13" in \
        refused(run_infer, "sd_xl_trt_inference", *wan, "sampling.num_frames=10")
    assert "sampling.width=40 must be a positive multiple of 16, the VAE's spatial scale factor times" in \
        refused(run_infer, "sd_xl_trt_inference", *wan, "sampling.width=40")
    assert "sampling.fps=0: give the frames per second the video plays at, 1 or more (tiny_wan's own: 8)" in \
        refused(run_infer, "sd_xl_trt_inference", *wan, "sampling.fps=0")
    assert "sampling.num_frames=9: model=tiny_sdxl draws images" in refused(
        run_infer, "sd_xl_trt_inference", "model=tiny_sdxl", "device=cpu", "backend=torch", images,
        "sampling.num_frames=9")
    assert "sampling.guidance_scale_2=3.0: wan_ti2v models have one backbone" in refused(
        run_infer, "sd_xl_trt_inference", "model=tiny_wan_ti2v", "device=cpu", "backend=torch", images,
        "sampling.guidance_scale_2=3.0")
    assert "cpu_offload=true keeps the networks a GPU is not running in host memory, but device=cpu" in refused(
        run_quantize, "sd_xl_quantize", *QUICK, "cpu_offload=true", f"out_dir={tmp_path / 'q'}")
    # A checkpoint folder without one of its experts.
    partial = tmp_path / "partial"
    shutil.copytree(checkpoints["fp8_l3"], partial)
    (partial / "transformer_2.mto").unlink()
    err = refused(run_infer, "sd_xl_trt_inference", *wan, f"quantized_backbone={partial}")
    assert f"quantized_backbone={partial}: {partial / 'transformer_2.mto'} does not exist (it holds transformer.mto)" in err
    # An image model's checkpoint for the video model, and the video model's for an image model.
    sdxl = run_quantize(compose_config("sd_xl_quantize", [
        "model=tiny_sdxl", "device=cpu", "quantize.n_steps=2", "quantize.calib_size=2", "quantize.batch_size=2",
        f"out_dir={tmp_path / 'sdxl'}"]))
    capsys.readouterr()
    assert "was made from a sdxl model, not from model=tiny_wan (wan)" in refused(
        run_infer, "sd_xl_trt_inference", *wan, f"quantized_unet={sdxl}")
    assert "was made from a wan model, not from model=tiny_sdxl (sdxl)" in refused(
        run_export, "sd_xl_export", "model=tiny_sdxl", "device=cpu", f"quantized_backbone={checkpoints['fp8_l3']}",
        f"infer.out_path={tmp_path / 'export'}")
    # NeMo's unet_xl names one engine; a model of two experts names each.
    assert "unet_xl=x.plan: model=tiny_wan has 2 backbones; name each engine as +engines.transformer=<file> " \
           "+engines.transformer_2=<file>" in refused(run_infer, "sd_xl_trt_inference", "model=tiny_wan",
                                                       "device=cpu", images, "unet_xl=x.plan")
    assert not any((tmp_path / name).exists() for name in ("images", "export", "q"))
