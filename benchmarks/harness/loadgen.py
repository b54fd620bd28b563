"""MLPerf's LoadGen as the benchmarks drive it: a test's settings, one test over a system under test
whose `issue` takes LoadGen's query samples, and the fields of its summary. Durations and query
counts are the caller's: shorter than MLPerf's minimums, no official MLPerf run."""

from __future__ import annotations

import re
import tempfile
import threading
from pathlib import Path

NS = 1e9
POLL_S = 0.5
# The least duration MLPerf's rules ask of a performance run.
MLPERF_MIN_DURATION_S = 600


def test_settings(scenario: str, min_duration_s: float, min_queries: int, expected_qps: float | None = None,
                  target_qps: float | None = None, latency_bound_s: float | None = None,
                  expected_latency_s: float | None = None):
    """PerformanceOnly settings of `scenario`: offline (all queries at once, at about `expected_qps`),
    server (Poisson arrivals at `target_qps`, its latency bound) or singlestream (one query after the
    other, each about `expected_latency_s`)."""
    import mlperf_loadgen as lg

    settings = lg.TestSettings()
    settings.mode = lg.TestMode.PerformanceOnly
    settings.min_duration_ms = round(min_duration_s * 1000)
    settings.min_query_count = min_queries
    if scenario == "offline":
        settings.scenario = lg.TestScenario.Offline
        settings.offline_expected_qps = expected_qps
    elif scenario == "server":
        settings.scenario = lg.TestScenario.Server
        settings.server_target_qps = target_qps
        settings.server_target_latency_ns = round(latency_bound_s * NS)
    else:
        settings.scenario = lg.TestScenario.SingleStream
        settings.single_stream_expected_latency_ns = round(expected_latency_s * NS)
    return settings


def waited(work, meanwhile=None) -> None:
    """`work()` on a thread of its own, waited for here: LoadGen's test blocks in C++, where Ctrl-C
    would wait for its end; this thread takes it at once. `meanwhile()`, where given, is called on
    this thread over and over until `work` ends (it should return within about POLL_S): a system
    under test whose work must run on the thread that built it."""
    raised = []

    def run():
        try:
            work()
        except BaseException as error:  # handed to the waiting thread
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while thread.is_alive():
        if meanwhile is None:
            thread.join(POLL_S)
        else:
            meanwhile()
    if raised:
        raise raised[0]


def loadgen_summary(sut, settings, samples: int, meanwhile=None) -> dict:
    """One LoadGen test over `sut` (its `issue(query_samples)` answers each with
    QuerySamplesComplete, or hands them to `meanwhile`, called on this thread while the test runs)
    on a sample library of `samples` held in memory; the fields of its summary. Its log folder is
    temporary."""
    import mlperf_loadgen as lg

    with tempfile.TemporaryDirectory(prefix="loadgen_") as log_dir:
        log = lg.LogSettings()
        log.log_output.outdir = log_dir
        log.log_output.copy_summary_to_stdout = False
        sut_handle = lg.ConstructSUT(sut.issue, lambda: None)
        qsl_handle = lg.ConstructQSL(samples, samples, lambda indices: None, lambda indices: None)
        waited(lambda: lg.StartTestWithLogSettings(sut_handle, qsl_handle, settings, log), meanwhile)
        lg.DestroyQSL(qsl_handle)
        lg.DestroySUT(sut_handle)
        return summary_fields((Path(log_dir) / "mlperf_log_summary.txt").read_text())


def summary_fields(text: str) -> dict:
    """mlperf_log_summary.txt's `name : value` lines, numbers as numbers."""
    fields = {}
    for line in text.splitlines():
        found = re.fullmatch(r"\s*([A-Za-z0-9][^:*]*?)\s*:\s*(\S.*?)\s*", line)
        if found:
            fields[found.group(1)] = number_or_text(found.group(2))
    return fields


def number_or_text(text: str):
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
