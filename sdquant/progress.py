"""Progress of the long loops (calibration, denoising, evaluation, training), shown one loop at a
time: a loop running inside another's shows nothing, so bars never nest. On a terminal it is a
tqdm bar; in a log (stderr not a terminal: a file, a pipe, Slurm) it is a plain line when the loop
starts, every LOG_INTERVAL seconds and when it ends, never the carriage-return updates a bar would
write there."""

from __future__ import annotations

import sys
import time

# Seconds between two plain lines in a log.
LOG_INTERVAL = 30.0

_running = 0  # loops running now, one inside another


class Progress:
    """Iterates over `items`, showing `description` and how many are done (`unit`: what they are,
    plural); `note` adds values (a loss) to what is shown."""

    def __init__(self, items, description: str, unit: str, show: bool = True, leave: bool = True):
        self.items = items
        self.description = description
        self.unit = unit
        self.show = show
        self.leave = leave
        self.notes: dict[str, str] = {}
        self._bar = None

    def note(self, **values) -> None:
        self.notes = {name: str(value) for name, value in values.items()}
        if self._bar is not None:
            self._bar.set_postfix(self.notes)

    def __iter__(self):
        global _running
        shown = self.show and _running == 0
        _running += 1
        try:
            if not shown:
                yield from self.items
            elif sys.stderr.isatty():
                yield from self._bar_updates()
            else:
                yield from self._log_lines()
        finally:
            _running -= 1

    def _bar_updates(self):
        from tqdm import tqdm

        self._bar = tqdm(self.items, desc=self.description, unit=self.unit, leave=self.leave, file=sys.stderr)
        try:
            yield from self._bar
        finally:
            self._bar.close()
            self._bar = None

    def _log_lines(self):
        total = len(self.items) if hasattr(self.items, "__len__") else None
        start = last = time.perf_counter()
        done = 0
        print(self._line(done, total, 0.0), file=sys.stderr, flush=True)
        for item in self.items:
            yield item
            done += 1
            now = time.perf_counter()
            if now - last >= LOG_INTERVAL or done == total:
                print(self._line(done, total, now - start), file=sys.stderr, flush=True)
                last = now

    def _line(self, done: int, total: int | None, seconds: float) -> str:
        count = f"{done}/{total} {self.unit} ({100 * done / total:.0f}%)" if total else f"{done} {self.unit}"
        left = f", about {seconds / done * (total - done):.0f} s left" if total and 0 < done < total else ""
        notes = "".join(f", {name} {value}" for name, value in self.notes.items())
        return f"{self.description}: {count}, {seconds:.1f} s{left}{notes}"

