"""The command lines ``zps-server`` and ``zps-worker``."""
