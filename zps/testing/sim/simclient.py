"""The stand-in client of a simulated cluster (:class:`SimClient`, for
:class:`zps.client.connection.Connection`: ClientSession with real request frames; its
timer calls ``tick``), and :class:`Op`, one push or read a client made, as the run's model
records it (the real client's, :mod:`.realclient`, too)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zps.client.session import ClientSession, Deliver, Fail, Send
from zps.protocol.codec import Encoder, decode
from zps.testing.sim.nodes import HB, TABLE_WIRE, TICK, World


@dataclass
class Op:
    """One push (or read) a client made, for the model."""

    client: str
    partition: int
    row: int
    grad: int
    submitted: float
    deadline: float
    outcome: str = ""  # "acked", "failed", "" (none yet)
    at: float = math.inf
    shard: str = ""
    epoch: int = -1
    values: Any = None
    rows: list[int] = field(default_factory=list)


class SimClient:
    def __init__(self, world: World, name: str, *, timeout: float, reader: bool = False) -> None:
        self.w = world
        self.name = name
        self.timeout = timeout
        self.reader = reader
        self.alive = False
        self.gen = 0
        self.pushing = False
        self.idle_until = 0.0

    def start(self) -> None:
        self.gen += 1
        self.alive = True
        self.session: ClientSession[Op] = ClientSession(
            f"{self.name}-{self.gen}".encode(), timeout=self.timeout, max_backoff=0.5
        )
        self.w.net.attach(self.name, self.on_message)
        self.send(("hello",))
        gen = self.gen
        self.w.sched.after(TICK, lambda: self._timer(gen))

    def crash(self) -> None:
        self.alive = False
        self.gen += 1
        self.w.net.detach(self.name)
        for _, op, _ in list(self.session.in_flight()):
            if op.outcome == "":
                op.outcome, op.at = "lost-client", self.w.sched.now

    def send(self, msg: Any) -> None:
        self.w.net.send(self.name, "broker", msg)

    def _timer(self, gen: int) -> None:
        if not self.alive or gen != self.gen:
            return
        now = self.w.sched.now
        self._do(self.session.tick(now))
        if int(now / HB) != int((now - TICK) / HB):
            self.send(("client-hb",))
        if (
            self.pushing
            and now >= self.idle_until
            and len(self.session) < 4
            and self.session.map is not None
            and self.w.sched.rng.random() < 0.6
        ):
            self.push()
        self.w.sched.after(TICK, lambda: self._timer(gen))

    def push(self) -> None:
        rng, w = self.w.sched.rng, self.w
        row = rng.randrange(w.rows)
        grad = rng.randint(1, 5)
        p = row % w.n_partitions
        enc = Encoder()
        ops: list[dict[str, Any]] = [
            {"op": "create", "spec": TABLE_WIRE},
            {"op": "push_rows", "t": "emb",
             "ids": enc.array(np.array([row], dtype=np.int64)),
             "g": enc.array(np.array([[-grad]], dtype=np.float32))},
        ]  # fmt: skip
        now = w.sched.now
        op = Op(self.name, p, row, grad, now, now + self.timeout)
        w.ops.append(op)
        self._do(self.session.submit(p, ops, enc, op, now))

    def probe(self, p: int) -> Op:
        """A write of nothing (a gradient of 0) to ``p``: whether it takes writes."""
        enc = Encoder()
        ops: list[dict[str, Any]] = [
            {"op": "create", "spec": TABLE_WIRE},
            {"op": "push_rows", "t": "emb",
             "ids": enc.array(np.array([p], dtype=np.int64)),
             "g": enc.array(np.zeros((1, 1), dtype=np.float32))},
        ]  # fmt: skip
        now = self.w.sched.now
        op = Op(self.name, p, p, 0, now, now + self.timeout)
        self._do(self.session.submit(p, ops, enc, op, now))
        return op

    def read(self, p: int, rows: list[int]) -> Op:
        enc = Encoder()
        ops = [{"op": "pull_rows", "t": "emb", "ids": enc.array(np.array(rows, dtype=np.int64))}]
        now = self.w.sched.now
        op = Op(self.name, p, -1, 0, now, now + self.timeout, rows=rows)
        self._do(self.session.submit(p, ops, enc, op, now))
        return op

    def on_message(self, src: str, msg: Any) -> None:
        now = self.w.sched.now
        if msg[0] == "map":
            self._do(self.session.on_map(msg[1], now))
        elif msg[0] == "reply":
            frames, shard = msg[1], msg[2]
            m = decode(frames)
            self.last_from = (shard, m.route.epoch)
            self._do(self.session.on_reply(m, now))

    def _do(self, actions: list[Any]) -> None:
        now = self.w.sched.now
        for a in actions:
            if isinstance(a, Send):
                self.send(("request", a.frames))
            elif isinstance(a, Deliver):
                op = a.token
                shard, epoch = self.last_from
                res = a.msg.header.get("res") or []
                if op.row < 0:
                    st = res[0] if res else {}
                    if st.get("st") == "OK":
                        arr = decode_array(a.msg, st["a"])
                        op.values = [float(v) for v in arr.reshape(-1)]
                        op.outcome = "acked"
                    else:
                        op.outcome = "failed:" + str(st.get("st"))
                else:
                    ok = len(res) == 2 and all(r.get("st") == "OK" for r in res)
                    op.outcome = "acked" if ok else "failed:" + str(res)
                op.at, op.shard, op.epoch = now, shard, epoch
                self.w.on_outcome(op)
            elif isinstance(a, Fail):
                op = a.token
                op.outcome, op.at = f"failed:{type(a.error).__name__}", now
                self.w.on_outcome(op)


def decode_array(msg: Any, desc: list[Any]) -> Any:
    from zps.protocol.codec import array_from

    return array_from(desc, msg.payloads, max_bytes=1 << 30)
