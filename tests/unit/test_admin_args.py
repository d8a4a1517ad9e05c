"""The admin commands refuse integers out of range at once, as usage errors naming the
flag (exit 2), before anything connects to a broker; values in range are taken."""

from __future__ import annotations

import pytest

from zps.cli.main import server_main, server_parser

BROKER = ["--broker", "tcp://127.0.0.1:9"]  # never reached: the command line is refused


@pytest.mark.parametrize(
    ("argv", "flag", "says"),
    [
        (["reset-partition", "--partition", "-1", "--accept-data-loss"], "--partition", "-1"),
        (["reset-partition", "--partition", "x", "--accept-data-loss"], "--partition", "x"),
        (["scale", "--partitions", "0"], "--partitions", "0"),
        (["scale", "--partitions", "-2"], "--partitions", "-2"),
        (
            ["scale", "--partitions", "2", "--max-slots-per-move", "-1"],
            "--max-slots-per-move",
            "-1",
        ),
        (["scale", "--partitions", "2", "--piece-bytes", "-1"], "--piece-bytes", "-1"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_an_integer_out_of_range_is_a_usage_error_naming_the_flag(
    argv: list[str], flag: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        server_main([*argv, *BROKER])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    command = argv[0]
    assert err.startswith(f"usage: zps-server {command} "), err
    low = {"--partitions": 1}.get(flag, 0)
    reason = f"'{says}' is not an integer" if says == "x" else f"must be at least {low}, not {says}"
    assert f"zps-server {command}: error: argument {flag}: {reason}" in err, err


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["reset-partition", "--partition", "0", "--accept-data-loss"], "partition", 0),
        (["scale", "--partitions", "1"], "partitions", 1),
        (["scale", "--partitions", "2", "--max-slots-per-move", "0"], "max_slots_per_move", 0),
        (["scale", "--partitions", "2", "--piece-bytes", "0"], "piece_bytes", 0),
        (["scale", "--cancel"], "max_slots_per_move", 0),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_the_lowest_value_in_range_is_taken(argv: list[str], field: str, value: int) -> None:
    args = server_parser().parse_args([*argv, *BROKER])
    assert getattr(args, field) == value
