"""Writing artifacts so that a crash or Ctrl-C never leaves a half-written file or folder under the
final name; and the list of what this process has written, for the line an interrupted script
prints (sdquant.cli)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# Every artifact renamed into place by this process, in order.
_written: list[Path] = []


def written_since(count: int) -> list[Path]:
    """The artifacts written after the first `count` that are still there (a file written inside a
    folder that was itself renamed into place counts once, as the folder), each once."""
    return [path for path in dict.fromkeys(_written[count:]) if path.exists()]


def written_count() -> int:
    return len(_written)


def _user_permissions(path: Path, mode: int) -> None:
    """mkstemp and mkdtemp make owner-only files and folders; artifacts get the usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


@contextlib.contextmanager
def atomic_path(final: Path):
    """Yields a temporary path beside `final`; renames it to `final` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
    os.close(handle)
    temp = Path(temp_name)
    _user_permissions(temp, 0o666)
    try:
        yield temp
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
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    _user_permissions(staging, 0o777)
    try:
        yield staging
        if replace and final.exists():
            shutil.rmtree(final)
        try:
            os.replace(staging, final)
        except OSError:
            if replace or not final.exists():
                raise
        _written.append(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_json(final: Path, data: dict) -> None:
    with atomic_path(final) as temp:
        temp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
