"""A broker restarts without its record only once the shards are settled: none paused,
unreadable, cut off or with a disk fault still to strike (docs/design.md, "Simulation":
without its record, nothing else fails until the shards have re-registered)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from zps.testing.sim.faults import FAULTS
from zps.testing.sim.world import World, run_seed


def _world(n: int = 3) -> SimpleNamespace:
    disk = lambda: SimpleNamespace(enospc=0, efbig=0, fsync_eio=0, slow=0.0)  # noqa: E731
    shards = [SimpleNamespace(name=f"s-{i}", alive=True, disk=disk()) for i in range(n)]
    net = SimpleNamespace(paused=set(), slow={}, cut=set())
    clients = [SimpleNamespace(name=f"c{i}") for i in range(2)]
    return SimpleNamespace(
        shards=shards, net=net, clients=clients, readers=[], routers=[SimpleNamespace(name="r0")]
    )


def test_shards_settled_only_with_nothing_under_way() -> None:
    settled = World._shards_settled
    w = _world()
    assert settled(w)
    for harm in (
        lambda w: setattr(w.shards[1], "alive", False),
        lambda w: w.net.paused.add("s-2"),
        lambda w: w.net.slow.__setitem__("s-2", math.inf),  # reads nothing (seed 302515)
        lambda w: w.net.cut.add(("broker", "s-0")),
        lambda w: w.net.cut.add(("s-0", "broker")),  # one way, its claim held
        lambda w: setattr(w.shards[0].disk, "enospc", 2),
        lambda w: setattr(w.shards[0].disk, "efbig", 1),
        lambda w: setattr(w.shards[0].disk, "fsync_eio", 1),  # fires in the hold (302515)
        lambda w: setattr(w.shards[0].disk, "slow", 0.2),
    ):
        w = _world()
        harm(w)
        assert not settled(w)
    w = _world()
    w.net.paused.add("c0")  # a client's own faults leave the claims alone
    w.net.slow["c1"] = math.inf
    # Cuts that carry no claim: between shards (seed 438), towards a client or a router.
    w.net.cut |= {("s-4", "s-5"), ("s-5", "s-4"), ("s-0", "c0"), ("r0", "s-1")}
    assert settled(w)


def test_a_shard_deaf_through_the_hold_keeps_the_record() -> None:
    """Seed 302515: s-2 (primary of p1, LSN 69 at epoch 1, the only copy of the writes
    acknowledged at LSN 37-69) read nothing from 6.72 s to 10.12 s; the broker restarted
    without its record at 6.98 s, s-0 (dropped from p1's in-sync set at LSN 36) came back
    after the hold and took p1, and s-2's copy was held as a conflict."""
    faults = [*FAULTS, "slow", "client", "reshard", "routers"]
    r = run_seed(302515, faults=faults, real_client=True)
    assert r.ok, r.failures
    assert any("broker restarts with its record" in s for s in r.schedule)
