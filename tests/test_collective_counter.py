"""CollectiveCounter on a 1-rank gloo group, and CommLedger bookkeeping."""

import random

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fl_megatron.federation.ledger import SCOPES, TIERS, CollectiveCounter, CommLedger


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_counts_eager_collectives(world, dtype):
    a = torch.ones(37, dtype=dtype)
    b = torch.ones(3, 11, dtype=dtype)
    gin = torch.ones(13, dtype=dtype)
    gout = torch.empty(13, dtype=dtype)
    rin = torch.ones(6, 5, dtype=dtype)
    rout = torch.empty(6, 5, dtype=dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    with CollectiveCounter() as counter:
        dist.all_reduce(a)
        dist.all_reduce(b)
        dist.all_gather_into_tensor(gout, gin)
        dist.reduce_scatter_tensor(rout, rin)
        _ = a * 2 + 1               # ordinary ops are not collectives
    calls = {k: v for k, v in counter.calls.items() if v}
    assert calls == {"allreduce_": 2, "_allgather_base_": 1, "_reduce_scatter_base_": 1}
    assert counter.payload["allreduce_"] == (37 + 33) * size
    assert counter.payload["_allgather_base_"] == 13 * size
    assert counter.payload["_reduce_scatter_base_"] == 30 * size
    assert counter.total_bytes == (37 + 33 + 13 + 30) * size
    # the collectives still ran (sum over one rank is the identity)
    assert torch.equal(a, torch.ones(37, dtype=dtype)) and torch.equal(gout, gin) and torch.equal(rout, rin)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_counts_functional_collectives(world):
    x = torch.randn(9, 4)
    with CollectiveCounter() as counter:
        r = funcol.wait_tensor(funcol.all_reduce(x, "sum", world))
        g = funcol.wait_tensor(funcol.all_gather_tensor(torch.ones(10, dtype=torch.float64), 0, world))
        s = funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.ones(8), "sum", 0, world))
    assert torch.equal(r, x) and g.shape == (10,) and s.shape == (8,)
    assert counter.calls["all_reduce"] == 1
    assert counter.calls["all_gather_into_tensor"] == 1
    assert counter.calls["reduce_scatter_tensor"] == 1
    assert counter.payload["all_reduce"] == 36 * 4
    assert counter.payload["all_gather_into_tensor"] == 10 * 8
    assert counter.payload["reduce_scatter_tensor"] == 8 * 4
    assert counter.total_bytes == 36 * 4 + 10 * 8 + 8 * 4


def test_counter_outside_context_counts_nothing(world):
    counter = CollectiveCounter()
    dist.all_reduce(torch.ones(4))
    with counter:
        pass
    dist.all_reduce(torch.ones(4))
    assert sum(counter.calls.values()) == 0 and counter.total_bytes == 0


def test_ledger_snapshot_sums_by_scope_and_tier():
    rng = random.Random(7)
    ledger = CommLedger()
    expect = {(s, t): 0 for s in SCOPES for t in TIERS}
    for _ in range(300):
        s, t, n = rng.choice(SCOPES), rng.choice(TIERS), rng.randint(0, 10**9)
        ledger.add(s, t, n)
        expect[s, t] += n
    snap = ledger.snapshot()
    assert snap == {
        "intra_group_bytes": expect["intra-group", "intra-node"] + expect["intra-group", "inter-node"],
        "inter_group_bytes": expect["inter-group", "intra-node"] + expect["inter-group", "inter-node"],
        "intra_node_bytes": expect["intra-group", "intra-node"] + expect["inter-group", "intra-node"],
        "inter_node_bytes": expect["intra-group", "inter-node"] + expect["inter-group", "inter-node"],
    }
    assert snap["intra_group_bytes"] + snap["inter_group_bytes"] == snap["intra_node_bytes"] + snap["inter_node_bytes"]
    assert all(type(v) is int for v in snap.values())


def test_fresh_ledger_is_zero():
    assert CommLedger().snapshot() == {"intra_group_bytes": 0, "inter_group_bytes": 0,
                                       "intra_node_bytes": 0, "inter_node_bytes": 0}


@pytest.mark.parametrize("scope,tier", [
    ("intra_group", "intra-node"), ("inter-group", "inter_node"), ("global", "intra-node"),
    ("intra-node", "intra-group"), ("", ""), ("inter-group", "node"),
])
def test_ledger_rejects_unknown_scope_or_tier(scope, tier):
    ledger = CommLedger()
    ledger.add("inter-group", "inter-node", 5)
    with pytest.raises(ValueError, match=f"unknown scope '{scope}' or tier '{tier}'"):
        ledger.add(scope, tier, 100)
    assert ledger.snapshot() == {"intra_group_bytes": 0, "inter_group_bytes": 5,
                                 "intra_node_bytes": 0, "inter_node_bytes": 5}
