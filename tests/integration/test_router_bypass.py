"""A routing broker that answers its clients but has no link to a partition's primary,
with real processes: the client sends that partition's requests to the broker while the
router refuses them (``bypass``), and to the router again once it routes them."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

from tests.integration.test_routers import (
    HOSTS,
    RouterCluster,
    acked_after,
    router_report,
    run_load,
)
from zps.testing import ExactSumLoad, free_port

#: The ZMTP 3 greeting every connection starts with, each way (bytes).
GREETING = 64


class ShardGate:
    """A TCP relay to a routing broker.  Shut to shards (:meth:`shut`), it closes every
    connection a shard made through it and each one a shard makes later, once the READY
    command of its handshake names a shard's identity (``s-``), before the router sees
    that READY; clients' connections are relayed throughout.  The router then has no
    link to the shards, while its clients and the broker hear it as before."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.shut_to_shards = False
        self.refused = 0  # shards' connections closed
        self.stopped = False
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def shut(self) -> None:
        self.shut_to_shards = True

    def _accept(self) -> None:
        while not self.stopped:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream)
            except OSError:
                down.close()
                continue
            with self.lock:
                self.socks += [down, up]
            threading.Thread(target=self._pump, args=(down, up), daemon=True).start()

    def _pump(self, down: socket.socket, up: socket.socket) -> None:
        held = bytearray()  # what the peer sent past its greeting, until its READY is whole
        sent = 0  # bytes of the peer's greeting passed on
        shard: bool | None = None  # None: its READY is not whole yet
        try:
            while not self.stopped:
                if shard and self.shut_to_shards:
                    self.refused += 1
                    return
                ready, _, _ = select.select([down, up], [], [], 0.05)
                for r in ready:
                    data = r.recv(65536)
                    if not data:
                        return
                    if r is up:
                        down.sendall(data)
                        continue
                    if shard is not None:
                        up.sendall(data)
                        continue
                    # The greeting goes on at once (both ends wait on it); what follows
                    # it is held until the READY command is whole.
                    n = min(len(data), GREETING - sent)
                    if n:
                        up.sendall(data[:n])
                        sent += n
                    held += data[n:]
                    shard = self._is_shard(held)
                    if shard is not None and not (shard and self.shut_to_shards):
                        up.sendall(held)
        except OSError:
            return
        finally:
            down.close()
            up.close()

    @staticmethod
    def _is_shard(held: bytearray) -> bool | None:
        """Whether the first command in ``held`` (a NULL mechanism's READY) names a
        shard's identity; None until it is whole."""
        if len(held) < 2:
            return None
        long = held[0] & 0x02
        head = 9 if long else 2
        if len(held) < head:
            return None
        size = int.from_bytes(held[1:9], "big") if long else held[1]
        if len(held) < head + size:
            return None
        body = bytes(held[head : head + size])
        at = body.find(b"\x08Identity")
        return at >= 0 and body[at + 9 + 4 : at + 9 + 4 + 2] == b"s-"

    def close(self) -> None:
        self.stopped = True
        self.listener.close()
        with self.lock:
            for s in self.socks:
                s.close()


def test_a_partition_the_router_cannot_reach_goes_to_the_broker_meanwhile() -> None:
    """The router of host-a loses its links to the shards (they cannot connect again)
    while its clients and the broker still reach it: it refuses the requests of host-a's
    partition as ``not connected`` and marks the refusal ``bypass``, and every writer has
    pushes acknowledged within a few seconds (through the broker), where without the
    bypass the router's refusals went on until each call's 30 s deadline."""
    stall = 5.0
    c = RouterCluster(partitions=2, shards=2, shard_hosts=HOSTS)
    c.routers = {}
    port = free_port()
    gate = ShardGate(("127.0.0.1", port))
    try:
        with c:
            gated = f"tcp://127.0.0.1:{gate.port}"
            c.start_router(HOSTS[0], port=port, advertise=gated)
            c.start_router(HOSTS[1])
            c.wait_routed()
            before = c.status()["broker"]["routed"]

            async def shut(load: ExactSumLoad) -> None:
                gate.shut()
                t0 = time.monotonic()
                await acked_after(load, t0, stall)
                await acked_after(load, time.monotonic(), stall)

            run_load(c, shut)
            report = router_report(gated)
            assert gate.refused > 0, "no shard's link to the router was closed"
            assert report["undeliverable"] > 0, report  # it refused: not connected
            assert c.status()["broker"]["routed"] > before  # the broker carried them
    finally:
        gate.close()


def test_the_bypass_ends_when_the_router_routes_again() -> None:
    """A bypass lasts ``client.failover_timeout``: once the shards' links are back, the
    partition's requests go through its router again, not the broker."""
    c = RouterCluster(partitions=2, shards=2, shard_hosts=HOSTS)
    c.routers = {}
    port = free_port()
    gate = ShardGate(("127.0.0.1", port))
    try:
        with c:
            gated = f"tcp://127.0.0.1:{gate.port}"
            c.start_router(HOSTS[0], port=port, advertise=gated)
            c.start_router(HOSTS[1])
            c.wait_routed()

            async def shut_and_open(load: ExactSumLoad) -> None:
                gate.shut()
                await acked_after(load, time.monotonic(), 5.0)
                report = await asyncio.to_thread(router_report, gated)
                assert report["undeliverable"] > 0, report
                gate.shut_to_shards = False  # the shards connect again (0.1-0.35 s)
                routed = report["routed"]
                deadline = time.monotonic() + 10.0
                while True:
                    report = await asyncio.to_thread(router_report, gated)
                    if report["routed"] > routed + 10:
                        break
                    assert time.monotonic() < deadline, f"not routing again: {report}"
                    await asyncio.sleep(0.1)

            run_load(c, shut_and_open)
    finally:
        gate.close()
