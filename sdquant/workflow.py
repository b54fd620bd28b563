"""What each script does, stage by stage; the scripts themselves only hand over the config."""

from __future__ import annotations

import os
import time
import types
from pathlib import Path

from omegaconf import OmegaConf

import torch

from . import build, checkpoint, export, load, lora, networks, parallel, refit, report, run
from .artifacts import read_json
from .calibrate import activation_amax, amax_summary, quantize_unet
from .config import (plain, validate_evaluate, validate_export, validate_infer, validate_quantize_block,
                     validate_train_scene)
from .errors import UserError
from .load import calibration_prompts_file, compute_dtype, empty_unet, load_pipeline, load_prompts, resolve_device
from .report import library_versions, print_engine_table, print_summary
from .recipe import uses_smoothquant


def _is_sdxl(cfg) -> bool:
    return networks.is_sdxl(cfg.model.family)


def quantized_checkpoint_dir(cfg) -> Path:
    return Path(cfg.out_dir).expanduser() / checkpoint.checkpoint_name(cfg)


def run_quantize(cfg) -> Path:
    """quantize.py: calibrates and quantizes the UNet, then exports and builds it when the
    switches ask; returns the checkpoint folder."""
    start = time.perf_counter()
    validate_quantize_block(cfg.quantize)
    folder = quantized_checkpoint_dir(cfg)
    export_cfg = _chained_export_config(cfg, folder) if cfg.run_onnx_export or cfg.run_trt_export else None
    if export_cfg is not None:
        validate_export(export_cfg)
    fingerprint = checkpoint.fingerprint(checkpoint.calibration_settings(cfg))
    if not cfg.force and checkpoint.is_complete(folder, fingerprint):
        print_summary("quantize", [], time.perf_counter() - start, reused=[folder / checkpoint.UNET_FILE])
    elif cfg.run_quantization:
        _calibrate_and_save(cfg, folder, fingerprint, start)
    else:
        raise UserError(f"run_quantization=false but {folder} holds no checkpoint for these settings: "
                        "run with run_quantization=true first")
    if export_cfg is not None and parallel.current_world().is_main:
        run_export(export_cfg)
    return folder


def _calibrate_and_save(cfg, folder: Path, fingerprint: str, start: float) -> None:
    """Calibration proper; under torchrun every process calibrates its share and rank 0 saves."""
    world = parallel.current_world()
    prompts = load_prompts(calibration_prompts_file(cfg), cfg.quantize.calib_size)
    device = parallel.rank_device(resolve_device(cfg.device), world)
    parallel.start(world, device)
    try:
        dtype = compute_dtype(device, cfg.dtype)
        pipe = load_pipeline(cfg.model, device, dtype)
        result = quantize_unet(pipe, prompts, cfg.quantize, cfg.seed, world, cfg.cuda_graph)
        if world.is_main:
            amax = activation_amax(pipe.unet)
            sidecar = {
                "fingerprint": fingerprint,
                "settings": checkpoint.calibration_settings(cfg),
                "resolved_config": OmegaConf.to_container(cfg, resolve=True),
                "versions": library_versions(),
                "device": str(device),
                "dtype": str(dtype),
                "job": {"processes": world.size, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID")},
                "calibration": {
                    "seconds": round(result.seconds, 3),
                    "record_seconds": round(result.record_seconds, 3),
                    "batches": result.batches,
                    "unet_calls": result.unet_calls,
                    "algorithm": result.algorithm,
                    "smoothquant": uses_smoothquant(cfg.quantize.format, cfg.quantize.quant_level),
                },
                "amax_summary": amax_summary(amax),
                "activation_amax": amax,
            }
            written = checkpoint.save(pipe.unet, folder, sidecar)
            print_summary("quantize", written, time.perf_counter() - start)
    finally:
        # Waits for rank 0's save, so no process moves on before the checkpoint exists.
        parallel.stop(world)


def _chained_export_config(cfg, folder: Path):
    """export_trt.py's config for the checkpoint in `folder`, from quantize.py's own blocks."""
    from .config import ExportApp

    out_path = Path(cfg.infer.out_path).expanduser()
    export_cfg = OmegaConf.structured(ExportApp)
    export_cfg.merge_with({
        "infer": {**OmegaConf.to_container(cfg.infer), "out_path": str(out_path if out_path.is_absolute()
                                                                        else folder / out_path)},
        "trt": cfg.trt, "onnx": cfg.onnx, "model": cfg.model, "quantized_unet": str(folder),
        "force": cfg.force, "device": cfg.device,
        "run_onnx_export": cfg.run_onnx_export, "run_trt_export": cfg.run_trt_export})
    return export_cfg


def _restore_quantized_unet(model, key: str, value: str, unet) -> dict:
    """Loads the quantize.py checkpoint that config `key` names into `unet`; returns its sidecar."""
    path = Path(value).expanduser()
    folder = path if path.is_dir() else path.parent
    sidecar = read_json(folder / checkpoint.SIDECAR_FILE) or {}
    made_for = sidecar.get("settings", {}).get("model", {}).get("family")
    if made_for is not None and made_for != plain(model.family):
        raise UserError(f"{key}={path} was made from a {made_for} model, not from "
                        f"model={model.name} ({plain(model.family)}): choose its own model")
    made_with = sidecar.get("settings", {}).get("model", {}).get("loras", [])
    named = lora.identities(model.loras)
    if made_for is not None and made_with != named:
        raise UserError(f"{key}={path} was calibrated with {lora.describe(made_with)}, but model.loras gives "
                        f"{lora.describe(named)}: set model.loras as the checkpoint was made, or quantize again")
    restored = checkpoint.restore(unet, path)
    if any(t.is_meta for t in (*restored.parameters(), *restored.buffers())):
        raise UserError(f"{key}={path} does not hold every UNet weight: quantize the model again")
    return sidecar


def _graph_fingerprint(cfg, name: str, dtype: torch.dtype, quantized: dict | None) -> str:
    return checkpoint.fingerprint({
        "graph": name,
        "model": checkpoint.model_identity(cfg.model, with_loras=lora.carried_by(name)),
        "dtype": str(dtype), "opset": cfg.onnx.opset, "trace_latent_size": cfg.onnx.trace_latent_size,
        "quantized": (quantized or {}).get("fingerprint") if name == networks.unet_graph_name(_is_sdxl(cfg)) else None,
    })


def run_export(cfg) -> list[Path]:
    """export_trt.py: the ONNX export, then the engines, as the switches say (or a refit)."""
    validate_export(cfg)
    if cfg.run_refit:
        return refit_engines(cfg)
    written = export_onnx(cfg) if cfg.run_onnx_export else []
    if cfg.run_trt_export:
        written += build_engines(cfg)
    return written


def export_onnx(cfg) -> list[Path]:
    """Exports every graph of the pipeline to ONNX; returns the ONNX files."""
    start = time.perf_counter()
    device = resolve_device(cfg.device)
    dtype = _graph_dtype(cfg)
    # Loaded straight in the graph's precision: a full-size SDXL in fp32 would not leave room to
    # trace it on a 24 GB host.
    quantized = None
    if cfg.quantized_unet:
        # The checkpoint holds every UNet weight: loading the model's own first would hold the
        # UNet twice, which a full-size SDXL cannot afford on a 24 GB host.
        pipe = load_pipeline(cfg.model, device, dtype, unet=empty_unet(cfg.model))
        quantized = _restore_quantized_unet(cfg.model, "quantized_unet", cfg.quantized_unet, pipe.unet)
        pipe.to(device)
    else:
        pipe = load_pipeline(cfg.model, device, dtype)
    vae_dtype = torch.float16 if cfg.onnx.vae_precision == "fp16" else torch.float32
    if quantized is not None:
        export.prepare_quantizers_for_export(pipe.unet, dtype)
    latent = cfg.onnx.trace_latent_size
    specs = export.graph_specs(pipe, cfg.model.family, cfg.infer.batch_size, latent, dtype, vae_dtype)
    written, reused = [], []
    for spec in specs:
        folder = networks.onnx_path(cfg.infer.out_path, spec.name).parent
        graph_dtype = vae_dtype if spec.name == "vae" else dtype
        fingerprint = _graph_fingerprint(cfg, spec.name, graph_dtype, quantized)
        if not cfg.force and export.is_current(folder, fingerprint):
            reused.append(folder / networks.ONNX_FILE)
            continue
        print(f"exporting {spec.name} to {folder} ...", flush=True)
        meta = {"fingerprint": fingerprint, "graph": spec.name, "dtype": str(graph_dtype),
                "inputs": spec.input_names, "outputs": spec.output_names,
                "quantized_unet": cfg.quantized_unet if spec.name == networks.unet_graph_name(_is_sdxl(cfg)) else None,
                "loras": lora.identities(cfg.model.loras) if lora.carried_by(spec.name) else [],
                "versions": library_versions()}
        export.export_graph(spec, folder, cfg.onnx.opset, meta, graph_dtype)
        written.append(folder / networks.ONNX_FILE)
    print_summary("ONNX export", [f for path in written for f in export.graph_files(path)],
                  time.perf_counter() - start, reused=reused)
    return written + reused


def _graph_dtype(cfg) -> torch.dtype:
    return torch.float16 if cfg.onnx.precision == "fp16" else torch.float32


def refit_engines(cfg) -> list[Path]:
    """export_trt.py run_refit=true: writes the weights of the model with model.loras fused in into
    the refittable engines in infer.out_path, without exporting or building; returns the plans."""
    start = time.perf_counter()
    out = cfg.infer.out_path
    record = build.engines_record(out)
    wanted = lora.identities(cfg.model.loras)
    plans = {name: build.plan_path(out, name) for name in networks.graph_names(cfg.model.family)
             if lora.carried_by(name)}
    for name, plan in plans.items():
        if name not in record or not plan.is_file():
            raise UserError(f"{plan} does not exist: build the engines first (export_trt.py trt.refittable=true)")
    # Every engine is checked before any is changed, so a refusal leaves them all as they were.
    stale = [name for name, plan in plans.items() if refit.needs_refit(record[name], plan, wanted)]
    if not stale:
        print_summary("TensorRT refit", [], time.perf_counter() - start, reused=list(plans.values()))
        return []
    # As the export loaded it, so the fused weights round as in a graph exported with them.
    dtype = _graph_dtype(cfg)
    pipe = load_pipeline(cfg.model, resolve_device(cfg.device), dtype)
    modules = {spec.name: spec.module for spec in export.graph_specs(
        pipe, cfg.model.family, 1, cfg.onnx.trace_latent_size, dtype, dtype) if spec.name in stale}
    refitted = []
    for name in stale:
        print(f"refitting {plans[name]} ...", flush=True)
        # Only the TensorRT that built an engine can load it, and so refit it.
        count = refit.refit_engine(build.engine_flavour(plans[name]), plans[name],
                                   export.graph_weights(modules[name]))
        # The engine no longer holds what its ONNX file does: a build from that file is not reused.
        record[name] = {**record[name], "loras": wanted, "refit_weights": count,
                        "fingerprint": checkpoint.fingerprint({"refit_of": record[name]["fingerprint"],
                                                               "loras": wanted})}
        # Saved after each engine, so the record describes every plan even if a later refit fails.
        record_file = build.save_engines_record(out, record)
        refitted.append(plans[name])
    print_summary("TensorRT refit", [*refitted, record_file], time.perf_counter() - start)
    return refitted


def build_engines(cfg) -> list[Path]:
    """Builds every engine from its ONNX file; returns the plan files."""
    start = time.perf_counter()
    out = cfg.infer.out_path
    onnx_files = build.required_onnx(out, cfg.model.family)
    fp8 = {name: build.uses_fp8(onnx_file) for name, onnx_file in onnx_files.items()}
    builder = build.engine_builder(cfg.trt, any(fp8.values()))
    timing_cache = Path(cfg.trt.timing_cache).expanduser() if cfg.trt.timing_cache else \
        build.plan_path(out, "timing").with_suffix(".cache")
    record = build.engines_record(out)
    build.free_gpu_memory_for_builder()
    written, reused = [], []
    for name, onnx_file in onnx_files.items():
        shapes = build.profile_shapes(cfg.infer, cfg.trt, name, build.onnx_input_dims(onnx_file))
        plan = build.plan_path(out, name)
        graph_meta = read_json(onnx_file.parent / export.META_FILE) or {}
        # An 8-bit UNet's scales fit the adapters it was calibrated with: it never takes others.
        refittable = cfg.trt.refittable and lora.carried_by(name) and not graph_meta.get("quantized_unet")
        fingerprint = checkpoint.fingerprint({
            "onnx": graph_meta.get("fingerprint"),
            "shapes": shapes, "flavour": [builder.flavour, builder.version], "builder": builder.tool,
            "level": cfg.trt.builder_optimization_level, "targets": list(cfg.trt.rtx_compute_capabilities),
            **({"refittable": True} if refittable else {})})
        if not cfg.force and plan.is_file() and record.get(name, {}).get("fingerprint") == fingerprint:
            reused.append(plan)
            continue
        print(f"building {plan} ...", flush=True)
        if builder.tool == "trtexec":
            command = build.trtexec_command(onnx_file, plan, shapes, cfg.trt, timing_cache)
            if not build.run_trtexec(command, plan):
                continue
            info = {"plan": plan.name, "onnx": str(onnx_file), "trtexec": command,
                    "inputs": {n: {"profile": [list(s) for s in v]} for n, v in shapes.items()}}
        else:
            info = build.build_engine(builder.api, onnx_file, shapes, cfg.trt, plan, timing_cache,
                                      list(refit.refittable_weights(onnx_file)) if refittable else ())
        # The TensorRT that built the engine is the one that must load it (build.engine_flavour).
        record[name] = {**info, "fingerprint": fingerprint, "flavour": builder.flavour,
                        "version": builder.version, "builder": builder.tool, "fp8": fp8[name],
                        "loras": graph_meta.get("loras", []), "quantized_unet": graph_meta.get("quantized_unet")}
        written.append(plan)
    if written:
        written.append(build.save_engines_record(out, record))
    print_engine_table(record)
    print_summary("TensorRT build", written, time.perf_counter() - start, reused=reused)
    return written + reused


def _stage_files(cfg) -> dict[str, Path]:
    """Engine file per stage, from NeMo's keys (unet_xl names the UNet engine for SD 1.5 too)."""
    names = networks.graph_names(cfg.model.family)
    keys = {"clip1": cfg.clip1, "clip2": cfg.clip2, "unet_xl": cfg.unet_xl, "unet": cfg.unet_xl, "vae": cfg.vae}
    return {name: Path(keys[name]).expanduser() for name in names}


def _onnx_beside(plan: Path) -> Path:
    return plan.parent.parent / "onnx" / plan.stem / networks.ONNX_FILE


def _load_stages(cfg, device: torch.device, sdxl: bool) -> dict:
    files = _stage_files(cfg)
    if cfg.backend == "onnxruntime":
        return {name: run.OnnxRuntimeStage(_onnx_beside(plan), list(cfg.onnx_providers))
                for name, plan in files.items()}
    if cfg.backend == "torch":
        from . import torch_backend

        dtype = compute_dtype(device)
        pipe = load_pipeline(cfg.model, device, dtype)
        if cfg.quantized_unet:
            _restore_quantized_unet(cfg.model, "quantized_unet", cfg.quantized_unet, pipe.unet)
            pipe.unet.to(device=device, dtype=dtype)
            if cfg.torch_backend.quantized == "fp8":
                torch_backend.convert_to_fp8(pipe.unet, cfg.quantized_unet)
        return torch_backend.speed_up(pipe, run.torch_stages(pipe, sdxl, dtype), cfg.torch_backend, cfg.cuda_graph,
                                      networks.unet_graph_name(sdxl), quantized=bool(cfg.quantized_unet))
    from .trt_runtime import trt_stages

    for name, plan in files.items():
        if not plan.is_file():
            raise UserError(f"{name}={plan}: no such engine; build it with export_trt.py")
    flavours = {name: build.engine_flavour(plan) for name, plan in files.items()}
    unet_name = networks.unet_graph_name(sdxl)
    return trt_stages(flavours, files, (unet_name,) if cfg.cuda_graph else ())


def _check_engine_profiles(pipeline: run.TextToImage, runs: list[run.SamplingSettings]) -> None:
    """Refuses, before any image work, a prompt batch or size the engines' profiles cannot take."""
    from .trt_runtime import check_within_profiles

    profiles = {name: stage.profiles() for name, stage in pipeline.stages.items()}
    for settings in runs:
        check_within_profiles(profiles, pipeline.stage_batches(settings),
                              (settings.height // pipeline.vae_scale, settings.width // pipeline.vae_scale))


def _prompt_batches(cfg) -> list[list[str]]:
    sampling = cfg.sampling
    if sampling.prompts_file:
        path = Path(sampling.prompts_file).expanduser()
        if not path.is_file():
            raise UserError(f"sampling.prompts_file={path}: no such file")
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        prompts = list(sampling.prompts)
    if not prompts:
        raise UserError("no prompts: set sampling.prompts or sampling.prompts_file")
    return [prompts[i:i + sampling.batch_size] for i in range(0, len(prompts), sampling.batch_size)]


def run_infer(cfg) -> dict:
    """infer_trt.py: images for every prompt batch, then timed runs and a latency report."""
    start = time.perf_counter()
    validate_infer(cfg)
    device = resolve_device(cfg.device)
    # Every stage runs on the current stream (TensorRT engines included), so one stream of the
    # run's own keeps the stages, the host's reads and the timing events in order; TensorRT
    # would synchronize extra on the legacy default stream.
    with torch.cuda.stream(torch.cuda.Stream(device) if device.type == "cuda" else None):
        written, timings, images_per_run, first_call_seconds = _images_and_timings(cfg, device)
    latency = report.latency_report(timings, images_per_run, cfg.sampling.steps)
    # The first call compiles (torch_backend.compile) or sets engines and graphs up: its excess
    # over a timed run is what a user waits once per process and shape.
    latency["first_call_seconds"] = first_call_seconds
    latency["setup_seconds"] = first_call_seconds - latency["ms"]["end_to_end"] / 1000
    latency.update({"backend": cfg.backend, "device": report.device_name(device), "versions": library_versions(),
                    "settings": OmegaConf.to_container(cfg, resolve=True)})
    report.print_latency(latency)
    written.append(report.write_report(Path(cfg.out_path).expanduser(), latency))
    print_summary("inference", written, time.perf_counter() - start)
    return latency


def _images_and_timings(cfg, device: torch.device) -> tuple[list[Path], list, int, float]:
    """The images of every prompt batch, then the warm-up and timed runs of the first batch; also
    the first call's seconds."""
    batches = _prompt_batches(cfg)
    pipeline = _text_to_image(cfg, _load_stages(cfg, device, _is_sdxl(cfg)), device)
    runs = [_settings(cfg, prompts, cfg.sampling.seed + index) for index, prompts in enumerate(batches)]
    if cfg.backend == "trt":
        _check_engine_profiles(pipeline, runs)

    written = []
    first_call_seconds = None
    for index, settings in enumerate(runs):
        call_start = time.perf_counter()
        images = pipeline(settings, run.StageTimer(device))
        first_call_seconds = first_call_seconds or time.perf_counter() - call_start
        written += report.save_images(images, Path(cfg.out_path).expanduser(), index, settings, _stage_files(cfg),
                                      cfg.backend)
    for _ in range(cfg.num_warmup_runs):
        pipeline(runs[0], run.StageTimer(device), progress=False)
    timings = []
    for _ in range(cfg.num_timed_runs):
        timer = run.StageTimer(device)
        run_start = time.perf_counter()
        pipeline(runs[0], timer, progress=False)
        stage_seconds = timer.finish()
        timings.append((time.perf_counter() - run_start, stage_seconds))
    return written, timings, len(batches[0]), first_call_seconds


def _text_to_image(cfg, stages: dict, device: torch.device) -> run.TextToImage:
    """The denoising loop over `stages`, with the model's tokenizers and scheduler config."""
    parts = load.pipeline_parts(cfg.model)
    scheduler = run.make_scheduler(cfg.sampling.scheduler, parts["scheduler_config"])
    vae_scale = 2 ** (len(parts["vae_config"]["block_out_channels"]) - 1)
    return run.TextToImage(stages, parts["tokenizers"], scheduler, types.SimpleNamespace(**parts["unet_config"]),
                           vae_scale, device, _is_sdxl(cfg))


def _settings(cfg, prompts: list[str], seed: int) -> run.SamplingSettings:
    s = cfg.sampling
    return run.SamplingSettings(prompts=prompts, negative_prompt=s.negative_prompt, steps=s.steps,
                                guidance_scale=s.guidance_scale, height=s.height, width=s.width, seed=seed)


ENGINE_SUFFIXES = (".plan", ".engine")


def _variant_kind(name: str, source: str | None) -> str:
    """What a variant's source is: the fp16 UNet itself, a quantize.py checkpoint, an ONNX file
    or an engine; refuses anything else before any work starts."""
    if source is None:
        return "fp16"
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"variants.{name}={source}: no such file or folder")
    if path.is_dir() or path.suffix == ".mto":
        return "checkpoint"
    if path.suffix == ".onnx":
        return "onnx"
    if path.suffix in ENGINE_SUFFIXES:
        return "engine"
    raise UserError(f"variants.{name}={source} is not a quantize.py checkpoint folder, a UNet .onnx file "
                    f"or a TensorRT engine ({', '.join(ENGINE_SUFFIXES)})")


def _variant_unet(cfg, name: str, kind: str, fp16_unet, device: torch.device, dtype: torch.dtype):
    """The UNet stage a variant runs."""
    source = cfg.variants[name]
    sdxl = _is_sdxl(cfg)
    if kind == "fp16":
        return fp16_unet
    if kind == "onnx":
        return run.OnnxRuntimeStage(Path(source).expanduser(), list(cfg.onnx_providers))
    if kind == "engine":
        from .trt_runtime import trt_stages

        unet_name = networks.unet_graph_name(sdxl)
        plan = Path(source).expanduser()
        return trt_stages(build.engine_flavour(plan), {unet_name: plan}, ())[unet_name]
    unet = empty_unet(cfg.model)
    _restore_quantized_unet(cfg.model, f"variants.{name}", source, unet)
    return run.unet_stage(unet.to(device=device, dtype=dtype), sdxl, dtype)


def run_evaluate(cfg) -> dict:
    """evaluate.py: each variant's images and teacher-forced noise predictions against the fp16 UNet's."""
    from tqdm import tqdm

    from . import quality

    start = time.perf_counter()
    validate_evaluate(cfg)
    kinds = {name: _variant_kind(name, source) for name, source in cfg.variants.items()}
    batches = _prompt_batches(cfg)
    device = resolve_device(cfg.device)
    dtype = compute_dtype(device, cfg.dtype)
    sdxl = _is_sdxl(cfg)
    pipe = load_pipeline(cfg.model, device, dtype)
    stages = run.torch_stages(pipe, sdxl, dtype)
    pipeline = _text_to_image(cfg, stages, device)
    unet_name = networks.unet_graph_name(sdxl)
    fp16_unet = stages[unet_name]
    lpips, clip = (quality.lpips_metric(cfg.metrics.lpips_net, device),
                   quality.clip_metric(cfg.metrics.clip_model, device))

    references = []  # per prompt batch: settings, initial latents, fp16 images, recorded UNet calls
    for index, prompts in enumerate(tqdm(batches, desc=quality.REFERENCE, unit="batch")):
        settings = _settings(cfg, prompts, cfg.sampling.seed + index)
        latents = pipeline.initial_latents(settings)
        recorder = quality.RecordingStage(fp16_unet)
        pipeline.stages[unet_name] = recorder
        references.append((settings, latents, pipeline(settings, run.StageTimer(device), latents=latents),
                           recorder.calls))
    reference_clip = ([value for settings, _, images, _ in references
                       for value in clip.score(None, images, settings.prompts)] if clip.score else None)
    reference_adherence = [row for settings, _, images, _ in references
                           for row in quality.adherence(images, settings.prompts)]

    columns = [torch.cat([images for _, _, images, _ in references])]
    scores = {}
    for name, kind in kinds.items():
        stage = _variant_unet(cfg, name, kind, fp16_unet, device, dtype)
        pipeline.stages[unet_name] = stage
        variant = quality.VariantScores(source=str(cfg.variants[name] or "the fp16 UNet again (self-check)"))
        images_per_batch = []
        for settings, latents, reference, calls in tqdm(references, desc=name, unit="batch"):
            images = pipeline(settings, run.StageTimer(device), latents=latents)
            variant.per_prompt += quality.score_images(reference, images, settings.prompts, [lpips, clip])
            variant.step_errors.append(quality.teacher_forced_errors(calls, stage))
            variant.adherence += quality.adherence(images, settings.prompts)
            images_per_batch.append(images)
        columns.append(torch.cat(images_per_batch))
        scores[name] = variant
    settings = {"model": cfg.model.name, "sampling": OmegaConf.to_container(cfg.sampling, resolve=True),
                "device": report.device_name(device), "dtype": str(dtype), "versions": library_versions()}
    result = quality.build_report(scores, reference_clip, reference_adherence,
                                  [m.note for m in (lpips, clip) if m.note], settings)
    written = quality.write_outputs(Path(cfg.out_path).expanduser(), result, quality.image_grid(columns))
    quality.print_means(result)
    print_summary("quality evaluation", written, time.perf_counter() - start)
    return result


def run_train_scene_model(cfg) -> Path:
    """tools/train_scene_model.py: trains the scene model and writes its diffusers folder."""
    from .train import train_scene_model

    start = time.perf_counter()
    validate_train_scene(cfg)
    out, record = train_scene_model(cfg, resolve_device(cfg.device))
    adherence = record["held_out_adherence"]
    if adherence["prompts"]:
        print(f"held-out prompts, all attributes right: {adherence['all']:.1%} of {adherence['prompts']} "
              f"({', '.join(f'{name} {adherence[name]:.0%}' for name in ('shape', 'colour', 'position', 'size', 'background'))})")
    print_summary("scene model training", sorted(p for p in out.rglob("*") if p.is_file()),
                  time.perf_counter() - start)
    return out
