"""Runs a script and holds it at a chosen point until a SIGINT arrives, so that a test's Ctrl-C lands
there whatever the machine's speed.

    python tests/pause_in_stage.py "<stage>" <function> <script> [overrides ...]

Once the script is inside the named stage (sdquant.cli.stage), the first call of a Python function
named <function> prints "paused in <stage> at <function>" and waits there until the process has
received SIGINT and its handler has run; then the call goes on, or ends in the KeyboardInterrupt
that handler raised. Nothing else of the script changes.
"""

from __future__ import annotations

import contextlib
import runpy
import signal
import sys
import time

import sdquant.cli

stage_name, function_name, script, *overrides = sys.argv[1:]
received = []


def _noting(handler):
    """`handler`, first noting that SIGINT came."""
    if not callable(handler):
        return handler

    def noted(signum, frame):
        received.append(signum)
        return handler(signum, frame)

    return noted


_install = signal.signal
signal.signal = lambda signum, handler: _install(signum, _noting(handler) if signum == signal.SIGINT else handler)
signal.signal(signal.SIGINT, signal.getsignal(signal.SIGINT))


def _pause_at_function(frame, event, arg):
    if event == "call" and frame.f_code.co_name == function_name:
        sys.setprofile(None)
        print(f"paused in {stage_name} at {function_name}", flush=True)
        while not received:
            time.sleep(0.01)


_stage = sdquant.cli.stage


@contextlib.contextmanager
def _pausing_stage(doing: str):
    with _stage(doing):
        if doing == stage_name:
            sys.setprofile(_pause_at_function)
        try:
            yield
        finally:
            if doing == stage_name:
                sys.setprofile(None)


sdquant.cli.stage = _pausing_stage
sys.argv = [script, *overrides]
runpy.run_path(script, run_name="__main__")
