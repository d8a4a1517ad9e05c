"""The layering rules, checked on the source: an I/O-free core, one module on sockets."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import zps

PKG = Path(zps.__file__).parent
CORE_FILES = [
    "codec.py",
    "routing.py",
    "batching.py",
    "membership.py",
    "cluster.py",
    "shardcore.py",
    "hashing.py",
    "errors.py",
    "init.py",
    "optim.py",
    "replication.py",
    "snapshot.py",
    "stepbuf.py",
    "coord.py",
    *sorted(f"store/{p.name}" for p in (PKG / "store").glob("*.py")),
]
DRIVERS = {"zps.transport", "zps.broker", "zps.server", "zps.client", "zps.sync", "zps.cli"}
IO_MODULES = {"zmq", "asyncio"}
#: The zmq names a driver other than transport may mention: types for annotations.
ZMQ_TYPES = {"zmq.asyncio.Socket", "zmq.asyncio.Context"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imports(path: Path) -> Iterator[str]:
    mod = module_name(path)
    yield from imports_of(parse(path), mod, is_package=path.name == "__init__.py")


def imports_of(tree: ast.Module, mod: str, *, is_package: bool) -> Iterator[str]:
    """Every module an import statement anywhere in ``tree`` names (functions included).

    ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (``c`` may be a submodule).
    """
    package = mod if is_package else mod.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                assert node.module is not None
                source = node.module
            yield source
            for alias in node.names:
                yield f"{source}.{alias.name}"


def top(name: str) -> str:
    return name.split(".")[0]


def is_driver(name: str) -> bool:
    return any(name == d or name.startswith(d + ".") for d in DRIVERS)


def test_the_core_file_list_exists() -> None:
    for f in CORE_FILES:
        assert (PKG / f).is_file(), f
    assert "store/tables.py" in CORE_FILES and "store/__init__.py" in CORE_FILES


@pytest.mark.parametrize("file", CORE_FILES)
def test_core_module_imports_no_io_and_no_driver(file: str) -> None:
    names = set(imports(PKG / file))
    assert not {n for n in names if top(n) in IO_MODULES}, f"{file} imports zmq/asyncio"
    assert not {n for n in names if is_driver(n)}, f"{file} imports a driver module"


@pytest.mark.parametrize("file", CORE_FILES)
def test_core_module_does_no_dynamic_imports(file: str) -> None:
    for node in ast.walk(parse(PKG / file)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            assert name not in {"import_module", "__import__"}, f"{file}: dynamic import"


def test_the_core_imports_only_the_core_even_indirectly() -> None:
    mods = all_modules()
    core = {module_name(PKG / f) for f in CORE_FILES}
    # Follow zps imports from every core module; the closure must stay inside the core.
    seen: set[str] = set()
    todo = sorted(core)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for name in imports(mods[mod]):
            if top(name) in IO_MODULES:
                raise AssertionError(f"{mod} imports {name}")
            if name in mods and name != "zps":
                todo.append(name)
    assert seen <= core, f"the core reaches {sorted(seen - core)}"


def zmq_chains(tree: ast.Module) -> list[str]:
    """Every maximal dotted name rooted at ``zmq`` used in an expression."""
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    chains = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "zmq":
            parts = ["zmq"]
            cur: ast.AST = node
            while isinstance(parents.get(cur), ast.Attribute):
                cur = parents[cur]
                assert isinstance(cur, ast.Attribute)
                parts.append(cur.attr)
            chains.append(".".join(parts))
    return chains


def test_only_transport_talks_to_zmq() -> None:
    zmq_users = {}
    for mod, path in all_modules().items():
        names = [n for n in imports(path) if top(n) == "zmq"]
        if names:
            zmq_users[mod] = names
    assert "zps.transport" in zmq_users  # the scan sees real imports
    assert set(zmq_users) <= {"zps.transport", "zps.broker", "zps.server", "zps.client"}
    for mod, names in zmq_users.items():
        if mod == "zps.transport":
            continue
        # Drivers may import zmq.asyncio for their annotations, and nothing else of zmq...
        assert set(names) == {"zmq.asyncio"}, (mod, names)
        # ...and name only its socket and context types: no sockets made, no options set.
        chains = set(zmq_chains(parse(all_modules()[mod])))
        assert chains <= ZMQ_TYPES, (mod, sorted(chains - ZMQ_TYPES))


def test_the_zmq_scan_sees_socket_calls() -> None:
    chains = set(zmq_chains(parse(PKG / "transport.py")))
    assert {"zmq.ROUTER", "zmq.DEALER", "zmq.ZMQError"} <= chains
    tree = ast.parse(
        "import zmq.asyncio\nx: zmq.asyncio.Socket\nzmq.asyncio.Context().socket(zmq.DEALER)\n"
    )
    assert sorted(zmq_chains(tree)) == ["zmq.DEALER", "zmq.asyncio.Context", "zmq.asyncio.Socket"]


def test_the_import_scan_resolves_relative_and_nested_imports() -> None:
    src = (
        "from . import index\n"
        "from .. import errors as e\n"
        "from ..client import Client\n"
        "def f():\n"
        "    import asyncio\n"
        "    if True:\n"
        "        from zmq import asyncio as za\n"
    )
    names = set(imports_of(ast.parse(src), "zps.store.probe", is_package=False))
    assert names == {
        "zps.store",
        "zps.store.index",
        "zps",
        "zps.errors",
        "zps.client",
        "zps.client.Client",
        "asyncio",
        "zmq",
        "zmq.asyncio",
    }
    assert any(is_driver(n) for n in names)
    pkg_names = set(imports_of(ast.parse("from . import x"), "zps.store", is_package=True))
    assert pkg_names == {"zps.store", "zps.store.x"}
