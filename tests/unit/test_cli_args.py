"""Command lines: ``zps-server demo``'s flags checked before anything starts, its
processes' logs kept (and named) when a run fails; output into a pipe whose reader went
away ends quietly."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zps.cli.main import server_main
from zps.examples import demo


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--epochs", "0", "must be at least 1, not 0"),
        ("--workers", "0", "must be at least 1, not 0"),
        ("--partitions", "0", "must be at least 1, not 0"),
        ("--replication", "-1", "must be at least 1, not -1"),
        ("--staleness", "-1", "must be at least 0, not -1"),
        ("--epochs", "two", "'two' is not an integer"),
    ],
)
def test_a_bad_flag_is_a_usage_error_naming_it(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        server_main(["demo", flag, value])
    assert exit.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err


def test_a_failed_run_keeps_its_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: demo.LocalCluster, timeout: float = 30.0) -> demo.LocalCluster:
        assert self.workdir is not None
        (self.workdir / "broker.log").write_text("the broker's last words\n")
        raise RuntimeError("the broker exited early")

    monkeypatch.setattr(demo.LocalCluster, "start", refuse)
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="exited early"):
        demo.run_demo(out=out)
    m = re.search(r"logs are kept in (\S+)", out.getvalue())
    assert m is not None, out.getvalue()
    kept = Path(m.group(1))
    try:
        assert (kept / "broker.log").read_text() == "the broker's last words\n"
    finally:
        shutil.rmtree(kept)


def test_output_to_a_closed_pipe_ends_quietly_with_the_sigpipe_status() -> None:
    config = Path(__file__).resolve().parents[2] / "deploy" / "zps.toml"
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command prints
    try:
        done = subprocess.run(
            [sys.executable, "-m", "zps", "check-config", str(config)],
            stdout=write,
            stderr=subprocess.PIPE,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, b"")


def test_an_unknown_flag_is_told_with_its_commands_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit:
        server_main(["status", "--brokr", "tcp://127.0.0.1:5555"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: zps-server status ")
    assert "zps-server status: error: unrecognized arguments: --brokr" in err


def test_a_shards_broker_flag_overrides_the_files_pair(tmp_path: Path) -> None:
    from zps.cli.main import server_parser
    from zps.cli.server import shard_config
    from zps.ops.config import load_settings

    path = tmp_path / "zps.toml"
    path.write_text('[shard]\nbrokers = ["tcp://a:5555", "tcp://b:5555"]\n')
    settings = load_settings(str(path), required=True)
    flagged = server_parser().parse_args(["shard", "--broker", "tcp://c:5555"])
    assert shard_config(flagged, settings).endpoints == ("tcp://c:5555",)
    plain = server_parser().parse_args(["shard"])
    assert shard_config(plain, settings).endpoints == ("tcp://a:5555", "tcp://b:5555")
