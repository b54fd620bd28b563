"""Writes the headline tables from the newest headline file of each family
(benchmarks/results/headline_<family>_<gpu>.json, written by benchmarks/run_all.py), between the
markers `<!-- headline:<family> -->` and `<!-- /headline:<family> -->` of README.md and
docs/models.md, and the README's serving table, a row per served model of harness/scenarios.py's
SERVING from its finished Server results (benchmarks/results/serve_<model>_server_<gpu>.json,
written by benchmarks/serve_load.py), between `<!-- headline:serving -->` and
`<!-- /headline:serving -->`. Markers without a results file behind them are left as they are.

    python benchmarks/write_tables.py            # README.md and docs/models.md
    python benchmarks/write_tables.py --check    # exits 1 where a document's tables are not the files'
"""

from __future__ import annotations

import argparse
import sys

from harness.tables import DOCUMENTS, REPO, tables, write_document, written_into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="say whether the documents' tables are the files', write nothing")
    args = parser.parse_args()
    made = tables()
    if args.check:
        texts = {name: (REPO / name).read_text() for name in DOCUMENTS}
        stale = [name for name, text in texts.items() if written_into(text, made) != text]
        print(f"{', '.join(stale)}: tables differ from the results files: run benchmarks/write_tables.py" if stale
              else f"the tables of {', '.join(DOCUMENTS)} are the results files'")
        sys.exit(1 if stale else 0)
    for name in DOCUMENTS:
        written = write_document(REPO / name, made)
        print(f"wrote {', '.join(written) or 'no'} tables into {name}")


if __name__ == "__main__":
    main()
