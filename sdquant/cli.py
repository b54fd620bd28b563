"""How every script starts and ends: the installed packages are checked before any work; input the
user can fix ends in one line on stderr and exit code 2; Ctrl-C ends in one line naming what the
script was doing and what it kept, exit code 130. Never a traceback.

Nothing half-written is left by an interrupted script because every artifact is written under a
temporary name and renamed when complete (sdquant.artifacts); what was renamed before Ctrl-C is
kept, and a rerun reuses it.
"""

from __future__ import annotations

import contextlib
import functools
import sys

from . import artifacts
from .environment import require_supported
from .errors import EXIT_USER_ERROR, UserError

# What a shell reports for a command ended by SIGINT: 128 + 2.
EXIT_INTERRUPTED = 130
# Kept artifacts named one by one in the interrupted line; more are counted.
NAMED_KEPT = 3


@contextlib.contextmanager
def stage(doing: str):
    """Names what the script does inside the block ("exporting unet_xl"), for the line Ctrl-C prints."""
    try:
        yield
    except KeyboardInterrupt as interrupt:
        # The innermost stage names it; the outer ones see it already named.
        if not hasattr(interrupt, "stage"):
            interrupt.stage = doing
        raise


def interrupted_line(interrupt: KeyboardInterrupt, kept: list) -> str:
    """The one line an interrupted script prints."""
    doing = getattr(interrupt, "stage", None)
    line = f"interrupted during {doing}; nothing written for it" if doing else \
        "interrupted before any work; nothing written"
    if kept:
        named = ", ".join(str(path) for path in kept[:NAMED_KEPT])
        more = f" and {len(kept) - NAMED_KEPT} more" if len(kept) > NAMED_KEPT else ""
        line += f"; kept what was finished before it: {named}{more}"
    return line


def exits_cleanly(main):
    """Wraps a script's body: refuses an environment the code cannot run on before any work, ends a
    UserError with its message and exit code 2, and Ctrl-C with one line and exit code 130."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        written_before = artifacts.written_count()
        try:
            require_supported()
            return main(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt as interrupt:
            print(interrupted_line(interrupt, artifacts.written_since(written_before)), file=sys.stderr, flush=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper
