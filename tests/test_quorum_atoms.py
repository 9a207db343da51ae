"""Elastic groups of unequal size, below the engine: the atom communicators one quorum makes on its
store (no common world: torchft's process-group wrapper under a prefix of the quorum and the
tuple), the average over them, a heal's copy across group sizes (whole shards, and one fragment's
window of them), and the model fingerprint that does not depend on the cut.

Three processes: group 0 of 2 ranks and group 1 of 1 rank, FSDP2's row cut of four tensors
(uneven ones included); group 0 is FSDP over 2, or HSDP with 2 replicas of 1 shard (each replica
averages and receives half of the atoms and passes them to the other). Checked against the full
tensors, built alike in every process."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fl_megatron.atom_plan import groups_from_sizes, plan_for_shapes
from fl_megatron.federation.atom_average import AtomAverager, fragment_windows, window_views
from fl_megatron.federation.atom_transfer import copy_across_groups_
from fl_megatron.federation.fingerprint import group_fingerprint, shard_fingerprints
from fl_megatron.launching.ports import free_port
from fl_megatron.local_ranks import run_ranks

pytest.importorskip("torchft")

SHAPES = [(5, 3), (7,), (2, 4), (1, 6)]


def _full(group: int, salt: int = 0) -> list:
    """Group `group`'s full tensors (the same in every process)."""
    g = torch.Generator().manual_seed(1000 * salt + group)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _cut(plan, rank: int, full: list) -> list:
    return [t.reshape(-1)[slice(*plan.shard_range(rank, i))].clone() for i, t in enumerate(full)]


def _window_from(window: tuple, group: int) -> list:
    """Group `group`'s full tensors (salt 4) with the elements inside `window` (over all tensors
    as one flat sequence) taken from group 1's."""
    out, offset = [], 0
    for mine, theirs in zip(_full(group, 4), _full(1, 4)):
        flat, lo = mine.reshape(-1).clone(), offset
        a, b = max(window[0] - lo, 0), min(window[1] - lo, flat.numel())
        if a < b:
            flat[a:b] = theirs.reshape(-1)[a:b]
        out.append(flat.view_as(mine))
        offset += flat.numel()
    return out


def _worker(rank: int, world: int, port: int, shards: tuple) -> dict:
    from fl_megatron.elastic.quorum_atoms import QuorumAtoms

    plan = plan_for_shapes(groups_from_sizes([2, 1], shards), SHAPES, "fsdp2")
    group = plan.group_of(rank)
    store_server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False) if rank == 0 else None
    own = [dist.new_group([0, 1]), dist.new_group([2])][group]
    replicas = own if plan.groups[group].replicas > 1 else None
    dist.barrier()
    atoms = QuorumAtoms(plan, rank, "gloo", timeout=timedelta(seconds=60))
    out = {"made": atoms.build(7, (0, 1), f"127.0.0.1:{port}"), "again": atoms.build(7, (1, 0), f"127.0.0.1:{port}")}
    out["sizes"] = sorted(dist.get_world_size(pg) for pg in atoms.communicators.values() if pg is not None)
    # the average over the quorum's atoms: (a + b) / 2 of the groups' full tensors, bit for bit
    shards = _cut(plan, rank, _full(group))
    AtomAverager(plan, rank, atoms.communicators, bucket_bytes=16, replica_group=replicas).average(shards)
    mean = [(a + b) / 2 for a, b in zip(_full(0), _full(1))]
    out["average"] = all(torch.equal(s, m) for s, m in zip(shards, _cut(plan, rank, mean)))
    ranges = [plan.shard_range(rank, t) for t in range(len(SHAPES))]
    first = plan.shard_of(rank)[1] == 0  # HSDP: one replica of each shard counts
    out["fingerprint_mean"] = group_fingerprint(shards, ranges, own, first)
    # a heal from the 1-rank group into the 2-rank group: two streams, each re-cut atom by atom
    streams = [_cut(plan, rank, _full(group, salt)) for salt in (1, 2)]
    before = group_fingerprint(streams[0], ranges, own, first)
    out["sent_1"] = copy_across_groups_(plan, rank, atoms.communicators, streams, 1, [0], (0, 1), bucket_bytes=12,
                                        replica_group=replicas)
    out["copied_1"] = all(torch.equal(s, r) for salt, stream in zip((1, 2), streams)
                          for s, r in zip(stream, _cut(plan, rank, _full(1, salt))))
    out["fingerprints"] = (before, group_fingerprint(streams[0], ranges, own, first))
    # a new quorum (another id): its communicators anew, and the copy the other way
    out["remade"] = atoms.build(8, (0, 1), f"127.0.0.1:{port}")
    streams = [_cut(plan, rank, _full(group, 3))]
    out["sent_0"] = copy_across_groups_(plan, rank, atoms.communicators, streams, 0, [1], (0, 1))
    out["copied_0"] = all(torch.equal(s, r) for s, r in zip(streams[0], _cut(plan, rank, _full(0, 3))))
    # a fragment's state (the views of its window over the model's elements): only the window
    # travels, into the same elements of the receiver's own cut; the rest stays its own
    window = fragment_windows(plan, 2)[1]
    stream = _cut(plan, rank, _full(group, 4))
    out["sent_window"] = copy_across_groups_(plan, rank, atoms.communicators, [window_views(plan, rank, stream, window)],
                                             1, [0], (0, 1), bucket_bytes=12, replica_group=replicas, window=window)
    out["copied_window"] = all(torch.equal(s, r) for s, r in zip(stream, _cut(plan, rank, _window_from(window, group))))
    dist.barrier()
    atoms.close()
    del store_server
    return out


@pytest.mark.parametrize("shards", [(2, 1), (1, 1)], ids=["fsdp", "hsdp"])
def test_quorum_atoms_average_copy_across_sizes_and_fingerprint(shards):
    results = run_ranks(3, _worker, free_port(), shards, timeout=240)
    for rank, r in enumerate(results):
        assert r["made"] and not r["again"] and r["remade"], r  # the same quorum and groups: kept
        assert r["average"] and r["copied_1"] and r["copied_0"] and r["copied_window"], (rank, r)
    # the 1-rank group's rank owns every element: it is in a communicator with each rank of group 0
    assert results[2]["sizes"] == [2, 2] and results[0]["sizes"] == results[1]["sizes"] == [2]
    # bytes: the sender sends each element of each stream once (4 bytes), the receivers nothing
    elements = sum(torch.Size(s).numel() for s in SHAPES)
    assert [r["sent_1"] for r in results] == [0, 0, 2 * elements * 4]
    assert results[0]["sent_0"] + results[1]["sent_0"] == elements * 4 and results[2]["sent_0"] == 0
    assert [r["sent_window"] for r in results] == [0, 0, (elements - elements // 2) * 4]  # the second half
    # the fingerprint: one value per model whatever its cut; after the copy group 0 holds group 1's
    assert len({r["fingerprint_mean"] for r in results}) == 1
    before = [r["fingerprints"][0] for r in results]
    after = [r["fingerprints"][1] for r in results]
    assert before[0] == before[1] != before[2] and len(set(after)) == 1 and after[0] == before[2]


def test_fingerprint_is_the_same_for_any_cut_and_sees_a_bit_or_a_swap():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    whole = shard_fingerprints([x], [0])[0]
    parts = shard_fingerprints([x[:1], x[1:377], x[377:]], [0, 1, 377])
    assert (sum(parts) + 2 ** 63) % 2 ** 64 - 2 ** 63 == whole
    swapped = x.clone()
    swapped[[10, 11]] = x[[11, 10]]
    nudged = x.clone()
    nudged[500] = torch.nextafter(x[500], torch.tensor(1e9))
    assert len({whole, shard_fingerprints([swapped], [0])[0], shard_fingerprints([nudged], [0])[0]}) == 3
