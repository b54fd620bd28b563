"""A family's headline results: one file per family and GPU
(benchmarks/results/headline_<family>_<gpu>.json) that holds what names the run (provenance) and,
per scenario row, its timed seconds, the graphs compiled while timed, its attention kernel and the
script's own row."""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

from .scenarios import Row, Scenario

RESULTS = Path(__file__).resolve().parents[1] / "results"


def gpu_slug(device: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu' for the CPU."""
    found = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", device)
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")


def headline_path(family: str, device: str) -> Path:
    return RESULTS / f"headline_{family}_{gpu_slug(device)}.json"


def started(scenario: Scenario, run: dict) -> dict:
    """A new headline file's content: the run's provenance, when it ran, no rows yet."""
    return {"family": scenario.family, "title": scenario.title, "date": datetime.date.today().isoformat(),
            **run, "rows": {}}


def picked(scenario: Scenario, row: Row, results: dict) -> dict:
    """`row`'s entry, from the script's results file: the figures the tables read, beside the
    script's whole row."""
    found = results.get("variants", {}).get(row.variant)
    if found is None:
        # Result files from before the rows pinned their attention kernel name them without it.
        found = results.get("variants", {}).get(row.variant.removesuffix(f"_{row.attention}"))
    if found is None or "error" in found:
        why = found["error"] if found else f"no row {row.variant!r} in the script's results"
        return {"label": row.label, "side": row.side, "error": why}
    seconds = found
    for key in scenario.seconds_key:
        seconds = seconds[key]
    timed_part = found
    for key in scenario.seconds_key[:-1]:
        timed_part = timed_part[key]
    return {"label": row.label, "side": row.side, "seconds": seconds,
            "attention_kernel": found.get("attention_kernel", row.attention),
            "graphs_compiled_while_timed": timed_part.get("graphs_compiled_while_timed"),
            "needs": row.needs, "script_versions": results.get("versions"), "row": found}


def write(path: Path, headline: dict) -> None:
    """Writes `headline` under a temporary name, then renames it: a stopped run leaves the last
    complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(headline, indent=2) + "\n")
    os.replace(temporary, path)
