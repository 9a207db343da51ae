"""The atom communicators of one quorum when elastic groups differ in size.

In one world every rank makes every owner tuple's communicator with `new_group`
(federation/atom_average.py). Elastic groups are separate jobs with no common world: at each
quorum, every rank of every live group makes the communicators of its owner tuples itself,
through torchft's process-group wrapper (the same one the quorum's own group uses, so a lost
peer is bounded and aborted alike), on the quorum's store under a prefix of the quorum and the
tuple. A tuple keeps only its owners in the live groups; where that leaves this rank alone its
elements are already their own mean (None). Every rank makes its tuples in the plan's sorted
order, the order in which it averages them, so no two ranks wait on each other's later tuple.

They are made again only when the quorum changes: torchft keeps the quorum id while the same
groups meet.
"""

from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

import torch.distributed as dist

from ..atom_plan import AtomPlan
from .quorum_group import registered_quorum_group, unregister_quorum_group
from .torchft_groups import quorum_process_group


def live_members(owners: Tuple[int, ...], live: Sequence[int]) -> Tuple[int, ...]:
    """The owners of an atom (one rank per group, in group order) in the live groups."""
    return tuple(owners[f] for f in live)


class QuorumAtoms:
    """`rank`'s atom communicators (by the plan's owner tuple) in the current quorum: a mapping the
    averagers read at every sync, rebuilt in place by `build` when the quorum changes."""

    def __init__(self, plan: AtomPlan, rank: int, backend: str = "gloo",
                 timeout: timedelta = timedelta(seconds=60)) -> None:
        self.plan, self.rank, self.backend, self.timeout = plan, rank, backend, timeout
        self.communicators: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}
        self.key: Optional[Tuple[int, Tuple[int, ...]]] = None  # (quorum id, live groups) they were made for
        self._wrappers: list = []  # torchft's wrappers, kept alive with their communicators
        self._mine = sorted({atom.owners for atom in plan.rank_atoms(rank)})

    def build(self, quorum_id: int, live: Sequence[int], store: str) -> bool:
        """Make this rank's communicators for the quorum `quorum_id` of the `live` groups (ids, in
        order) on the quorum's `store` ("host:port"); returns whether they were made anew. Every
        rank of every live group calls it after the quorum formed."""
        live = tuple(sorted(live))
        if (quorum_id, live) == self.key:
            return False
        group = self.plan.group_of(self.rank)
        if group not in live:
            raise ValueError(f"rank {self.rank}'s group {group} is not among the quorum's live groups {live}")
        self.close()
        index = {owners: i for i, owners in enumerate(self.plan.owner_tuples())}
        for owners in self._mine:  # sorted: the common order
            members = live_members(owners, live)
            if len(members) == 1:
                self.communicators[owners] = None
                continue
            i, me = index[owners], members.index(self.rank)
            wrapper = quorum_process_group(self.backend, self.timeout)
            wrapper.configure(f"{store}/fl_megatron/atoms/{quorum_id}/{i}", f"atoms_{i}", me, len(members),
                              quorum_id)
            self._wrappers.append(wrapper)
            self.communicators[owners] = registered_quorum_group(wrapper._pg, self.backend, quorum_id, me,
                                                                 name=f"atoms_{i}")
        self.key = (quorum_id, live)
        return True

    def close(self) -> None:
        """Take the communicators out of torch's registry and drop them (before the next quorum's)."""
        for pg in self.communicators.values():
            unregister_quorum_group(pg)
        for wrapper in self._wrappers:
            wrapper.abort(errored=False)
        self.communicators.clear()
        self._wrappers = []
        self.key = None
