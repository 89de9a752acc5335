"""What the command line shows on stderr while a model loads: what is read, how much, for how long.

    with Loading(model_dir) as loading:
        engine = load(model_dir, options)
        loading.done(engine)

On a terminal the line is redrawn in place every `TICK` seconds and ends as one line saying what was
loaded; elsewhere it is shown only with -v (INFO on the `colibri` logger), as those two lines.
`colibri -q` shows none. The bytes are the process's own reads (Linux's /proc/self/io `rchar`: every
read the loader makes, whatever the format), so nothing in the loaders reports progress.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

from .sizes import format_bytes

__all__ = ["Loading"]

log = logging.getLogger("colibri")
TICK = 0.25  # seconds between redraws on a terminal


def bytes_read() -> int | None:
    """Bytes this process has read through read(2) and its kin so far (None off Linux)."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None


class Loading:
    """The loading line of one model (see the module docstring)."""

    def __init__(self, model_dir: Path, stream=None):
        self.name = Path(model_dir).name
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() and log.isEnabledFor(logging.WARNING)  # not under -q
        self.shown = self.live or log.isEnabledFor(logging.INFO)  # -v: also where stderr is no terminal
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> Loading:
        self.t0, self.read0 = time.perf_counter(), bytes_read()
        if self.live:
            self._thread = threading.Thread(target=self._redraw, name="colibri-loading", daemon=True)
            self._thread.start()
        elif self.shown:
            self.stream.write(f"colibri: loading {self.name}\n")
        return self

    def _line(self) -> str:
        read = bytes_read()
        got = "" if read is None or self.read0 is None else f"{format_bytes(read - self.read0)} read · "
        return f"colibri: loading {self.name}: {got}{time.perf_counter() - self.t0:.1f} s"

    def _redraw(self) -> None:
        while not self._stop.wait(TICK):
            self.stream.write(f"\r\033[K{self._line()}")
            self.stream.flush()

    def done(self, engine) -> None:
        """Say what was loaded: the architecture, its resident weights, the time and bytes read."""
        self._finish()
        if self.shown:
            read = bytes_read()
            got = "" if read is None or self.read0 is None else f", {format_bytes(read - self.read0)} read"
            self.stream.write(f"colibri: loaded {self.name} ({engine.arch.name}, {format_bytes(engine.resident_bytes)} "
                              f"resident) in {time.perf_counter() - self.t0:.2f} s{got}\n")
            self.stream.flush()

    def _finish(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.stream.write("\r\033[K")  # the live line gives way to what follows
            self.stream.flush()

    def __exit__(self, *exc) -> None:
        self._finish()
