"""The operation table (zps/protocol/ops.py): every operation a shard serves is in it,
and the sets the roles read are its rows."""

from __future__ import annotations

import msgpack

from zps.core import batching, routing
from zps.ops import security
from zps.protocol import ops
from zps.protocol.ops import Kind, Operation
from zps.shard import core, slotops


def test_every_operation_a_shard_serves_is_in_the_table_and_no_other() -> None:
    served = set(core.SERVED)
    assert served == {op.value for op in Operation}


def test_the_shards_sets_are_the_tables() -> None:
    assert ops.MUTATIONS == core.MUTATIONS
    assert ops.SLOT_MUTATIONS == slotops.SLOT_MUTATIONS
    assert ops.ROW_OPS == slotops.ROW_OPS
    assert ops.CHUNK_OPS == slotops.CHUNK_OPS


def test_the_client_security_and_core_read_the_table() -> None:
    assert batching.MERGEABLE is ops.MERGEABLE
    assert routing.ROW_OPS is ops.ROW_OPS and routing.CHUNK_OPS is ops.CHUNK_OPS
    assert security.ADMIN_OPS is ops.ADMIN_OPS == {"drop", "checkpoint"}
    assert {"pull_rows", "pull_dense"} == ops.READS
    assert {"pull_rows", "push_rows"} == ops.MERGEABLE
    assert {"push_rows", "push_dense"} == ops.PUSHES


def test_a_member_is_its_wire_name() -> None:
    assert Operation.PUSH_ROWS == "push_rows" and f"{Operation.PUSH_ROWS}" == "push_rows"
    assert "push_rows" in ops.MUTATIONS and Operation.PUSH_ROWS in ops.MUTATIONS
    assert msgpack.packb({"op": Operation.PULL_DENSE}) == msgpack.packb({"op": "pull_dense"})
    assert Operation.PUSH_ROWS.kind == Kind.MUTATES | Kind.ROWS | Kind.MERGEABLE | Kind.PUSH


def test_a_lookup_takes_any_wire_value() -> None:
    assert ops.lookup("set_dense") is Operation.SET_DENSE
    for bad in ("PUSH_ROWS", "", ["push_rows"], {"a": 1}, None, 3):
        assert ops.lookup(bad) is None and ops.kind(bad) is Kind.NONE
    assert ops.kind("checkpoint") == Kind.ADMIN
