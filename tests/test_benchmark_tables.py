"""The README's headline tables are written from the benchmark harness's result files, and
run_all.py writes such a file from rows each run in a process of its own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from harness import tables  # noqa: E402
from harness.scenarios import SCENARIOS  # noqa: E402


def test_the_readme_tables_are_the_headline_files():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "write_tables.py"), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_headline_row_names_a_quality_figure_that_exists():
    for scenario in SCENARIOS.values():
        for row in scenario.rows:
            if row.quality is None:
                continue
            summary = json.loads((REPO / row.quality.summary).read_text())
            assert row.quality.judged in summary["unquantized"], (scenario.family, row.key)
            assert row.quality.setting is None or row.quality.setting in summary["settings"], (scenario.family, row.key)


def test_a_table_divides_by_the_peer_of_its_own_run_and_goes_between_its_markers():
    headline = {"device": "NVIDIA H200", "driver": "1", "code": "abc", "commit": "f" * 40, "versions": {"torch": "2"},
                "rows": {"peer": {"seconds": 20.0, "attention_kernel": "torch", "graphs_compiled_while_timed": 0},
                         "ours_fp8": {"seconds": 10.0, "attention_kernel": "torch", "graphs_compiled_while_timed": 0}}}
    body = tables.table(SCENARIOS["wan"], headline, "benchmarks/results/headline_wan_h200.json")
    assert "| ours, FP8 level 4 | 10.000 | 2.00x | torch |" in body
    assert "code abc (commit ffffffffffff)" in body and "graphs compiled while timed: 0, 0" in body
    start, end = tables.marker("wan")
    readme = f"before\n{start}\nold\n{end}\nafter\n"
    assert tables.written_into(readme, {"wan": body}) == f"before\n{start}\n{body}\n{end}\nafter\n"


def test_run_all_runs_each_row_in_its_own_process_on_its_lane_and_records_what_compiled_while_timed(tmp_path):
    out = tmp_path / "headline_wan_cpu.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "run_all.py"), "--family", "wan", "--rows",
                             "ours_16bit,peer", "--lanes", "2", "--tiny", "--out", str(out)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    headline = json.loads(out.read_text())
    assert len(headline["code"]) == 12 and headline["device"] == "cpu"
    rows = headline["rows"]
    assert {rows["ours_16bit"]["gpu"], rows["peer"]["gpu"]} == {"0", "1"}
    for row in rows.values():
        assert row["seconds"] > 0 and row["attention_kernel"] == "torch"
        assert row["graphs_compiled_while_timed"] == 0
    assert "2 cpu GPUs of one host" in tables.run_line(headline, "x") and "on a GPU of its own" in tables.run_line(
        headline, "x")


@pytest.mark.parametrize("arguments, says", [(["--family", "nope"], "--family nope: choose one of"),
                                             (["--family", "wan", "--rows", "fast"], "no rows ['fast'] in wan")])
def test_run_all_refuses_a_family_or_row_it_does_not_know(arguments, says):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "run_all.py"), *arguments], capture_output=True, text=True)
    assert result.returncode != 0 and says in result.stdout + result.stderr
