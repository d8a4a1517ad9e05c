"""The pure rules that bind identities to CURVE keys (zps.ops.security); the table of
which connection stands for which identity is tests/unit/test_peer_table.py's."""

from __future__ import annotations

import logging

import msgpack
import pytest

from zps.ops.security import (
    KeyRoles,
    RefusalLog,
    identity_refusal,
    key_identity,
    request_refusal,
)

SHARD, CLIENT, OPERATOR, STRANGER = (bytes([c]) * 40 for c in b"SCOX")
ROLES = KeyRoles(frozenset({SHARD}), frozenset({CLIENT}), frozenset({OPERATOR}))


def test_roles_by_key() -> None:
    assert ROLES.roles(SHARD) == {"shard"}
    assert ROLES.roles(CLIENT) == {"client"}
    assert ROLES.roles(OPERATOR) == {"operator", "client"}
    assert ROLES.roles(STRANGER) == set() and ROLES.roles(None) == set()
    assert ROLES.admitted == frozenset({SHARD, CLIENT, OPERATOR})
    # Without allowed_shards_dir every admitted key may act as a shard; without
    # allowed_clients_dir any key is admitted.
    open_ = KeyRoles(frozenset(), frozenset({CLIENT}), open_shards=True)
    assert open_.roles(CLIENT) == {"client", "shard"} and open_.roles(STRANGER) == set()
    assert KeyRoles(frozenset(), frozenset(), open_clients=True).admitted is None


@pytest.mark.parametrize(
    ("ident", "key", "owner", "reason"),
    [
        (key_identity(b"c-", CLIENT, b"x"), CLIENT, None, None),
        (key_identity(b"c-", CLIENT, b"x"), OPERATOR, None, "identity_of_another_key"),
        (b"c-0123456789abcdef-x", CLIENT, None, "identity_of_another_key"),
        (key_identity(b"c-", CLIENT, b"x"), None, None, "no_key"),
        (key_identity(b"c-", STRANGER, b"x"), STRANGER, None, "key_not_allowed"),
        (b"s-alpha", SHARD, None, None),
        (b"s-alpha", SHARD, SHARD, None),
        (b"h-s-alpha", SHARD, SHARD, None),
        (b"s-alpha", CLIENT, None, "wrong_role"),
        (b"s-alpha", SHARD, OPERATOR, "identity_of_another_key"),
    ],
)
def test_identity_refusal(
    ident: bytes, key: bytes | None, owner: bytes | None, reason: str | None
) -> None:
    assert identity_refusal(ident, key, ROLES, owner) == reason


def header(**h: object) -> bytes:
    return bytes(msgpack.packb(h))


def test_request_refusal() -> None:
    me = key_identity(b"c-", CLIENT, b"me")
    push = {"op": "push_dense", "t": "drop"}  # a table named like an operation
    assert request_refusal(header(cid=me, ops=[push]), me, operator=False) is None
    assert request_refusal(header(ops=[push]), me, operator=False) is None  # cid: sender
    other = request_refusal(header(cid=b"c-other", ops=[push]), me, operator=False)
    assert other is not None and other[0] == "identity_of_another_key"
    drop = header(cid=me, ops=[push, {"op": "drop", "t": "x"}, {"op": "checkpoint"}])
    refused = request_refusal(drop, me, operator=False)
    assert refused is not None and refused[0] == "wrong_role"
    assert "'checkpoint' operation and the 'drop' operation" in refused[1]
    assert request_refusal(drop, me, operator=True) is None
    assert request_refusal(b"\xc1", me, operator=False) is None  # the shard refuses it


def test_refusals_are_counted_always_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = RefusalLog(logging.getLogger("zps.test"), "the broker", window=60.0)
    with caplog.at_level(logging.WARNING, logger="zps.test"):
        for t in range(100):
            refusals.refused("c-x", CLIENT, "identity_of_another_key", 1000.0 + t / 10)
        refusals.refused("c-x", CLIENT, "wrong_role", 1010.0)  # another reason: logged
        refusals.refused("c-x", CLIENT, "identity_of_another_key", 1061.0)  # a minute on
    assert refusals.counts["identity_of_another_key"] == 101
    assert refusals.counts["wrong_role"] == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("the broker refused c-x (key CCCC")
