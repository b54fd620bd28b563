"""Holding Ctrl-C back across a few lines that must run whole (renaming an artifact into place,
removing a temporary), so that an interrupt lands before or after them, never between."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_deferred(on_press=None):
    """Inside the block SIGINT only calls `on_press` (if given); once the block is done, a SIGINT
    that came meanwhile goes to the handler that was there before (KeyboardInterrupt by default).
    Outside the main thread, or where SIGINT is ignored, the block runs as it is: only the main
    thread can install handlers, and an ignored SIGINT needs no holding back."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) in (
            signal.SIG_IGN, None):
        yield
        return
    pressed = []

    def hold(signum, frame):
        pressed.append(frame)
        if on_press is not None:
            on_press()

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pressed:
            if callable(previous):
                previous(signal.SIGINT, pressed[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
