"""A sync's PeerLatch (elastic mode): after a peer collective fails, the later peer collectives of
the sync are skipped and the in-group ones (HSDP's replica gathers) go on, the same calls as on a
rank whose peers are all alive; errors that are not a lost peer still raise."""

import pytest
import torch
import torch.distributed as dist

from fl_megatron.federation import averaging
from fl_megatron.federation.averaging import Peers, ShardAverager
from fl_megatron.federation.failed_collective import PeerLatch

LOST_PEER = "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"


def test_the_latch_remembers_the_first_lost_peer_and_skips_every_later_call():
    calls = []

    def collective(name, fail=False):
        calls.append(name)
        if fail:
            raise RuntimeError(LOST_PEER)
        return name

    latch = PeerLatch()
    assert latch(collective, "a") == "a" and latch.error is None
    assert latch(collective, "b", fail=True) is None and LOST_PEER in str(latch.error)
    assert latch(collective, "c") is None and calls == ["a", "b"]


@pytest.mark.parametrize("error", [ValueError("shapes differ"), RuntimeError("CUDA out of memory")])
def test_an_error_that_is_not_a_lost_peer_raises(error):
    def broken():
        raise error

    latch = PeerLatch()
    with pytest.raises(type(error)):
        latch(broken)
    assert latch.error is None


def _gathers_of_an_average(world, monkeypatch, fail_at=None) -> tuple[list, list, PeerLatch]:
    """(replica gathers, peer all-reduces, latch) of one HSDP replica's average whose peer all-reduce number
    `fail_at` loses its peer (None: none does)."""
    gathers, reduces = [], []
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        reduces.append(tensor.numel())
        if len(reduces) == fail_at:
            raise RuntimeError(LOST_PEER)
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(averaging.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(averaging, "gather_slices", lambda buffer, index, group: gathers.append(buffer.numel()))
    averager = ShardAverager(world, 1, replica_group=world, replicas=2, replica_index=0, bucket_bytes=64)
    latch = PeerLatch()
    shards = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (40, 7, 100, 3)]
    averager.average(shards, peers=Peers(world, 1, latch))
    return gathers, reduces, latch


def test_a_replica_that_lost_its_peer_makes_the_same_in_group_gathers(world, monkeypatch):
    healthy, reduces, latch = _gathers_of_an_average(world, monkeypatch)
    assert latch.error is None and len(reduces) == len(healthy) > 2
    lost, reduces, latch = _gathers_of_an_average(world, monkeypatch, fail_at=2)
    assert lost == healthy  # the same in-group collectives, in the same order and sizes
    assert len(reduces) == 2 and latch.error is not None  # nothing sent to the peers after the loss
