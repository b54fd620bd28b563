"""How the code refuses input the user can fix: one exception, which the scripts end with one line
on stderr and exit code 2 (sdquant.cli.exits_cleanly)."""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Input the user can fix. The message names the key, file or range and what to do."""
