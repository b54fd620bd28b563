"""What each script does, stage by stage; the scripts themselves only hand over the config."""

from __future__ import annotations

import time
import types
from pathlib import Path

from omegaconf import OmegaConf

import torch

from . import build, checkpoint, export, load, report, run
from .artifacts import read_json
from .calibrate import activation_amax, amax_summary, quantize_unet
from .config import Family, plain, validate_export, validate_infer, validate_quantize_block
from .errors import UserError
from .load import compute_dtype, empty_unet, load_pipeline, load_prompts, resolve_device
from .report import library_versions, print_engine_table, print_summary
from .recipe import uses_smoothquant


def quantized_checkpoint_dir(cfg) -> Path:
    return Path(cfg.out_dir).expanduser() / checkpoint.checkpoint_name(cfg)


def run_quantize(cfg) -> Path:
    """Calibrates and quantizes the UNet; returns the checkpoint folder."""
    start = time.perf_counter()
    validate_quantize_block(cfg.quantize)
    prompts = load_prompts(cfg.prompts_file, cfg.quantize.calib_size)
    settings = checkpoint.calibration_settings(cfg)
    fingerprint = checkpoint.fingerprint(settings)
    folder = quantized_checkpoint_dir(cfg)
    if not cfg.force and checkpoint.is_complete(folder, fingerprint):
        print_summary("quantize", [], time.perf_counter() - start,
                      reused=[folder / checkpoint.UNET_FILE])
        return folder

    device = resolve_device(cfg.device)
    dtype = compute_dtype(device, cfg.dtype)
    pipe = load_pipeline(cfg.model, device, dtype)
    result = quantize_unet(pipe, prompts, cfg.quantize, cfg.seed)
    amax = activation_amax(pipe.unet)
    sidecar = {
        "fingerprint": fingerprint,
        "settings": settings,
        "resolved_config": OmegaConf.to_container(cfg, resolve=True),
        "versions": library_versions(),
        "device": str(device),
        "dtype": str(dtype),
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
    return folder


def _restore_quantized_unet(cfg, unet) -> dict:
    """Loads the quantize.py checkpoint into `unet`; returns its sidecar."""
    path = Path(cfg.quantized_unet).expanduser()
    folder = path if path.is_dir() else path.parent
    sidecar = read_json(folder / checkpoint.SIDECAR_FILE) or {}
    made_for = sidecar.get("settings", {}).get("model", {}).get("family")
    if made_for is not None and made_for != plain(cfg.model.family):
        raise UserError(f"quantized_unet={path} was made from a {made_for} model, not from "
                        f"model={cfg.model.name} ({plain(cfg.model.family)}): choose its own model")
    restored = checkpoint.restore(unet, path)
    if any(t.is_meta for t in (*restored.parameters(), *restored.buffers())):
        raise UserError(f"quantized_unet={path} does not hold every UNet weight: quantize the model again")
    return sidecar


def _graph_fingerprint(cfg, name: str, dtype: torch.dtype, quantized: dict | None) -> str:
    return checkpoint.fingerprint({
        "graph": name,
        "model": checkpoint.model_identity(cfg.model),
        "dtype": str(dtype), "opset": cfg.onnx.opset, "trace_latent_size": cfg.onnx.trace_latent_size,
        "quantized": (quantized or {}).get("fingerprint") if name == export.unet_graph_name(cfg.model.family) else None,
    })


def run_export(cfg) -> list[Path]:
    """export_trt.py: the ONNX export, then the engines, as the switches say."""
    validate_export(cfg)
    written = export_onnx(cfg) if cfg.run_onnx_export else []
    if cfg.run_trt_export:
        written += build_engines(cfg)
    return written


def export_onnx(cfg) -> list[Path]:
    """Exports every graph of the pipeline to ONNX; returns the ONNX files."""
    start = time.perf_counter()
    device = resolve_device(cfg.device)
    dtype = torch.float16 if cfg.onnx.precision == "fp16" else torch.float32
    # Loaded straight in the graph's precision: a full-size SDXL in fp32 would not leave room to
    # trace it on a 24 GB host.
    quantized = None
    if cfg.quantized_unet:
        # The checkpoint holds every UNet weight: loading the model's own first would hold the
        # UNet twice, which a full-size SDXL cannot afford on a 24 GB host.
        pipe = load_pipeline(cfg.model, device, dtype, unet=empty_unet(cfg.model))
        quantized = _restore_quantized_unet(cfg, pipe.unet)
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
        folder = export.onnx_path(cfg.infer.out_path, spec.name).parent
        graph_dtype = vae_dtype if spec.name == "vae" else dtype
        fingerprint = _graph_fingerprint(cfg, spec.name, graph_dtype, quantized)
        if not cfg.force and export.is_current(folder, fingerprint):
            reused.append(folder / export.ONNX_FILE)
            continue
        print(f"exporting {spec.name} to {folder} ...", flush=True)
        meta = {"fingerprint": fingerprint, "graph": spec.name, "dtype": str(graph_dtype),
                "inputs": spec.input_names, "outputs": spec.output_names,
                "quantized_unet": cfg.quantized_unet if spec.name == export.unet_graph_name(cfg.model.family) else None,
                "versions": library_versions()}
        export.export_graph(spec, folder, cfg.onnx.opset, meta)
        written.append(folder / export.ONNX_FILE)
    print_summary("ONNX export", written, time.perf_counter() - start, reused=reused)
    return written + reused


def build_engines(cfg) -> list[Path]:
    """Builds every engine from its ONNX file; returns the plan files."""
    start = time.perf_counter()
    out = cfg.infer.out_path
    onnx_files = build.required_onnx(out, cfg.model.family)
    use_trtexec = cfg.trt.builder == "trtexec"
    flavour = None if use_trtexec and not _importable_tensorrt() else build.load_flavour(cfg.trt.backend)
    timing_cache = Path(cfg.trt.timing_cache).expanduser() if cfg.trt.timing_cache else \
        build.plan_path(out, "timing").with_suffix(".cache")
    record = build.engines_record(out)
    written, reused = [], []
    for name, onnx_file in onnx_files.items():
        shapes = build.profile_shapes(cfg.infer, cfg.trt, name, build.onnx_input_dims(onnx_file))
        plan = build.plan_path(out, name)
        fingerprint = checkpoint.fingerprint({
            "onnx": (read_json(onnx_file.parent / export.META_FILE) or {}).get("fingerprint"),
            "shapes": shapes, "flavour": flavour and [flavour.name, flavour.version], "builder": cfg.trt.builder,
            "level": cfg.trt.builder_optimization_level, "targets": list(cfg.trt.rtx_compute_capabilities)})
        if not cfg.force and plan.is_file() and record.get(name, {}).get("fingerprint") == fingerprint:
            reused.append(plan)
            continue
        print(f"building {plan} ...", flush=True)
        if use_trtexec:
            major = build.trtexec_major_version(flavour.version if flavour else None)
            command = build.trtexec_command(onnx_file, plan, shapes, cfg.trt, major, timing_cache)
            if not build.run_trtexec(command, plan):
                continue
            info = {"plan": plan.name, "onnx": str(onnx_file), "trtexec": command,
                    "inputs": {n: {"profile": [list(s) for s in v]} for n, v in shapes.items()}}
        else:
            info = build.build_engine(flavour, onnx_file, shapes, cfg.trt, plan, timing_cache)
        record[name] = {**info, "fingerprint": fingerprint,
                        "flavour": flavour.name if flavour else "trtexec",
                        "version": flavour.version if flavour else None}
        written.append(plan)
    if written:
        written.append(build.save_engines_record(out, record))
    print_engine_table(record)
    print_summary("TensorRT build", written, time.perf_counter() - start, reused=reused)
    return written + reused


def _importable_tensorrt() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) for name in build.BACKENDS)


def _stage_files(cfg) -> dict[str, Path]:
    """Engine file per stage, from NeMo's keys (unet_xl names the UNet engine for SD 1.5 too)."""
    names = run.STAGES_SDXL if Family(cfg.model.family) == Family.sdxl else run.STAGES_SD
    keys = {"clip1": cfg.clip1, "clip2": cfg.clip2, "unet_xl": cfg.unet_xl, "unet": cfg.unet_xl, "vae": cfg.vae}
    return {name: Path(keys[name]).expanduser() for name in names}


def _onnx_beside(plan: Path) -> Path:
    return plan.parent.parent / "onnx" / plan.stem / export.ONNX_FILE


def _load_stages(cfg, device: torch.device, sdxl: bool) -> dict:
    files = _stage_files(cfg)
    if cfg.backend == "onnxruntime":
        return {name: run.OnnxRuntimeStage(_onnx_beside(plan), list(cfg.onnx_providers))
                for name, plan in files.items()}
    if cfg.backend == "torch":
        dtype = compute_dtype(device)
        pipe = load_pipeline(cfg.model, device, dtype)
        if cfg.quantized_unet:
            checkpoint.restore(pipe.unet, Path(cfg.quantized_unet).expanduser())
            pipe.unet.to(device=device, dtype=dtype)
        return run.torch_stages(pipe, sdxl, dtype)
    from .trt_runtime import trt_stages

    for name, plan in files.items():
        if not plan.is_file():
            raise UserError(f"{name}={plan}: no such engine; build it with export_trt.py")
    records = {}
    for name, plan in files.items():
        records[name] = build.engines_record(plan.parent.parent).get(plan.stem, {})
    guided = cfg.sampling.guidance_scale > 1.0
    batch = cfg.sampling.batch_size
    run.check_within_profiles(records, {name: batch if name == "vae" else batch * (2 if guided else 1)
                                        for name in files}, cfg.sampling.height, cfg.sampling.width)
    unet_name = "unet_xl" if sdxl else "unet"
    return trt_stages(build.load_flavour("auto"), files, (unet_name,) if cfg.cuda_graph else ())


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
    sdxl = Family(cfg.model.family) == Family.sdxl
    parts = load.pipeline_parts(cfg.model)
    scheduler = run.make_scheduler(cfg.sampling.scheduler, parts["scheduler_config"])
    batches = _prompt_batches(cfg)
    stages = _load_stages(cfg, device, sdxl)
    vae_scale = 2 ** (len(parts["vae_config"]["block_out_channels"]) - 1)
    pipeline = run.TextToImage(stages, parts["tokenizers"], scheduler,
                               types.SimpleNamespace(**parts["unet_config"]), vae_scale, device, sdxl)

    out = Path(cfg.out_path).expanduser()
    written = []
    for index, prompts in enumerate(batches):
        settings = _settings(cfg, prompts, cfg.sampling.seed + index)
        images = pipeline(settings, run.StageTimer(device))
        written += report.save_images(images, out, index, settings, _stage_files(cfg), cfg.backend)

    settings = _settings(cfg, batches[0], cfg.sampling.seed)
    for _ in range(cfg.num_warmup_runs):
        pipeline(settings, run.StageTimer(device), progress=False)
    timings = []
    for _ in range(cfg.num_timed_runs):
        timer = run.StageTimer(device)
        run_start = time.perf_counter()
        pipeline(settings, timer, progress=False)
        stage_seconds = timer.finish()
        timings.append((time.perf_counter() - run_start, stage_seconds))
    latency = report.latency_report(timings, len(batches[0]), cfg.sampling.steps)
    latency.update({"backend": cfg.backend, "device": report.device_name(device), "versions": library_versions(),
                    "settings": OmegaConf.to_container(cfg, resolve=True)})
    report.print_latency(latency)
    written.append(report.write_report(out, latency))
    print_summary("inference", written, time.perf_counter() - start)
    return latency


def _settings(cfg, prompts: list[str], seed: int) -> run.SamplingSettings:
    s = cfg.sampling
    return run.SamplingSettings(prompts=prompts, negative_prompt=s.negative_prompt, steps=s.steps,
                                guidance_scale=s.guidance_scale, height=s.height, width=s.width, seed=seed)
