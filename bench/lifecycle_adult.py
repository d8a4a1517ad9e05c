"""Model quality under embedding admission and eviction: the Adult demo model
(``zps.examples.adult``, one hashed embedding table) trained in process on the real
table code (``zps.store.tables``), unbounded and with ``max_rows`` / ``admit_count`` /
``ttl_steps``, and evaluated on the test split.  One partition, one worker, the demo's
defaults (3 epochs, batch 512, Adam lr 0.01).

    .venv/bin/python bench/lifecycle_adult.py
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from zps.core.hashing import name_hash
from zps.examples import adult
from zps.protocol.specs import DenseSpec, EmbeddingSpec
from zps.store.tables import DenseTensor, EmbeddingTable


class StorePS:
    """The blocking client's six calls on in-process tables, with lifecycle settings."""

    def __init__(self, **lifecycle: int) -> None:
        self.lifecycle = lifecycle
        self.dense: dict[str, DenseTensor] = {}
        self.tables: dict[str, EmbeddingTable] = {}

    def create_dense(self, name: str, shape: Any, dtype: str = "float32", **kw: Any) -> None:
        size = int(np.prod(shape))
        spec = DenseSpec(
            name, tuple(shape), dtype, kw["init"], kw["optimizer"], name_hash(name), size
        )
        self.dense.setdefault(name, DenseTensor(spec))

    def create_embedding(self, name: str, dim: int, dtype: str = "float32", **kw: Any) -> None:
        spec = EmbeddingSpec(
            name, dim, dtype, kw["init"], kw["optimizer"], name_hash(name), **self.lifecycle
        )
        self.tables.setdefault(name, EmbeddingTable(spec))

    def pull_dense(self, name: str) -> Any:
        t = self.dense[name]
        return np.array(t.pull(0)).reshape(t.spec.shape)

    def push_dense(self, name: str, grad: Any) -> None:
        self.dense[name].push(0, np.asarray(grad).reshape(-1))

    def pull_rows(self, name: str, ids: Any) -> Any:
        return self.tables[name].pull(ids)

    def push_rows(self, name: str, ids: Any, grads: Any) -> None:
        self.tables[name].push(ids, grads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=adult.DEFAULT_EPOCHS)
    args = ap.parse_args()
    data = adult.load_adult()
    base = StorePS()
    adult.train_worker(base, data, epochs=args.epochs)
    base_metrics = adult.evaluate(base, data)
    n = len(base.tables["adult/emb"])
    print(f"unbounded: {n} rows, auc {base_metrics['auc']:.4f}, loss {base_metrics['loss']:.4f}")
    for label, kw in [
        ("max_rows = 90%", {"max_rows": n * 9 // 10}),
        ("max_rows = 50%", {"max_rows": n // 2}),
        ("max_rows = 25%", {"max_rows": n // 4}),
        ("admit_count = 5", {"admit_count": 5}),
        ("admit_prob = 0.1", {"admit_probability": 0.1}),
        ("ttl_steps = 50", {"ttl_steps": 50}),
    ]:
        ps = StorePS(**kw)
        adult.train_worker(ps, data, epochs=args.epochs)
        m = adult.evaluate(ps, data)
        t = ps.tables["adult/emb"]
        print(
            f"{label:16s}: {len(t)} rows ({t.evicted} evicted), auc {m['auc']:.4f} "
            f"({m['auc'] - base_metrics['auc']:+.4f}), loss {m['loss']:.4f}"
        )


if __name__ == "__main__":
    main()
