"""What the broker's live resharding (:mod:`zps.broker.reshard`) reports: its counters
(the status's ``reshard``) and the outcomes that end a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class MoveFailed(RuntimeError):
    """A request of a move failed: the move is cancelled and planned again."""


class StandbyAway(Exception):
    """The standby broker of the pair does not hold the record of the next move: no
    move starts (nothing fenced, nothing imported) until it does."""


class Superseded(Exception):
    """The broker's state was replaced (it stepped down, or took over again: see
    :meth:`Resharder.restore`): the step under way is not this state's, and sends
    nothing more; the record restored decides what comes next."""


@dataclass
class ReshardStats:
    moves_done: int = 0
    moves_cancelled: int = 0
    slots_moved: int = 0
    bytes_moved: int = 0
    #: The longest time slots were fenced (from the fence to the destination serving).
    max_fenced_s: float = 0.0
    #: Embedding rows the last move copied while its slots were fenced (with catch-up:
    #: those written during the copy before the fence).
    fenced_rows: int = 0
    #: Steps of the drops of released rows (``slots_compact``, ``compact_rows`` each).
    compact_steps: int = 0
    last_move_s: float = 0.0
    last_error: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
