"""Runs a family's headline rows (benchmarks/harness/scenarios.py) in one run on one GPU, each row
in a process of its own, warm (each row counts the graphs compiled while timed), and writes
benchmarks/results/headline_<family>_<gpu>.json, from which benchmarks/write_tables.py writes the
family's table in README.md or docs/models.md.

    python benchmarks/run_all.py --family sdxl
    python benchmarks/run_all.py --family wan --rows peer,ours_fp8     # some rows, into the same file
    python benchmarks/run_all.py --family flux --adopt benchmarks/results/flux_modulations_h100.json
    python benchmarks/run_all.py --family wan_video --lanes 4    # a host of 4 GPUs: a row a GPU at a time

--adopt builds the headline file from one earlier results file of the family's script (one run,
from before this harness): its rows keep that file's device and versions, and the headline says
that the code was not recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from harness.headline import headline_path, picked, started, write
from harness.provenance import provenance
from harness.scenarios import Scenario, scenario

BENCHMARKS = Path(__file__).resolve().parent


def run_row(scenario: Scenario, key: str, folder: Path, extra: list[str], timeout: float, gpu: str | None) -> dict:
    """One row in a process of its own (on GPU `gpu` alone where given); its entry, or the reason
    it has none."""
    row = scenario.row(key)
    out = folder / f"{key}.json"
    command = [sys.executable, str(BENCHMARKS / scenario.script), *scenario.common, *row.args, *extra,
               "--out", str(out)]
    print(f"{key}{f' (GPU {gpu})' if gpu is not None else ''}: {' '.join(command[1:])}", flush=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
    try:
        code = subprocess.run(command, timeout=timeout or None, env=env).returncode
    except subprocess.TimeoutExpired:
        return {"label": row.label, "side": row.side, "error": f"stopped after {timeout:g} s"}
    if not out.is_file():
        return {"label": row.label, "side": row.side, "error": f"its process exited {code} without a row"}
    entry = picked(scenario, row, json.loads(out.read_text()))
    return entry if gpu is None else {**entry, "gpu": gpu}


def lane_gpus(lanes: int) -> list[str] | None:
    """The GPU of each lane (None: one lane, the GPUs as they are): the first `lanes` of those
    CUDA_VISIBLE_DEVICES names, else of the host's; None where there are fewer. Without a GPU
    (--tiny) lanes are processes side by side."""
    import torch

    if lanes == 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    host = torch.cuda.device_count() if torch.cuda.is_available() else lanes
    gpus = visible.split(",") if visible else [str(index) for index in range(host)]
    return gpus[:lanes] if len(gpus) >= lanes else None


def run_rows(scenario: Scenario, keys: list[str], gpus: list[str] | None, record, **how) -> None:
    """The rows, one process at a time on each lane's GPU, each recorded as it ends: rows on
    several GPUs of one host take the time of the longest lane, not of all rows."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    for gpu in gpus or [None]:
        free.put(gpu)

    def on_a_free_gpu(key: str) -> dict:
        gpu = free.get()
        try:
            return run_row(scenario, key, gpu=gpu, **how)
        finally:
            free.put(gpu)

    with ThreadPoolExecutor(len(gpus or [None])) as lanes:
        running = {lanes.submit(on_a_free_gpu, key): key for key in keys}
        for done in as_completed(running):
            record(running[done], done.result())


def adopted(scenario: Scenario, source: Path) -> dict:
    """The headline of one earlier results file of the family's script."""
    results = json.loads(source.read_text())
    headline = started(scenario, {"code": None, "commit": None, "adopted_from": source.name,
                                  "device": results["device"], "driver": None, "versions": results.get("versions")})
    for row in scenario.rows:
        entry = picked(scenario, row, results)
        if "error" not in entry:
            headline["rows"][row.key] = entry
    return headline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True)
    parser.add_argument("--rows", default="", help="comma-separated row keys (default: all the family's rows)")
    parser.add_argument("--row-timeout", type=float, default=0, help="seconds after which a row's process is stopped")
    parser.add_argument("--adopt", type=Path, help="build the headline from this earlier results file instead")
    parser.add_argument("--out", type=Path, help="the headline file (default: benchmarks/results/headline_<family>_<gpu>.json)")
    parser.add_argument("--tiny", action="store_true", help="the tiny architectures, a dry run (scripts that take --tiny)")
    parser.add_argument("--lanes", type=int, default=1,
                        help="rows run side by side, each on a GPU of its own (a host of several GPUs)")
    args = parser.parse_args()
    chosen = scenario(args.family)
    keys = args.rows.split(",") if args.rows else [row.key for row in chosen.rows]
    unknown = [key for key in keys if key not in {row.key for row in chosen.rows}]
    if unknown:
        parser.error(f"--rows: no rows {unknown} in {args.family} (its rows: {', '.join(r.key for r in chosen.rows)})")
    gpus = lane_gpus(args.lanes)
    if args.lanes < 1 or (args.lanes > 1 and gpus is None):
        parser.error(f"--lanes {args.lanes}: give 1, or at most the GPUs CUDA_VISIBLE_DEVICES names")
    if args.adopt:
        if not args.adopt.is_file():
            parser.error(f"--adopt {args.adopt}: no such file")
        headline = adopted(chosen, args.adopt)
        out = args.out or headline_path(args.family, headline["device"])
        write(out, headline)
        print(f"wrote {out}: {len(headline['rows'])} rows adopted from {args.adopt.name}")
        return
    start = time.perf_counter()
    run = provenance()
    out = args.out or headline_path(args.family, run["device"])
    headline = json.loads(out.read_text()) if out.is_file() else started(chosen, run)
    if headline.get("code") != run["code"]:
        # Rows of other code are not one run with these: start the file again.
        headline = started(chosen, run)
    def record(key: str, entry: dict) -> None:
        headline["rows"][key] = entry
        write(out, headline)

    with tempfile.TemporaryDirectory() as folder:
        run_rows(chosen, keys, gpus, record, folder=Path(folder), extra=["--tiny"] if args.tiny else [],
                 timeout=args.row_timeout)
    failed = [key for key in keys if "error" in headline["rows"][key]]
    print(f"wrote {out}: {len(keys) - len(failed)} of {len(keys)} rows in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
