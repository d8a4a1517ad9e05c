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

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from zps import transport
from zps.errors import ConfigError, ZpsError
from zps.ops.config import Security
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
    return CurveKeys(
        public=_load(sec.curve_public_key_file, "curve_public_key_file", False),
        secret=_load(sec.curve_secret_key_file, "curve_secret_key_file", True),
        server_public=server,
        allowed_dir=sec.allowed_clients_dir,
    )


@dataclass(frozen=True)
class KeyRoles:
    """Which authenticated public keys (Z85) may act as what (``[security]
    allowed_shards_dir`` and ``allowed_clients_dir``)."""

    shards: frozenset[bytes]
    clients: frozenset[bytes]

    def role(self, key: bytes | None) -> str | None:
        """The role of ``key``: "shard", "client", or None (in neither set, or no key)."""
        if key is None:
            return None
        if key in self.shards:
            return "shard"
        return "client" if key in self.clients else None

    @property
    def admitted(self) -> frozenset[bytes]:
        return self.shards | self.clients


def _keys_in(directory: str, what: str) -> frozenset[bytes]:
    if not Path(directory).is_dir():
        raise ConfigError(f"security.{what}: {directory} is not a directory")
    try:
        return transport.load_public_keys(directory)
    except (OSError, ValueError) as e:
        raise ConfigError(f"security.{what}: cannot load the keys in {directory}: {e}") from None


def load_key_roles(sec: Security) -> KeyRoles | None:
    """The key sets by role, loaded and checked; None unless CURVE is on and
    ``allowed_shards_dir`` is set (then every allowed key may act as anything)."""
    if not sec.enabled or sec.allowed_shards_dir is None:
        return None
    shards = _keys_in(sec.allowed_shards_dir, "allowed_shards_dir")
    clients = (
        _keys_in(sec.allowed_clients_dir, "allowed_clients_dir")
        if sec.allowed_clients_dir is not None
        else frozenset()
    )
    return KeyRoles(shards, clients)


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
