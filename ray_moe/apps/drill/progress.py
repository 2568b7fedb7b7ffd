"""Progress lines while a drill runs: one short line per phase, ``[drill 12s] ...``, on stderr.

    [drill 0s] ray: started a local instance (4 CPUs)
    [drill 7s] step 5/10 data-path faults (3, 4, 7, 6)
    [drill 8s] fault 3 peer-count-disagreement: abort before payload exchange (ok)

The report itself goes to stdout (text or ``--json``), so the two never mix.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, TextIO


class Progress:
    """Writes ``[drill <elapsed>s] <message>`` lines; ``quiet`` keeps them (``lines``) without writing."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream  # None: the current sys.stderr at each write
        self._quiet = quiet
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self.lines: list[str] = []

    @classmethod
    def silent(cls) -> "Progress":
        return cls(quiet=True)

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def __call__(self, message: str) -> None:
        line = f"[drill {self.elapsed():.0f}s] {message}"
        with self._lock:
            self.lines.append(line)
            if not self._quiet:
                out = self._stream if self._stream is not None else sys.stderr
                print(line, file=out, flush=True)


__all__ = ["Progress"]
