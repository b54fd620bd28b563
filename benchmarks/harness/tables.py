"""The headline tables, written from the headline files into the documents that hold their markers
(the README: a table per family and the serving one; docs/models.md: the Wan video's, TI2V-5B's
and the window's): one table per family, its rows against the peer of the same run, the quality of
each setting beside it, and a line naming the run (GPU, driver, code, file); and the serving table,
a row per served model from its serve_load.py Server results, with a line naming each file's run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .headline import RESULTS
from .loadgen import MLPERF_MIN_DURATION_S
from .scenarios import SCENARIOS, SERVING, Quality, Scenario, Served

REPO = RESULTS.parents[1]
# The documents whose markers the tables go between, from the repository's root.
DOCUMENTS = ("README.md", "docs/models.md")


def quality_cell(quality: Quality | None) -> str:
    """A setting's figure: the mean over calibrations with its lowest and highest, and its points
    against the unquantized model; the reference's own figure for an unquantized row."""
    if quality is None:
        return "-"
    summary = json.loads((REPO / quality.summary).read_text())
    reference = summary["unquantized"][quality.judged]
    if quality.setting is None:
        return f"{reference:.1f}% (unquantized)"
    figure = summary["settings"][quality.setting][quality.judged]
    # An unquantized setting (a cache alone) has no calibration to vary: one run, no range.
    spread = (f"({figure['low']:.1f}-{figure['high']:.1f})" if len(figure["values"]) > 1
              else "(one run: nothing calibrated)")
    return f"{figure['mean']:.1f}% {spread}, {figure['mean'] - reference:+.1f} points"


def table(scenario: Scenario, headline: dict, source: str) -> str:
    rows = headline["rows"]
    peer = rows.get("peer", {}).get("seconds")
    rate = f" | {scenario.rate}/s" if scenario.rate else ""
    lines = [f"| {scenario.title} | {scenario.unit}{rate} | against the peer | attention | needs | quality: "
             f"{quality_judged(scenario)} |",
             "| --- | --- | --- | --- | --- | --- |" + (" --- |" if scenario.rate else "")]
    for row in scenario.rows:
        entry = rows.get(row.key)
        if entry is None or "seconds" not in entry:
            continue
        seconds = entry["seconds"]
        # Significant figures, not decimals: a video's rate is a few thousandths of one a second.
        rate_cell = f" | {scenario.per_call / seconds:.3g}" if scenario.rate else ""
        # A second peer (torchao's FP8 on the first) has its ratio against the first too, so that our
        # 8-bit row's ratio stands beside what their 8 bits buy.
        against = "-" if peer is None or row.key == "peer" else f"{peer / seconds:.2f}x"
        lines.append(f"| {row.label} | {seconds:.3f}{rate_cell} | {against} | {entry['attention_kernel']} | "
                     f"{row.needs or '-'} | {quality_cell(row.quality)} |")
    lines += ["", run_line(headline, source)]
    return "\n".join(lines)


def quality_judged(scenario: Scenario) -> str:
    judged = {row.quality.judged for row in scenario.rows if row.quality}
    return (f"scene model, {', '.join(sorted(judged))} right, mean of 3 calibrations (range)" if judged
            else "no scene model")


def run_line(headline: dict, source: str) -> str:
    """What names the run: its GPU and driver, its code, its file, and how warm it was."""
    compiled = [entry.get("graphs_compiled_while_timed") for entry in headline["rows"].values() if "seconds" in entry]
    warm = ("graphs compiled while timed: not recorded" if all(n is None for n in compiled) else
            "graphs compiled while timed: " + ", ".join("?" if n is None else str(n) for n in compiled))
    code = (code_named(headline) if headline.get("code") else
            f"code not recorded (measured before the harness, adopted from {headline['adopted_from']})")
    # Rows run side by side on GPUs of one host (run_all.py --lanes) name their GPU.
    gpus = {entry.get("gpu") for entry in headline["rows"].values() if "seconds" in entry}
    place = f"one {headline['device']}" if len(gpus) < 2 else f"{len(gpus)} {headline['device']} GPUs of one host"
    each = "each row its own process" + (" on a GPU of its own" if len(gpus) > 1 else "")
    return f"*One run on {place}{driver_and_torch(headline)}, {each}; {code}; {warm}; `{source}`.*"


def code_named(run: dict) -> str:
    """The code a run's provenance names: its digest, and its commit where that says what ran."""
    # A commit with changes on top, or a GPU machine's stale copy of the history, names nothing.
    clean = run.get("commit") and not run["commit"].endswith("+changes")
    return f"code {run['code']}" + (f" (commit {run['commit'][:12]})" if clean else "")


def driver_and_torch(run: dict) -> str:
    """', driver D, torch T' from a run's provenance; the driver left out where none was read."""
    driver = f", driver {run['driver']}" if run.get("driver") else ""
    return f"{driver}, torch {(run.get('versions') or {}).get('torch', '?')}"


def newest_headline(family: str) -> tuple[dict, str] | None:
    """The family's newest headline file (by its date, then the code's), and its path from the
    repository's root."""
    runs = [(json.loads(path.read_text()), path) for path in RESULTS.glob(f"headline_{family}_*.json")]
    # One family's name can begin another's (wan, wan_ti2v): each file names its own.
    runs = sorted(((run, path) for run, path in runs if run.get("family") == family),
                  key=lambda found: (found[0].get("date", ""), found[0].get("code") is not None))
    if not runs:
        return None
    run, path = runs[-1]
    return run, path.relative_to(REPO).as_posix()


SERVING_HEADER = ("| served model, setting | Offline images/s | Server queries/s | p50 / p99 s at that rate | "
                  "images a call, mean | MLPerf reference, Server queries/s |")


def serving_table(served: dict[str, tuple[dict, str]]) -> str:
    """A row per served model, then a line per machine and code naming its results files."""
    lines = [SERVING_HEADER, "| --- | --- | --- | --- | --- | --- |"]
    lines += [serving_row(SERVING[model], results) for model, (results, _) in served.items()]
    for line in serving_lines(served):
        # A blank line between: consecutive lines would run into one paragraph.
        lines += ["", line]
    return "\n".join(lines)


def serving_row(served: Served, results: dict) -> str:
    run = reported_run(results)
    latency = "-" if run is None else f"{run['latency_s']['p50']:.2f} / {run['latency_s']['p99']:.2f}"
    images = "-" if run is None else mean_call_images(run["server"]["requests_by_call_images"])
    return (f"| {served.title} | {offline_cell(results)} | {server_cell(results, run)} | {latency} | {images} | "
            f"{served.reference or '-'} |")


def reported_run(results: dict) -> dict | None:
    """The Server run at the rate the table reports: the search's answer (None where no rate held),
    or the one run at a set rate."""
    servers = [run for run in results["runs"] if run["scenario"] == "server"]
    if "server_largest_qps_within_bound" in results:
        best = results["server_largest_qps_within_bound"]
        # The search returns one of the rates it ran, the very float.
        return next((run for run in servers if run["target_qps"] == best), None)
    return servers[-1]


def server_cell(results: dict, run: dict | None) -> str:
    """The Server rate and what it answers to: the bound a search held, or the share of the Offline
    rate a set rate was."""
    bound = f"p99 <= {results['settings']['latency_bound_s']:g} s"
    if "server_largest_qps_within_bound" in results:
        return f"none held ({bound})" if run is None else f"{run['target_qps']:.2f} ({bound})"
    share = results["settings"]["target_share"]
    at = f" at {share:.0%} of Offline" if share else ""
    failed = f", {run['failed']} of {run['queries']} queries failed" if run["failed"] else ""
    return f"{run['target_qps']:.2f}{at}, no MLPerf bound{failed}"


def offline_cell(results: dict) -> str:
    """The Offline rate measured with the Server runs, else the one given to them (--offline-qps)."""
    measured = results.get("offline_images_per_s")
    if measured is not None:
        return f"{measured:.2f}"
    given = results["settings"]["offline_qps"]
    return "-" if given is None else f"{given:.2f} (--offline-qps)"


def mean_call_images(requests_by_call_images: dict[str, int]) -> str:
    """The images of a call, a mean over the calls: each query is one image, so a call of k images
    drew k requests."""
    requests = sum(requests_by_call_images.values())
    calls = sum(count / int(images) for images, count in requests_by_call_images.items())
    return f"{requests / calls:.1f}" if calls else "-"


def serving_lines(served: dict[str, tuple[dict, str]]) -> list[str]:
    """What names the runs: one line for the files of one machine, code and run length (each model
    served alone, one after another), naming them."""
    files_of: dict[str, list[str]] = {}
    for results, source in served.values():
        machine = results["provenance"]
        run = (f"one {machine['device']}{driver_and_torch(machine)}; {code_named(machine)}; each LoadGen run "
               f"at least {results['settings']['min_duration_s']:g} s (MLPerf's: {MLPERF_MIN_DURATION_S} s)")
        files_of.setdefault(run, []).append(f"`{source}`")
    return [f"*Each model its own server on {run}; {', '.join(files)}.*" for run, files in files_of.items()]


def served_results() -> dict[str, tuple[dict, str]]:
    """Each served model's finished Server results file and its path from the repository's root; of
    several (a file per GPU), the last by name, so that any checkout picks the same."""
    served = {}
    for model in SERVING:
        found = [(json.loads(path.read_text()), path.relative_to(REPO).as_posix())
                 for path in sorted(RESULTS.glob(f"serve_{model}_server_*.json"))]
        # A file is written after each run: one stopped half way says finished: false.
        finished = [each for each in found if each[0]["finished"]]
        if finished:
            served[model] = finished[-1]
    return served


def tables() -> dict[str, str]:
    """Each family's table, for the families that have a headline file, and the serving table
    where a served model has a finished results file."""
    made = {}
    for family, scenario in SCENARIOS.items():
        newest = newest_headline(family)
        if newest:
            made[family] = table(scenario, *newest)
    served = served_results()
    if served:
        made["serving"] = serving_table(served)
    return made


def marker(family: str) -> tuple[str, str]:
    return f"<!-- headline:{family} -->", f"<!-- /headline:{family} -->"


def written_into(text: str, made: dict[str, str]) -> str:
    """`text` with each table between its markers; the markers of a table not made (no results
    file) are left as they are."""
    for family, body in made.items():
        start, end = marker(family)
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
        if not pattern.search(text):
            continue
        text = pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)
    return text


def write_document(document: Path, made: dict[str, str]) -> list[str]:
    """Writes the tables `made` into `document` (a temporary file renamed); the tables written."""
    text = document.read_text()
    updated = written_into(text, made)
    temporary = document.with_name(document.name + ".tmp")
    temporary.write_text(updated)
    os.replace(temporary, document)
    return [family for family in made if marker(family)[0] in text]
