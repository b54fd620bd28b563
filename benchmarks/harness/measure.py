"""Timing a row: synchronized calls, the first (where it compiles) apart from the timed ones, and
how many graphs dynamo compiled while timed (0 where the warm-up covered everything timed)."""

from __future__ import annotations

import time

import torch


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def timed(fn, runs: int) -> list[float]:
    """`fn()`'s seconds over `runs` calls, each synchronized where a GPU runs it (a CPU dry run
    needs no wait)."""
    wait = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    seconds = []
    for _ in range(runs):
        wait()
        start = time.perf_counter()
        fn()
        wait()
        seconds.append(time.perf_counter() - start)
    return seconds


def nonfinite_values(output: torch.Tensor) -> int:
    """How many of a variant's output values (images or latents) are NaN or infinite: an 8-bit path
    that overflows shows here, not in its time."""
    return int(output.numel() - torch.isfinite(output).sum())


def time_calls(call, runs: int) -> dict:
    """`call()`'s first call (where it compiles), its times over `runs` calls after it, the graphs
    compiled while they ran, and the non-finite values of its last output."""
    last = [None]

    def keep():
        last[0] = call()

    first = timed(keep, 1)[0]
    graphs = graphs_compiled()
    seconds = timed(keep, runs)
    return {"first_call_s": first, "end_to_end_s": seconds, "best_s": min(seconds),
            "graphs_compiled_while_timed": graphs_compiled() - graphs, "nonfinite_values": nonfinite_values(last[0])}


def kernel_profile(call, top: int = 12) -> list[dict]:
    """GPU time per kernel over one `call()` (after warm-up), the largest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        call()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 1000, e.count) for e in trace.key_averages()
                   if e.device_time_total > 0), key=lambda row: -row[1])
    total = sum(ms for _, ms, _ in rows)
    return [{"kernel": name[:120], "ms": ms, "calls": count} for name, ms, count in rows[:top]] + \
        [{"kernel": "total", "ms": total, "calls": sum(c for _, _, c in rows)}]
