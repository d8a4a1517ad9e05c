"""Log set-up: plain lines on a terminal or file, sd-daemon priorities under journald.

journald reads a service's stderr line by line and files every line at the
unit's default priority (info) unless the line opens with a ``<N>`` prefix
(``sd-daemon(3)``): ``<3>`` error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug.
With the prefix, ``journalctl -p warning`` shows exactly the warnings and errors.

Rules:

- The prefix is written only when stderr *is* the journal stream: systemd sets
  ``$JOURNAL_STREAM`` to ``DEVICE:INODE`` of the stream it connected, and a child
  whose stderr was redirected elsewhere inherits the variable but not the stream,
  so the two are compared (``systemd.exec(5)``).  Anywhere else lines are plain
  and carry their own time stamp (journald stamps lines itself).
- Every line of a multi-line record (a traceback) carries the prefix: journald
  splits on newlines and would file the continuation lines at info.
- The environment is passed in by the caller; nothing here reads ``os.environ``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import IO

__all__ = ["JournalFormatter", "formatter_for", "is_journal", "priority", "setup_logging"]

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (``<2>`` critical ... ``<7>`` debug)."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def is_journal(stream: IO[str] | IO[bytes], environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` is the journal stream ``$JOURNAL_STREAM`` names."""
    value = environ.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError, AttributeError):
        # not a real file (pytest's capture), or a malformed value: no journal
        return False


class JournalFormatter(logging.Formatter):
    """Prefixes every line of a formatted record with its ``<N>`` priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def formatter_for(stream: IO[str], environ: Mapping[str, str]) -> logging.Formatter:
    """The formatter for lines written to ``stream``."""
    if is_journal(stream, environ):
        return JournalFormatter(JOURNAL_FORMAT)
    return logging.Formatter(PLAIN_FORMAT)


def setup_logging(
    level: str, environ: Mapping[str, str], stream: IO[str] | None = None
) -> logging.Handler | None:
    """Set the root logger to ``level`` (a name: "info", "warning", ...) and, unless
    it has handlers already (an embedding application's, or a test runner's), give
    it one writing to ``stream`` (default stderr).  Returns the handler added."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    if root.handlers:
        return None
    out = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter_for(out, environ))
    root.addHandler(handler)
    return handler
