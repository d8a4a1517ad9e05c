"""set_optimizer and advance_step in a shard's core: the same kind keeps its state,
another only with reset, schedules follow the step count, and both are mutations that
replicas, snapshots, checkpoints and the dedup record carry."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zps.init import Constant, Zeros
from zps.optim import SGD, Adagrad, Adam, Optimizer, at_step
from zps.optim.schedules import Cosine, LinearWarmup, Step
from zps.protocol.codec import CompressPolicy, Encoder, MsgType, Route, array_from, decode
from zps.protocol.specs import DenseSpec, EmbeddingSpec, spec_from_wire
from zps.shard.core import ShardCore

PARTITION, EPOCH = 1, 3
Op = tuple[dict[str, Any], dict[str, np.ndarray]]


def dense_spec(opt: Optimizer) -> DenseSpec:
    return DenseSpec("w", (6,), "float64", Zeros(), opt, 1, 4)  # chunks of 4 and 2


def emb_spec(opt: Optimizer, **kw: Any) -> EmbeddingSpec:
    return EmbeddingSpec("emb", 3, "float64", Constant(0.5), opt, 2, **kw)


def frames(ops: list[Op], cid: bytes | None = None, seq: int | None = None) -> list[Any]:
    enc = Encoder(CompressPolicy())
    header: dict[str, Any] = {
        "ops": [{**op, **{k: enc.array(v) for k, v in arrays.items()}} for op, arrays in ops]
    }
    if cid is not None:
        header |= {"cid": cid, "seq": seq}
    return enc.build(Route(MsgType.REQUEST, PARTITION, EPOCH, 9), header)


def call(core: ShardCore, ops: list[Op], **kw: Any) -> list[dict[str, Any]]:
    msg = decode([bytes(f) for f in frames(ops, **kw)])
    out = decode([bytes(f) for f in core.handle(msg.route, msg.header, msg.payloads)])
    res: list[dict[str, Any]] = out.header["res"]
    for r in res:
        if "a" in r:
            descs = r["a"] if r["a"] and isinstance(r["a"][0], list) else [r["a"]]
            r["arrays"] = [array_from(d, out.payloads, max_bytes=1 << 30) for d in descs]
    return res


def replicate(core: ShardCore, replica: ShardCore, ops: list[Op], **kw: Any) -> list[Any]:
    """Run ``ops`` on ``core`` and re-run the message on ``replica``, as a shard does."""
    res = call(core, ops, **kw)
    msg = decode([bytes(f) for f in frames(ops, **kw)])
    replica.apply_replicated(msg.header, msg.payloads)
    return res


def new_core(opt: Optimizer, **kw: Any) -> ShardCore:
    core = ShardCore()
    core.assign(PARTITION, EPOCH)
    create = [
        ({"op": "create", "spec": s.to_wire()}, {}) for s in (dense_spec(opt), emb_spec(opt, **kw))
    ]
    assert [r["st"] for r in call(core, create)] == ["OK", "OK"]
    return core


def set_opt(opt: Optimizer, t: str = "emb", reset: bool | None = None) -> Op:
    op: dict[str, Any] = {"op": "set_optimizer", "t": t, "optimizer": opt.spec()}
    if reset is not None:
        op["reset"] = reset
    return op, {}


def advance(t: str | None = None, n: int = 1) -> Op:
    return {"op": "advance_step", "t": t, "n": n}, {}


def push_rows(ids: list[int], g: np.ndarray) -> Op:
    return {"op": "push_rows", "t": "emb"}, {"ids": np.array(ids, dtype=np.int64), "g": g}


def pull_rows(ids: list[int]) -> Op:
    return {"op": "pull_rows", "t": "emb"}, {"ids": np.array(ids, dtype=np.int64)}


def push_dense(g: np.ndarray) -> Op:
    return {"op": "push_dense", "t": "w", "chunk": 0}, {"g": g}


def pull_dense() -> Op:
    return {"op": "pull_dense", "t": "w", "chunks": [0]}, {}


def row(core: ShardCore, i: int = 7) -> np.ndarray:
    return call(core, [pull_rows([i])])[0]["arrays"][0][0]


def test_same_kind_takes_the_new_rate_on_rows_and_chunks() -> None:
    core = new_core(SGD(lr=1.0))
    g = np.ones((1, 3))
    call(core, [push_rows([7], g), push_dense(np.ones(4))])
    assert row(core).tolist() == [-0.5] * 3
    lsn = core.lsn
    res = call(core, [set_opt(SGD(lr=0.25)), set_opt(SGD(lr=0.25), t="w")])
    assert [r["st"] for r in res] == ["OK", "OK"] and core.lsn == lsn + 2
    call(core, [push_rows([7], g), push_dense(np.ones(4))])
    assert row(core).tolist() == [-0.75] * 3
    assert call(core, [pull_dense()])[0]["arrays"][0].tolist() == [-1.25] * 4
    # The same optimizer again changes nothing: no LSN.
    lsn = core.lsn
    assert call(core, [set_opt(SGD(lr=0.25))])[0]["changed"] is False and core.lsn == lsn
    assert core.store.table("emb").spec.optimizer == SGD(lr=0.25)


def test_adam_with_a_new_rate_keeps_its_moments_and_step_counts() -> None:
    core = new_core(Adam(lr=0.1))
    rng = np.random.default_rng(3)
    grads = [rng.normal(size=(1, 3)) for _ in range(4)]
    # The reference: one Adam state carried across the change of rate.
    param = np.full((1, 3), 0.5)
    state = Adam().init_state(1, 3, np.float64)
    for i, g in enumerate(grads):
        opt = Adam(lr=0.1 if i < 2 else 0.02)
        if i == 2:
            assert call(core, [set_opt(opt)])[0]["st"] == "OK"
        opt.apply(param, g, state)
        call(core, [push_rows([7], g)])
    assert row(core).tolist() == param[0].tolist()
    assert core.store.table("emb").copy_state()["step"].tolist() == [[4.0]]


def test_another_kind_is_refused_unless_reset() -> None:
    core = new_core(Adam(lr=0.1))
    call(core, [push_rows([7], np.ones((1, 3)))])
    lsn, before = core.lsn, row(core)
    res = call(core, [set_opt(Adagrad(lr=0.5))])[0]
    assert res["st"] == "BAD_REQUEST"
    assert "adam" in res["msg"] and "adagrad" in res["msg"] and "reset_state" in res["msg"]
    assert core.lsn == lsn and core.store.table("emb").spec.optimizer == Adam(lr=0.1)
    res = call(core, [set_opt(Adagrad(lr=0.5), reset=True), set_opt(SGD(lr=2.0), "w", True)])
    assert [r["st"] for r in res] == ["OK", "OK"] and core.lsn == lsn + 2
    table = core.store.table("emb")
    # The values stay; the state is the new kind's initial state.
    assert row(core).tolist() == before.tolist()
    assert table.copy_state()["accumulator"].tolist() == [[0.1] * 3]
    call(core, [push_rows([7], np.ones((1, 3)))])
    expect = before - 0.5 * 1.0 / (np.sqrt(0.1 + 1.0) + 1e-10)
    assert row(core).tolist() == expect.tolist()
    call(core, [push_dense(np.ones(4))])
    assert call(core, [pull_dense()])[0]["arrays"][0].tolist() == [-2.0] * 4


def test_reset_keeps_the_admission_columns() -> None:
    core = new_core(SGD(lr=1.0), admit_count=2)
    call(core, [push_rows([7], np.ones((1, 3)))])  # counted, not trained
    call(core, [set_opt(Adam(lr=0.1), reset=True)])
    call(core, [push_rows([7], np.ones((1, 3)))])  # the second push: admitted, trained
    assert core.store.embedding("emb").n_admitted() == 1
    assert row(core).tolist() != [0.5] * 3


def test_bad_input_is_named() -> None:
    core = new_core(SGD(lr=1.0))
    lsn = core.lsn
    bad = [
        ({"op": "set_optimizer", "t": "nope", "optimizer": SGD().spec()}, {}),
        ({"op": "set_optimizer", "t": "emb", "optimizer": {**SGD().spec(), "lr": -1.0}}, {}),
        ({"op": "set_optimizer", "t": "emb", "optimizer": SGD().spec(), "reset": 1}, {}),
        advance(n=0),
        advance("nope"),
        ({"op": "advance_step", "t": None, "to": 3}, {}),
    ]
    res = call(core, bad)
    assert [r["st"] for r in res] == [
        "UNKNOWN_TABLE",
        *["BAD_REQUEST"] * 3,
        "UNKNOWN_TABLE",
        "BAD_REQUEST",
    ]
    assert "lr" in res[1]["msg"] and "reset" in res[2]["msg"] and "'n'" in res[3]["msg"]
    assert core.lsn == lsn


def test_a_schedule_follows_the_step_count() -> None:
    sched = LinearWarmup(Step(1.0, step_size=2, gamma=0.5), warmup_steps=2)
    core = new_core(SGD(lr=sched))
    value = 0.5
    for step in range(7):
        assert core.store.table("emb").spec.step == step
        call(core, [push_rows([7], np.ones((1, 3)))])
        value -= sched.value(step)
        assert row(core).tolist() == [value] * 3
        res = call(core, [advance()])[0]
        assert res["steps"] == {"emb": step + 1, "w": step + 1}
    assert [sched.value(s) for s in range(7)] == [0.5, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25]
    # One table only, and describe shows the count.
    call(core, [advance("w", 5)])
    described = call(core, [({"op": "describe", "t": "w"}, {})])[0]
    assert spec_from_wire(described["spec"]).step == 12
    assert core.store.table("emb").spec.step == 7


def test_replicas_snapshots_and_checkpoints_carry_optimizer_and_step() -> None:
    from zps.shard.checkpoint import cut, decode_checkpoint, encode_checkpoint, finish
    from zps.store.snapshot import decode_snapshot, encode_snapshot

    opt = Adam(lr=LinearWarmup(Cosine(0.01, total_steps=50), warmup_steps=3))
    primary, replica = new_core(Adam(lr=0.1)), new_core(Adam(lr=0.1))
    replica.primary = False
    g = np.ones((1, 3))
    replicate(primary, replica, [push_rows([7], g)], cid=b"c", seq=1)
    replicate(primary, replica, [set_opt(opt)], cid=b"c", seq=2)
    for seq in range(3, 9):
        replicate(primary, replica, [push_rows([7], g * seq), advance()], cid=b"c", seq=seq)
    # A retried advance is answered from the record, not applied again.
    again = call(primary, [push_rows([7], g * 8), advance()], cid=b"c", seq=8)
    assert again[1]["st"] == "OK" and primary.store.table("emb").spec.step == 6
    assert replica.lsn == primary.lsn
    assert replica.store.checksum() == primary.store.checksum()
    assert replica.store.table("emb").spec.optimizer == opt
    # A snapshot (a new replica) and a checkpoint (a restart) see the same table.
    enc = Encoder()
    header = encode_snapshot(enc, primary.snapshot())
    msg = decode(enc.build(Route(MsgType.SNAPSHOT, PARTITION, EPOCH, primary.lsn), header))
    heir = ShardCore()
    heir.assign(PARTITION, EPOCH)
    heir.load_snapshot(decode_snapshot(msg.header, msg.payloads, max_bytes=1 << 24))
    data = b"".join(bytes(p) for p in encode_checkpoint(finish(cut(primary))))
    restored = ShardCore()
    restored.assign(PARTITION, EPOCH)
    restored.load_snapshot(decode_checkpoint(data))
    for other in (heir, restored):
        spec = other.store.table("emb").spec
        assert spec.optimizer == opt and spec.step == 6
        assert other.store.checksum() == primary.store.checksum()
        call(other, [push_rows([7], g)])
    call(primary, [push_rows([7], g)])
    assert row(heir).tolist() == row(primary).tolist() == row(restored).tolist()


def test_a_table_made_again_keeps_its_step_and_create_stays_idempotent() -> None:
    core = new_core(SGD(lr=Step(1.0, 1)))
    call(core, [advance(n=3)])
    res = call(core, [({"op": "create", "spec": emb_spec(SGD(lr=Step(1.0, 1))).to_wire()}, {})])
    assert res[0] == {"st": "OK", "created": False}
    assert core.store.table("emb").spec.step == 3
    res = call(core, [({"op": "advance_step", "t": "emb", "to": 10}, {})])
    assert res[0]["steps"] == {"emb": 10}


@pytest.mark.parametrize("kernel", [True, False])
def test_scheduled_rates_reach_the_kernel_and_numpy_alike(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zps.store import kernel as compiled

    monkeypatch.setattr(compiled, "KERNEL", kernel and compiled.KERNEL)
    opt = Adam(lr=Cosine(0.1, total_steps=4))
    core = new_core(opt)
    param = np.full((1, 3), 0.5)
    state = opt.init_state(1, 3, np.float64)
    for step in range(6):
        g = np.full((1, 3), 0.1 * (step + 1))
        at_step(opt, step).apply(param, g, state)
        call(core, [push_rows([7], g), advance()])
    assert row(core).tolist() == param[0].tolist()


def test_reset_state_starts_the_same_kind_afresh_too() -> None:
    core = new_core(Adam(lr=0.1))
    call(core, [push_rows([7], np.ones((1, 3)))])
    assert core.store.table("emb").copy_state()["step"].tolist() == [[1.0]]
    lsn = core.lsn
    assert call(core, [set_opt(Adam(lr=0.1), reset=True)])[0]["changed"] is True
    assert core.lsn == lsn + 1
    assert core.store.table("emb").copy_state()["step"].tolist() == [[0.0]]


def test_new_adam_betas_take_new_bias_corrections() -> None:
    """The kernel's tables of bias corrections follow the betas (kept across new rates)."""
    core = new_core(Adam(lr=Step(0.1, 2)))
    param = np.full((1, 3), 0.5)
    state = Adam().init_state(1, 3, np.float64)
    opts = [Adam(lr=Step(0.1, 2))] * 3 + [Adam(lr=Step(0.1, 2), beta1=0.5, beta2=0.9)] * 3
    for step, opt in enumerate(opts):
        if step == 3:
            call(core, [set_opt(opt)])
        g = np.full((1, 3), 0.3 - 0.1 * step)
        at_step(opt, step).apply(param, g, state)
        call(core, [push_rows([7], g), advance()])
    assert row(core).tolist() == param[0].tolist()


def test_a_create_with_the_old_optimizer_conflicts_naming_the_optimizer_only() -> None:
    core = new_core(SGD(lr=1.0))
    call(core, [set_opt(SGD(lr=0.5)), advance(n=4)])
    res = call(core, [({"op": "create", "spec": emb_spec(SGD(lr=1.0)).to_wire()}, {})])[0]
    assert res["st"] == "TABLE_CONFLICT" and res["msg"].endswith("(differs in: optimizer)")
