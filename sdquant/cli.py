"""How every script starts and ends: the installed packages are checked before any work, and input
the user can fix ends in one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import functools
import sys

from .environment import require_supported
from .errors import EXIT_USER_ERROR, UserError


def exits_cleanly(main):
    """Wraps a script's body: refuses an environment the code cannot run on before any work, and
    ends a UserError with its message and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            require_supported()
            return main(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)

    return wrapper
