"""The release of this package (kept equal to ``version`` in pyproject.toml).

The wire protocol has a version of its own,
:data:`zps.protocol.codec.PROTOCOL_VERSION`; docs/design.md ("Versions") says which
releases may talk to each other.
"""

__version__ = "0.1.0"
