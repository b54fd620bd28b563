"""Writing artifacts so that a crash or Ctrl-C never leaves a half-written file under the final name."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(final: Path):
    """Yields a temporary path beside `final`; renames it to `final` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
    os.close(handle)
    temp = Path(temp_name)
    # mkstemp creates owner-only files; artifacts get the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    temp.chmod(0o666 & ~umask)
    try:
        yield temp
        os.replace(temp, final)
    finally:
        temp.unlink(missing_ok=True)


def write_json(final: Path, data: dict) -> None:
    with atomic_path(final) as temp:
        temp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
