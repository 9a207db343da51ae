"""The vote at a sync (federation/vote.py) over 3 real gloo ranks, each a group of one: the groups'
figures land in their own slots, and in elastic mode --fl-tune's choice rides on it, the lowest-
numbered group that chose deciding for all."""

import torch
import torch.distributed as dist

from fl_megatron.config.sync_mode import SyncMode
from fl_megatron.federation.vote import GroupFigures, across_peer_group, take_vote
from fl_megatron.local_ranks import run_ranks

INT8 = SyncMode("int8", 1, 2, 4)
BF16 = SyncMode("bf16", 0, 1, 4)
FP32 = SyncMode("fp32", 0, 1, 4)

# per vote: each group's choice (None: it chose nothing at this sync)
ROUNDS = [(None, INT8, BF16), (FP32, INT8, BF16), (None, None, None), (None, None, INT8)]


def _job(rank: int, world: int) -> list:
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group, in order
    shards = [torch.full((4,), float(rank))]
    out = []
    for step, choices in enumerate(ROUNDS):
        figures = GroupFigures(loss=1.0 + rank, grad_norm=10.0 * rank, tune_choice=choices[rank])
        vote = take_vote(step, shards, figures, rank, world, 0.0, own, across_peer_group(dist.group.WORLD), "cpu")
        out.append((vote.tune_choice, vote.losses, vote.grad_norms, vote.sick, vote.joining, vote.signalled))
    return out


def test_the_lowest_group_that_chose_decides_and_the_figures_stay_in_their_slots():
    results = run_ranks(3, _job, timeout=120)
    assert results[0] == results[1] == results[2]  # every rank ends with the same vote
    for (choice, losses, norms, sick, joining, signalled), choices in zip(results[0], ROUNDS):
        assert choice == next((c for c in choices if c is not None), None), (choices, choice)
        assert losses == [1.0, 2.0, 3.0] and norms == [0.0, 10.0, 20.0]
        assert sick == [] and joining == [] and signalled is False
    assert results[0][0][0] == INT8 and results[0][0][0].error_feedback is True  # a mode's every field survives
    assert results[0][3][0] == INT8
