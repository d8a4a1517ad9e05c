"""A TCP relay that keeps shards from linking to a routing broker, black-holes their links,
or resets every connection through it (tests and benchmarks of lost links:
``tests/integration/test_router_bypass.py``, ``tests/integration/test_broker_link_lost.py``,
``bench/router_bypass.py``)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading

#: The ZMTP 3 greeting every connection starts with, each way (bytes).
GREETING = 64


class ShardGate:
    """A TCP relay to a routing broker.  Shut to shards (:meth:`shut`), it closes every
    connection a shard made through it and each one a shard makes later, once the READY
    command of its handshake names a shard's identity (``s-``), before the router sees
    that READY; clients' connections are relayed throughout.  The router then has no
    link to the shards, while its clients and the broker hear it as before.

    Black-holed (:meth:`blackhole`), the shards' connections open at that moment carry
    nothing more from the router (what it sends them is dropped, without an error), as a
    connection that died one way would: each shard notices by its ZMTP heartbeats and
    connects again, and a new connection is relayed."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.shut_to_shards = False
        self.refused = 0  # shards' connections closed
        self.opened = 0  # connections accepted
        self.holed_below = 0  # connections numbered below it are black-holed to shards
        self.swallowed = 0  # bytes from the router dropped on black-holed connections
        self.resets = 0
        self.stopped = False
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def shut(self) -> None:
        """Close the shards' connections, and each one they make, until :meth:`open`."""
        self.shut_to_shards = True

    def blackhole(self) -> None:
        """Drop from now on what the router sends by the shards' connections open now."""
        self.holed_below = self.opened

    def reset(self) -> None:
        """Close every connection open now, both ways, as a connection reset does: what
        was in flight on it is lost; the peers connect again, and are relayed."""
        with self.lock:
            socks, self.socks = self.socks, []
            self.resets += 1
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def open(self) -> None:
        """Relay the shards' connections again (they connect every 0.1-0.35 s)."""
        self.shut_to_shards = False

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
                number = self.opened
                self.opened += 1
            threading.Thread(target=self._pump, args=(down, up, number), daemon=True).start()

    def _pump(self, down: socket.socket, up: socket.socket, number: int) -> None:
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
                        if shard and number < self.holed_below:
                            self.swallowed += len(data)
                            continue
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
