"""How the scripts refuse bad input: one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import functools
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Input the user can fix. The message names the key, file or range and what to do."""


def exits_cleanly(main):
    """Wraps a script's body: refuses an environment the code cannot run on before any work, and
    ends a UserError with its message and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        from .environment import require_supported

        try:
            require_supported()
            return main(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)

    return wrapper
