"""export_trt.py: the ONNX export of every network, then the TensorRT engines, as the switches say;
or instead a refit of refittable engines with other LoRA adapters."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..export import engines, graphs, refit
from ..quantize import checkpoint
from .. import load, lora
from ..artifacts import read_json
from ..cli import stage
from ..config import quantized_backbone, validate_export, validate_image_size
from ..errors import UserError
from ..families import family_of
from ..families.networks import Role
from ..load import empty_backbone, load_pipeline, resolve_device
from ..report import library_versions, print_engine_table, print_summary
from .settings import checked_cache, checked_checkpoint, restore_quantized_backbone, settled_image_size


def run_export(cfg) -> list[Path]:
    """export_trt.py: the ONNX export, then the engines, as the switches say (or a refit)."""
    validate_export(cfg)
    checkpoint_key, checkpoint_folder = quantized_backbone(cfg)
    if checkpoint_folder and cfg.run_onnx_export and not cfg.run_refit:
        checked_checkpoint(cfg.model, checkpoint_key, checkpoint_folder)
    if cfg.run_refit:
        return refit_engines(cfg)
    cfg.infer.height, cfg.infer.width = settled_image_size(cfg.infer, "infer", cfg.model)
    cache = _export_cache(cfg)
    written = export_onnx(cfg, cache) if cfg.run_onnx_export else []
    if cfg.run_trt_export:
        written += build_engines(cfg)
    return written


def export_onnx(cfg, cache=None) -> list[Path]:
    """Exports every graph of the pipeline (and the backbone's passes under the step cache `cache`)
    to ONNX; returns the ONNX files."""
    start = time.perf_counter()
    device = resolve_device(cfg.device)
    dtype = _graph_dtype(cfg)
    # Loaded straight in the graph's precision: a full-size SDXL in fp32 would not leave room to
    # trace it on a 24 GB host.
    family = family_of(cfg.model.family)
    quantized = None
    checkpoint_key, checkpoint_folder = quantized_backbone(cfg)
    with stage("loading the model"):
        if checkpoint_folder:
            # The checkpoint holds every backbone weight: loading the model's own first would hold
            # it twice, which a full-size SDXL cannot afford on a 24 GB host.
            pipe = load_pipeline(cfg.model, device, dtype, backbone=empty_backbone(cfg.model))
            quantized = restore_quantized_backbone(cfg.model, checkpoint_key, checkpoint_folder,
                                                   getattr(pipe, family.backbone.attribute))
            pipe.to(device)
        else:
            pipe = load_pipeline(cfg.model, device, dtype)
    vae_dtype = torch.float16 if cfg.onnx.vae_precision == "fp16" else torch.float32
    if quantized is not None:
        graphs.prepare_quantizers_for_export(getattr(pipe, family.backbone.attribute), dtype)
    latent = cfg.onnx.trace_latent_size
    specs = family.graph_specs(pipe, cfg.infer.batch_size, latent, dtype, vae_dtype, cache)
    written, reused = [], []
    for spec in specs:
        folder = graphs.onnx_path(cfg.infer.out_path, spec.name).parent
        graph_dtype = vae_dtype if spec.name == "vae" else dtype
        fingerprint = _graph_fingerprint(cfg, spec.name, graph_dtype, quantized, cache)
        if not cfg.force and graphs.is_current(folder, fingerprint):
            reused.append(folder / graphs.ONNX_FILE)
            continue
        meta = {"fingerprint": fingerprint, "graph": spec.name, "dtype": str(graph_dtype),
                "inputs": spec.input_names, "outputs": spec.output_names,
                "quantized_backbone": checkpoint_folder if spec.name in family.backbone_graphs() else None,
                **(cache.record() if spec.name in family.backbone_graphs()[1:] else {}),
                "loras": lora.identities(cfg.model.loras) if family.carries_adapters(spec.name) else [],
                "vae_scale_factor": pipe.vae_scale_factor, **family.export_sizes(pipe),
                "versions": library_versions()}
        with stage(f"exporting {spec.name}"):
            print(f"exporting {spec.name} to {folder} ...", flush=True)
            graphs.export_graph(spec, folder, cfg.onnx.opset, meta, graph_dtype)
        written.append(folder / graphs.ONNX_FILE)
    print_summary("ONNX export", [f for path in written for f in graphs.graph_files(path)],
                  time.perf_counter() - start, reused=reused)
    return written + reused


def _export_cache(cfg):
    """The step cache the export makes graphs for (quantize.py's export steps make none), refused
    before any work where the backbone or its graphs cannot take it."""
    if "cache" not in cfg:
        return None
    return checked_cache(cfg.cache, "cache", cfg.model, load.model_configs(cfg.model), "graphs")


def _graph_fingerprint(cfg, name: str, dtype: torch.dtype, quantized: dict | None, cache=None) -> str:
    family = family_of(cfg.model.family)
    backbone = name in family.backbone_graphs()
    return checkpoint.fingerprint({
        "graph": name,
        "model": checkpoint.model_identity(cfg.model, with_loras=family.carries_adapters(name)),
        "dtype": str(dtype), "opset": cfg.onnx.opset, "trace_latent_size": cfg.onnx.trace_latent_size,
        "quantized": (quantized or {}).get("fingerprint") if backbone else None,
        # UNet graphs traced before they took their upsampling sizes from the skip connections
        # run only at latent sizes that are multiples of 2**upsamplers: they are exported again.
        **({"upsampling": "to skip sizes"} if backbone else {}),
        **(cache.record() if name in family.backbone_graphs()[1:] else {}),
        # Absent without another VAE, so the graphs exported before the key still count as current.
        **({"vae_source": cfg.model.vae_source} if cfg.model.vae_source and family.network(name).role is Role.decoder
           else {}),
    })


def _graph_dtype(cfg) -> torch.dtype:
    return torch.float16 if cfg.onnx.precision == "fp16" else torch.float32


def refit_engines(cfg) -> list[Path]:
    """export_trt.py run_refit=true: writes the weights of the model with model.loras fused in into
    the refittable engines in infer.out_path, without exporting or building; returns the plans."""
    start = time.perf_counter()
    out = cfg.infer.out_path
    record = engines.engines_record(out)
    wanted = lora.identities(cfg.model.loras)
    family = family_of(cfg.model.family)
    plans = {name: engines.plan_path(out, name) for name in family.graph_names() if family.carries_adapters(name)}
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
    with stage("loading the model"):
        pipe = load_pipeline(cfg.model, resolve_device(cfg.device), dtype)
    modules = {spec.name: spec.module for spec in family.graph_specs(
        pipe, 1, cfg.onnx.trace_latent_size, dtype, dtype) if spec.name in stale}
    refitted = []
    for name in stale:
        # Only the TensorRT that built an engine can load it, and so refit it.
        with stage(f"refitting {plans[name].name}"):
            print(f"refitting {plans[name]} ...", flush=True)
            count = refit.refit_engine(engines.engine_flavour(plans[name]), plans[name],
                                       graphs.graph_weights(modules[name]))
        # The engine no longer holds what its ONNX file does: a build from that file is not reused.
        record[name] = {**record[name], "loras": wanted, "refit_weights": count,
                        "fingerprint": checkpoint.fingerprint({"refit_of": record[name]["fingerprint"],
                                                               "loras": wanted})}
        # Saved after each engine, so the record describes every plan even if a later refit fails.
        record_file = engines.save_engines_record(out, record)
        refitted.append(plans[name])
    print_summary("TensorRT refit", [*refitted, record_file], time.perf_counter() - start)
    return refitted


def build_engines(cfg) -> list[Path]:
    """Builds every engine from its ONNX file; returns the plan files."""
    start = time.perf_counter()
    out = cfg.infer.out_path
    family = family_of(cfg.model.family)
    onnx_files = required_onnx(out, family)
    fp8 = {name: engines.uses_fp8(onnx_file) for name, onnx_file in onnx_files.items()}
    builder = engines.engine_builder(cfg.trt, any(fp8.values()))
    timing_cache = Path(cfg.trt.timing_cache).expanduser() if cfg.trt.timing_cache else \
        engines.plan_path(out, "timing").with_suffix(".cache")
    # Graphs exported before the scale was recorded are from SD or SDXL, whose VAEs scale by 8.
    vae_scale = (read_json(onnx_files["vae"].parent / graphs.META_FILE) or {}).get("vae_scale_factor", 8)
    # The graphs may be from another model.source than the size was settled for.
    validate_image_size(cfg.infer, "infer", family.size_multiple(vae_scale), family.size_reason)
    record = engines.engines_record(out)
    engines.free_gpu_memory_for_builder()
    written, reused = [], []
    for name, onnx_file in onnx_files.items():
        graph_meta = read_json(onnx_file.parent / graphs.META_FILE) or {}
        axis_sizes = family.profile_axis_sizes(name, cfg.infer.height, cfg.infer.width, graph_meta, cfg.trt)
        shapes = engines.profile_shapes(cfg.infer, cfg.trt, family.network(name), engines.onnx_input_dims(onnx_file),
                                      axis_sizes)
        plan = engines.plan_path(out, name)
        # Graphs exported before the name was general call their checkpoint quantized_unet.
        quantized = graph_meta.get("quantized_backbone") or graph_meta.get("quantized_unet")
        # An 8-bit backbone's scales fit the adapters it was calibrated with: it never takes others.
        refittable = cfg.trt.refittable and family.carries_adapters(name) and not quantized
        fingerprint = checkpoint.fingerprint({
            "onnx": graph_meta.get("fingerprint"),
            "shapes": shapes, "flavour": [builder.flavour, builder.version], "builder": builder.tool,
            "level": cfg.trt.builder_optimization_level, "targets": list(cfg.trt.rtx_compute_capabilities),
            **({"refittable": True} if refittable else {})})
        if not cfg.force and plan.is_file() and record.get(name, {}).get("fingerprint") == fingerprint:
            reused.append(plan)
            continue
        with stage(f"building {plan.name}"):
            print(f"building {plan} ...", flush=True)
            if builder.tool == "trtexec":
                command = engines.trtexec_command(onnx_file, plan, shapes, cfg.trt, timing_cache)
                if not engines.run_trtexec(command, plan):
                    continue
                info = {"plan": plan.name, "onnx": str(onnx_file), "trtexec": command,
                        "inputs": {n: {"profile": [list(s) for s in v]} for n, v in shapes.items()}}
            else:
                info = engines.build_engine(builder.api, onnx_file, shapes, cfg.trt, plan, timing_cache,
                                          list(refit.refittable_weights(onnx_file)) if refittable else ())
        # The TensorRT that built the engine is the one that must load it (engines.engine_flavour).
        record[name] = {**info, "fingerprint": fingerprint, "flavour": builder.flavour,
                        "version": builder.version, "builder": builder.tool, "fp8": fp8[name],
                        "loras": graph_meta.get("loras", []), "quantized_backbone": quantized}
        # Saved after each engine, so the engines built before an interrupted or failed build are
        # described, and reused by the next run.
        record_file = engines.save_engines_record(out, record)
        written.append(plan)
    if written:
        written.append(record_file)
    print_engine_table(record)
    print_summary("TensorRT build", written, time.perf_counter() - start, reused=reused)
    return written + reused


def required_onnx(out_path, family) -> dict[str, Path]:
    """The ONNX file of every graph, and of the cached backbone passes where they were exported; a
    missing one names the step that makes it."""
    files = {name: graphs.onnx_path(out_path, name) for name in family.graph_names()}
    for name, path in files.items():
        if not path.is_file():
            raise UserError(f"{path} does not exist: export the ONNX graphs first "
                            "(python export_trt.py run_onnx_export=true ...)")
    cached = {name: graphs.onnx_path(out_path, name) for name in family.backbone_graphs() if name not in files}
    return {**files, **{name: path for name, path in cached.items() if path.is_file()}}
