"""Progress of the long loops: one bar at a time on a terminal, plain periodic lines in a log."""

from __future__ import annotations

import io
import re
import sys

from sdquant import progress
from sdquant.progress import Progress


def test_a_log_gets_plain_lines_with_count_time_and_notes(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)
    bar = Progress(range(3), "unet", "steps")
    for step in bar:
        bar.note(loss=f"{step / 10:.1f}")
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 4
    assert lines[0] == "unet: 0/3 steps (0%), 0.0 s", "a line as the loop starts"
    assert re.fullmatch(r"unet: 1/3 steps \(33%\), \d+\.\d s, about \d+ s left, loss 0\.0", lines[1])
    assert re.fullmatch(r"unet: 3/3 steps \(100%\), \d+\.\d s, loss 0\.2", lines[-1])


def test_a_short_loop_in_a_log_gets_a_line_at_its_start_and_end(capsys):
    assert list(Progress(range(50), "calibrating", "batches")) == list(range(50))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("calibrating: 50/50 batches (100%), ")


def test_a_loop_inside_another_shows_nothing(capsys):
    for _ in Progress(range(2), "fp16", "prompt batches"):
        assert list(Progress(range(4), "denoising", "steps")) == [0, 1, 2, 3]
    err = capsys.readouterr().err
    assert "fp16: 2/2 prompt batches" in err and "denoising" not in err
    list(Progress(range(1), "denoising", "steps"))
    assert "denoising: 1/1 steps" in capsys.readouterr().err, "once the outer loop ends, the next shows"


def test_a_terminal_gets_one_tqdm_bar_at_a_time(monkeypatch):
    terminal = io.StringIO()
    terminal.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", terminal)
    for _ in Progress(range(2), "int8", "prompt batches"):
        list(Progress(range(3), "denoising", "steps"))
    shown = terminal.getvalue()
    assert "int8: 100%" in shown and "\r" in shown
    assert "denoising" not in shown


def test_a_hidden_loop_still_runs_and_hides_nothing_after_it(capsys):
    assert list(Progress(range(3), "calibrating", "batches", show=False)) == [0, 1, 2]
    assert capsys.readouterr().err == ""
    list(Progress(range(1), "denoising", "steps"))
    assert "denoising" in capsys.readouterr().err
