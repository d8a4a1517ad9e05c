"""The field readers of the typed records (:mod:`zps.protocol.messages`): each returns a
checked value or raises :class:`ProtocolError`, and nothing else.  Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeAlias

from zps.errors import ProtocolError
from zps.protocol.enums import Role

Header: TypeAlias = Mapping[str, Any]


# -- field readers: each returns a checked value or raises ProtocolError ----------


def _field(h: Header, key: str, what: str) -> Any:
    if key not in h:
        raise ProtocolError(f"{what}: missing {key!r}")
    return h[key]


def _int(value: object, what: str, *, lo: int = 0, hi: int = 2**64 - 1) -> int:
    # bool is an int subclass; on the wire it is not a number
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _str(value: object, what: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ProtocolError(f"{what} must be a {'' if empty else 'non-empty '}string")
    return value


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{what} must be true or false, got {value!r}")
    return value


def _opt_int(h: Header, key: str, what: str, default: int) -> int:
    return _int(h[key], what) if key in h else default


def _opt_str(h: Header, key: str, what: str, default: str) -> str:
    return _str(h[key], what) if key in h else default


def _label(h: Header, key: str, what: str) -> str:
    value = _opt_str(h, key, what, "")
    if len(value) > 100:
        raise ProtocolError(f"{what} must be at most 100 characters")
    return value


def _header(h: object, what: str) -> Header:
    if not isinstance(h, Mapping):
        raise ProtocolError(f"{what} header must be a map, got {type(h).__name__}")
    return h


def _send_time(value: object) -> float | None:
    # A heartbeat's "t": the sender's monotonic clock (a float), not a table name.
    if value is not None and (not isinstance(value, float) or not math.isfinite(value)):
        raise ProtocolError(f"HEARTBEAT t must be a finite float send time, got {value!r}")
    return value


def _role(value: object, what: str) -> Role:
    if not isinstance(value, str) or value not in Role.__members__.values():
        raise ProtocolError(f"{what} must be one of {[r.value for r in Role]}, got {value!r}")
    return Role(value)
