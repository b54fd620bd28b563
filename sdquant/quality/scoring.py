"""Quality stage: how close a quantized backbone stays to the model's own unquantized one.

Images: every variant starts from the same initial latents as the unquantized reference, and its image
is scored against the reference's with PSNR and SSIM (scikit-image), LPIPS (torchmetrics) and the
CLIP score of image and prompt (a CLIP model through transformers), the last two only where their
weights are already on this machine: nothing is downloaded at run time.

Prompt adherence: for scene captions ("a small red circle on the left, white background", the
built-in scene model's language), a detector reads the shape, colour, place, size and background
back from each image and compares them with the prompt, for the reference and every variant.

Steps: with teacher forcing the variant's backbone is called on exactly the inputs the reference saw
along the reference's trajectory, so each step's error belongs to the UNet at that step and is not carried
over from earlier steps: it shows where in the denoising quantization hurts.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..artifacts import atomic_path, write_json
from ..load import folder_or_hub_id

# The reference is the model's own backbone, unquantized, in the dtype it ran in (fp32 on a CPU).
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def reference_name(dtype: torch.dtype) -> str:
    """What the report calls the unquantized reference: its dtype, as it ran."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def prediction(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A backbone stage's one output: the UNet's noise or a DiT's velocity prediction."""
    [value] = outputs.values()
    return value


class RecordingStage:
    """Passes one backbone's calls through and keeps each call's graph, inputs and prediction in
    `calls`, a list the pipeline's backbones share, so it holds their calls in the order they ran."""

    def __init__(self, stage, graph: str, calls: list):
        self.stage = stage
        self.graph = graph
        self.calls = calls

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        outputs = self.stage(**inputs)
        self.calls.append((self.graph, dict(inputs), prediction(outputs)))
        return outputs


@torch.no_grad()
def teacher_forced_errors(calls: list[tuple[str, dict, torch.Tensor]], predict) -> list[float]:
    """Per backbone call of the reference run (one per scheduler timestep for a backbone that sees
    both guidance halves at once), the relative L2 error ||eps_variant - eps_ref|| / ||eps_ref|| of
    the variant's prediction on the same input; `predict(index, inputs)` is the variant's, index
    counting that backbone's calls (with a step cache, its full or shallow pass)."""
    errors, seen = [], {}
    for graph, inputs, reference in calls:
        index = seen[graph] = seen.get(graph, -1) + 1
        reference = reference.float()
        difference = predict(index, inputs).float() - reference
        errors.append(float(difference.norm() / reference.norm().clamp_min(torch.finfo(torch.float32).tiny)))
    return errors


def to_pixels(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) float64, as scikit-image takes them."""
    return images.permute(0, 2, 3, 1).cpu().double().numpy()


def psnr(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of one (H, W, 3) image; inf for identical images."""
    from skimage.metrics import peak_signal_noise_ratio

    with np.errstate(divide="ignore"):
        return float(peak_signal_noise_ratio(reference, candidate, data_range=1.0))


def ssim(reference: np.ndarray, candidate: np.ndarray) -> float:
    from skimage.metrics import structural_similarity

    return float(structural_similarity(reference, candidate, channel_axis=-1, data_range=1.0))


@dataclass
class OptionalMetric:
    """A metric that needs weights: `score(reference, candidate, prompts)` gives one value per image,
    or is None, and then `note` says why."""

    name: str
    score: Callable | None = None
    note: str | None = None


_LPIPS_BACKBONES = {"alex": "alexnet", "vgg": "vgg16", "squeeze": "squeezenet1_1"}


def lpips_metric(net: str | None, device: torch.device) -> OptionalMetric:
    """LPIPS from torchmetrics, when torchvision and its backbone weights are already here."""
    if net is None:
        return OptionalMetric("lpips", note="LPIPS off (metrics.lpips_net=null)")
    try:
        import torchvision
        from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity
    except ImportError:
        return OptionalMetric("lpips", note="LPIPS skipped: torchmetrics' LPIPS needs torchvision "
                                            "(install the torchvision release that matches your torch)")
    weights = torchvision.models.get_model_weights(_LPIPS_BACKBONES[net]).IMAGENET1K_V1
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if not cached.is_file():
        return OptionalMetric("lpips", note=f"LPIPS skipped: the {net} backbone weights are not in {cached.parent} "
                                            "and nothing is downloaded at run time; fetch them once with "
                                            "torchvision where the network is reachable")
    metric = LearnedPerceptualImagePatchSimilarity(net_type=net, normalize=True).to(device).eval()

    def score(reference: torch.Tensor, candidate: torch.Tensor, _prompts: list[str]) -> list[float]:
        return [float(metric(c[None], r[None])) for r, c in zip(reference, candidate)]

    return OptionalMetric("lpips", score=score)


def clip_metric(model_id: str | None, device: torch.device) -> OptionalMetric:
    """CLIP score, 100 * max(cos(image, prompt), 0), with a CLIP model found locally.

    torchmetrics' CLIPScore (1.9) reads transformers 4's feature outputs and fails on transformers
    5, so the score is taken from CLIPModel's own normalised embeddings, the same definition.
    """
    if model_id is None:
        return OptionalMetric("clip", note="CLIP score off (metrics.clip_model=null)")
    from transformers import CLIPModel, CLIPProcessor

    location = folder_or_hub_id(model_id)
    try:
        model = CLIPModel.from_pretrained(location, local_files_only=True).to(device).eval()
        processor = CLIPProcessor.from_pretrained(location, local_files_only=True)
    except OSError:
        return OptionalMetric("clip", note=f"CLIP score skipped: {model_id} is neither a local folder nor in the "
                                           "Hugging Face cache, and nothing is downloaded at run time")

    @torch.no_grad()
    def score(_reference, images: torch.Tensor, prompts: list[str]) -> list[float]:
        pixels = [(image * 255).round().to(torch.uint8).cpu() for image in images]
        inputs = processor(text=prompts, images=pixels, return_tensors="pt", padding=True, truncation=True)
        outputs = model(**inputs.to(device))
        cosine = (outputs.image_embeds * outputs.text_embeds).sum(dim=-1)
        return (100 * cosine).clamp_min(0).tolist()

    return OptionalMetric("clip", score=score)


def adherence(images: torch.Tensor, prompts: list[str]) -> list[dict]:
    """Per image, which of the prompt's attributes the image shows (see scenes.score)."""
    from .scenes import score

    return [score(pixels, prompt) for pixels, prompt in zip(to_pixels(images), prompts)]


# "All attributes right" among the prompts of one object and of two.
OBJECT_COLUMNS = {1: "one_object", 2: "two_objects"}


def video_adherence(videos: torch.Tensor, prompts: list[str]) -> list[dict]:
    """Per video (N, F, 3, H, W), which of the prompt's attributes and motion it shows, and its
    temporal figures (see clips.score)."""
    from .clips import score

    return [score(to_pixels(video), prompt) for video, prompt in zip(videos, prompts)]


def _attributes(rows: list[dict]) -> tuple[str, ...]:
    """The attributes the rows were scored on: the scene detector's, and the clip detector's motion."""
    from .clips import ATTRIBUTES as CLIP_ATTRIBUTES
    from .scenes import ATTRIBUTES as SCENE_ATTRIBUTES

    return tuple(name for name in dict.fromkeys(SCENE_ATTRIBUTES + CLIP_ATTRIBUTES) if any(name in row for row in rows))


# The clip detector's temporal figures, averaged over the scored videos where there are any.
TEMPORAL = ("identity_kept", "jitter", "flicker")


def adherence_summary(rows: list[dict]) -> dict:
    """Share of scorable prompts with each attribute right, and with all of them right; for videos
    also the temporal figures' means."""
    scored = [row for row in rows if row["scorable"]]

    def share(name: str, objects: int | None = None) -> float | None:
        # A two-object prompt has no size to score; each share counts the prompts that have one.
        values = [float(row[name]) for row in scored if name in row and objects in (None, row.get("objects"))]
        return statistics.fmean(values) if values else None

    attributes = _attributes(scored)
    means = {name: share(name) for name in (*attributes, "all")}
    means.update({column: share("all", objects) for objects, column in OBJECT_COLUMNS.items()})
    temporal = {name: share(name) for name in TEMPORAL if any(name in row for row in scored)}
    return {"scored": len(scored), "not_scorable": len(rows) - len(scored), "attributes": list(attributes),
            "mean": means, **({"temporal": temporal} if temporal else {}), "per_prompt": rows}


@dataclass
class VariantScores:
    """One variant's scores: per prompt, the teacher-forced error per step (per batch), and
    per image the prompt adherence."""

    source: str
    per_prompt: list[dict] = field(default_factory=list)
    step_errors: list[list[float]] = field(default_factory=list)
    # The backbone of each call the step errors are of (each expert's, for a video model).
    step_graphs: list[str] = field(default_factory=list)
    adherence: list[dict] = field(default_factory=list)

    def step_error(self) -> list[float]:
        """Per step, the mean over prompt batches."""
        return [statistics.fmean(column) for column in zip(*self.step_errors)]

    def step_error_by_backbone(self) -> dict[str, list[float]]:
        """step_error split by the backbone each call ran, where several did (a video model's experts)."""
        errors = self.step_error()
        graphs = dict.fromkeys(self.step_graphs)
        if len(graphs) < 2:
            return {}
        return {graph: [error for error, ran in zip(errors, self.step_graphs) if ran == graph] for graph in graphs}

    def means(self) -> dict[str, float]:
        keys = [key for key in ("psnr", "ssim", "lpips", "clip", "temporal_psnr")
                if self.per_prompt and key in self.per_prompt[0]]
        means = {key: statistics.fmean(row[key] for row in self.per_prompt) for key in keys}
        if self.step_errors:
            means["step_error"] = statistics.fmean(self.step_error())
        return means


def score_images(reference: torch.Tensor, candidate: torch.Tensor, prompts: list[str],
                 optional: list[OptionalMetric]) -> list[dict]:
    """Per image of a batch: PSNR and SSIM against the reference, and each available optional metric."""
    reference_pixels, candidate_pixels = to_pixels(reference), to_pixels(candidate)
    rows = [{"prompt": prompt, "psnr": psnr(r, c), "ssim": ssim(r, c)}
            for prompt, r, c in zip(prompts, reference_pixels, candidate_pixels)]
    for metric in optional:
        if metric.score is None:
            continue
        for row, value in zip(rows, metric.score(reference, candidate, prompts)):
            row[metric.name] = value
    return rows


def temporal_psnr(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """PSNR in dB of a video's frame-to-frame changes (F, 3, H, W) against the reference's: motion the
    reference does not have (flicker, an object moving another way) lowers it where every frame alone
    may still score well. inf for identical changes; a one-frame video has none (nan)."""
    if len(reference) < 2:
        return float("nan")
    changes = [video[1:].double() - video[:-1].double() for video in (reference, candidate)]
    error = float(((changes[1] - changes[0]) ** 2).mean())
    return float("inf") if error == 0 else 10 * math.log10(4 / error)  # changes span [-1, 1]: peak 2


def score_videos(reference: torch.Tensor, candidate: torch.Tensor, prompts: list[str],
                 optional: list[OptionalMetric]) -> list[dict]:
    """Per video of a batch (N, F, 3, H, W): each image score's mean over its frames, and the PSNR of
    its frame-to-frame changes against the reference's (temporal_psnr)."""
    rows = []
    for video_reference, video, prompt in zip(reference, candidate, prompts):
        frames = score_images(video_reference, video, [prompt] * len(video), optional)
        rows.append({"prompt": prompt, **{key: statistics.fmean(frame[key] for frame in frames)
                                          for key in frames[0] if key != "prompt"},
                     "temporal_psnr": temporal_psnr(video_reference, video)})
    return rows


class ImageScores:
    """How an image family's samples (N, 3, H, W) are scored: adherence read by the scene detector,
    PSNR/SSIM and the optional metrics per image, and the grid's cell (the image)."""

    def adherence(self, samples: torch.Tensor, prompts: list[str]) -> list[dict]:
        return adherence(samples, prompts)

    def score(self, reference: torch.Tensor, candidate: torch.Tensor, prompts: list[str],
              optional: list[OptionalMetric]) -> list[dict]:
        return score_images(reference, candidate, prompts, optional)

    def cells(self, samples: torch.Tensor) -> torch.Tensor:
        return samples


class VideoScores(ImageScores):
    """A video family's samples (N, F, 3, H, W): adherence and motion read by the clip detector,
    PSNR/SSIM and the optional metrics over every frame, the temporal PSNR, and the first, middle
    and last frames side by side as the grid's cell (a strip that shows the motion)."""

    def adherence(self, samples: torch.Tensor, prompts: list[str]) -> list[dict]:
        return [{"prompt": prompt, **row} for prompt, row in zip(prompts, video_adherence(samples, prompts))]

    def score(self, reference: torch.Tensor, candidate: torch.Tensor, prompts: list[str],
              optional: list[OptionalMetric]) -> list[dict]:
        return score_videos(reference, candidate, prompts, optional)

    def cells(self, samples: torch.Tensor) -> torch.Tensor:
        frames = samples.shape[1]
        return torch.cat([samples[:, index] for index in (0, frames // 2, frames - 1)], dim=-1)


# How each family's output is scored (ModelFamily.output).
SCORES = {"image": ImageScores(), "video": VideoScores()}


def image_grid(columns: list[torch.Tensor]) -> "Image.Image":
    """One row per prompt, one column per model (the reference first), each (N, 3, H, W) in [0, 1]."""
    from PIL import Image

    rows = [torch.cat([column[index] for column in columns], dim=2) for index in range(len(columns[0]))]
    grid = torch.cat(rows, dim=1)
    return Image.fromarray((grid.permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8))


def _json_number(value):
    """JSON has no infinity: an identical image's PSNR is written as the string "inf"."""
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


def _jsonable(data):
    if isinstance(data, dict):
        return {key: _jsonable(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_jsonable(value) for value in data]
    return _json_number(data)


def build_report(variants: dict[str, VariantScores], reference_clip: list[float] | None,
                 reference_adherence: list[dict], notes: list[str], settings: dict, reference: str) -> dict:
    """The report; `reference` names the unquantized run (reference_name)."""
    adherence_by_model = {reference: adherence_summary(reference_adherence),
                          **{name: adherence_summary(scores.adherence) for name, scores in variants.items()}}
    if not adherence_by_model[reference]["scored"]:
        notes = notes + ["prompt adherence not scored: no prompt is a scene caption such as "
                         "'a small red circle on the left, white background' (model=scenes_sdxl's language) or, "
                         "for a 64x64 video, a clip caption such as 'a red circle moving slowly from left to right, "
                         "white background'"]
    return {
        "reference": {"name": reference, "clip": reference_clip},
        "variants": {name: {"source": scores.source, "mean": scores.means(), "per_prompt": scores.per_prompt,
                            "step_error": scores.step_error(),
                            **({"step_error_by_backbone": scores.step_error_by_backbone()}
                               if scores.step_error_by_backbone() else {})} for name, scores in variants.items()},
        "adherence": adherence_by_model,
        "notes": notes,
        "settings": settings,
    }


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _adherence_lines(adherence: dict, reference_name: str) -> list[str]:
    """The adherence table (share of prompts with each attribute right) and, per prompt, what
    each model got wrong."""
    reference = adherence[reference_name]
    if not reference["scored"]:
        return []
    attributes = reference["attributes"]
    lines = ["", "## Prompt adherence", "",
             f"Attributes read back from each sample by the scene (or clip) detector, on {reference['scored']} "
             "scene prompts" + (f" ({reference['not_scorable']} not scorable)" if reference["not_scorable"] else "")
             + ".", "",
             "| model | " + " | ".join(attributes) + " | all attributes | one object: all | two objects: all |",
             "| --- |" + " --- |" * (len(attributes) + 3)]
    for name, summary in adherence.items():
        lines.append(f"| {name} | " + " | ".join(_percent(summary["mean"].get(key))
                                                 for key in (*attributes, "all", *OBJECT_COLUMNS.values())) + " |")
    if "temporal" in reference:
        lines += ["", "Over time (the clip detector): share of videos whose every object keeps its colour and shape in "
                  "every frame, the tracks' largest distance from a straight line (pixels) and the background's mean "
                  "change between frames (levels): " + "; ".join(
                      f"{name} {_percent(summary['temporal']['identity_kept'])}, "
                      f"{_cell(summary['temporal']['jitter'])} px, {_cell(summary['temporal']['flicker'])}"
                      for name, summary in adherence.items()) + "."]
    lines += ["", "| prompt | " + " | ".join(adherence) + " |", "| --- |" + " --- |" * len(adherence)]
    for index, row in enumerate(reference["per_prompt"]):
        cells = []
        for summary in adherence.values():
            result = summary["per_prompt"][index]
            wrong = [key for key in attributes if key in result and not result[key]]
            cells.append("not scorable" if not result["scorable"] else ("right" if not wrong else
                                                                        "wrong " + ", ".join(wrong)))
        lines.append(f"| {row.get('prompt', index)} | " + " | ".join(cells) + " |")
    return lines


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return str(value)


def markdown(report: dict) -> str:
    s = report["settings"]
    sampling = s["sampling"]
    names = list(report["variants"])
    reference = report["reference"]["name"]
    lines = [f"# Quality against the unquantized backbone ({reference}): {s['model']}",
             "",
             f"{len(report['variants'][names[0]]['per_prompt'])} prompts, {sampling['steps']} steps "
             f"({sampling['scheduler']}), guidance {sampling['guidance_scale']}, {sampling['width']}x"
             f"{sampling['height']}, seed {sampling['seed']}; every variant starts from the reference run's "
             f"initial latents. The reference is the model's own backbone, unquantized, run in {s['dtype']} on {s['device']}. "
             "Grid (`grid.png`) columns: " + " | ".join([reference, *names]) + ".",
             "",
             "| variant | source | PSNR (dB) | SSIM | LPIPS | CLIP score | step error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    reference_clip = report["reference"]["clip"]
    lines.append(f"| {reference} | the model's own backbone, unquantized | - | - | - | "
                 f"{_cell(statistics.fmean(reference_clip) if reference_clip else None)} | - |")
    for name, variant in report["variants"].items():
        mean = variant["mean"]
        lines.append(f"| {name} | `{variant['source']}` | " + " | ".join(
            _cell(mean.get(key)) for key in ("psnr", "ssim", "lpips", "clip", "step_error")) + " |")
    if any("temporal_psnr" in variant["mean"] for variant in report["variants"].values()):
        lines += ["", "Videos: PSNR, SSIM, LPIPS and CLIP are means over every frame; the PSNR of the frame-to-frame "
                  "changes against the reference's (motion or flicker the reference does not have lowers it): "
                  + ", ".join(f"{name} {_cell(variant['mean'].get('temporal_psnr'))} dB"
                              for name, variant in report["variants"].items()) + "."]
        for name, variant in report["variants"].items():
            for graph, errors in variant.get("step_error_by_backbone", {}).items():
                lines.append(f"- {name}, {graph}: step error mean {_cell(statistics.fmean(errors))} over "
                             f"{len(errors)} calls")
    lines += ["", "## Per prompt (PSNR dB / SSIM)", "", "| prompt | " + " | ".join(names) + " |",
              "| --- |" + " --- |" * len(names)]
    for index, row in enumerate(report["variants"][names[0]]["per_prompt"]):
        cells = [f"{_cell(v['per_prompt'][index]['psnr'])} / {_cell(v['per_prompt'][index]['ssim'])}"
                 for v in report["variants"].values()]
        lines.append(f"| {row['prompt']} | " + " | ".join(cells) + " |")
    lines += ["", "## Noise-prediction error per step (teacher forcing)", "",
              "Relative L2 error of the backbone's output against the reference's, both fed the reference's trajectory.", "",
              "| step | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    steps = len(report["variants"][names[0]]["step_error"])
    for step in range(steps):
        lines.append(f"| {step} | " + " | ".join(_cell(v["step_error"][step]) for v in report["variants"].values())
                     + " |")
    lines += _adherence_lines(report["adherence"], reference)
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, report: dict, grid) -> list[Path]:
    out = Path(out)
    json_path, markdown_path, grid_path = out / "quality.json", out / "quality.md", out / "grid.png"
    write_json(json_path, _jsonable(report))
    with atomic_path(markdown_path) as temp:
        temp.write_text(markdown(report))
    with atomic_path(grid_path) as temp:
        grid.save(temp, format="PNG")
    return [json_path, markdown_path, grid_path]


def print_means(report: dict) -> None:
    adherence = report["adherence"]
    reference = report["reference"]["name"]
    print(f"\n{'variant':<16} {'PSNR dB':>9} {'SSIM':>7} {'LPIPS':>7} {'CLIP':>7} {'step err':>9} {'adherence':>10}")
    print(f"{reference:<16} {'':>9} {'':>7} {'':>7} {'':>7} {'':>9} {_percent(adherence[reference]['mean']['all']):>10}")
    for name, variant in report["variants"].items():
        mean = variant["mean"]
        print(f"{name:<16} " + " ".join(f"{_cell(mean.get(key)):>{width}}" for key, width in
                                        (("psnr", 9), ("ssim", 7), ("lpips", 7), ("clip", 7), ("step_error", 9)))
              + f" {_percent(adherence[name]['mean']['all']):>10}")
    for note in report["notes"]:
        print(f"note: {note}")
