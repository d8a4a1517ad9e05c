"""Placement: the cluster map on the wire, ids and dense chunks over partitions."""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zps.core.routing import (
    ClusterMap,
    PartitionInfo,
    chunk_partition,
    default_slot_map,
    dense_chunk_elems,
    partitions_of_ids,
    split_by_partition,
)
from zps.errors import ProtocolError


def cmap(n_partitions: int, n_slots: int = 4096, version: int = 1) -> ClusterMap:
    parts = {
        p: PartitionInfo(epoch=p + 1, primary=f"shard-{p}", in_sync=(f"shard-{p}",))
        for p in range(n_partitions)
    }
    return ClusterMap(version, n_slots, default_slot_map(n_slots, n_partitions), parts)


# ---- the map on the wire ----------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.integers(n, 64),
            st.integers(0, 2**40),
            st.lists(
                st.builds(
                    PartitionInfo,
                    st.integers(0, 2**32 - 1),
                    st.none() | st.text(max_size=8),
                    st.lists(st.text(max_size=4), max_size=2).map(tuple),
                    st.lists(st.text(max_size=4), max_size=2).map(tuple),
                ),
                min_size=n,
                max_size=n,
            ),
        )
    )
)
def test_map_round_trips_through_msgpack(args: tuple[int, int, int, list[PartitionInfo]]) -> None:
    n, n_slots, version, infos = args
    m = ClusterMap(version, n_slots, default_slot_map(n_slots, n), dict(enumerate(infos)))
    wire = msgpack.unpackb(msgpack.packb(m.to_wire(), use_bin_type=True), raw=False)
    back = ClusterMap.from_wire(wire)
    assert back.version == version and back.n_slots == n_slots
    assert back.slot_map.dtype == np.int32
    assert np.array_equal(back.slot_map, m.slot_map)
    assert dict(back.partitions) == dict(m.partitions)
    assert back.n_partitions == n


def _wire() -> dict[str, Any]:
    w = cmap(2, n_slots=8).to_wire()
    return msgpack.unpackb(msgpack.packb(w, use_bin_type=True), raw=False)  # type: ignore[no-any-return]


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    w = _wire()
    obj: Any = w
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
    return w


def _del(path: tuple[Any, ...]) -> dict[str, Any]:
    w = _wire()
    obj: Any = w
    for key in path[:-1]:
        obj = obj[key]
    del obj[path[-1]]
    return w


MALFORMED = [
    None,
    [],
    "map",
    {},
    _del(("version",)),
    _del(("slot_map",)),
    _del(("partitions",)),
    _del(("partitions", "0", "primary")),
    _del(("partitions", "1", "epoch")),
    _del(("partitions", "0", "replicas")),
    _set(("version",), "1"),
    _set(("version",), True),
    _set(("version",), 1.0),
    _set(("n_slots",), 0),
    _set(("n_slots",), -8),
    _set(("n_slots",), 9),
    _set(("slot_map",), "not bytes"),
    _set(("slot_map",), b"\0" * 31),
    _set(("slot_map",), np.full(8, 2, "<i4").tobytes()),  # names partition 2 of 2
    _set(("slot_map",), np.full(8, -1, "<i4").tobytes()),
    _set(("partitions",), []),
    _set(("partitions",), {}),
    _set(("partitions",), {"0": {}, "1": {}}),
    _set(("partitions",), {"x": _wire()["partitions"]["0"], "1": _wire()["partitions"]["1"]}),
    _set(("partitions",), {"5": _wire()["partitions"]["0"], "6": _wire()["partitions"]["1"]}),
    _set(("partitions",), {"0": _wire()["partitions"]["0"], "2": _wire()["partitions"]["1"]}),
    _set(("partitions", "0"), "info"),
    _set(("partitions", "0"), [1, 2]),
    _set(("partitions", "0", "primary"), 7),
    _set(("partitions", "0", "primary"), b"bytes"),
    _set(("partitions", "0", "epoch"), None),
    _set(("partitions", "0", "epoch"), "3"),
    _set(("partitions", "0", "epoch"), float("inf")),
    _set(("partitions", "0", "epoch"), float("nan")),
    _set(("partitions", "0", "epoch"), -1),
    _set(("partitions", "0", "replicas"), 5),
    _set(("partitions", "0", "in_sync"), None),
]


@pytest.mark.parametrize("obj", MALFORMED)
def test_malformed_maps_are_protocol_errors(obj: object) -> None:
    with pytest.raises(ProtocolError):
        ClusterMap.from_wire(obj)


def test_the_unmangled_wire_map_parses() -> None:
    assert ClusterMap.from_wire(_wire()).partitions[1].primary == "shard-1"


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_random_mangling_only_raises_protocol_error(data: st.DataObject) -> None:
    w = _wire()
    # Replace one node anywhere in the tree with a random value.
    paths: list[tuple[Any, ...]] = [()]
    paths += [(k,) for k in w]
    paths += [("partitions", p) for p in w["partitions"]]
    paths += [("partitions", p, k) for p in w["partitions"] for k in w["partitions"][p]]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(json_like)
    if path:
        obj: Any = w
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    else:
        w = value
    try:
        m = ClusterMap.from_wire(copy.deepcopy(w))
    except ProtocolError:
        return
    # Anything accepted is usable: every slot names a partition the map describes.
    assert all(int(p) in m.partitions for p in np.unique(m.slot_map))
    assert set(m.partitions) == set(range(m.n_partitions))


# ---- ids -> partitions ------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300),
    st.integers(1, 9),
)
def test_split_covers_every_position_once(ids_list: list[int], n: int) -> None:
    ids = np.array(ids_list, dtype=np.int64)
    m = cmap(n)
    parts = partitions_of_ids(ids, m)
    assert parts.shape == ids.shape
    assert ((parts >= 0) & (parts < n)).all()
    seen = np.zeros(ids.size, dtype=np.int64)
    owners = []
    for p, pos in split_by_partition(ids, m):
        assert pos.size > 0
        assert (parts[pos] == p).all()
        assert (np.diff(pos) > 0).all()  # stable: original order within a partition
        seen[pos] += 1
        owners.append(p)
    assert (seen == 1).all()
    assert owners == sorted(set(owners))


def test_split_of_no_ids_yields_nothing() -> None:
    assert list(split_by_partition(np.array([], dtype=np.int64), cmap(3))) == []


def test_placement_is_deterministic() -> None:
    ids = np.array([0, 1, -1, 2**62, 12345], dtype=np.int64)
    a = partitions_of_ids(ids, cmap(5))
    b = partitions_of_ids(ids.copy(), cmap(5, version=9))
    assert np.array_equal(a, b)
    # A duplicate id always goes where its first copy goes.
    assert (
        partitions_of_ids(np.array([7, 7, 7], dtype=np.int64), cmap(5))
        .tolist()
        .count(int(partitions_of_ids(np.array([7], dtype=np.int64), cmap(5))[0]))
        == 3
    )


@pytest.mark.parametrize("n", [2, 3, 7, 16])
@pytest.mark.parametrize("kind", ["sequential", "strided", "random"])
def test_ids_spread_evenly(n: int, kind: str) -> None:
    count = 100_000
    if kind == "sequential":
        ids = np.arange(count, dtype=np.int64)
    elif kind == "strided":
        ids = np.arange(count, dtype=np.int64) * 4096  # would all share a slot without mixing
    else:
        ids = np.random.default_rng(3).integers(-(2**63), 2**63 - 1, count, dtype=np.int64)
    counts = np.bincount(partitions_of_ids(ids, cmap(n)), minlength=n)
    expected = count / n
    assert counts.min() > 0.9 * expected and counts.max() < 1.1 * expected


# ---- dense chunks -----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_consecutive_chunks_use_every_partition(n: int) -> None:
    m = cmap(n)
    for name in ["w", "layer1.weight", "émbed"]:
        owners = [chunk_partition(name, i, m) for i in range(n)]
        assert sorted(owners) == list(range(n))
        assert chunk_partition(name, 3, m) == chunk_partition(name, 3, cmap(n, version=7))


def test_chunk_partition_wraps_around_the_slots() -> None:
    m = cmap(4, n_slots=8)
    assert chunk_partition("w", 0, m) == chunk_partition("w", 8, m)


def test_small_tensors_are_one_chunk() -> None:
    assert dense_chunk_elems(10, 4, 8) == 10
    assert dense_chunk_elems(0, 4, 8) == 1
    assert dense_chunk_elems(65536, 4, 8) == 65536  # exactly 256 KiB
    # One partition: whole up to the chunk target.
    assert dense_chunk_elems(500_000, 4, 1) == 500_000


def test_16_mib_over_two_partitions() -> None:
    size = (16 << 20) // 4
    elems = dense_chunk_elems(size, 4, 2)
    assert elems * 4 <= 2 << 20
    assert -(-size // elems) >= 2


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 2**34),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 64),
)
def test_dense_chunking_rules(size: int, itemsize: int, n: int) -> None:
    elems = dense_chunk_elems(size, itemsize, n)
    assert elems >= 1
    nbytes = size * itemsize
    n_chunks = -(-size // elems)
    if nbytes <= 256 << 10:
        assert n_chunks <= 1
    else:
        assert elems * itemsize <= max(2 << 20, nbytes if n == 1 else 0)
        if nbytes >= n * (256 << 10):
            assert n_chunks >= n  # every partition gets at least one chunk


def test_the_small_id_fast_path_routes_like_the_vectorised_one() -> None:
    from zps.core.hashing import mix64, mix64_int
    from zps.core.routing import SMALL_IDS

    rng = np.random.default_rng(5)
    xs = rng.integers(-(2**63), 2**63 - 1, 1000, dtype=np.int64)
    assert [mix64_int(int(x) & (2**64 - 1)) for x in xs[:50]] == mix64(xs[:50]).tolist()
    cmap = ClusterMap(1, 64, default_slot_map(64, 3), {p: PartitionInfo() for p in range(3)})
    for n in (1, 2, SMALL_IDS, SMALL_IDS + 1, 100):
        ids = xs[:n]
        got = {p: pos.tolist() for p, pos in split_by_partition(ids, cmap)}
        want = {}
        for pos, p in enumerate(partitions_of_ids(ids, cmap).tolist()):
            want.setdefault(p, []).append(pos)
        assert got == want


@pytest.mark.parametrize("n_slots", [4096, 1000, 64, 1])
def test_placement_is_slot_map_of_mix64_mod_n_slots(n_slots: int) -> None:
    from zps.core.hashing import mix64

    ids = np.random.default_rng(3).integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64)
    m = ClusterMap(1, n_slots, default_slot_map(n_slots, 3), {p: PartitionInfo() for p in range(3)})
    want = m.slot_map[(mix64(ids) % np.uint64(n_slots)).astype(np.int64)]
    assert np.array_equal(partitions_of_ids(ids, m), want)
