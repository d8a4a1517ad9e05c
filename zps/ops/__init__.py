"""Operations: configuration, metrics, systemd integration, CURVE security, the allocator."""
