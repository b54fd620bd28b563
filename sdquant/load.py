"""Loading stage: devices, pipelines (hub, folder, single file, built-in tiny models) and prompts."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .artifacts import atomic_folder
from .config import ModelConfig, cache_folder
from .errors import UserError
from .lora import fuse as fuse_loras
from .families import family_of


SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name} was asked for but no CUDA GPU is visible: use device=cpu")
    return device


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
VAE_DTYPES = ("auto", *DTYPES)


def compute_dtype(device: torch.device, name: str = "auto", gpu_dtype: torch.dtype = torch.float16) -> torch.dtype:
    """The family's half precision on GPUs (fp16 for SD and SDXL, bf16 for Flux, whose activations
    overflow fp16); CPUs run fp32, which they run much faster, unless a dtype is asked for (half
    the memory, for full-size models on small hosts)."""
    if name != "auto" and name not in DTYPES:
        raise UserError(f"dtype={name!r} is unknown: choose auto, {', '.join(DTYPES)}")
    if name == "auto":
        return gpu_dtype if device.type == "cuda" else torch.float32
    return DTYPES[name]


def decoder_dtype(model: ModelConfig, vae_config: dict, dtype: torch.dtype) -> torch.dtype:
    """What the VAE decodes in: model.vae_dtype, or with auto its family's choice for a pipeline in
    `dtype` (ModelFamily.decoder_dtype: a dtype whose range holds)."""
    if model.vae_dtype not in VAE_DTYPES:
        raise UserError(f"model.vae_dtype={model.vae_dtype!r} is unknown: choose {', '.join(VAE_DTYPES)}")
    if model.vae_dtype != "auto":
        return DTYPES[model.vae_dtype]
    return family_of(model.family).decoder_dtype(vae_config, dtype)


def ensure_tiny_model(model: ModelConfig) -> Path:
    """Builds the tiny model into its folder once; a half-built folder is never left behind. It is
    built only in the cache folder: anywhere else model.source names a folder that must exist, so a
    mistyped path creates nothing."""
    folder = Path(model.source).expanduser()
    if (folder / "model_index.json").exists():
        return folder
    if folder.parent != Path(cache_folder()):
        raise UserError(f"model.source={model.source}: no tiny model there; model={model.name} is built on first use "
                        f"in the cache folder ({cache_folder(model.name)}, from $SDQUANT_CACHE): leave model.source "
                        "at its default, or give the folder of one built before")
    quiet_libraries()  # saving draws transformers' progress bar, ahead of any one-line refusal
    family = family_of(model.family)
    # Another process may finish the same build first: its folder is as good as ours.
    with atomic_folder(folder, replace=False) as staging:
        family.build_pipeline(family.sizes["tiny"]).save_pretrained(staging)
    return folder


def quiet_libraries() -> None:
    """Keeps the libraries' per-call chatter (prompt truncation, deprecations) off the console."""
    import diffusers
    import transformers

    diffusers.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    # SmoothQuant names every Linear left in high precision on purpose by the exclusion filter.
    warnings.filterwarnings("ignore", message=".*is not calibrated, skip smoothing")


def _resolved_source(model: ModelConfig) -> str:
    return str(ensure_tiny_model(model)) if model.tiny else model.source


def folder_or_hub_id(source: str) -> str:
    """A local folder as an absolute path, anything else as given (a hub id)."""
    folder = Path(source).expanduser()
    return str(folder) if folder.is_dir() else source


def empty_backbones(model: ModelConfig) -> dict | None:
    """The model's backbones (its UNet or transformer, or each expert), by attribute, their weights on
    the meta device (no memory), for a checkpoint that brings every weight; None for single-file
    checkpoints, whose backbone config only the full load knows. Buffers are made for real: a
    checkpoint holds no buffer a module computes for itself (a rotary table)."""
    from accelerate import init_empty_weights

    family = family_of(model.family)
    source = _resolved_source(model)
    if source.endswith(SINGLE_FILE_SUFFIXES):
        return None
    cls = family.backbone_class()
    backbones = {}
    for attribute in family.backbone_attributes:
        config = cls.load_config(folder_or_hub_id(source), subfolder=attribute)
        with init_empty_weights(include_buffers=False):
            backbones[attribute] = cls.from_config(config)
    return backbones


def load_pipeline(model: ModelConfig, device: torch.device, dtype: torch.dtype, backbones: dict | None = None):
    """Returns the diffusers pipeline that `model` names, with its LoRA adapters fused in, on
    `device` in `dtype`; `backbones` (modules by attribute), when given, are used instead of
    loading the pipeline's own."""
    quiet_libraries()
    family = family_of(model.family)
    cls = family.pipeline_class()
    source = _resolved_source(model)
    components = dict(backbones or {})
    if model.vae_source:
        model_configs(model)  # refuses a VAE of other latents before any weight is read
        components["vae"] = other_vae(model, dtype)
    path = Path(source).expanduser()
    if str(source).endswith(SINGLE_FILE_SUFFIXES):
        if not path.is_file():
            raise UserError(f"model.source={source}: no such checkpoint file")
        kwargs = {"config": model.single_file_config} if model.single_file_config else {}
        pipe = _load_or_explain(cls.from_single_file, str(path), model, dtype=dtype, **kwargs,
                                **({"vae": components["vae"]} if model.vae_source else {}))
    elif path.is_dir():
        pipe = _load_or_explain(cls.from_pretrained, str(path), model, dtype=dtype, **components)
    elif _looks_local(source):
        raise _no_such_folder(source)
    else:
        pipe = _load_or_explain(cls.from_pretrained, source, model, dtype=dtype,
                                variant=model.variant, **components)
    missing = [name for name in family.components if getattr(pipe, name, None) is None]
    if missing:
        raise UserError(f"model.source={source} has no {', '.join(missing)}, so it is no {cls.__name__} as "
                        f"model.family={model.family} needs: set model.family to the model's own")
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.to(decoder_dtype(model, pipe.vae.config, dtype))
    # Given backbones stay where they are, on the meta device, until their weights are restored: a
    # checkpoint made with these adapters holds them fused already.
    pipe = pipe if backbones else pipe.to(device)
    fuse_loras(pipe, model.loras)
    return pipe


def vae_location(model: ModelConfig) -> tuple[str, str | None]:
    """Where model.vae_source's VAE is read from: (a folder or hub id, its subfolder): a VAE folder
    (config.json at its root), a pipeline folder holding vae/, or a hub id of a VAE."""
    folder = Path(model.vae_source).expanduser()
    if (folder / "config.json").is_file():
        return str(folder), None
    if (folder / "vae" / "config.json").is_file():
        return str(folder), "vae"
    if _looks_local(model.vae_source) or folder.exists():
        raise UserError(f"model.vae_source={model.vae_source}: no VAE there (no config.json in it or in its vae/ "
                        "folder): give a diffusers VAE folder, a pipeline folder or a hub id")
    return model.vae_source, None


def other_vae(model: ModelConfig, dtype: torch.dtype):
    """model.vae_source's VAE, as the class its config names, in `dtype`."""
    from diffusers import AutoModel

    location, subfolder = vae_location(model)
    try:
        return AutoModel.from_pretrained(location, subfolder=subfolder, torch_dtype=dtype)
    except (OSError, ValueError) as error:
        raise UserError(f"model.vae_source={model.vae_source} could not be loaded as a VAE ({type(error).__name__}: "
                        f"{str(error).splitlines()[0]}); give a local diffusers VAE folder") from error


def _checked_vae_config(model: ModelConfig, own: dict) -> dict:
    """model.vae_source's config, refused where its latents are not the model's own (`own`: the
    model's VAE config): another channel count or scale would feed the backbone latents it never saw."""
    from diffusers import AutoencoderKL

    location, subfolder = vae_location(model)
    try:
        other = AutoencoderKL.load_config(location, subfolder=subfolder)
    except (OSError, ValueError) as error:
        raise UserError(f"model.vae_source={model.vae_source}: cannot read its config "
                        f"({str(error).splitlines()[0]}); give a local diffusers VAE folder") from error
    family = family_of(model.family)
    shapes = {"latent channels": lambda config: config.get("latent_channels", config.get("z_dim")),
              "as its scale factor": family.vae_scale}
    for what, measure in shapes.items():
        mine, theirs = measure(own), measure(other)
        if mine != theirs:
            raise UserError(f"model.vae_source={model.vae_source} has {theirs} {what} where model={model.name}'s VAE "
                            f"has {mine}: give a VAE made for {family.name} models")
    return other


def _looks_local(source: str) -> bool:
    return source.startswith(("/", ".", "~"))


def _no_such_folder(source: str) -> UserError:
    return UserError(f"model.source={source}: no such folder; give a diffusers folder, a .safetensors file or a hub id")


def _load_or_explain(loader, source: str, model: ModelConfig, **kwargs):
    try:
        return loader(source, **kwargs)
    except (OSError, ValueError) as error:
        raise UserError(
            f"model.source={source} could not be loaded as a {model.family} "
            f"pipeline ({type(error).__name__}: {str(error).splitlines()[0]}); download it first "
            "or point model.source at a local diffusers folder"
        ) from error


def model_configs(model: ModelConfig) -> dict:
    """The scheduler, backbone and VAE configs and the pipeline's own of `model`, read without any
    weights; {} for a single-file checkpoint without model.single_file_config (only the full load
    knows them)."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler

    quiet_libraries()
    if model.vae_dtype not in VAE_DTYPES:
        raise UserError(f"model.vae_dtype={model.vae_dtype!r} is unknown: choose {', '.join(VAE_DTYPES)}")
    family = family_of(model.family)
    source = _resolved_source(model)
    if source.endswith(SINGLE_FILE_SUFFIXES):
        if not model.single_file_config:
            return {}
        source = model.single_file_config
    location = folder_or_hub_id(source)
    if _looks_local(source) and not Path(location).is_dir():
        raise _no_such_folder(source)
    try:
        configs = {
            # Any scheduler class reads the folder's config; make_scheduler picks the class to run.
            "scheduler_config": EulerDiscreteScheduler.load_config(location, subfolder="scheduler"),
            "backbone_config": family.backbone_class().load_config(location, subfolder=family.configs_backbone.attribute),
            "vae_config": AutoencoderKL.load_config(location, subfolder="vae"),
            # model_index.json: a video model's expert boundary.
            "pipeline_config": dict(family.pipeline_class().load_config(location)),
        }
    except (OSError, ValueError) as error:
        raise UserError(f"model.source={source}: cannot read its {family.configs_backbone.attribute}, VAE and scheduler configs "
                        f"({str(error).splitlines()[0]}); download the model first or point model.source at a "
                        f"local diffusers folder of a {family.name} model") from error
    if model.vae_source:
        configs["vae_config"] = _checked_vae_config(model, configs["vae_config"])
    return configs


def pipeline_parts(model: ModelConfig) -> dict:
    """What running engines needs of the model besides its networks: its configs (model_configs) and
    tokenizers; none of the weights are loaded."""
    from transformers import AutoTokenizer

    source = _resolved_source(model)
    if source.endswith(SINGLE_FILE_SUFFIXES):
        raise UserError(f"model.source={source}: running engines needs the model's diffusers folder "
                        "(or hub id) for its tokenizers and scheduler, not a single file")
    configs = model_configs(model)
    location = folder_or_hub_id(source)
    family = family_of(model.family)
    try:
        return {"tokenizers": [AutoTokenizer.from_pretrained(location, subfolder=name)
                               for name in family.tokenizer_folders], **configs}
    except (OSError, ValueError) as error:
        raise UserError(f"model.source={source}: cannot read its tokenizers ({str(error).splitlines()[0]})") from error


def builtin_prompts_path(name: str = "calib_prompts.txt") -> Path:
    """A prompts file shipped with the package: calibration or evaluation prompts."""
    return Path(__file__).parent / "data" / name


def load_prompts(prompts_file: str | None, count: int) -> list[str]:
    """The first `count` non-empty lines of the prompts file (the shipped one when None)."""
    path = Path(prompts_file).expanduser() if prompts_file else builtin_prompts_path()
    if not path.is_file():
        raise UserError(f"prompts_file={path}: no such file")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(prompts) < count:
        raise UserError(
            f"prompts_file={path} holds {len(prompts)} prompts but quantize.calib_size={count}: "
            "lower calib_size or add prompts"
        )
    return prompts[:count]
