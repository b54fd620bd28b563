"""Writes the README's headline tables from the newest headline file of each family
(benchmarks/results/headline_<family>_<gpu>.json, written by benchmarks/run_all.py), between the
README's markers `<!-- headline:<family> -->` and `<!-- /headline:<family> -->`, and its serving
table, a row per served model of harness/scenarios.py's SERVING from its finished Server results
(benchmarks/results/serve_<model>_server_<gpu>.json, written by benchmarks/serve_load.py), between
`<!-- headline:serving -->` and `<!-- /headline:serving -->`. Markers without a results file behind
them are left as they are.

    python benchmarks/write_tables.py            # README.md
    python benchmarks/write_tables.py --check    # exits 1 where README.md's tables, the serving one
                                                 # among them, are not the files'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.tables import REPO, tables, write_readme, written_into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--check", action="store_true", help="say whether the README's tables are the files', write nothing")
    args = parser.parse_args()
    if not args.readme.is_file():
        parser.error(f"--readme {args.readme}: no such file")
    if args.check:
        text = args.readme.read_text()
        stale = written_into(text, tables()) != text
        print(f"{args.readme}: " + ("its tables differ from the results files: run benchmarks/write_tables.py"
                                     if stale else "its tables are the results files'"))
        sys.exit(1 if stale else 0)
    written = write_readme(args.readme)
    print(f"wrote {', '.join(written) or 'no'} tables into {args.readme}")


if __name__ == "__main__":
    main()
