"""The faults a simulated run draws (``--faults``): those drawn by default, and those
drawn only when named (so the default draws, and every seed kept for them, stay as they
were).  :mod:`.world` injects them."""

from __future__ import annotations

FAULTS = (
    "kill",
    "power",
    "wipe",
    "pause",
    "partition",
    "disk",
    "crash-all",
    "broker",
    "pause-crash",
)
#: Changes of load drawn like faults, only when named in ``faults``: ``idle``, the clients
#: stop pushing for a while (a primary with nothing waiting drops no silent replica).
LOADS = ("idle",)
#: The broker pair, only when named: ``failover`` runs two brokers (:mod:`.pair`) and
#: draws kills, pauses and isolations of the active one.
PAIR = ("failover",)
#: Faults drawn only when named (the default draws, and so the seeds kept, stay as they
#: were): ``slow``, a shard or client that reads one message every 10-300 ms or none at
#: all for a while, its pipes filling to their high-water mark, or a shard's slow disk;
#: ``client``, a client's process killed and started again (a new session).
NAMED_ONLY = ("slow", "client")
#: Live resharding, only when named and with the real client (which routes ids by the
#: map's slots): ``reshard``, the operator scales the cluster to 1, 2 or 3 partitions
#: (``zps-server scale``) while it runs, or cancels the scaling under way.
RESHARD = ("reshard",)
#: Routing brokers, only when named and with the real client (whose links to the routers
#: of the map are the product's): ``routers``, the shards run two a host, a routing broker
#: (``zps-server broker --follow``) on each host, and a router is killed and restarted,
#: paused past the liveness timeout, or cut off from a client, a shard or a broker.
ROUTERS = ("routers",)
#: Same-host shared memory, only when named and with the real shards: ``shm``, the
#: shards and clients send their payload frames through memory (:mod:`.shmnet`: budgets
#: and reclaim times drawn per seed), and a process's regions are reused at once, as if
#: each reader had been slower than the owner's reclaim time.
SHM = ("shm",)
#: Connection resets, only when named and with the real clients: ``reset``, every
#: connection between two processes closes and is made again at once, what it held lost
#: both ways (a TCP reset; :func:`zps.testing.sim.simtransport.reset`); the connecting
#: sockets watch their handshakes, as the product's do, so each runs its
#: ``on_connected`` (a client sends again what was in flight there, a shard greets its
#: broker or router as a new link).
RESET = ("reset",)
#: Storage faults, only when named and with the real shards: ``efbig``, the next log
#: writes of one to three shards fail part-way with EFBIG (the file-size limit), as the
#: ``disk`` fault's ENOSPC; ``rot``, a shard holding data is killed (or the whole cluster
#: loses power) and a bit of one of its files (a log segment, a checkpoint, a small state
#: file) flips before it restarts: the copy may lose what it held, so only when another
#: copy holds every acknowledged write (as ``wipe``, and instead of it: once a run).
STORAGE = ("efbig", "rot")
#: Every fault that may be named.
NAMED = (*FAULTS, *LOADS, *PAIR, *NAMED_ONLY, *RESHARD, *ROUTERS, *SHM, *RESET, *STORAGE)
