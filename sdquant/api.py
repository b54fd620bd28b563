"""The Python API: a model's pipeline built once, with the settings infer_trt.py takes, then called
per request.

    from sdquant.api import load

    with load("scenes_sdxl", backend="torch", sampling={"steps": 20}) as pipe:
        drawn = pipe(["a red circle on the left and a blue square on the right"], seed=7)
        images = drawn.samples          # N x 3 x H x W in [0, 1]; drawn.stage_seconds per stage

`load` composes conf/sd_xl_trt_inference.yaml for the model as infer_trt.py does (its keys, its
defaults, its one-line refusals), so a call draws what the script draws for the same settings.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from pathlib import Path

from .assembly import Pipeline, assemble
from .config import register_schemas, settled_config, validate_infer
from .errors import UserError
from .runs.infer import settle_called_pipeline, settle_pipeline
from .runs.sample import defaults_of, settle_defaults

# The scripts' configs, beside the package in a checkout (pip install -e).
CONF = Path(__file__).resolve().parents[1] / "conf"
INFER_CONFIG = "sd_xl_trt_inference"


def compose(config_name: str, model: str, overrides: Sequence[str] = (), settings: dict | None = None):
    """The Hydra config `config_name` of conf/ for conf/model/<model>.yaml, with Hydra's `overrides`
    (as a script's command line takes them) and then `settings` (nested dicts of the same keys)
    merged in; a wrong key or type is refused in one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not (CONF / f"{config_name}.yaml").is_file():
        raise UserError(f"{CONF} holds no {config_name}.yaml: the API reads the scripts' configs from a checkout of "
                        "sdquant (pip install -e .)")
    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=[f"model={model}", *overrides])
        open_maps(cfg)
        return OmegaConf.merge(cfg, settings or {})
    except (HydraException, OmegaConfBaseException) as error:
        raise UserError(f"model={model} {' '.join(overrides)} {settings or ''}: {str(error).splitlines()[0]}") \
            from None


def open_maps(node) -> None:
    """Lets `settings` name the keys of the schemas' maps (a dict[str, ...] field, such as
    sampling.cache.backbone_thresholds, whose keys are the model's backbones), as `+key=...` does on
    a command line; the dataclass nodes around them still refuse a key they do not have."""
    from omegaconf import DictConfig, OmegaConf

    for key in node:
        child = node._get_node(key)
        if not isinstance(child, DictConfig):
            continue
        if child._metadata.object_type is dict and child._metadata.element_type is not typing.Any:
            OmegaConf.set_struct(child, False)
        else:
            open_maps(child)


def load(model: str = "sdxl_base", overrides: Sequence[str] = (), **settings) -> Pipeline:
    """The pipeline of conf/model/<model>.yaml built once with infer_trt.py's settings: `settings`
    as nested dicts (backend="torch", quantized_backbone="quantized/<folder>",
    torch_backend={"quantized": "fp8", "compile": True}, cuda_graph=True, ...), or `overrides` as
    the script's command line takes them ("model.source=/path/to/folder"). Its calls default to the
    config's sampling.* (steps, guidance, size, seed, ...)."""
    return build(settled_config(compose(INFER_CONFIG, model, overrides, settings)))


def build(app) -> Pipeline:
    """The pipeline of a settled config that holds infer_trt.py's keys (its own, or serve.py's)."""
    pipeline = assemble(settle_called_pipeline(app))
    pipeline.defaults = defaults_of(app.sampling)
    return pipeline


def from_pipeline(pipe, family: str, quantized: tuple[str, float] | None = None, **settings) -> Pipeline:
    """A diffusers pipeline already in memory (a benchmark's full-size architecture with random
    weights) built into the pipeline with infer_trt.py's settings (`settings` as for load; the
    torch backend), for family `family`; `quantized`: its backbones are fake-quantized in memory
    (ModelOpt's quantizers, calibrated) at this (format, quant_level), run on torch_backend.quantized's
    kernels."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .config import InferApp, ModelConfig
    from .families import family_of
    from .config import freeze
    from .load import DTYPES, decoder_dtype
    from .runs.infer import check_kernels
    from .runs.model import Checkpoint, Model

    register_schemas()
    torch_backend = settings.get("torch_backend") or {}
    if not isinstance(torch_backend, dict):
        raise UserError(f"torch_backend={torch_backend!r}: give a dict of torch_backend's keys")
    kernels = torch_backend.get("quantized", "fake")
    if kernels != "fake" and quantized is None:
        raise UserError(f"torch_backend.quantized={kernels} runs backbones quantized in memory: give quantized="
                        "(format, quant_level) as they were calibrated")
    # Settled as an unquantized run, which infer_trt.py's checks take; the in-memory checkpoint after.
    asked = {**settings, "torch_backend": {**torch_backend, "quantized": "fake"}}
    config = ModelConfig(name=f"{family} in memory", family=family, source="<in memory>")
    try:
        app = settled_config(OmegaConf.merge(OmegaConf.structured(InferApp(model=config, backend="torch")), asked))
    except OmegaConfBaseException as error:
        raise UserError(f"{settings}: {str(error).splitlines()[0]}") from None
    validate_infer(app)
    model = Model(app.model, family_of(family), family_of(family).parts_of(pipe))
    defaults = settle_defaults(model, app.sampling)
    # The stages run in the dtype the pipeline was built in, on any device; the VAE decodes in its
    # family's, as a loaded pipeline's does.
    built_in = next(model.family.backbone_modules(pipe)[model.family.backbone_attributes[0]].parameters()).dtype
    pipe.vae.to(decoder_dtype(app.model, pipe.vae.config, built_in))
    run = dataclasses.replace(settle_pipeline(app, model, defaults.cache, defaults.geometry),
                              dtype=next(name for name, dtype in DTYPES.items() if dtype == built_in))
    if quantized is not None:
        fmt, level = quantized
        checkpoint = Checkpoint.in_memory(f"the {family} backbones quantized in memory", fmt, level)
        kernels = freeze(dataclasses.replace(run.torch_backend, quantized=kernels))
        check_kernels(checkpoint, kernels)
        run = dataclasses.replace(run, checkpoint=checkpoint, torch_backend=kernels)
    pipeline = assemble(run, pipe=pipe)
    pipeline.defaults = defaults_of(app.sampling)
    return pipeline
