"""CURVE keys: writing, loading, and the socket options that use them.

The broker (and each shard's replication endpoint) is a CURVE server that
admits only clients whose public keys are in ``allowed_clients_dir``
(a ZAP allow-list, checked by pyzmq's authenticator); shards and clients are
CURVE clients that know the broker's public key.  Keys are the Z85 text
files pyzmq's ``zmq.auth`` writes: ``NAME.key`` (public) and
``NAME.key_secret`` (secret, mode 0600).
"""

from __future__ import annotations

from pathlib import Path

from zps import transport
from zps.errors import ConfigError
from zps.ops.config import Security
from zps.transport import CurveKeys

write_keypair = transport.write_keypair


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
