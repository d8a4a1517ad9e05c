"""An offline export's copies against each other: each slot served once, and every slot
when each copy says which it serves (copies from different points of a move refused)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from zps.errors import BadRequestError
from zps.model.offline import Copy, _check_slots


def copy(p: int, owned: list[int] | None, n_slots: int = 8) -> Copy:
    mask = None if owned is None else np.isin(np.arange(n_slots), owned)
    return Copy(Path(f"/d{p}"), p, owned=mask)


def test_copies_that_split_the_slots_pass() -> None:
    _check_slots({0: copy(0, [0, 1, 2, 3]), 1: copy(1, [4, 5, 6, 7])})
    _check_slots({0: copy(0, None), 1: copy(1, None)})  # no move involved them


def test_a_slot_served_twice_is_refused() -> None:
    # the destination activated, the source not yet released: the cut-over
    with pytest.raises(BadRequestError, match="2 slots are served by two partitions' copies"):
        _check_slots({0: copy(0, [0, 1, 2, 3, 4, 5]), 1: copy(1, [4, 5, 6, 7])})


def test_a_slot_served_nowhere_is_refused_when_every_copy_says() -> None:
    # the source released, the destination's copy given is behind its activation
    with pytest.raises(BadRequestError, match="2 slots are served by no copy"):
        _check_slots({0: copy(0, [0, 1, 2, 3]), 1: copy(1, [6, 7])})
    # a copy that no move involved serves what the map gave it: not known offline
    _check_slots({0: copy(0, [0, 1, 2, 3]), 1: copy(1, [6, 7]), 2: copy(2, None)})
