"""Runs a family's headline rows (benchmarks/harness/scenarios.py) in one run on one GPU, each row
in a process of its own, warm (each row counts the graphs compiled while timed), and writes
benchmarks/results/headline_<family>_<gpu>.json, from which benchmarks/write_tables.py writes the
README's table.

    python benchmarks/run_all.py --family sdxl
    python benchmarks/run_all.py --family wan --rows peer,ours_fp8     # some rows, into the same file
    python benchmarks/run_all.py --family flux --adopt benchmarks/results/flux_modulations_h100.json

--adopt builds the headline file from one earlier results file of the family's script (one run,
from before this harness): its rows keep that file's device and versions, and the headline says
that the code was not recorded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.headline import headline_path, picked, started, write
from harness.provenance import provenance
from harness.scenarios import Scenario, scenario

BENCHMARKS = Path(__file__).resolve().parent


def run_row(scenario: Scenario, key: str, folder: Path, extra: list[str], timeout: float) -> dict:
    """One row in a process of its own; its entry, or the reason it has none."""
    row = scenario.row(key)
    out = folder / f"{key}.json"
    command = [sys.executable, str(BENCHMARKS / scenario.script), *scenario.common, *row.args, *extra,
               "--out", str(out)]
    print(f"{key}: {' '.join(command[1:])}", flush=True)
    try:
        code = subprocess.run(command, timeout=timeout or None).returncode
    except subprocess.TimeoutExpired:
        return {"label": row.label, "side": row.side, "error": f"stopped after {timeout:g} s"}
    if not out.is_file():
        return {"label": row.label, "side": row.side, "error": f"its process exited {code} without a row"}
    return picked(scenario, row, json.loads(out.read_text()))


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
    args = parser.parse_args()
    chosen = scenario(args.family)
    keys = args.rows.split(",") if args.rows else [row.key for row in chosen.rows]
    unknown = [key for key in keys if key not in {row.key for row in chosen.rows}]
    if unknown:
        parser.error(f"--rows: no rows {unknown} in {args.family} (its rows: {', '.join(r.key for r in chosen.rows)})")
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
    with tempfile.TemporaryDirectory() as folder:
        for key in keys:
            headline["rows"][key] = run_row(chosen, key, Path(folder), ["--tiny"] if args.tiny else [],
                                            args.row_timeout)
            write(out, headline)
    failed = [key for key in keys if "error" in headline["rows"][key]]
    print(f"wrote {out}: {len(keys) - len(failed)} of {len(keys)} rows in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
