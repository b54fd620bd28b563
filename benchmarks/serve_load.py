"""Load on serve.py's image route, measured as MLPerf measures it: LoadGen issues the queries (Offline:
all at once; Server: Poisson arrivals at a target rate), each query one prompt sent as one HTTP
request, and the result is the rate, the latency percentiles, the failed queries and the server's
batch sizes over the run. Durations are shortened from MLPerf's minimums: no official MLPerf run.

    python benchmarks/serve_load.py --scenario offline --serve "model=sdxl_base backend=torch ..."
    python benchmarks/serve_load.py --scenario server --search --url http://127.0.0.1:8000 --model sdxl_base
    python benchmarks/serve_load.py --scenario server --target-qps 2 --url http://127.0.0.1:8000 --model sdxl_base
    python benchmarks/serve_load.py --scenario server --target-share 0.8 --url http://127.0.0.1:8000 --model flux_dev

Each query is one image of a prompt of --prompts (a line each), seeded --seed + the sample's index,
at the server's default size and steps unless --size and --steps say otherwise. Requests go out
from an asyncio client at most --max-in-flight at a time; queries past that wait in the client,
which LoadGen counts in their latency. A refused or failed request (a 503 among them) is a failed
query: completed to LoadGen, counted in the results, never sent again. A Server rate holds where
LoadGen's p99 latency is within --latency-bound-s and no query failed; --search bisects between
--search-low (half by default) of the Offline rate and the Offline rate (--offline-qps, or an
Offline run first).

With --serve, serve.py is started with those overrides, waited for (GET /health) and stopped with
SIGINT at the end, on an error and on Ctrl-C alike. After each run GET /metrics gives the calls'
image counts and the seconds of each stage, as differences across the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.headline import RESULTS, gpu_slug
from harness.loadgen import MLPERF_MIN_DURATION_S, NS, POLL_S, loadgen_summary, test_settings
from harness.processes import write_results
from harness.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "sdquant" / "data" / "eval_prompts.txt"
EXIT_BAD_ARGUMENTS = 2
EXIT_INTERRUPTED = 130
# MLPerf SDXL's Server latency bound.
MLPERF_LATENCY_BOUND_S = 20
ROUTE = "/v1/images/generations"
# serve.py drains for serve.drain_timeout_s (60 by default) after SIGINT; then Serve and Ray stop.
STOP_TIMEOUT_S = 150


class Refused(Exception):
    """What stops the benchmark before it measures: one line for the user."""


@dataclass
class Answer:
    sample_index: int
    status: int | str
    seconds: float


@dataclass
class RunRecord:
    """One LoadGen run's queries as the client saw them."""

    answers: list[Answer] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, answer: Answer) -> None:
        with self.lock:
            self.answers.append(answer)


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile, as LoadGen takes it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_ARGUMENTS)


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value

    return parse


def parsed_arguments(argv=None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("offline", "server"), required=True)
    parser.add_argument("--target-qps", type=positive(float), help="server: one Poisson run at this rate")
    parser.add_argument("--target-share", type=positive(float),
                        help="server: one Poisson run at this share of the Offline rate (an Offline run first, "
                             "or --offline-qps), e.g. 0.8 where a model has no latency bound")
    parser.add_argument("--search", action="store_true",
                        help="server: the largest rate that holds, bisected between --search-low x and 1x the "
                             "Offline rate")
    parser.add_argument("--search-low", type=positive(float), default=0.5,
                        help="search: the low end as a share of the Offline rate (below 1): a share that surely "
                             "holds costs a run; one close to the target finds it in fewer")
    parser.add_argument("--search-steps", type=int, default=3, help="bisections after the two ends")
    parser.add_argument("--offline-qps", type=positive(float),
                        help="--search, --target-share: this Offline rate instead of a run")
    parser.add_argument("--latency-bound-s", type=positive(float), default=MLPERF_LATENCY_BOUND_S)
    parser.add_argument("--min-duration-s", type=positive(float), default=120,
                        help=f"each run's least duration (MLPerf's: {MLPERF_MIN_DURATION_S})")
    parser.add_argument("--min-queries", type=positive(int), default=64, help="each run's least query count")
    parser.add_argument("--expected-qps", type=positive(float), default=2.5,
                        help="offline: LoadGen issues max(--min-queries, this x --min-duration-s x 1.1) queries")
    parser.add_argument("--url", help="a running server, http://host:port")
    parser.add_argument("--serve", help="serve.py's overrides, quoted as one argument: started and stopped here")
    parser.add_argument("--start-timeout-s", type=positive(float), default=1800,
                        help="--serve: how long the server may take to report healthy")
    parser.add_argument("--api-key", help="with --serve, serve.api_key= is taken where this is not given")
    parser.add_argument("--model", help="the served model's name: sent with each request and naming the results")
    parser.add_argument("--prompts", type=Path, default=PROMPTS, help="a prompt per line")
    parser.add_argument("--size", help="WxH; the server's default where not given")
    parser.add_argument("--steps", type=positive(int), help="the server's default where not given")
    parser.add_argument("--seed", type=int, default=0, help="sample i is seeded seed + i")
    parser.add_argument("--max-in-flight", type=positive(int), default=64,
                        help="requests out at once; keep it within what the server holds (serve.max_queued_requests "
                             "+ replicas x serve.max_batch_size) or the rest are refused with 503")
    parser.add_argument("--request-timeout-s", type=positive(float), default=600)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/serve_<model>_<scenario>_<gpu>.json")
    args = parser.parse_args(argv)
    try:
        settled(args)
    except Refused as error:
        parser.error(str(error))
    return args


def settled(args: argparse.Namespace) -> None:
    """The arguments checked against each other, and what --serve's overrides say filled in."""
    if (args.url is None) == (args.serve is None):
        raise Refused("give one of --url (a running server) and --serve (serve.py's overrides)")
    ways = [way for way, given in (("--target-qps", args.target_qps), ("--target-share", args.target_share),
                                   ("--search", args.search)) if given]
    if args.scenario == "server" and len(ways) != 1:
        raise Refused("--scenario server takes one of --target-qps Q, --target-share S and --search")
    if args.scenario == "offline" and ways:
        raise Refused(f"{ways[0]} is for --scenario server")
    if args.search_low >= 1:
        raise Refused(f"--search-low {args.search_low:g} is a share of the Offline rate: give one below 1")
    if args.size is not None and not re.fullmatch(r"\d+x\d+", args.size):
        raise Refused(f"--size {args.size} is not WxH, such as 1024x1024")
    if not args.prompts.is_file() or not prompts_of(args.prompts):
        raise Refused(f"--prompts {args.prompts} is no file with a prompt a line")
    overrides = overrides_of(args.serve or "")
    args.model = args.model or overrides.get("model")
    args.api_key = args.api_key or overrides.get("serve.api_key")
    if args.out is None and args.model is None:
        raise Refused("name the results: --model (the served model's name) or --out")


def overrides_of(serve: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(serve) if "=" in item)


def prompts_of(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def request_bodies(args) -> list[dict]:
    """The request of each sample index: its prompt and seed, and the size, steps and model asked for."""
    extra = {key: value for key, value in (("size", args.size), ("steps", args.steps), ("model", args.model))
             if value is not None}
    return [{"prompt": prompt, "seed": args.seed + index, "n": 1, **extra}
            for index, prompt in enumerate(prompts_of(args.prompts))]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def server_for(args):
    """The base URL to measure: --url as given, or serve.py started with --serve's overrides (on a
    free port where they name none) and stopped when the block ends, however it ends."""
    if args.url:
        yield args.url.rstrip("/")
        return
    overrides = shlex.split(args.serve)
    given = overrides_of(args.serve)
    if "serve.port" not in given:
        given["serve.port"] = str(free_port())
        overrides.append(f"serve.port={given['serve.port']}")
    host = given.get("serve.host", "127.0.0.1")
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{given['serve.port']}"
    log = tempfile.NamedTemporaryFile("w", prefix="serve_load_server_", suffix=".log", delete=False)
    print(f"starting serve.py (its output: {log.name})", flush=True)
    # A session of its own: a terminal's Ctrl-C reaches this script alone, which then stops the server.
    # SIGINT restored: started in the background (nohup, `&`), this script ignores it, and so would serve.py.
    process = subprocess.Popen([sys.executable, str(REPO / "serve.py"), *overrides], cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_until_healthy(url, process, args.start_timeout_s, log.name)
        yield url
    finally:
        stop(process)
        log.close()


def wait_until_healthy(url: str, process: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise Refused(f"serve.py exited with {process.returncode} before it was healthy: {last_line(log_path)}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(POLL_S)
    raise Refused(f"serve.py was not healthy within --start-timeout-s={timeout_s:g} (its output: {log_path})")


def last_line(path: str) -> str:
    lines = Path(path).read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(no output)"


def stop(process: subprocess.Popen) -> None:
    """serve.py stopped as a terminal's Ctrl-C stops it (SIGINT to its group: Ray's processes too),
    killed where it has not exited within STOP_TIMEOUT_S."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class HttpSut:
    """LoadGen's system under test: each query sent as one request from an asyncio loop on a thread
    of its own, so that LoadGen's issue thread only hands queries over and never waits on the server."""

    def __init__(self, url: str, headers: dict, bodies: list[dict], max_in_flight: int, timeout_s: float):
        self.bodies = bodies
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=max_in_flight))
        self.slots = asyncio.Semaphore(max_in_flight)
        self.record = RunRecord()

    def issue(self, samples) -> None:
        issued = time.perf_counter()
        for sample in samples:
            asyncio.run_coroutine_threadsafe(self.answer(sample.id, sample.index, issued), self.loop)

    async def answer(self, query_id: int, sample_index: int, issued: float) -> None:
        import mlperf_loadgen as lg

        status: int | str = "unanswered"
        try:
            status = await self.status_of(sample_index)
        except Exception as error:  # an answer that cannot be read is a failed query, never a lost one
            status = type(error).__name__
        finally:
            self.record.add(Answer(sample_index, status, time.perf_counter() - issued))
            lg.QuerySamplesComplete([lg.QuerySampleResponse(query_id, 0, 0)])

    async def status_of(self, sample_index: int) -> int | str:
        """The HTTP status of the sample's request (200 only with its one image), or the name of the
        error that stopped it."""
        async with self.slots:
            try:
                response = await self.client.post(ROUTE, json=self.bodies[sample_index])
            except httpx.HTTPError as error:
                return type(error).__name__
        if response.status_code == 200 and len(response.json().get("data", [])) != 1:
            return "not one image"
        return response.status_code

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.aclose(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def loadgen_settings(args, scenario: str, target_qps: float | None):
    return test_settings(scenario, args.min_duration_s, args.min_queries, expected_qps=args.expected_qps,
                         target_qps=target_qps, latency_bound_s=args.latency_bound_s)


def metric_samples(client: httpx.Client) -> dict[tuple, float]:
    """GET /metrics as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def server_side(before: dict, after: dict) -> dict:
    """What the server's metrics say of a run: the requests drawn in calls of each image count, the
    calls of each count, the mean seconds of each stage of a request, and the refusals by reason."""
    change = {key: value - before.get(key, 0.0) for key, value in after.items()}
    requests_by_images = call_sizes(change)
    stages = {}
    for (name, labels), seconds in change.items():
        count = change.get(("sdquant_serve_stage_seconds_count", labels), 0)
        if name == "sdquant_serve_stage_seconds_sum" and count:
            stages[dict(labels)["stage"]] = {"requests": round(count), "mean_s": seconds / count}
    refused = {dict(labels)["reason"]: round(value) for (name, labels), value in change.items()
               if name == "sdquant_serve_requests_refused_total" and value}
    # Each query is one image: a call of k images drew k of them.
    calls = {images: round(requests / images, 3) for images, requests in requests_by_images.items()}
    return {"requests_by_call_images": requests_by_images, "calls_by_images": calls, "stage_seconds": stages,
            "refused": refused}


def call_sizes(change: dict) -> dict[int, int]:
    """The batch-size histogram's cumulative buckets as requests per call image count, those with any."""
    cumulative = sorted((float(dict(labels)["le"]), value) for (name, labels), value in change.items()
                        if name == "sdquant_serve_batch_images_bucket" and dict(labels)["le"] != "+Inf")
    sizes, below = {}, 0.0
    for images, up_to in cumulative:
        if up_to - below:
            sizes[int(images)] = round(up_to - below)
        below = up_to
    return sizes


class Bench:
    """The server under measure and the queries' bodies; each run one LoadGen test."""

    def __init__(self, args, url: str):
        self.args = args
        self.url = url
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.bodies = request_bodies(args)
        self.metrics = httpx.Client(base_url=url, timeout=30)

    def check_answers(self) -> None:
        """One request before any run, so that a wrong key, model or size ends here in one line."""
        response = httpx.post(f"{self.url}{ROUTE}", json=self.bodies[0], headers=self.headers,
                              timeout=self.args.request_timeout_s)
        if response.status_code != 200:
            raise Refused(f"{self.url}{ROUTE} answered the first prompt with {response.status_code}: "
                          f"{response.text[:300]}")

    def run(self, scenario: str, target_qps: float | None = None) -> dict:
        args = self.args
        sut = HttpSut(self.url, self.headers, self.bodies, args.max_in_flight, args.request_timeout_s)
        before = metric_samples(self.metrics)
        started = time.perf_counter()
        try:
            summary = loadgen_summary(sut, loadgen_settings(args, scenario, target_qps), len(self.bodies))
        finally:
            sut.close()
        row = run_row(scenario, target_qps, summary, sut.record, time.perf_counter() - started, args.latency_bound_s)
        row["server"] = server_side(before, metric_samples(self.metrics))
        print(row_line(row), flush=True)
        return row


def run_row(scenario: str, target_qps, summary: dict, record: RunRecord, seconds: float, bound_s: float) -> dict:
    answered = [answer.seconds for answer in record.answers if answer.status == 200]
    failures: dict[str, int] = {}
    for answer in record.answers:
        if answer.status != 200:
            failures[str(answer.status)] = failures.get(str(answer.status), 0) + 1
    latency = {f"p{share}": summary.get(f"{share}.00 percentile latency (ns)", float("nan")) / NS
               for share in (50, 90, 99)}
    rate = summary.get("Samples per second", summary.get("Completed samples per second"))
    row = {"scenario": scenario, "target_qps": target_qps, "seconds": seconds, "queries": len(record.answers),
           "answered": len(answered), "failed": sum(failures.values()), "failures": failures, "rate_qps": rate,
           "latency_s": latency,
           "client_latency_s": {"min": min(answered), "max": max(answered),
                                "p50": percentile(answered, 0.5), "p99": percentile(answered, 0.99)}
           if answered else None,
           "loadgen_result": summary.get("Result is"), "loadgen": summary}
    if scenario == "server":
        row["p99_within_bound"] = latency["p99"] <= bound_s
        row["holds"] = row["p99_within_bound"] and not row["failed"]
    return row


def row_line(row: dict) -> str:
    rate = "no rate" if row["rate_qps"] is None else f"{row['rate_qps']:.3g} queries/s"
    line = f"{row['scenario']}: {row['answered']} of {row['queries']} answered, {rate}"
    if row["scenario"] == "server":
        line = (f"{row['scenario']} at {row['target_qps']:.3g} queries/s: {row['answered']} of {row['queries']} "
                f"answered, p50 {row['latency_s']['p50']:.2f} s, p99 {row['latency_s']['p99']:.2f} s "
                f"({'holds' if row['holds'] else 'does not hold'})")
    return line


def searched(measure_at, low: float, high: float, steps: int) -> tuple[float | None, list[dict]]:
    """The largest rate in [low, high] that holds, to `steps` bisections: the high end first (a
    server rarely beats its Offline rate), then the low end, then halving the interval between."""
    rows = []

    def holds(qps: float) -> bool:
        rows.append(measure_at(qps))
        return rows[-1]["holds"]

    if holds(high):
        return high, rows
    if not holds(low):
        return None, rows
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low, rows


def measured(args, url: str, keep) -> dict:
    """The runs the arguments ask for, the results so far handed to `keep` after each run (a machine
    lost in a long search leaves its finished runs), and the results, finished."""
    bench = Bench(args, url)
    bench.check_answers()
    results = {"benchmark": "serve_load", "model": args.model, "scenario": args.scenario, "finished": False,
               "official_mlperf_run": False,
               "shortened": f"each run at least {args.min_duration_s:g} s and {args.min_queries} queries; MLPerf's "
                            f"runs last at least {MLPERF_MIN_DURATION_S} s and need far more queries",
               "settings": settings_of(args), "runs": []}

    def run(scenario: str, target_qps: float | None = None) -> dict:
        results["runs"].append(bench.run(scenario, target_qps))
        keep(results)
        return results["runs"][-1]

    if args.scenario == "offline" or ((args.search or args.target_share) and args.offline_qps is None):
        offline = run("offline")
        if offline["failed"] or offline["rate_qps"] is None:
            # Refused queries end fast and would count as throughput.
            raise Refused(f"the Offline run failed {offline['failed']} of {offline['queries']} queries "
                          f"({offline['failures']}): no rate to report or search from")
        results["offline_images_per_s"] = offline["rate_qps"]
    if args.scenario == "server" and args.search:
        offline_qps = args.offline_qps or results["offline_images_per_s"]
        best, _ = searched(lambda qps: run("server", qps), args.search_low * offline_qps, offline_qps,
                           args.search_steps)
        results["server_largest_qps_within_bound"] = best
    elif args.scenario == "server":
        target = args.target_qps or args.target_share * (args.offline_qps or results["offline_images_per_s"])
        results["server_qps_holds"] = run("server", target)["holds"]
    results["finished"] = True
    return results


def settings_of(args) -> dict:
    kept = ("scenario", "target_qps", "target_share", "search", "search_low", "search_steps", "offline_qps",
            "latency_bound_s", "min_duration_s", "min_queries", "expected_qps", "url", "serve", "model", "size",
            "steps", "seed", "max_in_flight", "request_timeout_s")
    return {"prompts": str(args.prompts), "prompt_count": len(prompts_of(args.prompts)),
            **{name: getattr(args, name) for name in kept}}


def main(argv=None) -> None:
    args = parsed_arguments(argv)
    started = time.monotonic()
    machine = provenance()
    out = args.out or RESULTS / f"serve_{args.model}_{args.scenario}_{gpu_slug(machine['device'])}.json"
    kept_runs = []

    def keep(results: dict) -> None:
        write_results({**results, "seconds": time.monotonic() - started, "provenance": machine}, out)
        kept_runs[:] = results["runs"]

    try:
        with server_for(args) as url:
            results = measured(args, url, keep)
    except KeyboardInterrupt:
        kept = f"its {len(kept_runs)} finished run(s) are in {out} (finished: false)" if kept_runs else \
            "no run had finished"
        print(f"serve_load: stopped by Ctrl-C (the server stopped); {kept}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # LoadGen's test thread cannot be cancelled, and would keep issuing queries to a stopped server.
        os._exit(EXIT_INTERRUPTED)
    except Refused as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    keep(results)
    print(f"wrote {out} in {time.monotonic() - started:.0f} s: {final_line(results)}", flush=True)


def final_line(results: dict) -> str:
    if "server_largest_qps_within_bound" in results:
        best = results["server_largest_qps_within_bound"]
        return ("no rate held" if best is None else f"{best:.3g} queries/s held") + \
            f" p99 <= {results['settings']['latency_bound_s']:g} s"
    return row_line(results["runs"][-1])


if __name__ == "__main__":
    main()
