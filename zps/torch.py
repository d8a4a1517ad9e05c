"""PyTorch adapter (``pip install 'zps[torch]'``): train ``nn.Module`` s against a zps cluster.

Two building blocks, both on the blocking client (``zps.connect_sync``):

- :class:`ParameterServerModule` wraps an ``nn.Module`` (like ``DistributedDataParallel``):
  each parameter lives on the servers as the dense tensor ``{prefix}/{parameter name}``.
  ``pull()`` copies the server values into the module, ``push()`` sends every ``.grad`` (the
  optimizer runs on the shards) and clears it, ``step()`` is push then pull.
- :class:`ShardedEmbeddingBag` is ``nn.EmbeddingBag`` over a zps embedding table keyed by
  arbitrary int64 ids (hashed features): ``forward`` pulls the rows of the batch's unique ids
  into a local leaf tensor and reduces it with ``torch.nn.functional.embedding_bag``;
  ``push()`` sends those rows' gradients.

Initial values: tables start from deterministic server-side initialisers (``Zeros``,
``Constant``, ``Uniform``, ``Normal``), and ``create_*`` is idempotent only for an identical
spec, so every worker must derive the same initialiser.  The local values of the module are
therefore *not* uploaded at construction: each parameter is created with a zps initialiser --
by default the distribution PyTorch's own ``reset_parameters`` draws from for that layer (or
the exact constant, for constant tensors such as biases set to zero) -- and the module is
overwritten by a ``pull()`` at construction.  Every worker then starts from the same values.
To start from a pretrained model instead, one worker calls
:meth:`ParameterServerModule.upload` (the module's local values, or a ``state_dict``) or
:meth:`ParameterServerModule.load_export` (a zps export, see :mod:`zps.model.format`); both
set the server tensors (``set_dense``, optimizer state reset) and pull.
:func:`state_dict_from_export` reads an export into a plain ``state_dict`` without a cluster.

Concurrency: the operations of one ``pull``/``push``/``step`` are issued concurrently from a
small thread pool (the blocking client is thread-safe and multiplexes every call on its one
connection), so a model with many parameters costs about one round trip, not one per tensor.

The module is named ``zps.torch``; it imports the real ``torch`` (absolute imports), so there
is no shadowing inside the package.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

# Without the optional torch installed (the project's own type check), these are Any.
import torch  # type: ignore[import-not-found, unused-ignore]
import torch.nn.functional as F  # type: ignore[import-not-found, unused-ignore]
from torch import nn  # type: ignore[import-not-found, unused-ignore]

from zps.client.sync import SyncClient
from zps.init import Constant, Initializer, Normal, Uniform, Zeros
from zps.optim import Optimizer

__all__ = [
    "InitSpec",
    "OptimizerSpec",
    "ParameterServerModule",
    "ShardedEmbeddingBag",
    "default_init",
    "state_dict_from_export",
]

#: ``init=`` of :class:`ParameterServerModule`: one initialiser for every parameter, a mapping
#: from parameter name to initialiser (missing names get :func:`default_init`), or a function
#: ``(name, parameter) -> initialiser | None`` (``None``: :func:`default_init`).
InitSpec = (
    Initializer
    | Mapping[str, Initializer]
    | Callable[[str, nn.Parameter], Initializer | None]
    | None
)
#: ``optimizer=`` of :class:`ParameterServerModule`: one optimizer for every parameter, or a
#: function ``(name, parameter) -> optimizer`` (e.g. no weight decay on biases).
OptimizerSpec = Optimizer | Callable[[str, nn.Parameter], Optimizer]

_INIT_TYPES = (Zeros, Constant, Uniform, Normal)
_POOL_WORKERS = 16
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _run_all(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run independent blocking calls concurrently; results in order, first error raised."""
    if len(calls) <= 1:
        return [c() for c in calls]
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                _POOL_WORKERS, thread_name_prefix="zps-torch"
            )
        pool = _pool
    futures = [pool.submit(c) for c in calls]
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


def _table_dtype(t: torch.Tensor) -> str:
    return "float64" if t.dtype == torch.float64 else "float32"


def _to_numpy(t: torch.Tensor, dtype: str) -> npt.NDArray[Any]:
    """A contiguous CPU numpy copy/view of ``t`` in the table's dtype."""
    if t.is_sparse:
        t = t.to_dense()
    torch_dtype = torch.float64 if dtype == "float64" else torch.float32
    out: npt.NDArray[Any] = t.detach().to("cpu", torch_dtype).contiguous().numpy()
    return out


# --------------------------------------------------------------------------- initialisers


def _fan_in(weight: torch.Tensor) -> int:
    """PyTorch's fan-in of a weight: ``size(1) * receptive field``."""
    if weight.dim() < 2:
        raise ValueError("fan-in needs a weight of at least 2 dimensions")
    return int(weight.shape[1]) * math.prod(int(d) for d in weight.shape[2:])


def _uniform(bound: float) -> Initializer:
    return Uniform(-bound, bound) if bound > 0 else Zeros()


def _constant_value(t: torch.Tensor) -> float | None:
    """The value of a tensor whose elements are all equal (0.0 for an empty one), else None."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0.0
    first = flat[0]
    if bool(torch.all(flat == first)) and bool(torch.isfinite(first)):
        return float(first)
    return None


def _layer_rule(owner: nn.Module, local_name: str, p: torch.Tensor) -> Initializer | None:
    """The distribution PyTorch's ``reset_parameters`` draws ``owner.<local_name>`` from."""
    weight = getattr(owner, "weight", None)
    if isinstance(owner, nn.Linear | nn.modules.conv._ConvNd):
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
            return None
        fan_in = _fan_in(weight)
        # kaiming_uniform_(a=sqrt(5)) and the bias both give U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        return _uniform(1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0)
    if isinstance(owner, nn.Bilinear):
        if not isinstance(weight, torch.Tensor):
            return None
        return _uniform(1.0 / math.sqrt(int(weight.shape[1])))
    if isinstance(owner, nn.Embedding | nn.EmbeddingBag):
        if getattr(owner, "padding_idx", None) is not None:
            return None  # N(0, 1) with one zero row: not expressible, ask for an explicit init
        return Normal(0.0, 1.0)
    if isinstance(owner, nn.RNNBase):
        return _uniform(1.0 / math.sqrt(owner.hidden_size) if owner.hidden_size > 0 else 0.0)
    if isinstance(owner, nn.RNNCellBase):
        return _uniform(1.0 / math.sqrt(owner.hidden_size) if owner.hidden_size > 0 else 0.0)
    del local_name, p
    return None


def _constant_init(value: float) -> Initializer:
    return Zeros() if value == 0.0 else Constant(value)


def default_init(owner: nn.Module, local_name: str, p: torch.Tensor) -> Initializer:
    """The zps initialiser used for parameter ``local_name`` of layer ``owner`` by default.

    A constant tensor of more than one element (zeros, ones: biases, norm layers, anything set
    with ``nn.init.constant_``) keeps its exact value.  Otherwise the layer's PyTorch default
    distribution, which depends on shapes only, so every worker derives the same spec:
    ``Linear``/``Conv*``/``ConvTranspose*`` weight and bias ``U(-1/sqrt(fan_in),
    1/sqrt(fan_in))``; ``Bilinear`` ``U(-1/sqrt(in1), 1/sqrt(in1))``; ``Embedding``/
    ``EmbeddingBag`` (without ``padding_idx``) ``N(0, 1)``; ``RNN``/``LSTM``/``GRU`` and their
    cells ``U(-1/sqrt(hidden), 1/sqrt(hidden))``.  A one-element tensor of another layer keeps its
    value.  Anything else raises ``ValueError``: pass ``init=`` for it.
    """
    value = _constant_value(p)
    if value is not None and p.numel() > 1:
        return _constant_init(value)
    rule = _layer_rule(owner, local_name, p)
    if rule is not None:
        return rule
    if value is not None:
        return _constant_init(value)
    raise ValueError(
        f"no default zps initialiser for parameter {local_name!r} of "
        f"{type(owner).__name__}: pass init={{name: zps.init...}} for it"
    )


def _named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """``(full name, owning module, local name, parameter)``, each parameter once."""
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        for local, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{mod_name}.{local}" if mod_name else local), mod, local, p


def _check_init(name: str, init: object) -> Initializer:
    if not isinstance(init, _INIT_TYPES):
        raise TypeError(f"init for {name!r} must be a zps.init initializer, got {init!r}")
    return init


# --------------------------------------------------------------------------- dense parameters


class ParameterServerModule(nn.Module):  # type: ignore[misc, unused-ignore]
    """An ``nn.Module`` whose parameters live on a zps cluster.

    ``ParameterServerModule(module, ps, prefix, optimizer=zps.optim.Adam(lr=1e-3))`` creates
    (idempotently: every worker may do it) one dense tensor ``{prefix}/{name}`` per parameter of
    ``module`` (``name`` as in ``module.named_parameters()``; tied parameters once), with the
    parameter's shape and dtype float32 (float64 for float64 parameters), then pulls: the
    module's local values are replaced by the server's (see the module docstring for why;
    ``init=`` chooses the server-side initialisers, default :func:`default_init`).  With
    ``create=False`` it attaches to tensors another worker created (the shapes are checked).
    With ``upload=True`` the module's own values (a pretrained model) are set on the servers
    instead (:meth:`upload`; optimizer state reset): one worker does that, the others attach.

    Training loop::

        loss = criterion(model(x), y)
        loss.backward()
        model.step()          # push every .grad (optimizer on the shards), clear, pull

    ``forward`` calls the wrapped module.  :class:`ShardedEmbeddingBag` layers inside the module
    are pushed by ``push()``/``step()`` too.  Buffers (e.g. BatchNorm running statistics) stay
    local.  Parameters whose ``.grad`` is ``None`` are not pushed (as ``torch.optim`` skips them).
    """

    def __init__(
        self,
        module: nn.Module,
        ps: SyncClient,
        prefix: str,
        *,
        optimizer: OptimizerSpec | None = None,
        init: InitSpec = None,
        create: bool = True,
        upload: bool = False,
    ) -> None:
        super().__init__()
        if not prefix:
            raise ValueError("prefix must be a non-empty string")
        if create and optimizer is None:
            raise ValueError("optimizer= (a zps.optim optimizer) is required to create tensors")
        # upload=True: the module's own values (a pretrained model) replace the servers'
        own = (
            {n: p.detach().clone() for n, _, _, p in _named_parameters(module)} if upload else None
        )
        self.module = module
        self.ps = ps
        self.prefix = prefix
        #: ``(table name, parameter, table dtype)`` for every parameter, in module order.
        self.tables: list[tuple[str, nn.Parameter, str]] = []
        creates: list[Callable[[], None]] = []
        for name, owner, local, p in _named_parameters(module):
            table = f"{prefix}/{name}"
            dtype = _table_dtype(p)
            self.tables.append((table, p, dtype))
            if not create:
                continue
            assert optimizer is not None
            opt = optimizer if not callable(optimizer) else optimizer(name, p)
            ini = self._resolve_init(init, name, owner, local, p)
            shape = tuple(int(d) for d in p.shape)
            creates.append(
                functools.partial(ps.create_dense, table, shape, dtype, init=ini, optimizer=opt)
            )
        _run_all(creates)
        if own is not None:
            self.upload(own)
        else:
            self.pull()

    @staticmethod
    def _resolve_init(
        init: InitSpec, name: str, owner: nn.Module, local: str, p: nn.Parameter
    ) -> Initializer:
        chosen: object = None
        if isinstance(init, _INIT_TYPES):
            chosen = init
        elif isinstance(init, Mapping):
            chosen = init.get(name)
        elif init is not None:
            chosen = init(name, p)
        if chosen is None:
            return default_init(owner, local, p)
        return _check_init(name, chosen)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _embedding_bags(self) -> list[ShardedEmbeddingBag]:
        return [m for m in self.module.modules() if isinstance(m, ShardedEmbeddingBag)]

    def _gradients(self) -> list[tuple[str, nn.Parameter, npt.NDArray[Any]]]:
        grads = []
        for table, p, dtype in self.tables:
            if p.grad is not None:
                grads.append((table, p, _to_numpy(p.grad, dtype)))
        return grads

    def _assign(self, values: Sequence[tuple[nn.Parameter, npt.NDArray[Any]]]) -> None:
        with torch.no_grad():
            for p, arr in values:
                if tuple(arr.shape) != tuple(p.shape):
                    raise ValueError(
                        f"server tensor has shape {tuple(arr.shape)}, parameter {tuple(p.shape)}"
                    )
                p.copy_(torch.from_numpy(arr))

    def pull(self) -> None:
        """Copy the server values of every parameter into the module (no autograd)."""
        arrays = _run_all(
            [functools.partial(self.ps.pull_dense, table) for table, _, _ in self.tables]
        )
        self._assign([(p, a) for (_, p, _), a in zip(self.tables, arrays, strict=True)])

    def upload(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """Set the server tensors to the module's local values, or to those of
        ``state_dict`` (parameter names as in ``module.named_parameters()``; names it
        lacks are left alone), then pull; returns the parameter names set.  The
        optimizer state of each tensor set starts afresh.  One worker does this (a
        warm start from a pretrained model); the others ``pull()`` afterwards.

        Construction pulls, replacing the local values by the servers': to upload a
        pretrained module's values, construct with ``upload=True`` or pass its
        ``state_dict()`` taken before wrapping."""
        prefix = f"{self.prefix}/"
        calls: list[Callable[[], None]] = []
        names = []
        for table, p, dtype in self.tables:
            name = table[len(prefix) :]
            if state_dict is None:
                value = _to_numpy(p, dtype)
            elif name in state_dict:
                value = _to_numpy(state_dict[name], dtype)
            else:
                continue
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"{name}: the value has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(p.shape)}"
                )
            names.append(name)
            calls.append(functools.partial(self.ps.set_dense, table, value))
        _run_all(calls)
        self.pull()
        return names

    def load_export(self, path: str | os.PathLike[str], *, prefix: str | None = None) -> list[str]:
        """Set the server tensors from a zps export (``zps-server export``) holding the
        tensors ``{prefix}/{name}`` (default: this module's prefix) of this module's
        parameters, then pull; returns the names set."""
        return self.upload(state_dict_from_export(path, prefix or self.prefix))

    def push(self) -> None:
        """Push every parameter's ``.grad`` (and the rows of :class:`ShardedEmbeddingBag`
        layers), concurrently; the optimizer runs on the shards.  Clears the gradients once all
        were acknowledged."""
        grads = self._gradients()
        calls: list[Callable[[], Any]] = [
            functools.partial(self.ps.push_dense, table, g) for table, _, g in grads
        ]
        for bag in self._embedding_bags():
            call = bag._take()
            if call is not None:
                calls.append(call)
        _run_all(calls)
        for _, p, _ in grads:
            p.grad = None

    def step(self) -> None:
        """Push then pull: each parameter's push is followed by its pull, all concurrently."""
        grads = {table: g for table, _, g in self._gradients()}

        def push_pull(table: str, g: npt.NDArray[Any] | None) -> npt.NDArray[Any]:
            if g is not None:
                self.ps.push_dense(table, g)
            return self.ps.pull_dense(table)

        calls: list[Callable[[], Any]] = [
            functools.partial(push_pull, table, grads.get(table)) for table, _, _ in self.tables
        ]
        for bag in self._embedding_bags():
            call = bag._take()
            if call is not None:
                calls.append(call)
        pulled = _run_all(calls)[: len(self.tables)]
        for table, p, _ in self.tables:
            if table in grads:
                p.grad = None
        self._assign([(p, a) for (_, p, _), a in zip(self.tables, pulled, strict=True)])


def state_dict_from_export(path: str | os.PathLike[str], prefix: str) -> dict[str, torch.Tensor]:
    """The dense tensors ``{prefix}/{name}`` of a zps export as ``{name: tensor}``, for
    ``module.load_state_dict(..., strict=False)`` (no cluster needed)."""
    from zps.model.format import Export

    export = Export(path)
    head = f"{prefix}/"
    out: dict[str, torch.Tensor] = {}
    for entry in export:
        if entry.kind == "dense" and entry.name.startswith(head):
            out[entry.name[len(head) :]] = torch.from_numpy(np.array(export.values(entry.name)))
    if not out:
        raise ValueError(f"the export at {path} has no dense tensor named {head}...")
    return out


# --------------------------------------------------------------------------- embeddings


class ShardedEmbeddingBag(nn.Module):  # type: ignore[misc, unused-ignore]
    """``nn.EmbeddingBag`` over a zps embedding table of int64 ids (any value, e.g. hashes).

    ``forward(input, offsets=None, per_sample_weights=None)`` takes the arguments of
    ``nn.EmbeddingBag.forward`` (1-D ``input`` with ``offsets``, or 2-D ``input`` of fixed-size
    bags) but ids are arbitrary int64 keys of the table named ``name``.  It pulls the rows of the
    batch's unique ids (one round trip), makes them a local leaf tensor and reduces with
    ``F.embedding_bag`` (``mode`` 'sum', 'mean' or 'max'), so autograd is PyTorch's own.
    While grad is enabled the leaf is kept until :meth:`push`, which sends the rows' gradients in
    one ``push_rows`` (several forwards before a push accumulate: the server sums gradients of
    duplicate ids).  :meth:`discard` drops them instead.  Inside a
    :class:`ParameterServerModule`, its ``push()``/``step()`` does this.

    ``init`` defaults to ``N(0, 1)`` as ``nn.EmbeddingBag``; ``create=False`` attaches to a table
    created elsewhere.
    """

    def __init__(
        self,
        ps: SyncClient,
        name: str,
        embedding_dim: int,
        *,
        mode: Literal["sum", "mean", "max"] = "mean",
        optimizer: Optimizer | None = None,
        init: Initializer | None = None,
        dtype: Literal["float32", "float64"] = "float32",
        include_last_offset: bool = False,
        create: bool = True,
    ) -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
        if create and optimizer is None:
            raise ValueError("optimizer= (a zps.optim optimizer) is required to create the table")
        self.ps = ps
        self.name = name
        self.embedding_dim = int(embedding_dim)
        self.mode = mode
        self.dtype = dtype
        self.include_last_offset = include_last_offset
        self._pending: list[tuple[npt.NDArray[np.int64], torch.Tensor]] = []
        if create:
            ps.create_embedding(
                name,
                self.embedding_dim,
                dtype,
                init=init if init is not None else Normal(0.0, 1.0),
                optimizer=optimizer,
            )

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.embedding_dim}, mode={self.mode!r}"

    def pull_rows(self, ids: npt.ArrayLike) -> torch.Tensor:
        """The current rows of ``ids`` as a tensor (no autograd)."""
        rows = self.ps.pull_rows(self.name, np.asarray(ids, dtype=np.int64).reshape(-1))
        return torch.from_numpy(np.asarray(rows))

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids = input.detach().to("cpu", torch.int64).numpy().reshape(-1)
        uniq, inverse = np.unique(ids, return_inverse=True)
        torch_dtype = torch.float64 if self.dtype == "float64" else torch.float32
        if uniq.size:
            rows = np.asarray(self.ps.pull_rows(self.name, uniq))
            weight = torch.from_numpy(rows).to(input.device, torch_dtype)
        else:
            weight = torch.zeros((0, self.embedding_dim), dtype=torch_dtype, device=input.device)
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            self._pending.append((uniq.astype(np.int64, copy=False), weight))
        local = torch.from_numpy(inverse.reshape(input.shape).astype(np.int64)).to(input.device)
        return F.embedding_bag(
            local,
            weight,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )

    @property
    def pending(self) -> int:
        """How many forward passes' rows wait for :meth:`push`."""
        return len(self._pending)

    def discard(self) -> None:
        """Drop the rows of the forward passes since the last push without pushing."""
        self._pending.clear()

    def _take(self) -> Callable[[], None] | None:
        """Take the pending gradients; return the blocking call that pushes them (or None)."""
        pending, self._pending = self._pending, []
        ids: list[npt.NDArray[np.int64]] = []
        grads: list[npt.NDArray[Any]] = []
        for uniq, weight in pending:
            if weight.grad is not None and uniq.size:
                ids.append(uniq)
                grads.append(_to_numpy(weight.grad, self.dtype))
        if not ids:
            return None
        all_ids = np.concatenate(ids) if len(ids) > 1 else ids[0]
        all_grads = np.concatenate(grads) if len(grads) > 1 else grads[0]

        def call() -> None:
            self.ps.push_rows(self.name, all_ids, all_grads)

        return call

    def push(self) -> None:
        """Send the gradients of the rows used since the last push (one ``push_rows``)."""
        call = self._take()
        if call is not None:
            call()
