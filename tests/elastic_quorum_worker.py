"""One federation group of one rank, its own world, meeting the others over torchft's quorum
group (run by tests/test_elastic_quorum.py: python elastic_quorum_worker.py GROUP LIGHTHOUSE ROUNDS OUT)."""

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fl_megatron.elastic import ElasticPeerTier
from fl_megatron.federation.averaging import ShardAverager
from fl_megatron.federation.graphs import Round
from fl_megatron.launching.ports import free_port


def shards_of(group: int, round_index: int) -> list[torch.Tensor]:
    """Group `group`'s values in round `round_index`: two shards, a packed small one and a big one."""
    gen = torch.Generator().manual_seed(1000 * round_index + group)
    return [torch.randn(37, generator=gen), torch.randn(5000, generator=gen)]


def main() -> None:
    group, lighthouse, rounds, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    tier = ElasticPeerTier(group, 0, 1, lighthouse, "127.0.0.1", port, min_groups=1,
                           state_dict=lambda: {}, load_state_dict=lambda state: None,
                           timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=60))
    # every group heartbeats before any asks for a quorum: the first one then holds all three
    ready = Path(out).with_suffix(".ready")
    ready.touch()
    deadline = time.monotonic() + 60
    while len(list(ready.parent.glob("*.ready"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    records = []
    for r in range(rounds):
        m = tier.meet()
        peer = tier.group
        record = {"round": r, "groups": list(m.groups), "rank": m.rank, "size": dist.get_world_size(peer),
                  "rank_in_group": dist.get_rank(peer), "backend": dist.get_backend(peer)}
        # exact fp32 FedAvg over the live groups (packed and in-place pieces)
        fp32 = shards_of(group, r)
        ShardAverager(peer, m.size, bucket_bytes=4096).average(fp32)
        record["fp32"] = [t.tolist() for t in fp32]
        # int8 all-to-all / all-gather, the last live group left out (it sends nothing, receives the mean)
        int8 = shards_of(group, r)
        ShardAverager(peer, m.size, sync_dtype="int8").average(int8, include=m.rank != m.size - 1,
                                                                contributors=m.size - 1)
        record["int8"] = [t.tolist() for t in int8]
        # one gossip round by point-to-point: each group mixes half-and-half with the next one
        ring = shards_of(group, r)
        following, previous = (m.rank + 1) % m.size, (m.rank - 1) % m.size
        ShardAverager(peer, m.size).average(ring, mixing=Round(0.5, (following,), ((previous, 0.5),)))
        record["gossip"] = [t.tolist() for t in ring]
        record["commit"] = tier.commit()
        records.append(record)
        if group == 2 and r == 0:  # group 2 leaves for good after the first round
            break
    tier.close()
    with open(out, "w") as f:
        json.dump(records, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
