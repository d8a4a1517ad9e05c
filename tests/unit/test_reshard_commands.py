"""The operator's scale commands to the broker's resharding (zps/broker/reshard.py,
``Resharder.request``), on the broker's state without sockets."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.test_cluster import reg
from zps.broker.reshard import Resharder
from zps.core.cluster import ClusterState


class Host:
    """What the resharding's commands use of the broker."""

    def __init__(self) -> None:
        self.state = ClusterState(2, n_slots=16)
        for node in ("a", "b", "c"):
            reg(self.state, node)
        self.changed = 0

    def state_changed(self) -> None:
        self.changed += 1


def test_the_same_scale_command_again_keeps_the_move_in_flight() -> None:
    host = Host()
    r = Resharder(host, durable=True, heartbeat_interval=0.1, liveness=10)  # type: ignore[arg-type]
    first = r.request(1, 1.0)
    assert first["ok"], first
    assert r.record is not None
    # A move is in flight (fenced at its source) when the command comes again.
    r.record = replace(r.record, source=1, dest=0, slots=(1, 3, 5), stage="copying")
    again = r.request(1, 2.0)
    assert again == {"ok": True, "msg": "scaling to 1 partitions is under way"}
    assert (r.record.source, r.record.dest, r.record.slots, r.record.stage) == (
        1,
        0,
        (1, 3, 5),
        "copying",
    )
    other = r.request(2, 3.0)
    assert not other["ok"] and "cancel it first" in other["msg"]
