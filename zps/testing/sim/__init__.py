"""A deterministic cluster simulator over zps's real pure cores.

One process, one seeded scheduler, simulated time, network and disks; the broker's
ClusterState, the shards' ShardSession / ShardCore / Durability / Wal / checkpoints and
the clients' ClientSession run for real under thin sim drivers (:mod:`.nodes`).  Faults
are drawn per seed (:mod:`.world`), known defects can be patched in (:mod:`.bugs`), and
a run is replayed exactly from its seed: ``python -m zps.testing.sim --seed S --trace``.
See docs/design.md, "Simulation".
"""

from zps.testing.sim.checks import Result
from zps.testing.sim.faults import FAULTS
from zps.testing.sim.world import World, run_seed

__all__ = ["FAULTS", "Result", "World", "run_seed"]
