"""The layering rules, checked on the source.

Every module of the package is classified by layer:

- ``core``: pure (no zmq, no asyncio, no files or clocks of its own); imports only the core.
- ``driver``: a process's I/O around the core (sockets, timers, files).
- ``ops``: configuration, metrics, systemd, security, the allocator.
- ``app``: what users run or import at the top: the CLIs, the public package, the torch
  adapter, the local-cluster harness and the demo.

and by role (``broker``, ``shard``, ``client`` or shared).  Roles never import each other
sideways; the runtime (core, drivers, ops) never imports the app layer, the examples or the tests;
only the transport talks to zmq.  A new module must be classified here, or the test fails.
No two modules import each other, directly or around a cycle (imports inside functions and
under ``TYPE_CHECKING`` included), but for the cycles of :data:`ALLOWED_CYCLES`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import zps

PKG = Path(zps.__file__).parent

LAYERS: dict[str, str] = {
    # the typed protocol and the pure core shared by every role
    "zps.errors": "core",
    "zps.init": "core",
    "zps.optim": "core",
    "zps.optim.schedules": "core",
    "zps.version": "core",
    "zps.protocol": "core",
    "zps.protocol.codec": "core",
    "zps.protocol.specs": "core",
    "zps.protocol.messages": "core",
    "zps.protocol.ops": "core",
    "zps.protocol.enums": "core",
    "zps.protocol.fields": "core",
    "zps.protocol.control": "core",
    "zps.protocol.stream": "core",
    "zps.core": "core",
    "zps.core.batching": "core",
    "zps.core.brokerstate": "core",
    "zps.core.bstar": "core",
    "zps.core.cluster": "core",
    "zps.core.clusterbase": "core",
    "zps.core.cluster_map": "core",
    "zps.core.cluster_status": "core",
    "zps.core.nodes": "core",
    "zps.core.placement": "core",
    "zps.core.recovery": "core",
    "zps.core.coord": "core",
    "zps.core.hashing": "core",
    "zps.core.membership": "core",
    "zps.core.memo": "core",
    "zps.core.replication": "core",
    "zps.core.reshard": "core",
    "zps.core.slotclaims": "core",
    "zps.core.routing": "core",
    "zps.core.rows": "core",
    # the shard's store: tables, index, snapshots, the sync-mode step buffer
    "zps.store": "core",
    "zps.store.index": "core",
    "zps.store.mapped": "core",
    "zps.store.lowfds": "core",
    "zps.store.partition": "core",
    "zps.store.snapshot": "core",
    "zps.store.snapstream": "core",
    "zps.store.checksums": "core",
    "zps.store.stepbuf": "core",
    "zps.store.slots": "core",
    "zps.store.tables": "core",
    "zps.store.common": "core",
    "zps.store.dense": "core",
    "zps.store.embedding": "core",
    "zps.store.kernel": "core",
    # the write-ahead log's files (file I/O, no sockets or event loop)
    "zps.store.wal": "driver",
    # a checkpoint read once in slices at a restart (file I/O, no sockets or event loop)
    "zps.store.slicereader": "driver",
    # per-role pure state machines and their drivers
    "zps.transport": "driver",
    "zps.transport.channel": "driver",
    "zps.transport.compiled": "driver",
    "zps.transport.curve": "driver",
    "zps.transport.flow": "driver",
    "zps.transport.iothreads": "driver",
    "zps.transport.link": "driver",
    "zps.transport.peers": "core",
    "zps.transport.sockets": "driver",
    "zps.shm": "driver",
    "zps.shm.region": "driver",
    "zps.shm.arena": "driver",
    "zps.shm.mapper": "driver",
    "zps.shm.header": "driver",
    "zps.shm.memory": "driver",
    "zps.broker": "driver",
    "zps.broker.acceptance": "core",
    "zps.broker.broker": "driver",
    "zps.broker.base": "driver",
    "zps.broker.persistence": "driver",
    "zps.broker.report": "driver",
    "zps.broker.admission": "driver",
    "zps.broker.datapath": "driver",
    "zps.broker.control": "driver",
    "zps.broker.routes": "core",
    "zps.broker.primaries": "core",
    "zps.broker.forwarded": "core",
    "zps.broker.following": "core",
    "zps.broker.forward": "driver",
    "zps.broker.statefile": "driver",
    "zps.broker.pair": "driver",
    "zps.broker.training": "driver",
    "zps.broker.reshard": "driver",
    "zps.broker.reshardhost": "driver",
    "zps.broker.reshardstats": "core",
    "zps.broker.router": "driver",
    "zps.shard": "driver",
    "zps.shard.core": "core",
    "zps.shard.admission": "core",
    "zps.shard.slotops": "core",
    "zps.shard.server": "driver",
    "zps.shard.cuts": "core",
    "zps.shard.dedup": "core",
    "zps.shard.records": "core",
    "zps.shard.links": "driver",
    "zps.shard.routers": "driver",
    "zps.shard.pipeline": "driver",
    "zps.shard.metrics": "driver",
    "zps.shard.checkpointing": "driver",
    "zps.shard.session": "core",
    "zps.shard.primary": "driver",
    "zps.shard.replica": "driver",
    "zps.shard.checkpoint": "driver",
    "zps.shard.restore": "driver",
    "zps.shard.durability": "driver",
    "zps.shard.liveness": "core",
    "zps.shard.snapshots": "driver",
    "zps.shard.held": "driver",
    "zps.client": "driver",
    "zps.client.client": "driver",
    "zps.client.routers": "core",
    "zps.client.sync": "driver",
    "zps.client.progress": "driver",
    "zps.client.session": "core",
    "zps.client.training": "driver",
    "zps.client.connection": "driver",
    "zps.client.ops": "driver",
    "zps.client.futures": "driver",
    "zps.client.background": "driver",
    "zps.client.timer": "driver",
    "zps.client.shmpath": "driver",
    "zps.client.routerlinks": "driver",
    "zps.client.pair": "driver",
    "zps.client.inbound": "core",
    "zps.client.export": "driver",
    "zps.client.keyvalue": "driver",
    "zps.client.values": "core",
    # the export format (files) and offline export from data dirs
    "zps.model": "driver",
    "zps.model.format": "driver",
    "zps.model.offline": "driver",
    # operations
    "zps.ops": "ops",
    "zps.ops.config": "ops",
    "zps.ops.datadir": "ops",
    "zps.ops.durable": "ops",
    "zps.ops.logs": "ops",
    "zps.ops.malloc": "ops",
    "zps.ops.meter": "ops",
    "zps.ops.metrics": "ops",
    "zps.ops.page": "ops",
    "zps.ops.security": "ops",
    "zps.ops.systemd": "ops",
    # what users run and import
    "zps": "app",
    "zps.__main__": "app",
    "zps.worker_entry": "app",
    "zps.cli": "app",
    "zps.cli.main": "app",
    "zps.cli.common": "app",
    "zps.cli.server": "app",
    "zps.cli.status": "app",
    "zps.cli.admin": "app",
    "zps.cli.data": "app",
    "zps.cli.jobs": "app",
    "zps.cli.keys": "app",
    "zps.cli.worker": "app",
    "zps.torch": "app",
    "zps.testing": "app",
    "zps.testing.bytecode": "app",
    "zps.testing.gate": "app",
    "zps.testing.sim": "app",
    "zps.testing.sim.__main__": "app",
    "zps.testing.sim.aioloop": "app",
    "zps.testing.sim.clientnet": "app",
    "zps.testing.sim.realclient": "app",
    "zps.testing.sim.realbroker": "app",
    "zps.testing.sim.realbugs": "app",
    "zps.testing.sim.realpair": "app",
    "zps.testing.sim.realrouter": "app",
    "zps.testing.sim.routernet": "app",
    "zps.testing.sim.realshard": "app",
    "zps.testing.sim.shardnet": "app",
    "zps.testing.sim.shmnet": "app",
    "zps.testing.sim.simclient": "app",
    "zps.testing.sim.simtransport": "app",
    "zps.testing.sim.bugs": "app",
    "zps.testing.sim.checks": "app",
    "zps.testing.sim.cli": "app",
    "zps.testing.sim.disk": "app",
    "zps.testing.sim.faults": "app",
    "zps.testing.sim.net": "app",
    "zps.testing.sim.nodes": "app",
    "zps.testing.sim.pair": "app",
    "zps.testing.sim.sched": "app",
    "zps.testing.sim.world": "app",
    "zps.examples": "app",
    "zps.examples.adult": "app",
    "zps.examples.demo": "app",
}
RUNTIME = {"core", "driver", "ops"}
#: Packages that belong to one role; a role imports none of the others.
ROLES = {"zps.broker", "zps.shard", "zps.client"}
#: What each role must not import besides the other roles: the client holds no store.
ROLE_FORBIDDEN = {"zps.client": {"zps.store"}}
#: The import cycles among zps modules that are still to be broken, by name; the test fails
#: on any other cycle, and on an entry here that no longer is one.
ALLOWED_CYCLES: dict[str, frozenset[str]] = {}
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


def compiled_modules() -> set[str]:
    """The package's compiled extensions (``zps/_zmqio.c`` is ``zps._zmqio``): modules that
    import nothing of zps."""
    names = set()
    for path in [*PKG.rglob("*.c"), *PKG.rglob("*.so")]:
        names.add(".".join([*path.parent.relative_to(PKG.parent).parts, path.name.split(".")[0]]))
    return names


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


def core_modules() -> list[str]:
    return sorted(m for m, layer in LAYERS.items() if layer == "core")


def under(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def module_level_imports(path: Path) -> Iterator[str]:
    """The zps modules imported at module level (not inside functions)."""
    tree = parse(path)
    body = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    mod = module_name(path)
    yield from imports_of(
        ast.Module(body=body, type_ignores=[]), mod, is_package=path.name == "__init__.py"
    )


def test_every_module_is_classified() -> None:
    mods = set(all_modules())
    assert not mods - set(LAYERS), f"classify these in LAYERS: {sorted(mods - set(LAYERS))}"
    assert not set(LAYERS) - mods, f"gone from the package: {sorted(set(LAYERS) - mods)}"


@pytest.mark.parametrize("mod", core_modules())
def test_core_module_imports_no_io_and_only_the_core(mod: str) -> None:
    names = set(imports(all_modules()[mod]))
    assert not {n for n in names if top(n) in IO_MODULES}, f"{mod} imports zmq/asyncio"
    outside = {n for n in names if n in LAYERS and LAYERS[n] != "core" and n != "zps"}
    assert not outside, f"{mod} imports {sorted(outside)}"


@pytest.mark.parametrize("mod", core_modules())
def test_core_module_does_no_dynamic_imports(mod: str) -> None:
    for node in ast.walk(parse(all_modules()[mod])):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            assert name not in {"import_module", "__import__"}, f"{mod}: dynamic import"


def test_the_core_imports_only_the_core_even_indirectly() -> None:
    mods = all_modules()
    core = set(core_modules())
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


@pytest.mark.parametrize("role", sorted(ROLES))
def test_roles_do_not_import_each_other(role: str) -> None:
    forbidden = (ROLES - {role}) | ROLE_FORBIDDEN.get(role, set())
    for mod, path in all_modules().items():
        if not under(mod, role):
            continue
        bad = {n for n in imports(path) if any(under(n, f) for f in forbidden)}
        assert not bad, f"{mod} ({role}) imports {sorted(bad)}"


def test_the_runtime_never_imports_the_app_layer_examples_or_tests() -> None:
    mods = all_modules()
    for mod, path in mods.items():
        if LAYERS[mod] not in RUNTIME:
            continue
        for name in imports(path):
            if top(name) == "tests" or under(name, "zps.examples"):
                raise AssertionError(f"{mod} imports {name}")
            if name in LAYERS and LAYERS[name] == "app" and name != "zps":
                raise AssertionError(f"{mod} imports the app module {name}")


def test_the_cli_loads_the_demo_and_the_harness_only_lazily() -> None:
    cli = {m: p for m, p in all_modules().items() if under(m, "zps.cli")}
    for mod, path in cli.items():
        eager = set(module_level_imports(path))
        bad = {n for n in eager if under(n, "zps.examples") or under(n, "zps.testing")}
        assert not bad, f"{mod} imports {sorted(bad)} at module level"
    path = cli["zps.cli.main"]
    assert any(under(n, "zps.examples") for n in imports(path))  # the scan sees the lazy one


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
    assert "zps.transport.channel" in zmq_users  # the scan sees real imports
    assert all(LAYERS[m] == "driver" for m in zmq_users), zmq_users
    for mod, names in zmq_users.items():
        if under(mod, "zps.transport"):
            continue
        # Drivers may import zmq.asyncio for their annotations, and nothing else of zmq...
        assert set(names) == {"zmq.asyncio"}, (mod, names)
        # ...and name only its socket and context types: no sockets made, no options set.
        chains = set(zmq_chains(parse(all_modules()[mod])))
        assert chains <= ZMQ_TYPES, (mod, sorted(chains - ZMQ_TYPES))


def test_the_zmq_scan_sees_socket_calls() -> None:
    chains = set(zmq_chains(parse(PKG / "transport" / "sockets.py")))
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
    assert any(under(n, "zps.client") for n in names)
    pkg_names = set(imports_of(ast.parse("from . import x"), "zps.store", is_package=True))
    assert pkg_names == {"zps.store", "zps.store.x"}


def module_edges(tree: ast.Module, mod: str, *, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``tree`` imports (anywhere: functions and
    ``TYPE_CHECKING`` blocks included).  ``from a import b`` depends on ``a.b`` when that is
    a module, else on ``a``; the packages above an imported module are not counted (their
    ``__init__`` runs first whoever imports)."""
    package = mod if is_package else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                assert node.module is not None
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif source in known:
                    out.add(source)
    out.discard(mod)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = all_modules()
    known = set(mods) | compiled_modules()
    return {
        mod: module_edges(parse(path), mod, is_package=path.name == "__init__.py", known=known)
        for mod, path in mods.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm):
    each is one or more import cycles through those modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_path(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """One cycle through ``component``, as the modules it passes, the first one again last."""
    start = min(component)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    raise AssertionError(f"no cycle through {sorted(component)}")


def test_no_import_cycles_but_the_allowed_ones() -> None:
    graph = import_graph()
    cycles = import_cycles(graph)
    allowed = set(ALLOWED_CYCLES.values())
    new = [" -> ".join(cycle_path(graph, c)) for c in sorted(cycles - allowed, key=sorted)]
    assert not new, f"import cycles: {new}"
    stale = [name for name, c in ALLOWED_CYCLES.items() if c not in cycles]
    assert not stale, f"no longer cycles (remove them from ALLOWED_CYCLES): {stale}"


def test_the_cycle_check_sees_type_checking_and_function_imports() -> None:
    sources = {
        "zps.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zps.b import B\n",
        "zps.b": "def f():\n    from . import c\n",
        "zps.c": "import zps.a\nfrom zps import _ext\n",
        "zps.d": "from zps.c import x\n",
    }
    known = {*sources, "zps", "zps._ext"}
    graph = {
        mod: module_edges(ast.parse(src), mod, is_package=False, known=known)
        for mod, src in sources.items()
    }
    assert graph == {
        "zps.a": {"zps.b"},
        "zps.b": {"zps.c"},
        "zps.c": {"zps.a", "zps._ext"},
        "zps.d": {"zps.c"},
    }
    assert import_cycles(graph) == {frozenset({"zps.a", "zps.b", "zps.c"})}
    assert cycle_path(graph, frozenset({"zps.a", "zps.b", "zps.c"})) == [
        "zps.a",
        "zps.b",
        "zps.c",
        "zps.a",
    ]
    del graph["zps.a"]
    assert import_cycles(graph) == set()
