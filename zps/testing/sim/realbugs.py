"""The broker pair's known defects (:mod:`.bugs`) as they apply to the real code paths
a ``--real-broker`` run takes: the real :class:`~zps.broker.pair.Pair` and the wire
shard of :mod:`.realpair`.  ``--bug NAME`` puts both in place; a defect with no entry
here patches the stand-in only (or, as ``pair-primary-first`` in
:class:`~zps.core.bstar.BinaryStar`, code both run)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Patch = list[tuple[Any, str, Any]]


def _pair_unfenced() -> Patch:
    from zps.testing.sim.realpair import WirePairShard

    def fenced(self: Any, src: str, header: dict[str, Any]) -> bool:
        self.current = src  # whichever broker spoke last, and no term learnt (none stamped)
        return False

    return [(WirePairShard, "_fenced", fenced)]


def _standby_without_record() -> Patch:
    from zps.broker.pair import Pair

    real = Pair._on_peer

    async def on_peer(self: Any, frames: Any) -> None:
        await real(self, frames[:2])  # the record the active peer sent is dropped

    return [(Pair, "_on_peer", on_peer)]


def _pair_map_before_standby() -> Patch:
    from zps.broker.pair import Pair

    def after_held(self: Any, callback: Callable[[], object]) -> None:
        callback()  # at once, whatever the standby holds

    return [(Pair, "after_held", after_held)]


_PATCHES: dict[str, Callable[[], Patch]] = {
    "pair-unfenced": _pair_unfenced,
    "standby-without-record": _standby_without_record,
    "pair-map-before-standby": _pair_map_before_standby,
}


@contextlib.contextmanager
def patched(name: str | None) -> Iterator[None]:
    """Run with the real code paths' form of the defect ``name`` in place (None, or a
    defect without one: nothing)."""
    if name is None or name not in _PATCHES:
        yield
        return
    patches = _PATCHES[name]()
    saved = [(obj, attr, obj.__dict__[attr]) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)
