"""The PyTorch adapter (``zps.torch``) against real brokers and shards, compared with torch."""

from __future__ import annotations

import copy
import math
import time
import uuid
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from torch import nn  # noqa: E402

import zps  # noqa: E402
from zps.optim import SGD, Adam, Momentum  # noqa: E402
from zps.testing import LocalCluster  # noqa: E402
from zps.torch import ParameterServerModule, ShardedEmbeddingBag, default_init  # noqa: E402


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def ps(cluster: LocalCluster) -> Iterator[zps.SyncClient]:
    with zps.connect_sync(cluster.address) as client:
        yield client


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


# --------------------------------------------------------------------------- dense parameters


def test_create_pulls_server_values_and_workers_agree(ps: zps.SyncClient) -> None:
    prefix = unique("mlp")
    model = ParameterServerModule(mlp(0), ps, prefix, optimizer=SGD(lr=0.1))
    names = [t for t, _, _ in model.tables]
    assert names == [f"{prefix}/{n}" for n in ("0.weight", "0.bias", "2.weight", "2.bias")]
    for table, p, dtype in model.tables:
        assert dtype == "float32"
        server = ps.pull_dense(table)
        assert server.shape == tuple(p.shape)
        np.testing.assert_array_equal(p.detach().numpy(), server)
        # PyTorch's default Linear distribution: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        fan_in = 5 if table.startswith(f"{prefix}/0.") else 8
        assert np.abs(server).max() <= 1 / math.sqrt(fan_in)
        if table.endswith("weight"):  # 40 and 8 elements: not all near 0 (p < 1e-4)
            assert np.abs(server).max() > 0.3 / math.sqrt(fan_in)
    # A second worker with different local values gets the same (idempotent) spec and values.
    other = ParameterServerModule(mlp(1), ps, prefix, optimizer=SGD(lr=0.1))
    for (_, p, _), (_, q, _) in zip(model.tables, other.tables, strict=True):
        assert torch.equal(p, q)
    # Forward is the wrapped module's.
    x = torch.randn(4, 5)
    assert torch.equal(model(x), model.module(x))


@pytest.mark.parametrize(
    ("zps_opt", "torch_opt"),
    [
        (SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
        (SGD(lr=0.1, weight_decay=0.01), lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01)),
        (Momentum(lr=0.05, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
        (Adam(lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01)),
    ],
    ids=["sgd", "sgd-wd", "momentum", "adam"],
)
def test_server_optimizer_matches_torch_optim(ps: zps.SyncClient, zps_opt, torch_opt) -> None:
    model = ParameterServerModule(mlp(0), ps, unique("opt"), optimizer=zps_opt)
    reference = copy.deepcopy(model.module)
    opt = torch_opt(reference.parameters())
    torch.manual_seed(42)
    for step in range(4):
        x, y = torch.randn(16, 5), torch.randn(16, 1)
        for m in (model, reference):
            nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step % 2:
            model.push()
            assert all(p.grad is None for p in model.parameters())
            model.pull()
        else:
            model.step()
            assert all(p.grad is None for p in model.parameters())
        for (table, p, _), q in zip(model.tables, reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(ps.pull_dense(table), p.detach().numpy())


def test_parameters_without_grad_are_not_pushed(ps: zps.SyncClient) -> None:
    model = ParameterServerModule(mlp(0), ps, unique("nograd"), optimizer=Adam(lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    first = model.module[0]
    first(torch.randn(3, 5)).sum().backward()  # only the first layer gets gradients
    model.step()
    after = list(model.parameters())
    assert not torch.equal(before[0], after[0])
    assert not torch.equal(before[1], after[1])
    assert torch.equal(before[2], after[2])
    assert torch.equal(before[3], after[3])


class WithCustomParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.offset = nn.Parameter(torch.full((2, 2), 0.5))
        self.table = nn.Parameter(torch.randn(4, 3))
        self.norm = nn.LayerNorm(3)
        self.emb = nn.Embedding(10, 3)


def test_init_choices(ps: zps.SyncClient) -> None:
    module = WithCustomParameters()
    # Constant tensors keep their value, known layers get PyTorch's distribution.
    assert default_init(module, "scale", module.scale) == zps.init.Constant(1.0)
    assert default_init(module, "offset", module.offset) == zps.init.Constant(0.5)
    assert default_init(module.norm, "bias", module.norm.bias) == zps.init.Zeros()
    assert default_init(module.emb, "weight", module.emb.weight) == zps.init.Normal(0.0, 1.0)
    # A random tensor of an unknown layer has no default: the error names it.
    with pytest.raises(ValueError, match="'table'"):
        ParameterServerModule(WithCustomParameters(), ps, unique("x"), optimizer=SGD())
    prefix = unique("custom")
    model = ParameterServerModule(
        module,
        ps,
        prefix,
        optimizer=SGD(),
        init={"table": zps.init.Uniform(-0.5, 0.5)},
    )
    values = {t.removeprefix(prefix + "/"): p.detach().numpy() for t, p, _ in model.tables}
    assert set(values) == {"scale", "offset", "table", "norm.weight", "norm.bias", "emb.weight"}
    np.testing.assert_array_equal(values["scale"], np.ones(3, np.float32))
    np.testing.assert_array_equal(values["offset"], np.full((2, 2), 0.5, np.float32))
    np.testing.assert_array_equal(values["norm.bias"], np.zeros(3, np.float32))
    assert np.abs(values["table"]).max() < 0.5
    # One initialiser for everything; attaching without creating; a shape mismatch.
    everything = ParameterServerModule(
        nn.Linear(3, 2), ps, unique("all"), optimizer=SGD(), init=zps.init.Constant(0.25)
    )
    assert all(bool((p == 0.25).all()) for p in everything.parameters())
    attached = ParameterServerModule(nn.Linear(3, 2), ps, everything.prefix, create=False)
    assert all(bool((p == 0.25).all()) for p in attached.parameters())
    with pytest.raises(ValueError, match="shape"):
        ParameterServerModule(nn.Linear(2, 3), ps, everything.prefix, create=False)


# --------------------------------------------------------------------------- embeddings

V, DIM = 40, 6


def bag_and_reference(
    ps: zps.SyncClient, mode: str
) -> tuple[ShardedEmbeddingBag, nn.EmbeddingBag, np.ndarray, np.ndarray]:
    """A sharded bag over arbitrary int64 keys, and an nn.EmbeddingBag with the same rows."""
    bag = ShardedEmbeddingBag(ps, unique("bag"), DIM, mode=mode, optimizer=SGD(lr=1.0))
    keys = np.random.default_rng(3).choice(2**62, size=V, replace=False).astype(np.int64)
    keys[0] = -5  # negative ids are ids too
    weights = ps.pull_rows(bag.name, keys)
    ref = nn.EmbeddingBag(V, DIM, mode=mode)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(weights))
    return bag, ref, keys, weights


@pytest.mark.parametrize("mode", ["sum", "mean", "max", "weighted-sum"])
def test_embedding_bag_matches_torch(ps: zps.SyncClient, mode: str) -> None:
    weighted = mode == "weighted-sum"
    bag, ref, keys, weights = bag_and_reference(ps, "sum" if weighted else mode)
    gen = torch.Generator().manual_seed(7)
    ref_psw: list[torch.Tensor] = []
    our_psw: list[torch.Tensor] = []
    # Two forward passes before one push: the server sums the gradients of both.
    for batch in range(2):
        idx = torch.randint(0, V, (30,), generator=gen)  # duplicates within and across bags
        offsets = torch.tensor([0, 4, 4, 11, 20, 29])  # with an empty bag
        psw = torch.rand(30, generator=gen) if weighted else None
        psw_ours = psw.clone().requires_grad_(True) if psw is not None else None
        psw_ref = psw.clone().requires_grad_(True) if psw is not None else None
        out = bag(torch.from_numpy(keys)[idx], offsets, per_sample_weights=psw_ours)
        expect = ref(idx, offsets, per_sample_weights=psw_ref)
        torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
        assert out.shape == (6, DIM)
        upstream = torch.randn(out.shape, generator=gen) * (batch + 1)
        (out * upstream).sum().backward()
        (expect * upstream).sum().backward()
        if psw_ours is not None and psw_ref is not None:
            our_psw.append(psw_ours)
            ref_psw.append(psw_ref)
    for ours, theirs in zip(our_psw, ref_psw, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert bag.pending == 2
    bag.push()
    assert bag.pending == 0
    # SGD(lr=1) on the server: new rows = old rows - summed gradients.
    expected = weights - ref.weight.grad.numpy()
    np.testing.assert_allclose(ps.pull_rows(bag.name, keys), expected, rtol=1e-6, atol=1e-6)


def test_embedding_bag_2d_input_no_grad_and_discard(ps: zps.SyncClient) -> None:
    bag, ref, keys, weights = bag_and_reference(ps, "mean")
    idx = torch.randint(0, V, (5, 3))
    with torch.no_grad():
        out = bag(torch.from_numpy(keys)[idx])
    assert bag.pending == 0
    torch.testing.assert_close(out, ref(idx).detach(), rtol=1e-6, atol=1e-6)
    bag(torch.from_numpy(keys)[idx]).sum().backward()
    assert bag.pending == 1
    bag.discard()
    bag.push()  # nothing to push
    np.testing.assert_array_equal(ps.pull_rows(bag.name, keys), weights)
    # An empty batch: every bag empty, nothing pulled or pushed.
    empty = bag(torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    assert empty.shape == (3, DIM)
    assert not empty.any()


# --------------------------------------------------------------------------- training


class AdultLogistic(nn.Module):
    """Logistic regression on Adult: one weight per hashed categorical value, plus numerics."""

    def __init__(self, ps: zps.SyncClient, table: str, n_numeric: int) -> None:
        super().__init__()
        self.categorical = ShardedEmbeddingBag(
            ps, table, 1, mode="sum", init=zps.init.Zeros(), optimizer=Adam(lr=0.05)
        )
        self.numeric = nn.Linear(n_numeric, 1)

    def forward(self, cat_ids: torch.Tensor, numeric: torch.Tensor) -> torch.Tensor:
        return (self.categorical(cat_ids) + self.numeric(numeric)).squeeze(-1)


def test_train_adult_end_to_end(ps: zps.SyncClient) -> None:
    from zps.examples.adult import auc, load_adult

    data = load_adult()
    prefix = unique("adult-torch")
    model = ParameterServerModule(
        AdultLogistic(ps, f"{prefix}/emb", data.n_numeric), ps, prefix, optimizer=Adam(lr=0.05)
    )
    assert [t for t, _, _ in model.tables] == [f"{prefix}/numeric.weight", f"{prefix}/numeric.bias"]
    test_ids = torch.from_numpy(data.test.cat_ids)
    test_x = torch.from_numpy(data.test.numeric)
    test_y = torch.from_numpy(data.test.label)
    loss_fn = nn.BCEWithLogitsLoss()

    def test_loss() -> tuple[float, float]:
        with torch.no_grad():
            logits = model(test_ids, test_x)
        return float(loss_fn(logits, test_y)), auc(data.test.label, logits.numpy())

    before, _ = test_loss()
    train = data.train
    order = np.random.default_rng(0).permutation(len(train))
    started = time.perf_counter()
    steps = 0
    for start in range(0, order.size, 512):
        idx = order[start : start + 512]
        logits = model(torch.from_numpy(train.cat_ids[idx]), torch.from_numpy(train.numeric[idx]))
        loss_fn(logits, torch.from_numpy(train.label[idx])).backward()
        model.step()
        steps += 1
    seconds = time.perf_counter() - started
    after, test_auc = test_loss()
    print(
        f"adult: {steps} steps in {seconds:.2f}s, test loss {before:.3f} -> {after:.3f}, "
        f"AUC {test_auc:.4f}"
    )
    assert after < before - 0.2
    assert test_auc > 0.88
