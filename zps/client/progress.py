"""Progress of a training worker: a bar on a terminal, periodic lines otherwise.

``report()`` is cheap (it only stores numbers); output is written at most
every ``interval`` seconds, to stderr, so a worker's own output and the
journal stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(
        self,
        *,
        name: str = "",
        stream: TextIO | None = None,
        enabled: bool = True,
        interval: float | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.name = name
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.interval = interval if interval is not None else (0.2 if self.tty else 10.0)
        self._clock = clock
        self.started = clock()
        self._last = -1e9
        self.metrics: dict[str, float] = {}
        self.rows = 0.0
        self.steps = 0
        self.loss: float | None = None

    def report(
        self,
        *,
        rows: float = 0,
        loss: float | None = None,
        total: float | None = None,
        **extra: float,
    ) -> None:
        """One step done: ``rows`` trained in it, its ``loss``; ``extra`` shown as is."""
        self.steps += 1
        self.rows += rows
        if loss is not None:
            # a smoothed loss reads better than a noisy per-batch one
            self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss
        if total is not None:
            extra["total"] = total
        self.metrics.update(extra)
        now = self._clock()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._write(now)

    def line(self, now: float | None = None) -> str:
        elapsed = max(1e-9, (now if now is not None else self._clock()) - self.started)
        parts = [f"{self.name}: " if self.name else "", f"step {self.steps}"]
        total = self.metrics.get("total")
        if total:
            frac = min(1.0, self.rows / total)
            bar = "#" * int(frac * 20) + "-" * (20 - int(frac * 20))
            parts.append(f"  [{bar}] {frac * 100:5.1f}%")
        parts.append(f"  {self.rows:,.0f} rows  {self.rows / elapsed:,.0f} rows/s")
        if self.loss is not None:
            parts.append(f"  loss {self.loss:.4f}")
        for k, v in self.metrics.items():
            if k != "total":
                parts.append(f"  {k} {v:g}")
        return "".join(parts)

    def _write(self, now: float) -> None:
        end = "" if self.tty else "\n"
        prefix = "\r" if self.tty else ""
        self.stream.write(prefix + self.line(now) + end)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.steps:
            self._write(self._clock())
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()
