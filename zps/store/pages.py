"""Which pages the kernel gives the tables' memory files (:mod:`zps.store.mapped`).

Rows arrive in a memory file by ``pwrite`` (a restart, a joining copy, a move's new
rows); each page is allocated and cleared on its first write.  Huge pages (2 MiB) for
``memfd`` files are the kernel's shared-memory setting,
``/sys/kernel/mm/transparent_hugepage/shmem_enabled``, not the process's: ``always``,
``within_size`` and ``force`` give them to written files; ``advise`` only to pages
faulted through a mapping that asked (``MADV_HUGEPAGE``), which ``pwrite`` is not;
``never`` and ``deny`` never.  The setting is the host's (docs/deploy.md, "Huge pages
for the tables").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: The kernel's setting for huge pages of shared memory (memory files among it).
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
#: Settings under which a memory file written by ``pwrite`` gets huge pages.
HUGE_WHEN_WRITTEN = frozenset({"always", "within_size", "force"})


@dataclass(frozen=True)
class MemoryFilePages:
    """The kernel's setting (None: not found) and what it gives written memory files."""

    setting: str | None

    @property
    def huge(self) -> bool:
        return self.setting in HUGE_WHEN_WRITTEN

    def describe(self) -> str:
        """One line for the shard's start-up log."""
        if self.setting is None:
            return "tables' memory files: page size unknown (no transparent huge pages here)"
        if self.huge:
            return f"tables' memory files get huge pages (shmem_enabled: {self.setting})"
        return (
            f"tables' memory files get 4 KiB pages (shmem_enabled: {self.setting}): "
            "restarts and catch-ups of large partitions fill them slower than with huge "
            "pages (docs/deploy.md, 'Huge pages for the tables')"
        )


def parse_setting(text: str) -> str | None:
    """The chosen word of a sysfs choice list (``always [never] ...`` -> ``never``)."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]") and len(word) > 2:
            return word[1:-1]
    return None


def memory_file_pages(path: Path = SHMEM_ENABLED) -> MemoryFilePages:
    """This host's setting, read from ``path``."""
    try:
        return MemoryFilePages(parse_setting(path.read_text()))
    except OSError:
        return MemoryFilePages(None)
