"""Reporting stage: library versions for provenance and the closing summary of every script."""

from __future__ import annotations

import functools
import hashlib
import platform
import sys
from importlib import metadata
from pathlib import Path

from . import __version__

PROVENANCE_PACKAGES = ("torch", "diffusers", "transformers", "nvidia-modelopt", "onnx",
                       "onnxruntime", "tensorrt", "tensorrt-rtx-cu13")
PACKAGE_ROOT = Path(__file__).parent


@functools.cache
def source_digest(root: Path = PACKAGE_ROOT) -> str:
    """A digest of the Python source under `root` (the package's own by default): it names the code
    a record came from where the version number, one for many commits, cannot (a GPU machine's copy
    of the tree has no git history to ask)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "sdquant": __version__, "sdquant_source": source_digest()}
    for package in PROVENANCE_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _size(path: Path) -> str:
    size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


# The packages a bug report needs, with the names the summary gives them.
SUMMARY_PACKAGES = {"sdquant": "sdquant", "torch": "torch", "diffusers": "diffusers", "nvidia-modelopt": "ModelOpt"}


def versions_line() -> str:
    """What ran: sdquant, torch, diffusers, ModelOpt and the TensorRT flavour this process loaded."""
    from .export.engines import BACKENDS

    versions = library_versions()
    parts = [f"{label} {versions[name]}" for name, label in SUMMARY_PACKAGES.items() if name in versions]
    parts += [f"{name} {sys.modules[name].__version__}" for name in BACKENDS if name in sys.modules]
    return "versions: " + ", ".join(parts)


def print_summary(title: str, written: list[Path], seconds: float, reused: list[Path] = (),
                  notes: list[str] = ()) -> None:
    print(f"\n{title} finished in {seconds:.1f} s")
    for path in written:
        print(f"  wrote   {path}  ({_size(path)})")
    for path in reused:
        print(f"  reused  {path}  (force=true rebuilds it)")
    for note in notes:
        print(f"  note    {note}")
    print(f"  {versions_line()}")


def print_engine_table(record: dict) -> None:
    """One line per engine: its batch range, inputs and size."""
    if not record:
        return
    print(f"\n{'engine':<12} {'batch min/opt/max':<18} {'MB':>8}  inputs")
    for name, info in record.items():
        inputs = info.get("inputs", {})
        profiles = [spec["profile"] for spec in inputs.values() if "profile" in spec]
        batch = "/".join(str(p[0]) for p in profiles[0]) if profiles else "?"
        size = f"{info['bytes'] / 1024**2:.1f}" if "bytes" in info else "-"
        dtypes = ", ".join(f"{n}:{spec.get('dtype', '?')}" for n, spec in inputs.items())
        print(f"{name:<12} {batch:<18} {size:>8}  {dtypes}")


def device_name(device) -> str:
    """The GPU's name, or the CPU's model (FP8 fake quantization rounds a little differently on each
    CPU, so figures measured on one name it)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({cpu_model()})"


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it, e.g. 'AMD EPYC' or 'Intel(R) Xeon(R) ...'."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


class ImageWriter:
    """Writes each prompt batch's PNGs (the prompt, the image's own seed, steps and engines in their
    metadata) on worker threads while the next batch runs, since encoding a batch takes a good part
    of a fast GPU's call (1.4 s of 4.9 s for 8 SDXL images). Only the main thread reads the
    images from the device, which also waits for the call that made them. A batch is queued only
    once the one before the last is written, so a failed write stops the run a batch later and at
    most two batches wait in memory. Leaving the block, also on an error or Ctrl-C, waits for the
    queued PNGs, each renamed into place whole, so that every image made is kept; Ctrl-C is held
    back while it waits."""

    def __init__(self, out: Path, engines: dict, backend: str, workers: int = 4):
        from concurrent.futures import ThreadPoolExecutor

        self.out, self.backend = Path(out), backend
        self.engines = ", ".join(f"{k}={v}" for k, v in engines.items())
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="png")
        self.queued: list[list] = []  # per batch, its PNGs' futures
        self.written: list[Path] = []
        # NaN pixels the images held before rounding (written as black; the decode clamps an infinity
        # into range): a backbone or VAE out of its range, which every report states.
        self.nonfinite_values = 0

    def __enter__(self) -> "ImageWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        from .interrupts import interrupts_deferred

        with interrupts_deferred():
            self.pool.shutdown(wait=True)

    def submit(self, samples, batch_index: int, settings) -> None:
        """Queues the batch's samples (images N x 3 x H x W, or videos N x F x 3 x H x W, in [0, 1])."""
        import torch

        self._wait(keep=1)
        self.nonfinite_values += int((~torch.isfinite(samples)).sum())
        pixels = to_pixels(samples)
        futures = []
        for offset, (prompt, seed, array) in enumerate(zip(settings.image_prompts, settings.seeds, pixels)):
            text = {"prompt": prompt, "negative_prompt": settings.negative_prompt, "seed": seed,
                    "steps": settings.steps, "guidance_scale": settings.guidance_scale, "backend": self.backend,
                    "engines": self.engines, **self.settings_of(settings)}
            futures += [self.pool.submit(write, array, path, text)
                        for write, path in self.files(self.out, f"{batch_index:03d}_{offset:02d}")]
        self.queued.append(futures)

    def settings_of(self, settings) -> dict:
        """What a sample's metadata records besides the prompt, seed, steps, guidance and engines."""
        return {}

    def files(self, out: Path, stem: str) -> list[tuple]:
        """(writer, path) of each file a sample is written to."""
        return [(_write_png, out / f"image_{stem}.png")]

    def finish(self) -> list[Path]:
        """Waits for every queued PNG; the paths in the order queued. A failed write raises here."""
        self._wait(keep=0)
        return self.written

    def _wait(self, keep: int) -> None:
        """Waits for the queued batches but the last `keep`, raising the first failed write."""
        from .interrupts import interrupts_deferred

        with interrupts_deferred():
            while len(self.queued) > keep:
                self.written += [future.result() for future in self.queued.pop(0)]


class VideoWriter(ImageWriter):
    """ImageWriter's queue for videos: each as video_<batch>_<k>.mp4 (H.264 through PyAV at the
    settings' frames per second, its settings in the file's metadata) and its first frame as
    video_<batch>_<k>.png, a poster a file browser shows."""

    def settings_of(self, settings) -> dict:
        second = {} if settings.guidance_scale_2 is None else {"guidance_scale_2": settings.guidance_scale_2}
        return {"frames": settings.frames, "fps": settings.fps, **second}

    def files(self, out: Path, stem: str) -> list[tuple]:
        return [(_write_mp4, out / f"video_{stem}.mp4"), (_write_poster, out / f"video_{stem}.png")]


# What each family's output is written as (ModelFamily.output), and the package each writer needs
# beyond the project's own (with the extra that installs it).
WRITERS = {"image": ImageWriter, "video": VideoWriter}
WRITER_PACKAGES = {"video": ("av", "video")}


def require_writer(output: str, model_name: str) -> None:
    """Refuses, before any work, a run whose writer's package is not installed."""
    import importlib.util

    from .errors import UserError

    package, extra = WRITER_PACKAGES.get(output, (None, None))
    if package and importlib.util.find_spec(package) is None:
        raise UserError(f"model={model_name} draws {output}s, which are written with {package} (PyAV), not installed "
                        f"here: pip install -e \".[{extra}]\" (or pip install {package})")


def to_pixels(samples):
    """Samples in [0, 1] (N x 3 x H x W, or N x F x 3 x H x W) as uint8 arrays, channels last, on the host."""
    import torch

    return (samples * 255).round().to(torch.uint8).movedim(-3, -1).cpu().numpy()


def _write_mp4(frames, path: Path, text: dict) -> Path:
    from .artifacts import atomic_path

    with atomic_path(path) as temp:
        encode_mp4(frames, str(temp), text)
    return path


def encode_mp4(frames, target, text: dict) -> None:
    """(F, H, W, 3) uint8 frames as an H.264 MP4 at text["fps"] into `target` (a path, or a binary
    file object), every entry of `text` in its metadata."""
    import av

    # use_metadata_tags: MP4 keeps keys of its own naming (prompt, seed, ...) only when told to.
    with av.open(target, mode="w", format="mp4", options={"movflags": "use_metadata_tags"}) as container:
        for key, value in text.items():
            container.metadata[key] = str(value)
        stream = container.add_stream("libx264", rate=int(text["fps"]))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        # Visually lossless (H.264's constant quality 17), so the file shows what the pipeline drew.
        stream.options = {"crf": "17"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def _write_poster(frames, path: Path, text: dict) -> Path:
    return _write_png(frames[0], path, text)


def _write_png(array, path: Path, text: dict) -> Path:
    from .artifacts import atomic_path

    with atomic_path(path) as temp:
        encode_png(array, temp, text)
    return path


def encode_png(array, target, text: dict) -> None:
    """An (H, W, 3) uint8 image as a PNG into `target` (a path, or a binary file object), every
    entry of `text` in its metadata."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in text.items():
        info.add_text(key, str(value))
    Image.fromarray(array).save(target, format="PNG", pnginfo=info)


def latency_report(timings: list, images_per_run: int, steps: int, backbones: list[str]) -> dict:
    """Mean figures over the timed runs: each stage, the backbones (UNet or DiT, or each expert of a
    video model: graphs `backbones`) per step, the whole pipeline and the pipeline's own overhead (end
    to end minus the stages)."""
    import statistics

    runs = len(timings)
    end_to_end = statistics.mean(total for total, _ in timings)
    stage_totals: dict[str, float] = {}
    stage_calls: dict[str, float] = {}
    for _, stages in timings:
        for name, calls in stages.items():
            stage_totals[name] = stage_totals.get(name, 0.0) + sum(calls) / runs
            stage_calls[name] = stage_calls.get(name, 0.0) + len(calls) / runs
    backbone_total = sum(stage_totals.get(name, 0.0) for name in backbones)
    text = sum(v for k, v in stage_totals.items() if k not in (*backbones, "vae"))
    in_stages = sum(stage_totals.values())
    return {
        "timed_runs": runs, "images_per_run": images_per_run, "steps": steps, "backbone": " + ".join(backbones),
        "ms": {
            "text_encoders": 1000 * text,
            "backbone_total": 1000 * backbone_total,
            "backbone_per_step": 1000 * backbone_total / steps,
            "vae": 1000 * stage_totals.get("vae", 0.0),
            "end_to_end": 1000 * end_to_end,
            "pipeline_overhead": 1000 * (end_to_end - in_stages),
        },
        "stage_ms": {name: 1000 * value for name, value in stage_totals.items()},
        "stage_calls": stage_calls,
        "pipeline_overhead_fraction": (end_to_end - in_stages) / end_to_end,
        "images_per_second": images_per_run / end_to_end,
    }


def print_latency(report: dict) -> None:
    timed = f" ({report['timed']})" if "timed" in report else ""
    print(f"\nlatency over {report['timed_runs']} call(s){timed}, {report['images_per_run']} image(s), "
          f"{report['steps']} steps, backend {report.get('backend')} on {report.get('device')}")
    backbones = report["backbone"].split(" + ")
    backbone = backbones[0] if len(backbones) == 1 else "backbones"
    labels = {"text_encoders": "text encoders", "backbone_per_step": f"{backbone} per step",
              "backbone_total": f"{backbone} total", "vae": "VAE", "end_to_end": "whole pipeline",
              "pipeline_overhead": "pipeline overhead"}
    for key, label in labels.items():
        print(f"  {label:<18} {report['ms'][key]:10.2f} ms")
        if key == "backbone_total" and len(backbones) > 1:
            for name in backbones:
                calls = report.get("stage_calls", {}).get(name, 0)
                print(f"    {name:<16} {report['stage_ms'].get(name, 0.0):10.2f} ms over {calls:g} calls")
    print(f"  {report.get('output', 'image') + 's per second':<18} {report['images_per_second']:10.3f}")
    rate = (report.get("after_first_batch") or {}).get("images_per_second")
    if rate:
        print(f"  {'after batch one':<18} {rate:10.3f} {report.get('output', 'image')}s/s over the later prompt "
              "batches, saving included")
    if "first_call_seconds" in report:
        setup = report["setup_seconds"]
        told = (f"compiling and setting up: {setup:.1f} s once per shape" if setup >= SETUP_SHOWN
                else "no set-up beyond a timed run")
        print(f"  {'first call':<18} {1000 * report['first_call_seconds']:10.2f} ms  ({told})")
    if report.get("cache_passes"):
        ran = ", ".join(f"{name} {each['full_passes']} of {each['calls']}" for name, each in report["cache_passes"].items())
        print(f"  {'step cache':<18} hooked calls run in full over the timed call(s): {ran}")
    if report.get("nonfinite_values"):
        print(f"  warning: the {report.get('output', 'image')}s held {report['nonfinite_values']} NaN values "
              "(written black)")


def summed_passes(counts: list[dict[str, dict]]) -> dict[str, dict]:
    """Each backbone's calls under a cache hook, those run in full, and those run in full at each of
    its steps, summed over several calls' or processes' counts (sdquant.assembly.Drawn.cache_passes).
    A count without the steps (a shard job of an older version) leaves their sum out, not short."""
    summed: dict[str, dict] = {}
    for count in counts:
        for name, each in count.items():
            total = summed.setdefault(name, {"full_passes": 0, "calls": 0, "full_steps": []})
            total["full_passes"] += each["full_passes"]
            total["calls"] += each["calls"]
            if "full_steps" in total and "full_steps" in each:
                total["full_steps"] = steps_added(total["full_steps"], each["full_steps"])
            else:
                total.pop("full_steps", None)
    return summed


def steps_added(first, second) -> list[int]:
    """Two counts per step added, step by step (a shorter list counts 0 past its end)."""
    return [(first[step] if step < len(first) else 0) + (second[step] if step < len(second) else 0)
            for step in range(max(len(first), len(second)))]


def after_first_batch(images: int, seconds: float) -> dict:
    """The images of a process's prompt batches after its first (which compiles or sets up) and the
    seconds from the end of its first call until the last PNG was written: the rate a long prompt
    list runs at, saving included; images_per_second None where the process had no other batch."""
    return _rate(images, seconds)


def _rate(images: int, seconds: float) -> dict:
    return {"images": images, "seconds": seconds, "images_per_second": images / seconds if images else None}


# Below this a first call's excess over a timed run is run-to-run noise, not set-up.
SETUP_SHOWN = 0.05


def setup_seconds(first_call_seconds: float, end_to_end_ms: float) -> float:
    """What the first call took beyond a timed run (compiling, engine and graph set-up); a first
    call that happened to run faster than the timed mean had none, not a negative one."""
    return max(0.0, first_call_seconds - end_to_end_ms / 1000)


def write_report(out: Path, report: dict, name: str = "latency.json") -> Path:
    from .artifacts import write_json

    path = Path(out) / name
    write_json(path, report)
    return path


def merged_latency(parts: list[dict]) -> dict:
    """One report for processes that each made their share of the images side by side: each part's
    figures, their mean per stage, and the throughput of all of them together (the sum of the
    parts' images per second)."""
    import statistics

    merged = {key: value for key, value in parts[0].items() if key != "parts"}
    merged["ms"] = {key: statistics.mean(part["ms"][key] for part in parts) for key in parts[0]["ms"]}
    merged["images_per_second"] = sum(part["images_per_second"] for part in parts)
    merged["images_written"] = sum(part["images_written"] for part in parts)
    merged["nonfinite_values"] = sum(part.get("nonfinite_values", 0) for part in parts)
    # A part without the counts (a shard job of an older version) leaves the sum out, not short.
    if all("cache_passes" in part for part in parts):
        merged["cache_passes"] = summed_passes([part["cache_passes"] for part in parts])
    else:
        merged.pop("cache_passes", None)
    merged["after_first_batch"] = _after_first_batch_together(parts)
    merged["first_call_seconds"] = max(part["first_call_seconds"] for part in parts)
    merged["setup_seconds"] = max(part["setup_seconds"] for part in parts)
    merged["parts"] = [{key: value for key, value in part.items() if key not in ("settings", "versions")}
                       for part in parts]
    return merged


def _after_first_batch_together(parts: list[dict]) -> dict | None:
    """The parts' later batches as if they started together (torchrun's ranks, shard jobs started at
    once): their images in the slowest part's time. None where a part's report predates the figure
    (a shard job of an older version)."""
    if any("after_first_batch" not in part for part in parts):
        return None
    return _rate(sum(part["after_first_batch"]["images"] for part in parts),
                 max(part["after_first_batch"]["seconds"] for part in parts))


def merge_shard_reports(out: Path, count: int) -> dict | None:
    """The merged report of shard.count jobs once every one has written its own, else None (the
    last job to finish merges; two finishing together write the same file)."""
    import json

    paths = [Path(out) / f"latency.shard{index}of{count}.json" for index in range(count)]
    if not all(path.is_file() for path in paths):
        return None
    reports = [json.loads(path.read_text()) for path in paths]
    merged = merged_latency([part for report in reports for part in report.get("parts", [report])])
    merged.update(versions=reports[0].get("versions"), settings=reports[0].get("settings"), shards=count)
    return merged
