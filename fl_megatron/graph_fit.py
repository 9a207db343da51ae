"""Which communication graphs between federation groups exist, and for how many groups.

Pure Python, below the configuration: a topology that cannot connect the run's groups is
refused while the flags are validated, before any process group exists.
"""

import math
from typing import Optional

GRAPHS = ("complete", "ring", "torus", "exponential", "one-peer-exponential")
TOPOLOGIES = GRAPHS + ("ada",)
ADA_LEVELS = ("none",) + GRAPHS  # "none" (no exchange) is only a step of an Ada ladder


def torus_shape(groups: int) -> Optional[tuple[int, int]]:
    """The most square rows x columns = groups with both sides at least 3 (so a group's four
    neighbours are distinct), or None."""
    for rows in range(math.isqrt(groups), 2, -1):
        if groups % rows == 0 and groups // rows >= 3:
            return rows, groups // rows
    return None


def topology_problem(name: str, groups: int) -> Optional[str]:
    """Why `name` cannot connect `groups` federation groups (None if it can)."""
    if name not in TOPOLOGIES:
        return f"topology {name!r} is not one of {', '.join(TOPOLOGIES)}"
    if name == "torus" and groups > 1 and torus_shape(groups) is None:
        valid = [t for t in TOPOLOGIES if t != "torus"]
        return (f"a torus needs the number of federation groups to be rows x columns with both at least 3 "
                f"(9, 12, 15, 16, ...), not {groups}; valid for {groups} groups: {', '.join(valid)}")
    return None


def out_degree(name: str, groups: int) -> int:
    """Other groups that receive a group's shard in one round of a gossip graph (not complete)."""
    if groups < 2 or name == "none":
        return 0
    if name == "ring":
        return len({1 % groups, (groups - 1) % groups} - {0})
    if name == "torus":
        return 4
    if name == "exponential":
        return max(1, math.ceil(math.log2(groups)))
    if name == "one-peer-exponential":
        return 1
    raise ValueError(f"{name!r} is not a gossip graph")
