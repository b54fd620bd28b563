"""Writing artifacts so that a crash or Ctrl-C never leaves a half-written file or folder under the
final name; and the list of what this process has written, for the line an interrupted script
prints (sdquant.cli)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path

from .interrupts import interrupts_deferred

# Every artifact renamed into place by this process, in order.
_written: list[Path] = []


def written_since(count: int) -> list[Path]:
    """The artifacts written after the first `count` that are still there (a file written inside a
    folder that was itself renamed into place counts once, as the folder), each once."""
    return [path for path in dict.fromkeys(_written[count:]) if path.exists()]


def written_count() -> int:
    return len(_written)


def _temporary_name(final: Path) -> Path:
    """A name beside `final` (same file system, so the rename is atomic) that nothing else uses.
    Only the name: the helpers create it inside the block that removes it, so no interrupt can
    fall between its creation and the cleanup that owns it."""
    return final.parent / f".{final.name}.{secrets.token_hex(8)}.partial"


@contextlib.contextmanager
def atomic_path(final: Path):
    """Yields a temporary path beside `final` for the block to write; renames it to `final` only if
    the block succeeds, and removes it otherwise."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = _temporary_name(final)
    try:
        yield temp
        with interrupts_deferred():
            os.replace(temp, final)
            _written.append(final)
    finally:
        temp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(final: Path, replace: bool = True):
    """Yields an empty folder beside `final`; it becomes `final` only if the block succeeds. An
    existing `final` is replaced, or with replace=False kept (another process made it first)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging, displaced = _temporary_name(final), _temporary_name(final)
    try:
        staging.mkdir()  # mode 0o777 less the umask: the usual permissions
        yield staging
        with interrupts_deferred():
            _move_into_place(staging, final, displaced, replace)
    finally:
        # Removing a large half-written folder takes a while: an interrupt must not cut it short.
        with interrupts_deferred():
            shutil.rmtree(staging, ignore_errors=True)


def _move_into_place(staging: Path, final: Path, displaced: Path, replace: bool) -> None:
    """Renames `staging` to `final`; a `final` already there is first renamed to `displaced`, put
    back if the rename fails and removed once it succeeded, so `final` is always one whole folder,
    old or new."""
    if replace and final.exists():
        os.replace(final, displaced)
    try:
        os.replace(staging, final)
    except OSError:
        if displaced.exists():
            os.replace(displaced, final)
        if replace or not final.exists():
            raise
    _written.append(final)
    shutil.rmtree(displaced, ignore_errors=True)


def write_json(final: Path, data: dict) -> None:
    with atomic_path(final) as temp:
        temp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
