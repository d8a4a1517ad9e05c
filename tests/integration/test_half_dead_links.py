"""Links whose connection died with neither end told, with real processes, with and
without CURVE: a broker pair's peer link, and a shard's link to a routing broker.

Each link goes through a relay (:class:`HalfOpenProxy`) that, frozen, holds every
connection it relayed open and silent, as a network path that died unseen; later
connections are relayed.  The link's DEALER must notice (its pings go unanswered),
connect again, and carry traffic there.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from tests.integration.test_curve_roles import keygen, q
from tests.integration.test_identities import HalfOpenProxy
from zps.ops.config import ClientConfig, Security
from zps.optim import SGD
from zps.testing import LocalCluster, PairCluster, Proc, free_port

pytestmark = pytest.mark.timeout(120)

#: How long a frozen link may take to carry traffic again: the DEALER's ping timeout
#: (4 s) and a reconnect, with room for a loaded host.
RECOVERY_S = 15.0


class Keys:
    """CURVE keys for a cluster: the brokers' pair (routing brokers serve with it too),
    a shard's and a client's, all allowed."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "keys"
        allowed = work / "allowed"
        allowed.mkdir(parents=True)
        for name in ("broker", "shard", "client"):
            keygen(self.dir, name)
            shutil.copy(self.dir / f"{name}.key", allowed / f"{name}.key")
        self.work, self.allowed = work, allowed

    def config(self, key: str) -> list[str]:
        """``--config`` with ``key``'s [security] section."""
        path = self.work / f"{key}.toml"
        path.write_text(
            f"[security]\n"
            f"curve_secret_key_file = {q(self.dir / f'{key}.key_secret')}\n"
            f"curve_public_key_file = {q(self.dir / f'{key}.key')}\n"
            f"broker_public_key_file = {q(self.dir / 'broker.key')}\n"
            f"allowed_clients_dir = {q(self.allowed)}\n"
        )
        return ["--config", str(path)]

    def client(self, timeout: float) -> ClientConfig:
        sec = Security(
            curve_secret_key_file=str(self.dir / "client.key_secret"),
            curve_public_key_file=str(self.dir / "client.key"),
            broker_public_key_file=str(self.dir / "broker.key"),
        )
        return ClientConfig(
            security=sec, connect_timeout=timeout, timeout=timeout, name="zps.testing"
        )


def client_config(keys: Keys | None, timeout: float = 10.0) -> ClientConfig:
    if keys is None:
        return ClientConfig(connect_timeout=timeout, timeout=timeout, name="zps.testing")
    return keys.client(timeout)


def cluster_status(c: LocalCluster, keys: Keys | None) -> dict[str, Any]:
    with zps.connect_sync(c.address, client_config(keys, 10.0)) as ps:
        return ps.status()


def wait_status(
    c: LocalCluster, keys: Keys | None, ok: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    deadline = time.monotonic() + RECOVERY_S
    while True:
        status = cluster_status(c, keys)
        if ok(status):
            return status
        assert time.monotonic() < deadline, f"not {what} after {RECOVERY_S}s: {status}"
        time.sleep(0.1)


def carried(proxy: HalfOpenProxy) -> list[tuple[list[bytes], list[bytes]]]:
    """Each relayed connection's first ZMTP commands each way (a handshake that never
    reached READY shows here)."""
    return [
        ([n for n, _ in z["up"].commands[:4]], [n for n, _ in z["down"].commands[:4]])
        for z in proxy.zmtp
    ]


def wait_linked(proxy: HalfOpenProxy, what: str) -> None:
    """Until a connection through ``proxy`` finished its handshake (the server's READY
    went down it).  A peer may be heard over the other link alone before this one is
    made (it connects again every 0.1-0.35 s until the far end listens)."""
    deadline = time.monotonic() + RECOVERY_S
    while not any(z["down"].first(b"READY") is not None for z in proxy.zmtp):
        assert time.monotonic() < deadline, (
            f"{what} never finished a handshake through the relay; what each connection "
            f"it relayed carried (ZMTP commands up, down): {carried(proxy)}"
        )
        time.sleep(0.02)


def wait_accepted(proxy: HalfOpenProxy, count: int, what: str) -> None:
    deadline = time.monotonic() + RECOVERY_S
    while proxy.accepted < count:
        assert time.monotonic() < deadline, (
            f"{what} never connected again through the relay; what each connection it "
            f"relayed carried (ZMTP commands up, down): {carried(proxy)}"
        )
        time.sleep(0.02)


class ProxiedPair(PairCluster):
    """A broker pair whose peer links each go through a relay (``relays[i]``: to
    broker i's peer socket)."""

    relays: list[HalfOpenProxy]

    def start_member(self, role: str, grace: float | None = None) -> Proc:
        i = 0 if role == "primary" else 1
        args = [
            self.python, "-m", "zps", "broker", "--bind", self.endpoint(i),
            "--pair-role", role,
            "--peer-bind", f"tcp://127.0.0.1:{self.ports[2 + i]}",
            "--peer", f"tcp://127.0.0.1:{self.relays[1 - i].port}",
            "--peer-timeout", str(self.peer_timeout),
            "--partitions", str(self.partitions), "--replication", str(self.replication),
            "--startup-grace", str(self.startup_grace if grace is None else grace),
            *self.common_args(), *self.broker_args,
        ]  # fmt: skip
        return self.spawn(f"broker-{role}", args)


@pytest.fixture(params=[False, True], ids=["plain", "curve"])
def keys(request: pytest.FixtureRequest, tmp_path: Path) -> Keys | None:
    return Keys(tmp_path) if request.param else None


def test_a_pair_hears_its_peer_again_after_the_peer_links_died_unseen(
    keys: Keys | None, tmp_path: Path
) -> None:
    """Both peer links freeze: the active broker finds its peer silent, and within the
    ping timeout both links are made again, the peer is heard and the standby takes the
    active broker's newer state record again."""
    c = ProxiedPair(partitions=1, shards=1, liveness=10, workdir=tmp_path)
    c.ports = [free_port() for _ in range(4)]
    c.relays = [HalfOpenProxy(("127.0.0.1", c.ports[2 + i])) for i in range(2)]
    if keys is not None:
        c.broker_args = keys.config("broker")
        c.shard_args = keys.config("shard")
    try:
        c.prepare()
        c.port = c.ports[0]
        c.start_member("primary")
        c.start_member("backup")
        c.start_shard()

        def pair(s: dict[str, Any]) -> dict[str, Any]:
            return dict(s["pair"])

        def holding(s: dict[str, Any]) -> bool:
            peer = pair(s)["peer"]
            return c.healthy(s) and peer["alive"] and peer["has_record"] is not None

        before = pair(wait_status(c, keys, holding, "a pair with its standby's record"))
        held = before["peer"]["has_record"]
        silences = before["peer"]["silences"]
        # Both links must carry beats when they freeze: one made after the freeze would
        # carry the peer's beats on, and no silence would follow.
        for relay in c.relays:
            wait_linked(relay, "a peer link")
        accepted = [r.accepted for r in c.relays]
        for relay in c.relays:
            relay.freeze()
        for relay, n in zip(c.relays, accepted, strict=True):
            wait_accepted(relay, n + 1, "a peer link")
        # The active broker found its peer silent (a whole timeout unheard) and heard it
        # again: counted when heard, so no transient state is polled for.
        wait_status(
            c,
            keys,
            lambda s: pair(s)["peer"]["silences"] > silences and pair(s)["peer"]["alive"],
            "the peer heard again after a silence",
        )
        with zps.connect_sync(c.address, client_config(keys)) as ps:
            ps.create_dense("after", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        wait_status(
            c,
            keys,
            lambda s: (pair(s)["peer"]["has_record"] or 0) > held,
            "the standby holding the newer record",
        )
        assert pair(cluster_status(c, keys))["state"] == before["state"]  # no failover
    finally:
        c.stop()
        for relay in c.relays:
            relay.close()


def router_report(endpoint: str, cfg: ClientConfig) -> dict[str, Any]:
    """The routing broker at ``endpoint``'s own report."""

    async def ask() -> dict[str, Any]:
        async with zps.connect(endpoint, cfg) as ps:
            reply = await ps.status()
        return dict(reply["router"])

    return asyncio.run(asyncio.wait_for(ask(), 20))


def router_routed(endpoint: str, cfg: ClientConfig) -> int:
    """Requests the routing broker at ``endpoint`` routed (from its own report)."""
    return int(router_report(endpoint, cfg)["routed"])


def test_a_shards_router_link_that_died_unseen_is_made_again(
    keys: Keys | None, tmp_path: Path
) -> None:
    """A routing broker advertises a relay; the shard's link to it freezes: the shard
    connects again within the ping timeout, and requests through the router reach it
    there."""
    c = LocalCluster(partitions=1, shards=1, liveness=10, workdir=tmp_path)
    if keys is not None:
        c.broker_args = keys.config("broker")
        c.shard_args = keys.config("shard")
    bind = free_port()
    relay = HalfOpenProxy(("127.0.0.1", bind))
    advertised = f"tcp://127.0.0.1:{relay.port}"
    cfg = client_config(keys)
    try:
        c.prepare()
        c.start_broker()
        c.start_shard()
        router_args = keys.config("broker") if keys is not None else []
        c.spawn(
            "router",
            [c.python, "-m", "zps", "broker", "--follow", c.address,
             "--bind", f"tcp://127.0.0.1:{bind}", "--advertise", advertised,
             *c.common_args(), *router_args],
        )  # fmt: skip

        def routed(s: dict[str, Any]) -> bool:
            return c.healthy(s) and any(0 in r["partitions"] for r in s["routers"])

        wait_status(c, keys, routed, "partition 0 routed by the router")
        wait_accepted(relay, 1, "the shard")
        with zps.connect_sync(c.address, cfg) as ps:
            ps.create_dense("via", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        before = router_routed(advertised, cfg)
        relay.freeze()  # the shard's link, and the clients' made so far
        # No client runs now: the next connection relayed is the shard's.
        wait_accepted(relay, relay.accepted + 1, "the shard's router link")
        # The router hears the shard there (a heartbeat at once on a new connection);
        # until then it sends partition 0's requests to the broker.
        deadline = time.monotonic() + RECOVERY_S
        while (report := router_report(advertised, cfg))["unheard"]:
            assert time.monotonic() < deadline, f"the shard not heard again: {report}"
            time.sleep(0.05)
        with zps.connect_sync(c.address, cfg) as ps:
            ps.push_dense("via", np.ones(2))
            np.testing.assert_array_equal(ps.pull_dense("via"), [-1.0, -1.0])
        assert router_routed(advertised, cfg) >= before + 2  # through the router
    finally:
        c.stop()
        relay.close()
