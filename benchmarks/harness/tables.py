"""The README's headline tables, written from the headline files: one table per family, its rows
against the peer of the same run, the quality of each setting beside it, and a line naming the run
(GPU, driver, code, file)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .headline import RESULTS
from .scenarios import SCENARIOS, Quality, Scenario

REPO = RESULTS.parents[1]


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
    return (f"{figure['mean']:.1f}% ({figure['low']:.1f}-{figure['high']:.1f}), "
            f"{figure['mean'] - reference:+.1f} points")


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
        rate_cell = f" | {scenario.per_call / seconds:.3f}" if scenario.rate else ""
        against = "-" if peer is None or row.side == "peer" else f"{peer / seconds:.2f}x"
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
    found = sorted(RESULTS.glob(f"headline_{family}_*.json"),
                   key=lambda path: (json.loads(path.read_text()).get("date", ""),
                                     json.loads(path.read_text()).get("code") is not None))
    if not found:
        return None
    return json.loads(found[-1].read_text()), found[-1].relative_to(REPO).as_posix()


def tables() -> dict[str, str]:
    """Each family's table, for the families that have a headline file."""
    made = {}
    for family, scenario in SCENARIOS.items():
        newest = newest_headline(family)
        if newest:
            made[family] = table(scenario, *newest)
    return made


def marker(family: str) -> tuple[str, str]:
    return f"<!-- headline:{family} -->", f"<!-- /headline:{family} -->"


def written_into(text: str, made: dict[str, str]) -> str:
    """`text` with each family's table between its markers; the markers of a family without a
    table are left as they are."""
    for family, body in made.items():
        start, end = marker(family)
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
        if not pattern.search(text):
            continue
        text = pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)
    return text


def write_readme(readme: Path) -> list[str]:
    """Writes the tables into `readme` (a temporary file renamed); the families written."""
    text = readme.read_text()
    made = tables()
    updated = written_into(text, made)
    temporary = readme.with_name(readme.name + ".tmp")
    temporary.write_text(updated)
    os.replace(temporary, readme)
    return [family for family in made if marker(family)[0] in text]
