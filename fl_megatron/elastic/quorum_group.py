"""Make the process group of one torchft quorum usable with torch.distributed's functions.

torchft builds a fresh communicator for every quorum (its ProcessGroupGloo/NCCL wrapper's
`configure`), outside torch's group registry: an all-reduce on it works, but anything that
looks the group up (`get_backend`, `get_world_size`, `get_rank(group)`, point-to-point by
group rank) raises. The engine's averaging calls exactly those. Here the quorum's group is
entered into the registry, with this process at its quorum rank, and taken out again before
the next quorum replaces it. torch's registry is process-global state: this module is the only
place that touches it, and only for groups it entered itself.
"""

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

# the peers of a quorum have no rank in this group's own world: their stand-in global ranks
# start here, far above any world rank of a federation group's job
_STAND_IN_RANK_BASE = 1 << 30


def registered_quorum_group(pg: dist.ProcessGroup, backend: str, quorum_id: int, quorum_rank: int,
                            name: str = ""):
    """Enter torchft's raw quorum group `pg` (`backend`: 'gloo' or 'nccl') in torch's group
    registry, this process being quorum rank `quorum_rank`; returns `pg`. `name`: what tells it
    apart from the quorum's other groups (an atom communicator's tuple)."""
    size = pg.size()
    if not 0 <= quorum_rank < size:
        raise ValueError(f"quorum rank {quorum_rank} is outside a quorum group of {size}")
    own = dist.get_rank()
    ranks = {(own if i == quorum_rank else _STAND_IN_RANK_BASE + i): i for i in range(size)}
    name = f"fl_megatron_quorum_{quorum_id}_{name}{'_' * bool(name)}{quorum_rank}"
    world = c10d._world
    world.pg_map[pg] = (backend, None)
    world.pg_names[pg] = name
    world.pg_group_ranks[pg] = ranks
    world.pg_backend_config[pg] = backend
    world.pg_to_tag[pg] = name
    world.tags_to_pg.setdefault(name, []).append(pg)
    return pg


def unregister_quorum_group(pg) -> None:
    """Take a group entered by `registered_quorum_group` out of the registry (torchft aborts or
    drops the communicator itself when it builds the next quorum's)."""
    world = c10d._world
    if pg is None or pg not in world.pg_map:
        return
    tag = world.pg_to_tag.pop(pg, None)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                  world.pg_coalesce_state):
        table.pop(pg, None)
    if tag is not None and pg in world.tags_to_pg.get(tag, []):
        world.tags_to_pg[tag].remove(pg)
        if not world.tags_to_pg[tag]:
            del world.tags_to_pg[tag]
