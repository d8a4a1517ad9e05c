"""Liveness is measured apart from I/O: a shard behind a slow, full link keeps its lease.

A broker, a shard and a client each in a network namespace of their own (the approach of
``test_netns.py``), the shard's link shaped by ``tc`` ``tbf`` to 100 Mbit/s each way. The
client keeps six 4 MiB dense pushes and pulls in flight, uncompressed and not through shared
memory (the lab's hosts share a machine): about two seconds of link time queued each way,
more than a primary's lease (0.9 s here). Heartbeats and lease echoes travel on the shard's
liveness link (``h-`` + its identity), not behind that data, so the lease never lapses: no
request is refused ``NOT_PRIMARY`` and re-sent, the broker declares nothing dead (no
failover, the epoch stays), and the sums are exact. With heartbeats on the data connection,
echoes waited behind the queue, the primary refused requests that had already crossed its
link, and the client re-sent them.

With CURVE key roles on, a liveness link needs a shard key, the key its shard's data
identity is bound to.

The namespace test needs root, ``ip netns`` and ``tc`` with ``tbf``; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.integration import test_curve_roles as curve
from tests.integration.test_netns import PORT, Lab, ip
from zps.protocol.codec import MsgType

#: CURVE roles: a broker and two shards with keys of their own, clients with theirs.
roles = curve.roles

RATE = "100mbit"
# A primary's lease: 0.1 s x (10 - 1) = 0.9 s, about 11 MB at 100 Mbit/s.
HB = ["--heartbeat-interval", "0.1", "--liveness", "10"]
IN_FLIGHT = 6
ROUNDS = 2
ELEMS = 1 << 20  # float32: 4 MiB a push or a pull

CLIENT = """
import asyncio, json, sys, time
import numpy as np
import zps
from zps.ops.config import ClientConfig

ELEMS, IN_FLIGHT, ROUNDS = {elems}, {in_flight}, {rounds}

async def main(address):
    # Uncompressed (and not through shared memory: the lab turns it off), gradients zstd
    # cannot shrink much: the link must really be full.
    config = ClientConfig(timeout=30, connect_timeout=30, name="gray-links", compress=False)
    async with zps.connect(address, config) as ps:
        await ps.create_dense(
            "w", shape=(ELEMS,), dtype="float32", init=zps.init.Zeros(),
            optimizer=zps.optim.SGD(lr=1.0),
        )
        await ps.pull_dense("w")
        at_start = await ps.status()
        before = at_start["partitions"][0]
        retries, requests = ps.stats.retries, ps.stats.requests
        t0 = time.monotonic()
        # Whole numbers below 2**24 / 24: every order of the pushes sums them exactly.
        grad = np.random.default_rng(7).integers(1, 1 << 19, ELEMS).astype(np.float32)

        async def task():
            for _ in range(ROUNDS):
                await ps.push_dense("w", grad)
                await ps.pull_dense("w")

        await asyncio.gather(*(task() for _ in range(IN_FLIGHT)))
        w = await ps.pull_dense("w")
        status = await ps.status()
        print(json.dumps({{
            "retries": ps.stats.retries - retries,
            "requests": ps.stats.requests - requests,
            "exact": bool((w == -float(IN_FLIGHT * ROUNDS) * grad).all()),
            "seconds": time.monotonic() - t0,
            "before": before,
            # Whether a duplicate came before the load, if one comes (for the message).
            "duplicates_before": at_start["shards"][0]["stats"]["duplicates"],
            "status": status,
        }}, default=str), flush=True)

asyncio.run(main(sys.argv[1]))
"""


class ShapedLab(Lab):
    def shape(self, name: str, rate: str) -> None:
        """``rate`` each way on ``name``'s link: its eth0 (sending) and its switch port
        (receiving); a token bucket of 64 KiB and 20 ms of queue, as bench/scaleout.py."""
        for ns, dev in ((self.ns(name), "eth0"), (self.switch, f"v{name}"[:15])):
            tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
               str(64 << 10), "latency", "20ms")  # fmt: skip


def tc(ns: str, *args: str) -> None:
    res = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=20
    )
    if res.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {res.stderr.strip()}")


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[ShapedLab]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            pytest.skip(f"no `{tool}` command (iproute2)")
    tag = secrets.token_hex(3)
    net = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
    lab = ShapedLab(tag, net, tmp_path)
    try:
        try:
            lab.setup_switch()
        except RuntimeError as e:
            pytest.skip(f"cannot create network namespaces / a bridge here: {e}")
        yield lab
    finally:
        lab.cleanup()
        left = ip("netns", "list").stdout
        assert f"zpsns-{tag}" not in left, left


def test_lease_holds_behind_a_full_slow_link(lab: ShapedLab) -> None:
    lab.node("broker", 1)
    shard_ip = lab.node("shard", 11)
    lab.node("client", 31)
    try:
        lab.shape("shard", RATE)
    except RuntimeError as e:
        pytest.skip(f"cannot shape a link with tbf here: {e}")

    def zps(name: str, node: str, *args: str) -> None:
        lab.run(name, node, [sys.executable, "-m", "zps", *args, *HB])

    zps("broker", "broker", "broker", "--bind", lab.broker_address, "--partitions", "1",
        "--replication", "1", "--startup-grace", "0")  # fmt: skip
    zps("shard", "shard", "shard", "--broker", lab.broker_address, "--advertise-host",
        shard_ip, "--replication-bind", f"tcp://{shard_ip}:0")  # fmt: skip
    script = lab.workdir / "client.py"
    script.write_text(
        textwrap.dedent(CLIENT).format(elems=ELEMS, in_flight=IN_FLIGHT, rounds=ROUNDS)
    )
    client = lab.run("client", "client", [sys.executable, str(script), lab.broker_address])
    deadline = time.monotonic() + 120
    while client.poll() is None:
        assert time.monotonic() < deadline, f"the client did not finish\n{lab.logs()}"
        time.sleep(0.1)
    assert client.returncode == 0, lab.logs()
    out: dict[str, Any] = json.loads(lab.log("client").strip().splitlines()[-1])

    # Exactly once: every element is minus the number of pushes times its gradient.
    assert out["exact"], lab.logs()
    # The link was full: the pushes and pulls took longer than a lease, several times.
    assert out["seconds"] > 4 * 0.9, out["seconds"]
    # Nothing refused and sent again (a lapsed lease answers NOT_PRIMARY; the client
    # re-sends), nothing applied twice, nothing declared dead.
    assert out["retries"] == 0, (out["retries"], out["requests"], lab.logs())
    status, before = out["status"], out["before"]
    assert status["failovers"] == 0, lab.logs()
    part = status["partitions"][0]
    assert (part["state"], part["epoch"], part["primary"]) == (
        "ok",
        before["epoch"],
        before["primary"],
    ), lab.logs()
    (shard,) = status["shards"]
    assert shard["stats"]["duplicates"] == 0, (out["duplicates_before"], lab.logs())
    assert "lease" not in lab.log("shard"), lab.log("shard")
    assert "declared dead" not in lab.log("broker"), lab.log("broker")
    assert lab.broker_address.endswith(f":{PORT}")


def key_text(c: curve.RolesCluster, name: str) -> str:
    """The Z85 public key of the cluster's key ``name``, as the broker's log gives it."""
    public, _ = zmq.auth.load_certificate(str(c.keys / f"{name}.key"))
    return public.decode("ascii")


def test_a_liveness_link_needs_its_shards_key(roles: curve.RolesCluster) -> None:
    status = roles.status()
    victim = status["shards"][0]
    node = victim["node"]
    own_key = roles.proc_by_pid(victim["pid"]).name  # shard0 or shard1, its key's name
    other_key = "shard1" if own_key == "shard0" else "shard0"
    ctx = zmq.Context()
    try:
        beat = [b"", *curve.control(MsgType.HEARTBEAT, {"t": 1e9, "lsn": 0})]
        # A client key may not speak for a shard, on a liveness link either.
        hostile = curve.curve_dealer(ctx, roles, "hostile", b"h-s-ghost", roles.address)
        hostile.send_multipart(beat)
        assert curve.wait_log(roles, r"the broker refused s-ghost .*role may not do this")
        # Another shard's key presenting the victim's liveness link as its zps id is
        # refused, logged under that key, and gets no lease echo.
        ident = f"h-{node}".encode()
        thief = curve.curve_dealer(ctx, roles, other_key, ident, roles.address)
        thief.send_multipart(beat)
        other_public = key_text(roles, other_key)
        assert curve.wait_log(
            roles,
            rf"the broker refused h?-?{node} \(key {re.escape(other_public)}\): "
            "the identity belongs to another key",
        )
        assert not hostile.poll(300) and not thief.poll(300), "a lease echo to an impostor"
        # The shards' own liveness links are admitted: the cluster stays healthy, and no
        # message under the victim's own key was refused.
        after = roles.status()
        assert roles.healthy(after), after
        assert after["failovers"] == status["failovers"]
        own_public = key_text(roles, own_key)
        assert f"(key {own_public})" not in roles.broker().log()
    finally:
        ctx.destroy(0)
