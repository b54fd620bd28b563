"""The artifact helpers under an interrupt at every point: a real SIGINT raised at each bytecode
instruction of a write, one instruction further each run, never leaves a temporary file or folder,
and the final name always holds one whole artifact (the old one or the new one) or none."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sdquant.artifacts import atomic_folder, atomic_path, write_json


def _interrupted_at(instruction: int, write) -> bool:
    """Runs `write()` with SIGINT raised at its `instruction`-th bytecode instruction, counted over
    every Python frame it runs; returns whether the signal was raised before it finished."""
    count = 0

    def per_instruction(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
            if count == instruction:
                # As from a terminal: Python's handler raises KeyboardInterrupt at the next point
                # the interpreter checks for signals, wherever the code is then.
                signal.raise_signal(signal.SIGINT)
        return per_instruction if count < instruction else None

    def per_call(frame, event, arg):
        if count >= instruction:
            return None
        frame.f_trace_opcodes = True
        return per_instruction

    sys.settrace(per_call)
    try:
        write()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return count >= instruction


def _left_over(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if ".partial" in path.name]


def _write_file(final: Path):
    with atomic_path(final) as temp:
        temp.write_text("new, whole")


def _write_folder(final: Path):
    with atomic_folder(final) as staging:
        (staging / "part1").write_text("new")
        (staging / "part2").write_text("new")


def _write_json(final: Path):
    write_json(final, {"whole": True})


def _file_state(final: Path):
    return final.read_text() if final.exists() else None


def _folder_state(final: Path):
    return {p.name: p.read_text() for p in sorted(final.iterdir())} if final.exists() else None


CASES = {
    "file": (_write_file, _file_state, lambda f: f.write_text("old, whole"), "new, whole", "old, whole"),
    "json": (_write_json, _file_state, lambda f: f.write_text('{"old": true}\n'),
             '{\n  "whole": true\n}\n', '{"old": true}\n'),
    "folder": (_write_folder, _folder_state,
               lambda f: (f.mkdir(), (f / "part1").write_text("old"), (f / "old_only").write_text("old")),
               {"part1": "new", "part2": "new"}, {"old_only": "old", "part1": "old"}),
}


def sweep(kind: str, existing: bool, root: Path) -> None:
    """Interrupts one write of `kind` at instruction 1, 2, 3, ... until one finishes untouched."""
    write, state, make_old, new, old = CASES[kind]
    # A process started with SIGINT ignored (any job a non-interactive shell puts in the
    # background, as CI runners may) keeps ignoring it, and Python then installs no handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    instruction, outcomes = 0, set()
    while True:
        instruction += 1
        folder = root / str(instruction)
        folder.mkdir()
        final = folder / "artifact"
        if existing:
            make_old(final)
        interrupted = _interrupted_at(instruction, lambda: write(final))
        assert not _left_over(folder), f"a temporary left by SIGINT at instruction {instruction}"
        found = state(final)
        assert found in (new, old if existing else None), f"SIGINT at instruction {instruction} left {found!r}"
        outcomes.add(found == new)
        if not interrupted:
            break
    # The sweep reached both ends: interrupted before the rename (the old or no artifact) and
    # past it (the new one), and a run that no interrupt touched.
    assert outcomes == {True, False} and instruction > 50, (instruction, outcomes)
    assert state(final) == new


@pytest.mark.parametrize("existing", [False, True], ids=["new", "replacing"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_an_interrupt_at_any_instruction_leaves_one_whole_artifact_or_none(tmp_path, kind, existing):
    # In a process of its own: exceptions raised from a trace function at arbitrary instructions
    # leave exception contexts behind that later tests' tracebacks would show.
    result = subprocess.run([sys.executable, "-c", f"import test_artifacts; test_artifacts.sweep({kind!r}, {existing}, "
                             f"test_artifacts.Path({str(tmp_path)!r}))"],
                            cwd=Path(__file__).parent, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
