"""What this machine gives a partition's bulk paths without zps: the floor of each path.

    .venv/bin/python bench/bulk_floor.py --gb 3

Each stage moves ``--gb`` GB in 16 MiB chunks with the same system calls a zps path makes,
and nothing else (no checksum, no tables, no ids):

- ``socket``: one process sends the bytes to another over pyzmq on loopback TCP (PUSH to
  PULL, a few chunks in flight, zero-copy sends of slices of its memory), the receiver
  drops each chunk: the transfer alone.
- ``socket, into a memory file``: the receiver writes each chunk into a memory file
  (``memfd``, ``pwrite``), as a joining copy fills its tables' arrays.
- ``socket, into a memory file and a synced file``: and writes it to a file in
  ``--dir``, synced at the end, as a joining copy keeps the snapshot as its checkpoint: a
  replica's catch-up without zps.
- ``file written and synced``: one process writes the bytes to a file and syncs it: a
  checkpoint without zps.
- ``cold file read into a memory file``: that file, dropped from the page cache, read into
  a memory file: a restart without zps.
- ``memory file filled from memory``: one process writes a 16 MiB buffer again and again
  into a memory file: what the kernel's first write of each page costs alone.

With ``--idle S`` every run of a stage starts after S seconds with nothing running, for
memory a previous run freed to be handed back where the machine does that (a virtual
machine whose balloon reports free pages to its host; docs/performance.md, "Huge pages
for the memory files"); the default, 0, starts each at once.  The kernel's setting for
huge pages of shared memory (which memory files get) is printed with the load.

The table gives each stage's wall time, GB/s and CPU seconds (both processes where there are
two).  ``bench/big_partition.py`` measures zps's own paths on a partition of the same
size; docs/performance.md sets the two side by side.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

CHUNK = 16 << 20
#: Chunks a sender has queued ahead of the receiver (the snapshot sender's window is 4).
WINDOW = 4


def _cpu() -> float:
    return time.process_time()


def payload(total: int) -> bytearray:
    """``total`` bytes of random data (one random chunk repeated): every page touched,
    nothing a compressing file system could shrink."""
    chunk = os.urandom(CHUNK)
    data = bytearray(total)
    for off in range(0, total, CHUNK):
        n = min(CHUNK, total - off)
        data[off : off + n] = chunk[:n]
    return data


def _receiver(endpoint: str, total: int, into: str, path: str | None, out: mp.Queue[Any]) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, WINDOW)
    s.setsockopt(zmq.RCVBUF, 8 << 20)
    s.bind(endpoint)
    mem = None
    if into == "memfd":
        mem = os.memfd_create("floor")
        os.ftruncate(mem, total)
    if path:
        Path(path).unlink(missing_ok=True)  # not truncated while the sender's clock runs
    f = open(path, "wb", buffering=0) if path else None  # noqa: SIM115
    out.put("ready")
    c0 = _cpu()
    got = 0
    while got < total:
        frame = s.recv(copy=False)
        buf = frame.buffer
        n = len(buf)
        if mem is not None:
            os.pwrite(mem, buf, got)
        if f is not None:
            f.write(buf)
        got += n
    if f is not None:
        os.fsync(f.fileno())
    done = (time.perf_counter(), _cpu() - c0)  # before the files are closed and freed
    if f is not None:
        f.close()
    if mem is not None:
        os.close(mem)
    out.put(done)
    s.close(linger=0)
    ctx.term()


def transfer(total: int, into: str, path: str | None) -> tuple[float, float]:
    """Seconds from the first send to the receiver's last write (and sync), and CPU-s of
    both processes."""
    with socket_port() as port:
        endpoint = f"tcp://127.0.0.1:{port}"
    q: mp.Queue[Any] = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_receiver, args=(endpoint, total, into, path, q))
    p.start()
    assert q.get(timeout=60) == "ready"
    data = payload(total)
    view = memoryview(data)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, WINDOW)
    s.setsockopt(zmq.SNDBUF, 8 << 20)
    s.connect(endpoint)
    c0 = _cpu()
    t0 = time.perf_counter()
    for off in range(0, total, CHUNK):
        s.send(view[off : off + CHUNK], copy=False)
    t_end, rcpu = q.get(timeout=600)
    cpu = _cpu() - c0 + rcpu
    p.join(timeout=60)
    s.close(linger=0)
    ctx.term()
    return t_end - t0, cpu


class socket_port:
    """A free TCP port on loopback."""

    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return int(self.s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.s.close()


def write_file(total: int, path: str) -> tuple[float, float]:
    data = payload(total)
    view = memoryview(data)
    Path(path).unlink(missing_ok=True)
    with open(path, "wb", buffering=0) as f:
        c0, t0 = _cpu(), time.perf_counter()
        for off in range(0, total, CHUNK):
            f.write(view[off : off + CHUNK])
        os.fsync(f.fileno())
        took = time.perf_counter() - t0, _cpu() - c0
    return took


def read_cold(total: int, path: str) -> tuple[float, float]:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    mfd = os.memfd_create("floor")
    os.ftruncate(mfd, total)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    c0, t0 = _cpu(), time.perf_counter()
    off = 0
    while off < total:
        n = os.readv(fd, [view])
        if n <= 0:
            break
        os.pwrite(mfd, view[:n], off)
        off += n
    took, cpu = time.perf_counter() - t0, _cpu() - c0  # before the memory file is freed
    os.close(mfd)
    os.close(fd)
    return took, cpu


#: The first words of the stages' names, which ``--only`` picks them by.
STAGE_WORDS = ("socket", "file", "cold", "memory")


def fill_memfd(total: int) -> tuple[float, float]:
    data = payload(CHUNK)
    mfd = os.memfd_create("floor")
    os.ftruncate(mfd, total)
    c0, t0 = _cpu(), time.perf_counter()
    for off in range(0, total, CHUNK):
        os.pwrite(mfd, data, off)
    took = time.perf_counter() - t0, _cpu() - c0  # before the memory file is freed
    os.close(mfd)
    return took


def shmem_setting() -> str:
    """The kernel's setting for huge pages of shared memory, memory files among it."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return "unknown"
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "unknown")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="GB moved by each stage (default 1)")
    ap.add_argument(
        "--dir",
        default=".",
        help="where the files go, on the disk a shard's data dir would use (default: the "
        "current directory; a tmpfs would measure memory, not the disk)",
    )
    ap.add_argument("--runs", type=int, default=1, help="runs of each stage (default 1)")
    ap.add_argument(
        "--idle",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds with nothing running before each run (default 0)",
    )
    ap.add_argument(
        "--only", help=f"comma-separated stages by their first word: {','.join(STAGE_WORDS)}"
    )
    args = ap.parse_args(argv)
    total = int(args.gb * 1e9) // CHUNK * CHUNK
    if total == 0:
        ap.error(f"--gb must be at least {CHUNK / 1e9:.3f} (one chunk)")
    if not Path(args.dir).is_dir():
        ap.error(f"--dir {args.dir}: no such directory")
    if args.idle < 0:
        ap.error("--idle must be at least 0")
    chosen = set(args.only.split(",")) if args.only else set(STAGE_WORDS)
    if unknown := chosen - set(STAGE_WORDS):
        ap.error(
            f"--only: no stage {', '.join(sorted(unknown))} (stages: {', '.join(STAGE_WORDS)})"
        )
    gb = total / 1e9
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = str(Path(d) / "floor.bin")
        stages: list[tuple[str, Callable[[], tuple[float, float]]]] = [
            ("socket", lambda: transfer(total, "drop", None)),
            ("socket, into a memory file", lambda: transfer(total, "memfd", None)),
            (
                "socket, into a memory file and a synced file",
                lambda: transfer(total, "memfd", path),
            ),
            ("file written and synced", lambda: write_file(total, path)),
            ("cold file read into a memory file", lambda: read_cold(total, path)),
            ("memory file filled from memory", lambda: fill_memfd(total)),
        ]
        if "cold" in chosen:
            chosen.add("file")  # the cold read reads the file that stage wrote
        stages = [st for st in stages if st[0].split()[0].rstrip(",") in chosen]
        print(
            f"{gb:.2f} GB in {CHUNK >> 20} MiB chunks; load {os.getloadavg()[0]:.1f}; "
            f"huge pages of shared memory: {shmem_setting()}; idle before each run: {args.idle:g} s"
        )
        print(f"{'stage':<46} {'wall s':>8} {'GB/s':>7} {'CPU s':>7}")
        for name, run in stages:
            for _ in range(args.runs):
                time.sleep(args.idle)
                took, cpu = run()
                print(f"{name:<46} {took:8.2f} {gb / took:7.2f} {cpu:7.2f}", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process: {peak:.0f} MB; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
