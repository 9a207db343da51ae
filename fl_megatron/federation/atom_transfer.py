"""A group's state copied into groups of another size, atom by atom (elastic healing).

Every tensor a heal carries that is cut as the shards are (the shards themselves, the inner
optimizer's moments, the outer anchors and momenta) goes, for each atom, from its owner in the
source group to its owner in each receiving group, over the atom's communicator: point to point,
packed per bucket, in the plan's sorted order of tuples on every rank (as the averages run: no
two ranks wait on each other's later tuple). Each rank sends or receives only its own elements;
nothing is gathered. Ranks of groups that neither send nor receive take no part; in a receiving group with HSDP
replicas, each replica passes the atoms it received to the others of its shard. Groups of the
same size get exactly their counterpart's shards, as torchft's rank-to-rank heal gives them.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..atom_plan import AtomPlan
from .atom_average import (buckets, pack, pieces_by_tuple, replica_slice_buckets, share_replica_slices_,
                           tensor_windows, unpack, window_lengths)
from .failed_collective import call_directly, has_failed


@torch.no_grad()
def copy_across_groups_(plan: AtomPlan, rank: int, communicators: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]],
                        streams: Sequence[List[torch.Tensor]], source: int, receivers: Sequence[int],
                        live: Sequence[int], bucket_bytes: int = 32 << 20, replica_group=None,
                        call=call_directly, window: Optional[Tuple[int, int]] = None) -> int:
    """Make each receiving group's `streams` equal the `source` group's, in place (collective over
    the live groups' ranks, every one calling it with the same arguments but its own `streams`).
    A stream is one state of every tensor of the plan (e.g. the first Adam moments): this rank's
    flat shard of tensor t at index t, of its shard's length. `live`: the quorum's groups (in the
    order of `communicators`' members). `replica_group`: this rank's HSDP replicas, where a
    receiving group has them (each atom reaches one replica of its shard, which passes it on, as
    the average does). `call`: what every cross-group send and receive goes through (a
    PeerLatch: a lost peer is remembered and the rest skipped). `window`: the streams hold only
    the part of each shard inside this window over the model's elements (a fragment's state,
    `atom_average.window_views`); None: whole shards. Returns the bytes this rank sent across
    groups."""
    live = sorted(live)
    group = plan.group_of(rank)
    if source not in live or any(f not in live for f in receivers) or source in receivers:
        raise ValueError(f"a copy from group {source} to {sorted(receivers)} among the live groups {live}")
    if group != source and group not in receivers:
        return 0
    _, replica, _ = plan.shard_of(rank)
    if group in receivers and plan.groups[group].replicas > 1 and replica_group is None:
        raise ValueError(f"rank {rank}'s group has {plan.groups[group].replicas} replicas: the replica group is needed")
    windows, lengths = tensor_windows(plan, window), window_lengths(plan, rank, window)
    for i, stream in enumerate(streams):
        if [s.numel() for s in stream] != lengths:
            raise ValueError(f"stream {i}: shards of {[s.numel() for s in stream]} elements; this rank's plan "
                             f"holds {lengths}")
    sent = 0
    for owners, pieces in sorted(pieces_by_tuple(plan, rank, windows).items()):
        members = [owners[f] for f in live]
        pg = communicators.get(owners)
        if pg is None:  # source and receivers are live: every tuple of theirs has one
            raise ValueError(f"no communicator for owner tuple {owners}: build them for the quorum first")
        targets = [members.index(owners[f]) for f in receivers]
        for stream in streams:
            flats = [s.view(-1) for s in stream]
            for bucket in buckets(pieces, max(1, bucket_bytes // stream[0].element_size() if stream else 1)):
                buffer = pack(bucket, flats)
                if group == source:
                    for target in targets:
                        call(dist.send, buffer.contiguous(), group_dst=target, group=pg)
                        if not has_failed(call):
                            sent += buffer.numel() * buffer.element_size()
                else:
                    received = torch.empty_like(buffer)
                    call(dist.recv, received, group_src=members.index(owners[source]), group=pg)
                    buffer.copy_(received)
                    unpack(buffer, bucket, flats)
    if group in receivers and plan.groups[group].replicas > 1:  # each replica's atoms to the others
        for stream in streams:
            per_bucket = max(1, bucket_bytes // stream[0].element_size()) if stream else 1
            share_replica_slices_([s.view(-1) for s in stream], replica_slice_buckets(plan, rank, windows, per_bucket),
                                  replica, replica_group)
    return sent
