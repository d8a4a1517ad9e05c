"""Train a small PyTorch model on UCI Adult with its parameters on a zps cluster.

    pip install -e '.[torch]'
    python examples/torch_adult.py                          # starts a local cluster
    python examples/torch_adult.py --broker tcp://HOST:5555  # or uses a running one

Hashed categorical features go through a ShardedEmbeddingBag (rows on the shards, pulled per
batch); the numeric features through a local MLP whose parameters are dense tensors on the
shards (ParameterServerModule).  Adam runs on the shards.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
import torch
from torch import nn

import zps
from zps.examples.adult import auc, load_adult
from zps.testing import LocalCluster
from zps.torch import ParameterServerModule, ShardedEmbeddingBag


class Model(nn.Module):
    def __init__(self, ps: zps.SyncClient, prefix: str, n_numeric: int, dim: int = 8) -> None:
        super().__init__()
        self.categorical = ShardedEmbeddingBag(
            ps,
            f"{prefix}/emb",
            dim,
            mode="sum",
            init=zps.init.Normal(0.0, 0.01),
            optimizer=zps.optim.Adam(lr=0.01),
        )
        self.numeric = nn.Sequential(nn.Linear(n_numeric, dim), nn.ReLU())
        self.head = nn.Linear(dim, 1)

    def forward(self, cat_ids: torch.Tensor, numeric: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.categorical(cat_ids) + self.numeric(numeric))
        out: torch.Tensor = self.head(h).squeeze(-1)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", help="address of a running broker (default: start one)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)  # small batches: more threads only contend with the shards
    torch.manual_seed(0)
    data = load_adult()
    with contextlib.ExitStack() as stack:
        address = args.broker or stack.enter_context(LocalCluster(partitions=2, shards=2)).address
        ps = stack.enter_context(zps.connect_sync(address))
        model = ParameterServerModule(
            Model(ps, "torch-adult", data.n_numeric),
            ps,
            "torch-adult",
            optimizer=zps.optim.Adam(lr=0.01),
        )
        loss_fn = nn.BCEWithLogitsLoss()
        train = data.train
        started = time.perf_counter()
        for epoch in range(args.epochs):
            order = np.random.default_rng(epoch).permutation(len(train))
            for start in range(0, order.size, args.batch_size):
                idx = order[start : start + args.batch_size]
                logits = model(
                    torch.from_numpy(train.cat_ids[idx]), torch.from_numpy(train.numeric[idx])
                )
                loss = loss_fn(logits, torch.from_numpy(train.label[idx]))
                loss.backward()
                model.step()
            with torch.no_grad():
                test_logits = model(
                    torch.from_numpy(data.test.cat_ids), torch.from_numpy(data.test.numeric)
                )
            test_loss = float(loss_fn(test_logits, torch.from_numpy(data.test.label)))
            print(
                f"epoch {epoch}: test loss {test_loss:.4f}, "
                f"AUC {auc(data.test.label, test_logits.numpy()):.4f}, "
                f"{time.perf_counter() - started:.1f}s"
            )


if __name__ == "__main__":
    main()
