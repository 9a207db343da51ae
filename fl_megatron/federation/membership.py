"""Who meets at a sync: the live federation groups of that sync's quorum."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Membership:
    """One sync's quorum as this rank sees it (the same on every rank of every live group). In one
    world it is every group, always; in elastic mode torchft's lighthouse decides it."""

    quorum_id: int
    groups: tuple          # the live groups' slots, in peer-group rank order
    rank: int              # this group's index in `groups` (its rank in the peer group)
    healed: bool = False   # this group was behind and took the live groups' state at this quorum
    seconds: float = 0.0   # how long the quorum (and healing) took here

    @property
    def size(self) -> int:
        return len(self.groups)


def whole_federation(num_groups: int, group: int) -> Membership:
    """The membership of every sync in one world: all groups, this one at its own slot."""
    return Membership(0, tuple(range(num_groups)), group)


class TooFewGroups(RuntimeError):
    """Elastic mode: fewer live groups than --fl-min-groups met within the quorum timeout (the
    message names the missing groups)."""
