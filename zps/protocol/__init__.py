"""The wire protocol: message framing and codec, table specs, typed records. Pure: no I/O."""
