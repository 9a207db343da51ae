"""FederationEngine in one process, through a fake backend: when it syncs, what it hands the
averager, that it refreshes the backend after writing the shards in place, and what it reports.

The peer group is this process's 1-rank group (the layout says 2 groups of 1 rank, so the
engine is active): the average of a shard over its peers is then the shard itself."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from fl_megatron.config import FederationConfig
from fl_megatron.federation import FederationEngine
from fl_megatron.federation.membership import whole_federation
from fl_megatron.topology import make_layout


class FakeBackend:
    """Two shards (one odd-sized) and a log of the engine's calls."""

    def __init__(self) -> None:
        self.shards = [torch.arange(6, dtype=torch.float32), torch.full((3,), 4.0)]
        self.calls: list[str] = []

    def local_shards(self) -> list[torch.Tensor]:
        self.calls.append("local_shards")
        return self.shards

    def refresh_after_sync(self) -> None:
        self.calls.append("refresh")


def _groups(world):
    layout = make_layout(2, ranks_per_node=1, group_size=1)  # 2 groups of 1 rank, on 2 nodes
    return SimpleNamespace(layout=layout, coords=(0, 0, 0), rank=0, peer=world, replica=None, federation=world,
                           exchange_peer=None, may_roll_back=False, meet=lambda: whole_federation(2, 0),
                           tier=lambda kind: "inter-node", mesh=SimpleNamespace(device_type="cpu"),
                           all_reduce_job=lambda tensor, op=dist.ReduceOp.SUM: dist.all_reduce(tensor, op, group=world))


def test_engine_syncs_every_h_steps_and_at_the_end_in_place_then_refreshes(world):
    backend = FakeBackend()
    storage = [t.data_ptr() for t in backend.shards]
    engine = FederationEngine(backend, _groups(world), FederationConfig(sync_interval=3))
    synced = [step for step in range(1, 8) if engine.after_step(step, last=step == 7) is not None]
    assert synced == [3, 6, 7]
    assert backend.calls == ["local_shards", "refresh"] * 3
    assert [t.data_ptr() for t in backend.shards] == storage  # written in place
    assert torch.equal(backend.shards[0], torch.arange(6, dtype=torch.float32))
    assert torch.equal(backend.shards[1], torch.full((3,), 4.0))
    assert engine.last_synced_step == 7


def test_sync_reports_payload_bytes_and_disabled_syncing_never_calls_the_backend(world):
    backend = FakeBackend()
    engine = FederationEngine(backend, _groups(world), FederationConfig(sync_interval=2))
    result = engine.sync(step=2)
    assert result.step == 2 and result.inter_group_bytes == (6 + 3) * 4 and result.intra_group_bytes == 0
    quiet = FakeBackend()
    off = FederationEngine(quiet, _groups(world), FederationConfig(sync_interval=2, disable_sync=True))
    assert all(off.after_step(s, last=s == 4) is None for s in range(1, 5)) and quiet.calls == []
