"""A text-to-video model's videos measured as MLPerf's text-to-video benchmark measures them: the
pipeline built once (infer_trt.py's settings), warmed by one video, then LoadGen's Offline (every
query at once) or SingleStream (one after the other) over the first --count prompts, every video
from the same initial latent, as MLPerf's reference draws every prompt from its fixed latent. The
result is the rate (videos a second), GPU-seconds a video on this one GPU, the latency
percentiles, each video's seconds and the graphs compiled while timed (0 when warm). Durations are
the caller's (MLPerf's minimum is 600 s and its Offline run every prompt): no official MLPerf run.

    python benchmarks/mlperf_video.py --model wan22_t2v_a14b --prompts vbench_prompts.txt \\
        --latent fixed_latent.pt --count 8 --scenario offline \\
        --set "backend=torch quantized_backbone=quantized/<folder> torch_backend.quantized=fp8 torch_backend.compile=true"
    python benchmarks/mlperf_video.py --model tiny_wan --count 2 --set "backend=torch device=cpu"     # a dry run

MLPerf's settings for Wan2.2-T2V-A14B are the model config's (720x1280, 81 frames, 16 fps, guidance
4.0 and 3.0, the experts' boundary at 0.875) with sampling.steps=20 and Wan's negative prompt
(--set "sampling.negative_prompt='...'"); its prompts (data/vbench_prompts.txt) and its fixed
latent (data/fixed_latent.pt, bf16, 1x16x21x90x160) come with its dataset. Without --latent, one
latent drawn from --seed serves every prompt. LoadGen gets each video's completion without its
frames (the accuracy run, VBench, is MLPerf's own). Results go to
benchmarks/results/mlperf_video_<model>_<scenario>_<gpu>.json (--out), rewritten after each run.
"""

from __future__ import annotations

import argparse
import importlib.util
import queue
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXIT_BAD_ARGUMENTS = 2
EXIT_INTERRUPTED = 130


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_ARGUMENTS)


def parsed_arguments(argv=None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a video model's config (conf/model/<model>.yaml)")
    parser.add_argument("--set", default="", help="infer_trt.py's overrides, quoted as one argument")
    parser.add_argument("--prompts", type=Path, help="a prompt a line (MLPerf's data/vbench_prompts.txt); default: "
                                                     "the model's evaluation prompts")
    parser.add_argument("--count", type=int, default=8, help="the first COUNT prompts, one query each")
    parser.add_argument("--latent", type=Path, help="the initial latent every video starts from (a torch file)")
    parser.add_argument("--seed", type=int, default=42, help="without --latent: the seed of the one latent drawn")
    parser.add_argument("--scenario", choices=("offline", "singlestream"), default="offline")
    parser.add_argument("--warm-steps", type=int, default=0,
                        help="the warm-up video's first WARM_STEPS steps alone, where what compiles does not depend "
                             "on the step count (0: the whole video)")
    parser.add_argument("--min-duration-s", type=float, default=0.0, help="each run's least duration (MLPerf's: 600)")
    parser.add_argument("--expected-video-s", type=float,
                        help="a video's seconds, from which LoadGen plans a --min-duration-s run (default: the warm-up "
                             "video's, which holds the compiling: too long where a duration asks for more videos)")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/mlperf_video_<model>_<scenario>_<gpu>.json")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count {args.count}: give how many prompts to run, 1 or more")
    if args.warm_steps < 0:
        parser.error(f"--warm-steps {args.warm_steps}: give a number of steps, or 0 for the whole video")
    if args.min_duration_s < 0:
        parser.error(f"--min-duration-s {args.min_duration_s}: give 0 or more seconds")
    if args.expected_video_s is not None and args.expected_video_s <= 0:
        parser.error(f"--expected-video-s {args.expected_video_s}: give a video's seconds, above 0")
    if importlib.util.find_spec("mlperf_loadgen") is None:
        parser.error("MLPerf's LoadGen is not installed: pip install -e \".[serve-load]\" (mlcommons-loadgen)")
    for option, path in (("--prompts", args.prompts), ("--latent", args.latent)):
        if path is not None and not path.is_file():
            parser.error(f"{option} {path}: no such file")
    return args


def chosen_prompts(args, model_config) -> list[str]:
    """The first --count prompts of --prompts, else of the model's evaluation prompts (the package's
    where it names none)."""
    from sdquant.errors import UserError
    from sdquant.load import builtin_prompts_path

    path = args.prompts or Path(model_config.eval_prompts or builtin_prompts_path("eval_prompts.txt")).expanduser()
    if not path.is_file():
        raise UserError(f"model.eval_prompts={path}: no such file; give --prompts")
    return first_prompts(path, args.count, "--count")


def first_prompts(path: Path, count: int, option: str) -> list[str]:
    """The first `count` non-empty lines of `path`; `option` names the count in the message where
    the file holds fewer."""
    from sdquant.errors import UserError

    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if len(prompts) < count:
        raise UserError(f"{option} {count}: {path} holds {len(prompts)} prompts")
    return prompts[:count]


def initial_latent(args, pipeline, settings):
    """The latent every video starts from: --latent's (checked against the run's shape), else one
    drawn from --seed; in the dtype and on the device the pipeline draws its own."""
    import torch

    from sdquant.errors import UserError

    shape = pipeline.flow.latent_shape(settings)
    if args.latent is None:
        return pipeline.flow.initial_latents(settings)
    try:
        latent = torch.load(args.latent, map_location="cpu", weights_only=True)
    except Exception as error:  # a file torch cannot read: one line, as any bad input
        raise UserError(f"--latent {args.latent}: not a tensor torch.load reads ({type(error).__name__})")
    if not isinstance(latent, torch.Tensor) or tuple(latent.shape) != tuple(shape):
        found = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
        raise UserError(f"--latent {args.latent} holds {found}; this run's videos start from {tuple(shape)} "
                         "(batch, channels, latent frames, height, width): give the latent of this geometry")
    return latent.to(pipeline.flow.device, pipeline.flow.latent_dtype)


class VideoSut:
    """LoadGen's system under test: queries queued as LoadGen issues them, each drawn in turn on the
    thread that built and warmed the pipeline (`answer_next`, LoadGen waiting on its own)."""

    def __init__(self, pipeline, settings: list, latent):
        self.pipeline, self.settings, self.latent = pipeline, settings, latent
        self.pending: queue.Queue = queue.Queue()
        self.videos: list[dict] = []

    def issue(self, samples) -> None:
        issued = time.perf_counter()
        for sample in samples:
            self.pending.put((sample.id, sample.index, issued))

    def answer_next(self) -> None:
        import mlperf_loadgen as lg
        import torch

        from harness.loadgen import POLL_S

        try:
            query_id, index, issued = self.pending.get(timeout=POLL_S)
        except queue.Empty:
            return
        started = time.perf_counter()
        samples = self.pipeline.run(self.settings[index], progress=False, latents=self.latent).samples
        done = time.perf_counter()
        self.videos.append({"prompt": index, "seconds": done - started, "since_issued_s": done - issued,
                            "nonfinite_values": int(samples.numel() - torch.isfinite(samples).sum()),
                            "checksum": float(samples.double().sum())})
        # One line a video: a run of many minutes shows where it is, and a log cut short keeps them.
        print(f"video {len(self.videos)}: prompt {index}, {done - started:.2f} s", flush=True)
        lg.QuerySamplesComplete([lg.QuerySampleResponse(query_id, 0, 0)])


def measured(args, pipeline, prompts: list[str], warm_up_steps: int = 0, **asked) -> dict:
    """The warm-up video (the first prompt's, or its first `warm_up_steps` steps where what compiles
    does not depend on the step count), then one LoadGen run of the scenario (args.scenario,
    .min_duration_s) over the prompts, each video from one latent (args.latent, else drawn from
    args.seed); `asked`: the calls' settings beside the pipeline's defaults (steps, guidance_scale, ...)."""
    from harness.loadgen import NS, loadgen_summary, test_settings
    from harness.measure import graphs_compiled

    settings = [pipeline.settle([prompt], seed=args.seed, **asked) for prompt in prompts]
    latent = initial_latent(args, pipeline, settings[0])
    warm_up = pipeline.settle(prompts[:1], seed=args.seed, **{**asked, "steps": warm_up_steps}) if warm_up_steps \
        else settings[0]
    start = time.perf_counter()
    pipeline.run(warm_up, progress=False, latents=latent)
    warm_up_s = time.perf_counter() - start
    sut = VideoSut(pipeline, settings, latent)
    compiled = graphs_compiled()
    # Offline issues max(count, expected rate x duration x 1.1) queries: the count, unless a
    # duration asks for more. SingleStream runs at least the count, one after the other.
    expected_s = args.expected_video_s or warm_up_s * settings[0].steps / warm_up.steps
    loadgen = test_settings(args.scenario, args.min_duration_s, len(prompts), expected_qps=1 / expected_s,
                            expected_latency_s=expected_s)
    summary = loadgen_summary(sut, loadgen, len(prompts), meanwhile=sut.answer_next)
    rate = summary.get("Samples per second")
    if args.scenario == "singlestream":
        rate = 1 / (summary["Mean latency (ns)"] / NS)
    return {"scenario": args.scenario, "videos": len(sut.videos), "prompts": len(prompts),
            "videos_per_s": rate, "gpu_s_per_video": 1 / rate if rate else None,
            "p50_s": summary.get("50.00 percentile latency (ns)", float("nan")) / NS,
            "p90_s": summary.get("90.00 percentile latency (ns)", float("nan")) / NS,
            "warm_up_video_s": warm_up_s, "warm_up_steps": warm_up.steps,
            "graphs_compiled_while_timed": graphs_compiled() - compiled,
            "nonfinite_values": sum(video["nonfinite_values"] for video in sut.videos),
            "latent": str(args.latent) if args.latent else f"drawn from seed {args.seed}",
            "loadgen": {key: summary[key] for key in ("Result is", "Min duration satisfied", "Min queries satisfied")
                        if key in summary},
            "per_video": sut.videos}


def main(argv=None) -> None:
    args = parsed_arguments(argv)
    from harness.headline import RESULTS, gpu_slug
    from harness.processes import write_results
    from harness.provenance import provenance

    from sdquant.api import INFER_CONFIG, build, compose
    from sdquant.cli import exits_cleanly
    from sdquant.config import settled_config
    from sdquant.errors import UserError
    from sdquant.families import family_of

    results = {"benchmark": "mlperf_video", "model": args.model, "overrides": args.set, **provenance(), "runs": []}
    out = args.out or RESULTS / f"mlperf_video_{args.model}_{args.scenario}_{gpu_slug(results['device'])}.json"

    def run(_):
        start = time.perf_counter()
        app = settled_config(compose(INFER_CONFIG, args.model, shlex.split(args.set)))
        if family_of(app.model.family).output != "video":
            raise UserError(f"--model {args.model} draws images: give a video model")
        prompts = chosen_prompts(args, app.model)
        with build(app) as pipeline:
            row = measured(args, pipeline, prompts, warm_up_steps=args.warm_steps)
        results["runs"].append(row)
        write_results(results, out)
        print(f"{args.scenario}: {row['videos']} videos, {row['videos_per_s']:.5f} videos/s, "
              f"{row['gpu_s_per_video']:.2f} GPU-s a video, p90 {row['p90_s']:.2f} s, "
              f"{row['graphs_compiled_while_timed']} graphs compiled while timed; wrote {out} in "
              f"{time.perf_counter() - start:.0f} s")

    exits_cleanly(run)(None)


if __name__ == "__main__":
    main()
