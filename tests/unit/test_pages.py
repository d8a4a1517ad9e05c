"""Which pages the tables' memory files get: the kernel's shared-memory setting read and
told in the shard's start-up log (zps.store.pages)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zps.store.pages import MemoryFilePages, memory_file_pages, parse_setting


@pytest.mark.parametrize(
    ("text", "setting"),
    [
        ("always within_size advise [never] deny force\n", "never"),
        ("always [within_size] advise never deny force\n", "within_size"),
        ("[always] within_size advise never deny force", "always"),
        ("always within_size [advise] never deny force", "advise"),
        ("always within_size advise never", None),  # no choice marked
        ("", None),
        ("[] never", None),
    ],
)
def test_the_marked_word_is_the_setting(text: str, setting: str | None) -> None:
    assert parse_setting(text) == setting


@pytest.mark.parametrize(
    ("setting", "huge"),
    [
        ("always", True),
        ("within_size", True),
        ("force", True),
        ("advise", False),  # pwrite faults through no mapping that asked for them
        ("never", False),
        ("deny", False),
        (None, False),
    ],
)
def test_only_settings_that_give_written_files_huge_pages_count(
    setting: str | None, huge: bool
) -> None:
    pages = MemoryFilePages(setting)
    assert pages.huge is huge
    line = pages.describe()
    if setting is None:
        assert "unknown" in line
    elif huge:
        assert line == f"tables' memory files get huge pages (shmem_enabled: {setting})"
    else:
        assert f"4 KiB pages (shmem_enabled: {setting})" in line and "docs/deploy.md" in line


def test_the_setting_is_read_from_the_kernels_file(tmp_path: Path) -> None:
    f = tmp_path / "shmem_enabled"
    f.write_text("always [within_size] advise never deny force\n")
    assert memory_file_pages(f) == MemoryFilePages("within_size")
    assert memory_file_pages(tmp_path / "missing") == MemoryFilePages(None)
