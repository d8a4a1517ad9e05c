"""CURVE keys: writing, loading, and the socket options that use them.

The broker (and each shard's replication endpoint) is a CURVE server that
admits only clients whose public keys are in ``allowed_clients_dir``
(a ZAP allow-list, checked by pyzmq's authenticator); shards and clients are
CURVE clients that know the broker's public key.  Keys are the Z85 text
files pyzmq's ``zmq.auth`` writes: ``NAME.key`` (public) and
``NAME.key_secret`` (secret, mode 0600).

:func:`write_keypair` never replaces a key unless told to (a new key pair locks
out every peer that trusts the old public key), never creates a missing
directory unless told to (a typo would put the secret somewhere unexpected),
and never lets the secret be readable by others, not even for a moment: the
pair is written in a private directory and linked into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import msgpack

from zps import transport
from zps.errors import ConfigError, ZpsError
from zps.ops.config import Security
from zps.protocol.ops import ADMIN_OPS
from zps.transport import CurveKeys

log = logging.getLogger("zps.security")

#: What a key pair's file name stem may be.
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def write_keypair(
    out_dir: str, name: str, *, force: bool = False, parents: bool = False
) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (mode 0600) in ``out_dir``.

    Raises :class:`~zps.errors.ZpsError` naming the file if either exists (unless
    ``force``: then both are replaced, each atomically), or the directory if it is
    missing (unless ``parents``: then it is created, mode 0750)."""
    if not KEY_NAME.fullmatch(name):
        raise ConfigError(
            f"key name must be letters, digits, '.', '_' or '-' (no path), got {name!r}"
        )
    out = Path(out_dir)
    if not out.is_dir():
        if out.exists():
            raise ZpsError(f"{out} is not a directory")
        if not parents:
            raise ZpsError(f"directory {out} does not exist (create it, or pass --parents)")
        out.mkdir(parents=True, mode=0o750)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    if not force:
        for path in (secret, public):
            if path.exists():
                raise ZpsError(
                    f"{path} exists: not overwritten (peers that trust its key would be "
                    "locked out); pass --force to replace the key pair"
                )
    try:
        with tempfile.TemporaryDirectory(dir=out, prefix=".keygen-") as tmp:  # mode 0700
            pub_tmp, sec_tmp = transport.write_keypair(tmp, name)
            os.chmod(sec_tmp, 0o600)
            if force:
                os.replace(sec_tmp, secret)
                os.replace(pub_tmp, public)
            else:  # a link never replaces: a file that appeared meanwhile wins
                os.link(sec_tmp, secret)
                try:
                    os.link(pub_tmp, public)
                except OSError:
                    secret.unlink()
                    raise
    except FileExistsError as e:
        raise ZpsError(f"{e.filename}: exists: not overwritten (pass --force)") from None
    except OSError as e:
        raise ZpsError(f"cannot write the key pair in {out}: {e}") from None
    return public, secret


def _load(path: str, what: str, secret: bool) -> bytes:
    if not Path(path).is_file():
        state = "is not a file" if Path(path).exists() else "does not exist"
        raise ConfigError(f"security.{what}: cannot load {path}: the file {state}")
    try:
        pub, sec = transport.load_keys(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"security.{what}: cannot load {path}: {e}") from None
    key = sec if secret else pub
    if key is None:
        raise ConfigError(
            f"security.{what}: {path} holds no {'secret' if secret else 'public'} key"
        )
    return bytes(key)


def load_curve_keys(sec: Security) -> CurveKeys | None:
    """The keys ``sec`` names, loaded and checked; None when CURVE is off."""
    if not sec.enabled:
        return None
    assert sec.curve_secret_key_file is not None and sec.curve_public_key_file is not None
    server = (
        _load(sec.broker_public_key_file, "broker_public_key_file", False)
        if sec.broker_public_key_file
        else None
    )
    if sec.allowed_clients_dir is not None and not Path(sec.allowed_clients_dir).is_dir():
        raise ConfigError(
            f"security.allowed_clients_dir: {sec.allowed_clients_dir} is not a directory"
        )
    public = _load(sec.curve_public_key_file, "curve_public_key_file", False)
    secret = _load(sec.curve_secret_key_file, "curve_secret_key_file", True)
    _check_pair(public, secret, sec.curve_public_key_file, sec.curve_secret_key_file)
    return CurveKeys(
        public=public,
        secret=secret,
        server_public=server,
        allowed_dir=sec.allowed_clients_dir,
    )


def _check_pair(public: bytes, secret: bytes, public_file: str, secret_file: str) -> None:
    """Refuse a public key that is not the one of the secret key: peers would know this
    process by a key it cannot prove, and every handshake would fail."""
    try:
        derived = transport.public_key_of(secret)
    except ValueError as e:
        raise ConfigError(
            f"security.curve_secret_key_file: {secret_file} holds no valid secret key: {e}"
        ) from None
    if derived != public:
        raise ConfigError(
            f"security.curve_public_key_file {public_file} is not the public key of "
            f"security.curve_secret_key_file {secret_file}: give the NAME.key and "
            "NAME.key_secret that `zps-server keygen` wrote together"
        )


@dataclass(frozen=True)
class KeyRoles:
    """Which authenticated public keys (Z85) may act as what under CURVE: ``[security]
    allowed_shards_dir``, ``allowed_clients_dir`` and ``allowed_operators_dir``.

    Without ``allowed_shards_dir`` every admitted key may act as a shard
    (``open_shards``); without ``allowed_clients_dir`` any key may connect
    (``open_clients``: encryption without an allow-list)."""

    shards: frozenset[bytes]
    clients: frozenset[bytes]
    operators: frozenset[bytes] = frozenset()
    open_shards: bool = False
    open_clients: bool = False

    def roles(self, key: bytes | None) -> frozenset[str]:
        """The roles of ``key``: a subset of {"shard", "client", "operator"} (empty: in
        no allow-list, or no key)."""
        if key is None:
            return frozenset()
        out = set()
        if key in self.operators:
            out.add("operator")
        if key in self.clients or key in self.operators or self.open_clients:
            out.add("client")
        if key in self.shards or (self.open_shards and out):
            out.add("shard")
        return frozenset(out)

    def role(self, key: bytes | None) -> str | None:
        """The role of ``key``: "shard", "client", or None (in no set, or no key)."""
        roles = self.roles(key)
        return "shard" if "shard" in roles else "client" if "client" in roles else None

    @property
    def admitted(self) -> frozenset[bytes] | None:
        """The keys the handshake admits (None: any key)."""
        return None if self.open_clients else self.shards | self.clients | self.operators


def _keys_in(directory: str, what: str) -> frozenset[bytes]:
    if not Path(directory).is_dir():
        raise ConfigError(f"security.{what}: {directory} is not a directory")
    try:
        return transport.load_public_keys(directory)
    except (OSError, ValueError) as e:
        raise ConfigError(f"security.{what}: cannot load the keys in {directory}: {e}") from None


def load_roles(sec: Security) -> KeyRoles | None:
    """The key sets by role, loaded and checked; None when CURVE is off."""
    if not sec.enabled:
        return None

    def keys(path: str | None, what: str) -> frozenset[bytes]:
        return _keys_in(path, what) if path is not None else frozenset()

    return KeyRoles(
        shards=keys(sec.allowed_shards_dir, "allowed_shards_dir"),
        clients=keys(sec.allowed_clients_dir, "allowed_clients_dir"),
        operators=keys(sec.allowed_operators_dir, "allowed_operators_dir"),
        open_shards=sec.allowed_shards_dir is None,
        open_clients=sec.allowed_clients_dir is None,
    )


def load_key_roles(sec: Security) -> KeyRoles | None:
    """:func:`load_roles` when ``allowed_shards_dir`` is set (a shard's replication
    endpoint then admits only shard keys), else None."""
    if not sec.enabled or sec.allowed_shards_dir is None:
        return None
    return load_roles(sec)


# -- identities bound to keys ------------------------------------------------------

#: Hex digits of a key's tag in the identities it may use.
TAG_CHARS = 16
#: Why a peer or a message is refused, as counted (``zps_*_refusals{reason=...}``).
REFUSAL_REASONS = (
    "no_key",
    "key_not_allowed",
    "wrong_role",
    "identity_of_another_key",
    "no_identity",
)
#: The words a log line gives each reason.
REFUSAL_WORDS = {
    "no_key": "no CURVE key (it did not complete a CURVE handshake)",
    "key_not_allowed": "its key is in no allow-list",
    "wrong_role": "its key's role may not do this",
    "identity_of_another_key": "the identity belongs to another key",
    "no_identity": "its connection carries no zps id (a zps older than this one, or not zps)",
}


def key_tag(key: bytes) -> bytes:
    """The tag of a Z85 public key: the first hex digits of its SHA-256.  Finding
    another key of the same tag costs about 2**64 key generations."""
    return hashlib.sha256(key).hexdigest()[:TAG_CHARS].encode()


def key_identity(prefix: bytes, key: bytes, suffix: bytes) -> bytes:
    """The routing identity a peer of ``key`` uses under CURVE: ``prefix`` (``c-``,
    ``r-``), the key's tag, ``-`` and ``suffix``."""
    return prefix + key_tag(key) + b"-" + suffix


def client_identity(public: bytes | None) -> bytes:
    """A new client's zps id: under CURVE (``public``: its key) ``c-``, the key's tag and
    8 random hex digits, so no other key may use it; else ``c-`` and 16 random hex
    digits."""
    if public is not None:
        return key_identity(b"c-", public, uuid.uuid4().hex[:8].encode())
    return f"c-{uuid.uuid4().hex[:16]}".encode()


def is_shard_identity(ident: bytes) -> bool:
    """A shard's identity (``s-NAME``) or its liveness link's (``h-s-NAME``)."""
    return ident.startswith(b"s-") or ident.startswith(b"h-s-")


def identity_refusal(
    ident: bytes, key: bytes | None, roles: KeyRoles, owner: bytes | None
) -> str | None:
    """Why a message from routing identity ``ident`` authenticated by ``key`` is refused
    (one of :data:`REFUSAL_REASONS`), or None: accepted.

    A shard identity needs a key of the shard role and belongs to ``owner``, the key
    its name is bound to (None: not bound yet; the caller binds it to ``key``).  Any
    other identity carries its key's tag (:func:`key_identity`), so no table decides
    it and no key can ever send as another's."""
    if key is None:
        return "no_key"
    have = roles.roles(key)
    if not have:
        return "key_not_allowed"
    if is_shard_identity(ident):
        if "shard" not in have:
            return "wrong_role"
        return None if owner is None or owner == key else "identity_of_another_key"
    n = 2 + TAG_CHARS
    if ident[2:n] != key_tag(key) or ident[n : n + 1] != b"-":
        return "identity_of_another_key"
    return None


#: Broker-handled commands that change the cluster (a STATUS request's fields).
ADMIN_FIELDS = ("reset_partition", "drain", "undrain", "scale", "scale_cancel")


def request_refusal(
    header_frame: bytes | memoryview, ident: bytes, operator: bool
) -> tuple[str, str] | None:
    """Why a client's REQUEST (its header frame, from ``ident``) is refused under CURVE:
    ``(reason, what)``, or None.  Its dedup id (``cid``, the shard's default: the sender)
    must be the sender's own identity, so no key's requests can take another's sequence
    numbers; its :data:`ADMIN_OPS` need an ``operator`` key.  A header that does not
    decode is left to the shard (which refuses it)."""
    try:
        header = msgpack.unpackb(bytes(header_frame), raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException):
        return None
    if not isinstance(header, dict):
        return None
    cid = header.get("cid")
    if cid is not None and cid != ident:
        return "identity_of_another_key", "a request's 'cid' must be its sender's identity"
    ops = header.get("ops")
    if operator or not isinstance(ops, list):
        return None
    asked = sorted({o["op"] for o in ops if isinstance(o, dict) and o.get("op") in ADMIN_OPS})
    if not asked:
        return None
    return "wrong_role", refused_by_role(" and ".join(f"the {op!r} operation" for op in asked))


def refused_by_role(what: str) -> str:
    """The answer to a command ``what`` from a key that is not an operator's."""
    return (
        f"refused by role: {what} changes the cluster and needs an operator key "
        "(security.allowed_operators_dir); this key is not one"
    )


class RefusalLog:
    """Refusals counted by reason and logged at WARNING once per peer, key and reason
    per ``window`` seconds (a flood of refused messages costs one line a minute each)."""

    def __init__(self, log: logging.Logger, where: str, window: float = 60.0) -> None:
        self.log = log
        self.where = where
        self.window = window
        self.counts: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        self._last: dict[tuple[str, bytes | None, str], float] = {}

    def due(self, peer: str, key: bytes | None, reason: str, now: float) -> bool:
        """Whether a refusal of ``(peer, key)`` for ``reason`` at ``now`` is logged (and
        note it)."""
        last = self._last.get((peer, key, reason))
        if last is not None and now - last < self.window:
            return False
        if len(self._last) >= 4096:  # forget those past their window
            self._last = {k: t for k, t in self._last.items() if now - t < self.window}
            if len(self._last) >= 4096:
                return False  # a flood of fresh peers: counted, not logged
        self._last[(peer, key, reason)] = now
        return True

    def refused(
        self, peer: str, key: bytes | None, reason: str, now: float, detail: str = ""
    ) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if self.due(peer, key, reason, now):
            self.log.warning(
                "%s refused %s (key %s): %s%s",
                self.where,
                peer,
                (key or b"none").decode("ascii", "replace"),
                REFUSAL_WORDS.get(reason, reason),
                f" ({detail})" if detail else "",
            )


def warn_if_exposed(endpoint: str, sec: Security, what: str) -> bool:
    """Log a warning (and return True) when ``endpoint`` binds an address other hosts
    can reach while CURVE is off: anyone who reaches it can act as any peer."""
    if sec.enabled:
        return False
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp":
        return False
    host = (parts.hostname or "").strip("[]")
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return False
    log.warning(
        "%s binds %s without CURVE: anyone who reaches it can act as any shard or "
        "client (set [security] keys, or bind a loopback address)",
        what,
        endpoint,
    )
    return True
