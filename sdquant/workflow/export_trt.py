"""export_trt.py: the ONNX export of every network, then the TensorRT engines, as the switches say;
or instead a refit of refittable engines with other LoRA adapters. The config is settled once
(sdquant.runs.export) into an ExportRun, as quantize.py settles the export of its checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..export import engines, onnx_graphs, refit
from ..quantize import checkpoint
from .. import lora
from ..artifacts import read_json
from ..assembly import restore
from ..cli import stage
from ..config import sizes_of, validate_image_size
from ..errors import UserError
from ..graphs.networks import Role
from ..load import empty_backbones, load_pipeline, resolve_device
from ..report import library_versions, print_engine_table, print_summary
from ..runs.export import ExportRun, settle_export
from ..runs.model import config_digest, settle_checkpoint


def run_export(cfg) -> list[Path]:
    """export_trt.py at its edge: the config settled, then the ONNX export and the engines, as the
    switches say (or a refit)."""
    return export(settle_export(cfg))


def export(settled: ExportRun) -> list[Path]:
    """The settled export's steps: the ONNX graphs, then the engines (or a refit)."""
    if settled.run_refit:
        return refit_engines(settled)
    written = export_onnx(settled) if settled.run_onnx_export else []
    if settled.run_trt_export:
        written += build_engines(settled)
    return written


def export_onnx(settled: ExportRun) -> list[Path]:
    """Exports every graph of the pipeline (and the backbone's passes under the step cache) to ONNX;
    returns the ONNX files."""
    start = time.perf_counter()
    device = resolve_device(settled.device)
    dtype = _graph_dtype(settled)
    # Loaded straight in the graph's precision: a full-size SDXL in fp32 would not leave room to
    # trace it on a 24 GB host.
    family, model, cache = settled.family, settled.model.config, settled.cache
    quantized = None
    with stage("loading the model"):
        if settled.checkpoint:
            # The checkpoint holds every backbone weight: loading the model's own first would hold
            # it twice, which a full-size SDXL cannot afford on a 24 GB host.
            pipe = load_pipeline(model, device, dtype, backbones=empty_backbones(model))
            restored = settle_checkpoint(settled.model, settled.checkpoint_key, settled.checkpoint)
            restore(restored, family.backbone_modules(pipe))
            quantized = restored.record
            pipe.to(device)
        else:
            pipe = load_pipeline(model, device, dtype)
    vae_dtype = torch.float16 if settled.onnx.vae_precision == "fp16" else torch.float32
    if quantized is not None:
        for module in family.backbone_modules(pipe).values():
            onnx_graphs.prepare_quantizers_for_export(module, dtype)
    specs = family.graph_specs(pipe, settled.infer.batch_size, settled.geometry, settled.onnx.trace_latent_size,
                               dtype, vae_dtype, cache)
    written, reused = [], []
    for spec in specs:
        folder = onnx_graphs.onnx_path(settled.infer.out_path, spec.name).parent
        graph_dtype = vae_dtype if family.network(spec.name).role is Role.decoder else dtype
        fingerprint = _graph_fingerprint(settled, spec.name, graph_dtype, quantized)
        if not settled.force and onnx_graphs.is_current(folder, fingerprint):
            reused.append(folder / onnx_graphs.ONNX_FILE)
            continue
        runs_backbone = spec.name in family.backbone_graphs()
        meta = {"fingerprint": fingerprint, "graph": spec.name, "dtype": str(graph_dtype),
                "inputs": spec.input_names, "outputs": spec.output_names,
                "quantized_backbone": settled.checkpoint if runs_backbone else None,
                **(cache.record() if spec.name in family.cached_graphs() else {}),
                "loras": lora.identities(model.loras) if family.carries_adapters(spec.name) else [],
                "vae_scale_factor": family.vae_scale(pipe.vae.config), **family.export_sizes(pipe, settled.geometry),
                **({"backbone_config": config_digest(settled.model.parts["backbone_config"])}
                   if runs_backbone and settled.model.parts else {}),
                **family.traced_geometry_record(spec.name, settled.geometry), "versions": library_versions()}
        with stage(f"exporting {spec.name}"):
            print(f"exporting {spec.name} to {folder} ...", flush=True)
            onnx_graphs.export_graph(spec, folder, settled.onnx.opset, meta, graph_dtype)
        written.append(folder / onnx_graphs.ONNX_FILE)
    print_summary("ONNX export", [f for path in written for f in onnx_graphs.graph_files(path)],
                  time.perf_counter() - start, reused=reused)
    return written + reused


def _graph_fingerprint(settled: ExportRun, name: str, dtype: torch.dtype, quantized: dict | None) -> str:
    family, model, cache = settled.family, settled.model.config, settled.cache
    backbone = name in family.backbone_graphs()
    return checkpoint.fingerprint({
        "graph": name,
        "model": checkpoint.model_identity(model, with_loras=family.carries_adapters(name)),
        "dtype": str(dtype), "opset": settled.onnx.opset, "trace_latent_size": settled.onnx.trace_latent_size,
        "quantized": (quantized or {}).get("fingerprint") if backbone else None,
        # UNet graphs traced before they took their upsampling sizes from the skip connections
        # run only at latent sizes that are multiples of 2**upsamplers: they are exported again.
        **({"upsampling": "to skip sizes"} if backbone else {}),
        **(cache.record() if name in family.cached_graphs() else {}),
        # Absent without another VAE, so the graphs exported before the key still count as current.
        **({"vae_source": model.vae_source} if model.vae_source and family.network(name).role is Role.decoder
           else {}),
        # A graph traced at one geometry (a video model's) is another graph at another.
        **family.traced_geometry_record(name, settled.geometry),
    })


def _graph_dtype(settled: ExportRun) -> torch.dtype:
    return torch.float16 if settled.onnx.precision == "fp16" else torch.float32


def refit_engines(settled: ExportRun) -> list[Path]:
    """export_trt.py run_refit=true: writes the weights of the model with model.loras fused in into
    the refittable engines in infer.out_path, without exporting or building; returns the plans."""
    start = time.perf_counter()
    out = settled.infer.out_path
    record = engines.engines_record(out)
    wanted = lora.identities(settled.model.config.loras)
    family = settled.family
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
    dtype = _graph_dtype(settled)
    with stage("loading the model"):
        pipe = load_pipeline(settled.model.config, resolve_device(settled.device), dtype)
    modules = {spec.name: spec.module for spec in family.graph_specs(
        pipe, 1, settled.geometry, settled.onnx.trace_latent_size, dtype, dtype) if spec.name in stale}
    refitted = []
    for name in stale:
        # Only the TensorRT that built an engine can load it, and so refit it.
        with stage(f"refitting {plans[name].name}"):
            print(f"refitting {plans[name]} ...", flush=True)
            count = refit.refit_engine(engines.engine_flavour(plans[name]), plans[name],
                                       onnx_graphs.graph_weights(modules[name]))
        # The engine no longer holds what its ONNX file does: a build from that file is not reused.
        record[name] = {**record[name], "loras": wanted, "refit_weights": count,
                        "fingerprint": checkpoint.fingerprint({"refit_of": record[name]["fingerprint"],
                                                               "loras": wanted})}
        # Saved after each engine, so the record describes every plan even if a later refit fails.
        record_file = engines.save_engines_record(out, record)
        refitted.append(plans[name])
    print_summary("TensorRT refit", [*refitted, record_file], time.perf_counter() - start)
    return refitted


def build_engines(settled: ExportRun) -> list[Path]:
    """Builds every engine from its ONNX file; returns the plan files."""
    start = time.perf_counter()
    out, family, trt = settled.infer.out_path, settled.family, settled.trt
    onnx_files = required_onnx(out, family)
    for name, onnx_file in onnx_files.items():
        onnx_graphs.check_graph_file(onnx_file, "infer.out_path", family.network(name), Path(out))
    fp8 = {name: engines.uses_fp8(onnx_file) for name, onnx_file in onnx_files.items()}
    builder = engines.engine_builder(trt, any(fp8.values()))
    timing_cache = Path(trt.timing_cache).expanduser() if trt.timing_cache else \
        engines.plan_path(out, "timing").with_suffix(".cache")
    # Graphs exported before the scale was recorded are from SD or SDXL, whose VAEs scale by 8.
    decoder = next(name for name in onnx_files if family.network(name).role is Role.decoder)
    vae_scale = (read_json(onnx_files[decoder].parent / onnx_graphs.META_FILE) or {}).get("vae_scale_factor", 8)
    # The graphs may be from another model.source than the size was settled for.
    validate_image_size(sizes_of(settled.infer), "infer.", family.size_multiple(vae_scale), family.size_reason)
    record = engines.engines_record(out)
    engines.free_gpu_memory_for_builder()
    written, reused = [], []
    for name, onnx_file in onnx_files.items():
        graph_meta = read_json(onnx_file.parent / onnx_graphs.META_FILE) or {}
        axis_sizes = family.profile_axis_sizes(name, settled.geometry, graph_meta, trt)
        shapes = engines.profile_shapes(settled.infer, trt, family.network(name), engines.onnx_input_dims(onnx_file),
                                        axis_sizes)
        plan = engines.plan_path(out, name)
        # Graphs exported before the name was general call their checkpoint quantized_unet.
        quantized = graph_meta.get("quantized_backbone") or graph_meta.get("quantized_unet")
        # An 8-bit backbone's scales fit the adapters it was calibrated with: it never takes others.
        refittable = trt.refittable and family.carries_adapters(name) and not quantized
        fingerprint = checkpoint.fingerprint({
            "onnx": graph_meta.get("fingerprint"),
            "shapes": shapes, "flavour": [builder.flavour, builder.version], "builder": builder.tool,
            "level": trt.builder_optimization_level, "targets": list(trt.rtx_compute_capabilities),
            **({"refittable": True} if refittable else {})})
        if not settled.force and plan.is_file() and record.get(name, {}).get("fingerprint") == fingerprint:
            reused.append(plan)
            continue
        with stage(f"building {plan.name}"):
            print(f"building {plan} ...", flush=True)
            if builder.tool == "trtexec":
                command = engines.trtexec_command(onnx_file, plan, shapes, trt, timing_cache)
                if not engines.run_trtexec(command, plan):
                    continue
                info = {"plan": plan.name, "onnx": str(onnx_file), "trtexec": command,
                        "inputs": {n: {"profile": [list(s) for s in v]} for n, v in shapes.items()}}
            else:
                info = engines.build_engine(builder.api, onnx_file, shapes, trt, plan, timing_cache,
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
    files = {name: onnx_graphs.onnx_path(out_path, name) for name in family.graph_names()}
    for name, path in files.items():
        if not path.is_file():
            raise UserError(f"{path} does not exist: export the ONNX graphs first "
                            "(python export_trt.py run_onnx_export=true ...)")
    cached = {name: onnx_graphs.onnx_path(out_path, name) for name in family.cached_graphs()}
    return {**files, **{name: path for name, path in cached.items() if path.is_file()}}
