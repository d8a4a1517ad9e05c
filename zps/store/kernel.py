"""The binding of the optional compiled kernel (``zps.store._kernel``, built from
``zps/store/_kernel.c`` by ``pip install`` where a C compiler is found): probe, gather,
optimizer and scatter of an embedding table's rows in one call, and a dense chunk's update
in one pass, with bit for bit the numpy version's results.

The tables (zps/store/embedding.py, zps/store/dense.py) read :data:`COMPILED` and
:data:`KERNEL` from this module at each call, so setting them here (a test's patch, a
benchmark's switch) takes effect at once.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum

try:  # the compiled pull and push, built by ``pip install`` where a C compiler is found
    from zps.store import _kernel as _compiled  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _compiled = None

__all__ = ["ADAM_STEPS", "COMPILED", "KERNEL", "ROW0", "KernelOpt", "adam_tables", "kernel_opt"]

Array = npt.NDArray[Any]

#: The compiled module (None: it was not built).
COMPILED: Any = _compiled
#: Whether an embedding table's pull and push, and a dense chunk's update (but Adam's),
#: use the compiled kernel (each row updated in place).  ``ZPS_NO_KERNEL=1`` in the
#: environment turns it off, as it does the index's compiled lookup.
KERNEL = COMPILED is not None and os.environ.get("ZPS_NO_KERNEL", "") in ("", "0")
#: Adam's bias-correction tables (see :func:`adam_tables`) start with this many steps.
ADAM_STEPS = 1024
#: A dense chunk's one row, for the kernel.
ROW0 = np.zeros(1, dtype=np.int64)
ROW0.setflags(write=False)

#: An applied optimizer as the kernel takes it (see :func:`kernel_opt`).
KernelOpt = tuple[int, float, float, float, float, float, float, int]


def _fixed(rate: object) -> float:
    """An applied optimizer's rate (:func:`zps.optim.at_step` fixed it)."""
    assert isinstance(rate, float | int), "a scheduled optimizer applied without at_step"
    return float(rate)


def kernel_opt(opt: object) -> KernelOpt | None:
    """An applied optimizer (a fixed rate: see :func:`zps.optim.at_step`) as the kernel's
    ``opt`` tuple: ``(kind, clip (0: none), weight_decay, four hyperparameters, flag)``,
    the flag Momentum's ``nesterov`` (for Adam, set with its tables); None if the kernel
    has no such kind, or was not built."""
    k = COMPILED
    if k is None:
        return None
    if isinstance(opt, SGD):
        return (k.SGD, opt.clip or 0.0, opt.weight_decay, _fixed(opt.lr), 0.0, 0.0, 0.0, 0)
    if isinstance(opt, Momentum):
        return (
            k.MOMENTUM,
            opt.clip or 0.0,
            opt.weight_decay,
            _fixed(opt.lr),
            opt.momentum,
            0.0,
            0.0,
            int(opt.nesterov),
        )
    if isinstance(opt, Adagrad):
        rate = _fixed(opt.lr)
        return (k.ADAGRAD, opt.clip or 0.0, opt.weight_decay, rate, opt.eps, 0.0, 0.0, 0)
    if isinstance(opt, Adam):
        return (
            k.ADAM,
            opt.clip or 0.0,
            opt.weight_decay,
            _fixed(opt.lr),
            opt.beta1,
            opt.beta2,
            opt.eps,
            0,
        )
    if isinstance(opt, FTRL):
        alpha = _fixed(opt.alpha)
        return (k.FTRL, opt.clip or 0.0, 0.0, alpha, opt.beta, opt.l1, opt.l2, 0)
    return None


def adam_tables(opt: Adam, steps: int, dtype: np.dtype[Any]) -> tuple[Array, Array, bool]:
    """``1 - beta1**t`` and ``1 - beta2**t`` for steps ``t = 0 .. steps - 1``, computed
    exactly as :meth:`zps.optim.Adam.apply` computes them for each row (the same numpy
    call on a column of float steps), so the kernel's bias corrections are the same bits;
    and whether they are saturated: both powers at the last step are below an eighth of
    the dtype's epsilon, so ``1 - beta**t`` is exactly 1 there and at every later step
    (then the tables stop growing, and the kernel uses their last entry)."""
    t = np.arange(steps, dtype=dtype).reshape(-1, 1)
    pow1 = np.power(opt.beta1, t, dtype=dtype)
    pow2 = np.power(opt.beta2, t, dtype=dtype)
    tiny = float(np.finfo(dtype).eps) / 8
    saturated = bool(pow1[-1, 0] < tiny and pow2[-1, 0] < tiny)
    bc1, bc2 = (1.0 - pow1).reshape(-1), (1.0 - pow2).reshape(-1)
    return np.ascontiguousarray(bc1), np.ascontiguousarray(bc2), saturated
