"""The benchmarks' shared harness: how a row is timed (measure), how each variant runs in a process
of its own (processes), how the peers are set up as their libraries advise (peers), the cache
settings both sides take (caches), what names the code and the machine (provenance), the headline
rows of each family (scenarios) and the README's tables written from their results (tables).

The benchmark scripts beside this folder import it; `benchmarks/run_all.py` runs a family's
headline rows and `benchmarks/write_tables.py` writes the tables of README.md and docs/models.md
from them.
"""
