"""FederationEngine in one process, through a fake backend: when it syncs, what it hands the
averager, that it refreshes the backend after writing the shards in place, and what it reports.

The bookkeeping tests use this process's 1-rank group as the peer group (the layout says 2
groups of 1 rank, so the engine is active; the average over one peer is the shard itself); the
averaging test runs 2 real groups of 1 rank each, in two processes, against the closed-form mean."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fl_megatron.config import FederationConfig
from fl_megatron.federation import CollectiveCounter, FederationEngine
from fl_megatron.federation.membership import whole_federation
from fl_megatron.federation.transaction import OneWorldTransaction
from fl_megatron.local_ranks import run_ranks
from fl_megatron.topology import make_layout


class FakeBackend:
    """Two shards (one odd-sized) and a log of the engine's calls."""

    def __init__(self) -> None:
        self.shards = [torch.arange(6, dtype=torch.float32), torch.full((3,), 4.0)]
        self.calls: list[str] = []

    def local_shards(self) -> list[torch.Tensor]:
        self.calls.append("local_shards")
        return self.shards

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"shard.{i}", s.view(-1)) for i, s in enumerate(self.shards)]

    def inner_state_shards(self) -> list[torch.Tensor]:
        return []

    def reset_optimizer_state(self) -> None:
        self.calls.append("reset")

    def refresh_after_sync(self) -> None:
        self.calls.append("refresh")


def _groups(world, rank: int = 0):
    """Rank `rank` of 2 groups of 1 rank on 2 nodes, its peer group `world`."""
    layout = make_layout(2, ranks_per_node=1, group_size=1)
    groups = SimpleNamespace(layout=layout, coords=(rank, 0, 0), rank=rank, peer=world, replica=None, federation=world,
                             exchange_peer=None, meet=lambda: whole_federation(2, rank),
                             tier=lambda kind: "inter-node", device_type="cpu",
                             all_reduce_job=lambda tensor, op=dist.ReduceOp.SUM: dist.all_reduce(tensor, op, group=world),
                             reduce_across_groups=lambda tensor, op, call: call(dist.all_reduce, tensor, op=op, group=world))
    groups.transaction = lambda backend, state: OneWorldTransaction(groups)
    groups.has_exchange_groups = lambda: groups.exchange_peer is not None  # as ProcessGroups says
    return groups


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


IN_PLACE_BUCKET_MB = 64 / 2**20  # 16 elements: both shards are averaged in place, not packed


def _two_groups_sync(rank: int, world: int, bucket_mb: float) -> list:
    """Group `rank` (of 2, one rank each) with shards that differ by group, through two syncs."""
    backend = FakeBackend()
    backend.shards = [shard * (rank + 1) + 10 * rank for shard in backend.shards]
    engine = FederationEngine(backend, _groups(dist.group.WORLD, rank),
                              FederationConfig(sync_interval=2, bucket_mb=bucket_mb))
    calls = []
    with CollectiveCounter(lambda name, ranks, nbytes: calls.append(name)):
        first = engine.after_step(2)
    after = [shard.tolist() for shard in backend.shards]  # plain lists: tensors do not outlive the process
    with torch.no_grad():  # the groups drift apart again before the next sync
        for shard in backend.shards:
            shard.add_(rank + 1)
    final = engine.after_step(4, last=True)
    metrics = [(first.variance, first.carried), (final.variance, final.param_rms, final.carried)]
    return [first.step, after, [shard.tolist() for shard in backend.shards], backend.calls, calls, metrics]


@pytest.mark.parametrize("bucket_mb", [32.0, IN_PLACE_BUCKET_MB], ids=["packed", "in-place"])
def test_two_groups_end_each_sync_with_the_mean_of_their_shards(bucket_mb):
    results = run_ranks(2, _two_groups_sync, bucket_mb, timeout=120)
    base = FakeBackend().shards
    mean = [(shard + (2 * shard + 10)) / 2 for shard in base]  # groups 0 and 1 as _two_groups_sync makes them
    elements = sum(s.numel() for s in base)
    for step, after, final, calls, collectives, metrics in results:
        assert step == 2 and calls == ["local_shards", "refresh"] * 2
        assert all(torch.allclose(torch.tensor(a), m) for a, m in zip(after, mean))
        # the second sync averages the drift too: + (1 + 2) / 2
        assert all(torch.allclose(torch.tensor(f), m + 1.5) for f, m in zip(final, mean))
        # a scheduled sync: the vote's in-group round, then the data, which carries the vote across
        # the groups (inside the packed bucket, or beside the first in-place one, issued with it);
        # no round for its metrics (they ride on the next vote)
        packed = bucket_mb != IN_PLACE_BUCKET_MB
        assert collectives == ["allreduce_"] * (2 if packed else 4), collectives
        (first_variance, first_carried), (last_variance, last_rms, carried) = metrics
        assert first_variance is None and first_carried is None  # carried by the next vote
        # the first sync's, in closed form: groups x and 2x + 10 differ by x + 10, so the variance
        # across the two is ((x + 10) / 2)^2; the rms is the mean's
        variance = sum(float((((s + 10) / 2) ** 2).sum()) for s in base) / elements
        rms = (sum(float((m ** 2).sum()) for m in mean) / elements) ** 0.5
        assert carried.step == 2 and carried.variance == pytest.approx(variance, rel=1e-9)
        assert carried.param_rms == pytest.approx(rms, rel=1e-9)
        # the last sync's own, at once: groups mean + 1 and mean + 2
        assert last_variance == pytest.approx(0.25, rel=1e-9)
        assert last_rms == pytest.approx((sum(float(((m + 1.5) ** 2).sum()) for m in mean) / elements) ** 0.5)
