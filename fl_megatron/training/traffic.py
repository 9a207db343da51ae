"""The bytes of the work a group repeats (a training step, an evaluation): measured once under a
collective counter, then counted into the ledger at every repetition without counting again."""

from dataclasses import dataclass
from typing import Optional

from ..federation import CollectiveCounter, CommLedger


@dataclass
class Calibrated:
    """Payload bytes per network tier of one piece of repeated work, once measured."""

    by_tier: Optional[dict] = None


class TrafficMeter:
    """In-group payload bytes of training steps and evaluations, for the ledger."""

    def __init__(self, groups, ledger: CommLedger) -> None:
        self.groups, self.ledger = groups, ledger
        self.step, self.evaluation = Calibrated(), Calibrated()

    def measured(self, calibrated: Calibrated, work):
        """Run `work`; the first time under a collective counter, to learn its payload bytes."""
        if calibrated.by_tier is not None:
            result = work()
        else:
            with CollectiveCounter() as counter:
                result = work()
            calibrated.by_tier = self._classify(counter)
        for tier, nbytes in calibrated.by_tier.items():
            self.ledger.add("intra-group", tier, nbytes)
        return result

    def _classify(self, counter: CollectiveCounter) -> dict:
        """Backend collectives stay inside the group: gathers and scatters on the shard group,
        all-reduces on the replica group under HSDP (tiny norm reductions are counted with them)."""
        shard_tier = self.groups.tier("shard")
        replica_tier = self.groups.tier("replica") if self.groups.layout.is_hsdp else shard_tier
        out: dict = {}
        for op, nbytes in counter.payload.items():
            tier = replica_tier if op.startswith(("allreduce", "all_reduce")) else shard_tier
            out[tier] = out.get(tier, 0) + nbytes
        return out
