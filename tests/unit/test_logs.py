"""Log lines: sd-daemon priority prefixes on the journal stream, plain elsewhere."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from zps.ops.logs import JournalFormatter, formatter_for, is_journal, priority, setup_logging


def _stream_id(f: object) -> str:
    st = os.fstat(f.fileno())  # type: ignore[attr-defined]
    return f"{st.st_dev}:{st.st_ino}"


def test_priorities_of_levels() -> None:
    assert priority(logging.CRITICAL) == 2
    assert priority(logging.ERROR) == 3
    assert priority(logging.WARNING) == 4
    assert priority(logging.INFO) == 6
    assert priority(logging.DEBUG) == 7
    assert priority(5) == 7


def test_journal_stream_is_matched_by_device_and_inode(tmp_path: Path) -> None:
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        env = {"JOURNAL_STREAM": _stream_id(a)}
        assert is_journal(a, env)
        # A child whose stderr went elsewhere inherits the variable, not the stream.
        assert not is_journal(b, env)
        assert not is_journal(a, {})
        assert not is_journal(a, {"JOURNAL_STREAM": "garbage"})
        assert not is_journal(a, {"JOURNAL_STREAM": "1:x"})
        assert isinstance(formatter_for(a, env), JournalFormatter)
        assert not isinstance(formatter_for(b, env), JournalFormatter)


def _record(level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord("zps.broker", level, __file__, 1, msg, None, None)


def test_journal_lines_carry_their_priority_on_every_line() -> None:
    fmt = JournalFormatter("%(levelname)s %(name)s: %(message)s")
    assert fmt.format(_record(logging.ERROR, "partition 0 lost")).startswith("<3>ERROR ")
    assert fmt.format(_record(logging.WARNING, "w")).startswith("<4>")
    assert fmt.format(_record(logging.INFO, "i")).startswith("<6>")
    assert fmt.format(_record(logging.DEBUG, "d")).startswith("<7>")
    lines = fmt.format(_record(logging.ERROR, "first\nsecond\nthird")).split("\n")
    assert lines == ["<3>ERROR zps.broker: first", "<3>second", "<3>third"]


def test_setup_writes_prefixed_lines_to_the_journal_and_plain_lines_elsewhere(
    tmp_path: Path,
) -> None:
    root = logging.getLogger()
    saved, saved_level = list(root.handlers), root.level
    for h in saved:
        root.removeHandler(h)
    try:
        for journal in (True, False):
            path = tmp_path / f"log-{journal}"
            with open(path, "w") as out:
                env = {"JOURNAL_STREAM": _stream_id(out)} if journal else {}
                handler = setup_logging("info", env, out)
                assert handler is not None
                logging.getLogger("zps.test").error("bad")
                logging.getLogger("zps.test").info("fine")
                logging.getLogger("zps.test").debug("hidden")
                root.removeHandler(handler)
            lines = path.read_text().splitlines()
            assert len(lines) == 2, lines
            if journal:
                assert lines == ["<3>ERROR zps.test: bad", "<6>INFO zps.test: fine"]
            else:
                assert not lines[0].startswith("<")
                assert lines[0].endswith("ERROR zps.test: bad")
                assert lines[0][:4].isdigit()  # a time stamp of its own
    finally:
        for h in saved:
            root.addHandler(h)
        root.setLevel(saved_level)
