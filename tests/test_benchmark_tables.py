"""The headline tables of the README and docs/models.md are written from the benchmark harness's
result files, and run_all.py writes such a file from rows each run in a process of its own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from harness import tables  # noqa: E402
from harness.scenarios import SCENARIOS, SERVING  # noqa: E402


def test_the_readme_tables_are_the_headline_files():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "write_tables.py"), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_family_and_the_serving_table_have_their_place_in_one_document():
    families = [*SCENARIOS, "serving"]
    texts = [(REPO / name).read_text() for name in tables.DOCUMENTS]
    for family in families:
        start, end = tables.marker(family)
        holding = [text for text in texts if start in text]
        assert len(holding) == 1 and holding[0].count(start) == 1, family
        assert holding[0].index(start) < holding[0].index(end), family


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


def test_a_second_peer_is_divided_by_the_first_as_ours_are():
    headline = {"device": "NVIDIA H100", "code": "abc", "versions": {"torch": "2"},
                "rows": {"peer": {"seconds": 4.0, "attention_kernel": "torch"},
                         "peer_torchao": {"seconds": 3.2, "attention_kernel": "torch"},
                         "ours_fp8": {"seconds": 2.5, "attention_kernel": "torch"}}}
    body = tables.table(SCENARIOS["flux"], headline, "benchmarks/results/headline_flux_h100.json")
    rows = {line.split(" | ")[0]: line.split(" | ")[3] for line in body.splitlines() if line.startswith("| ")}
    assert rows["| diffusers' compiled pipeline"] == "-"
    assert [rows[label] for label in rows if "torchao" in label] == ["1.25x"]
    assert rows["| ours, FP8 level 4"] == "1.60x"


def test_a_commit_is_named_changed_only_where_a_digested_file_changed(tmp_path):
    from harness.provenance import code_digest, commit

    def git(*arguments):
        subprocess.run(["git", *arguments], cwd=tmp_path, check=True, capture_output=True)

    for path, text in {"sdquant/api.py": "x = 1\n", "benchmarks/run.sh": "true\n",
                       "benchmarks/results/row.json": "{}\n", "sdquant/models/scenes/weights.bin": "w"}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "t")
    digest = code_digest(tmp_path)
    # A lease's tree goes without its results and scene models: the same code, the same commit.
    (tmp_path / "benchmarks/results/row.json").unlink()
    (tmp_path / "sdquant/models/scenes/weights.bin").unlink()
    assert not commit(tmp_path).endswith("+changes") and code_digest(tmp_path) == digest
    (tmp_path / "benchmarks/run.sh").write_text("false\n")
    assert commit(tmp_path).endswith("+changes") and code_digest(tmp_path) != digest


def test_a_setting_with_nothing_calibrated_shows_its_one_run_without_a_range():
    peer = tables.quality_cell(SCENARIOS["wan_video"].row("peer").quality)
    ours = tables.quality_cell(SCENARIOS["wan_video"].row("ours_fp8_cache").quality)
    assert peer.endswith("(one run: nothing calibrated), +0.8 points") and peer.startswith("83.6%")
    assert "one run" not in ours and "-" in ours.split("(")[1]


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


def server_run(target_qps: float, p50: float, p99: float, requests_by_call_images: dict, failed: int = 0) -> dict:
    """A Server run as serve_load.py's run_row and server_side record it (the fields the table reads)."""
    return {"scenario": "server", "target_qps": target_qps, "rate_qps": target_qps, "queries": 64,
            "answered": 64 - failed, "failed": failed, "latency_s": {"p50": p50, "p90": p99 - 1, "p99": p99},
            "holds": p99 <= 20 and not failed,
            "server": {"requests_by_call_images": requests_by_call_images, "calls_by_images": {}}}


def serve_results(model: str, settings: dict, runs: list, finished: bool = True, **answer) -> dict:
    offline = {"scenario": "offline", "target_qps": None, "rate_qps": answer.get("offline_images_per_s"),
               "queries": 300, "answered": 300, "failed": 0}
    return {"benchmark": "serve_load", "model": model, "scenario": "server", "finished": finished,
            "shortened": "each run at least 120 s and 64 queries; MLPerf's runs last at least 600 s",
            "settings": {"latency_bound_s": 20, "target_share": None, "search": False, "offline_qps": None,
                         "min_duration_s": 120, **settings},
            "runs": [offline, *runs], **answer, "seconds": 900.0,
            "provenance": {"code": "abc123abc123", "commit": "f" * 40, "device": "NVIDIA H200", "driver": "580.1",
                           "cuda": "13.0", "versions": {"torch": "2.11.0"}}}


@pytest.fixture
def results_folder(tmp_path, monkeypatch):
    """A checkout whose benchmarks/results the tables read."""
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    monkeypatch.setattr(tables, "REPO", tmp_path)
    monkeypatch.setattr(tables, "RESULTS", folder)
    return folder


def test_the_serving_table_reports_the_searched_rate_and_the_set_one_between_its_markers(results_folder):
    # serve_measure.sh's SDXL search: the Offline rate failed the bound, 0.9 of it held.
    low = 0.9 * 2.2
    sdxl = serve_results("sdxl_base", {"search": True, "search_low": 0.9},
                         [server_run(2.2, 12.0, 25.3, {"8": 64}), server_run(low, 9.1, 17.85, {"8": 56, "4": 8})],
                         offline_images_per_s=2.2, server_largest_qps_within_bound=low)
    flux = serve_results("flux_dev", {"target_share": 0.8}, [server_run(0.8 * 0.43, 3.1, 6.4, {"1": 40})],
                         offline_images_per_s=0.43, server_qps_holds=True)
    (results_folder / "serve_sdxl_base_server_h200.json").write_text(json.dumps(sdxl))
    (results_folder / "serve_flux_dev_server_h200.json").write_text(json.dumps(flux))
    body = tables.tables()["serving"]
    assert body.splitlines()[0] == tables.SERVING_HEADER
    assert ("| SDXL FP8 level 3, 1024x1024, 20 steps, up to 8 images a call | 2.20 | 1.98 (p99 <= 20 s) | "
            "9.10 / 17.85 | 7.1 | NVIDIA TensorRT, MLPerf v4.1: 1.97 per H100, 2.10 per H200 |") in body
    assert ("| Flux.1-dev FP8 level 4, 1024x1024, 28 steps, one image a call | 0.43 | "
            "0.34 at 80% of Offline, no MLPerf bound | 3.10 / 6.40 | 1.0 | - |") in body
    # Both served on one machine from one code: one line names both files.
    assert body.endswith("\n\n*Each model its own server on one NVIDIA H200, driver 580.1, torch 2.11.0; code "
                         "abc123abc123 (commit ffffffffffff); each LoadGen run at least 120 s (MLPerf's: 600 s); "
                         "`benchmarks/results/serve_sdxl_base_server_h200.json`, "
                         "`benchmarks/results/serve_flux_dev_server_h200.json`.*")
    start, end = tables.marker("serving")
    readme = f"before\n{start}\nold\n{end}\nafter\n"
    assert tables.written_into(readme, tables.tables()) == f"before\n{start}\n{body}\n{end}\nafter\n"


def test_a_search_where_no_rate_held_reports_no_latency(results_folder):
    sdxl = serve_results("sdxl_base", {"search": True}, [server_run(2.2, 12.0, 25.3, {"8": 64}),
                                                         server_run(1.1, 11.0, 21.0, {"8": 64})],
                         offline_images_per_s=2.2, server_largest_qps_within_bound=None)
    (results_folder / "serve_sdxl_base_server_h200.json").write_text(json.dumps(sdxl))
    assert "| 2.20 | none held (p99 <= 20 s) | - | - |" in tables.tables()["serving"]


def test_a_set_rate_from_a_given_offline_rate_names_it_and_its_failed_queries():
    # The Offline rate from an earlier command (--offline-qps): the results hold no Offline run.
    flux = serve_results("flux_dev", {"target_share": 0.8, "offline_qps": 0.45},
                         [server_run(0.36, 3.0, 30.0, {"1": 60}, failed=4)], server_qps_holds=False)
    flux["runs"] = flux["runs"][1:]
    assert ("| 0.45 (--offline-qps) | 0.36 at 80% of Offline, no MLPerf bound, 4 of 64 queries failed | "
            "3.00 / 30.00 | 1.0 | - |") in tables.serving_row(SERVING["flux_dev"], flux)


def test_a_serving_file_stopped_half_way_is_left_out(results_folder):
    held = serve_results("sdxl_base", {"search": True}, [server_run(2.0, 9.0, 18.0, {"8": 64})],
                         offline_images_per_s=2.0, server_largest_qps_within_bound=2.0)
    stopped = serve_results("sdxl_base", {"search": True}, [server_run(2.2, 9.0, 18.0, {"8": 64})], finished=False,
                            offline_images_per_s=2.2)
    (results_folder / "serve_sdxl_base_server_h100.json").write_text(json.dumps(held))
    (results_folder / "serve_sdxl_base_server_h200.json").write_text(json.dumps(stopped))
    body = tables.tables()["serving"]
    assert "| 2.00 | 2.00 (p99 <= 20 s) |" in body and "serve_sdxl_base_server_h100.json" in body
    assert "serve_sdxl_base_server_h200.json" not in body
    (results_folder / "serve_sdxl_base_server_h100.json").unlink()
    assert "serving" not in tables.tables()


@pytest.mark.parametrize("arguments, says", [(["--family", "nope"], "--family nope: choose one of"),
                                             (["--family", "wan", "--rows", "fast"], "no rows ['fast'] in wan")])
def test_run_all_refuses_a_family_or_row_it_does_not_know(arguments, says):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "run_all.py"), *arguments], capture_output=True, text=True)
    assert result.returncode != 0 and says in result.stdout + result.stderr


def test_a_family_reads_its_own_headline_file_not_one_whose_family_begins_with_its_name(results_folder):
    # headline_wan_*.json matches the other Wan families' files too; newer ones must not stand for
    # the A14B's step.
    for family, date in (("wan", "2026-01-01"), ("wan_ti2v", "2026-02-01"), ("wan_video", "2026-03-01")):
        run = {"family": family, "date": date, "device": "NVIDIA H100", "code": "abc", "versions": {"torch": "2"},
               "rows": {"peer": {"seconds": 2.0, "attention_kernel": "torch"}}}
        (results_folder / f"headline_{family}_h100.json").write_text(json.dumps(run))
    for family in ("wan", "wan_ti2v", "wan_video"):
        assert tables.newest_headline(family)[1] == f"benchmarks/results/headline_{family}_h100.json"
    assert tables.newest_headline("wan_window") is None
