"""Every key ``deploy/zps.toml`` shows commented out (``# key = value``) is a key of its
section: uncommented where it stands, the file still loads and the value reaches the
settings.  Keys that exclude each other (a broker of a pair does not follow one) are
uncommented in separate files."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from zps.ops.config import Settings, load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "zps.toml"
SECTION = re.compile(r"\[([A-Za-z_]+)\]")
COMMENTED = re.compile(r"#\s*(([A-Za-z_][A-Za-z0-9_]*)\s*=\s*\S.*)")

#: Keys that load only together: each set is uncommented as one.
PAIR = frozenset({"broker.pair_role", "broker.peer_bind", "broker.peer"})
CURVE_PAIR = frozenset({"security.curve_secret_key_file", "security.curve_public_key_file"})
TOGETHER = (PAIR, CURVE_PAIR)
#: A routing broker's keys: not one of a pair, so never in a file with PAIR.
FOLLOW = frozenset({"broker.follow", "broker.advertise", "broker.host"})
#: The process settings a shared section is read from.
SHARED_IN = {
    "heartbeat": "broker",
    "security": "broker",
    "metrics": "broker",
    "checkpoint": "shard",
    "limits": "shard",
    "replication": "shard",
}


@dataclass(frozen=True)
class Commented:
    line: int  # 0-based index into the file's lines
    section: str
    key: str
    text: str  # the line uncommented

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"


def commented_keys() -> list[Commented]:
    out: list[Commented] = []
    section: str | None = None
    for i, line in enumerate(DEPLOY.read_text().splitlines()):
        stripped = line.strip()
        if m := SECTION.fullmatch(stripped):
            section = m[1]
        elif m := COMMENTED.fullmatch(stripped):
            assert section is not None, f"deploy/zps.toml:{i + 1}: a key before any section"
            out.append(Commented(i, section, m[2], m[1]))
    return out


KEYS = commented_keys()
BY_NAME = {c.name: c for c in KEYS}


def groups() -> list[list[Commented]]:
    """The keys to uncomment one file at a time: each TOGETHER set as one, any other
    key alone."""
    grouped = [[BY_NAME[n] for n in sorted(s)] for s in TOGETHER]
    in_sets = {n for s in TOGETHER for n in s}
    return grouped + [[c] for c in KEYS if c.name not in in_sets]


def uncommented(keys: list[Commented], tmp_path: Path) -> Path:
    lines = DEPLOY.read_text().splitlines()
    for c in keys:
        lines[c.line] = c.text
    path = tmp_path / "zps.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def setting(settings: Settings, section: str, key: str) -> Any:
    owner = getattr(settings, SHARED_IN.get(section, section))
    if section in SHARED_IN:
        owner = getattr(owner, section)
    return getattr(owner, key)


def check_values(settings: Settings, keys: list[Commented]) -> None:
    for c in keys:
        value = tomllib.loads(c.text)[c.key]
        expected = tuple(value) if isinstance(value, list) else value
        assert setting(settings, c.section, c.key) == expected, c.name


def test_the_file_shows_commented_keys_of_every_kind() -> None:
    names = set(BY_NAME)
    assert len(names) == len(KEYS), "a key is shown twice in one section"
    assert names >= PAIR | CURVE_PAIR | FOLLOW
    assert names >= {"shard.shm_bytes", "client.shm_bytes"}


@pytest.mark.parametrize("keys", groups(), ids=lambda keys: "+".join(c.name for c in keys))
def test_each_commented_key_loads_where_it_stands(keys: list[Commented], tmp_path: Path) -> None:
    settings = load_settings(str(uncommented(keys, tmp_path)))
    check_values(settings, keys)


@pytest.mark.parametrize(
    ("leave_out", "keep"),
    [(FOLLOW, PAIR), (PAIR, FOLLOW)],
    ids=["a broker of a pair", "a routing broker"],
)
def test_every_commented_key_at_once_loads(
    leave_out: frozenset[str], keep: frozenset[str], tmp_path: Path
) -> None:
    keys = [c for c in KEYS if c.name not in leave_out]
    assert keep <= {c.name for c in keys}
    settings = load_settings(str(uncommented(keys, tmp_path)))
    check_values(settings, keys)
