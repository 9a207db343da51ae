"""Groups of unequal speed (--fl-balance-steps, --fl-group-intervals): two groups of one rank, both
on a 0.12 s "machine" (a sleep before every step), group 1 slowed by 0.25 s more (slow:1:0.25),
H = 8, a budget of 40 federation steps.

Balanced, the fast group takes 8 steps per round and the slow one what fits in that time, so the
federation trains at >= 0.9 of what the two groups make alone (each group's tokens per step over
its median step time, from its own records of the same run). With the fixed H of today the slow
group holds the fast one up at every sync: <= 0.75 of it, so the test tells the two apart.

The federation's rate is taken over its planned rounds, from the first sync to the last full
round's: the first round (one step each, which measures the groups, and the run's start-up) and
the budget's cut last round are left out of both runs alike; the whole run's rate is printed."""

import json
import statistics

import pytest

from cli_utils import SGD, federation_records, launch

pytestmark = pytest.mark.timeout(600)

FAULT = "slow:0:0.12,slow:1:0.12,slow:1:0.25"
TOKENS_PER_STEP = 2 * 32  # TINY: micro-batch 2 x 32 tokens, one rank per group


def _run(tmp_path, name: str, *flags: str) -> tuple[dict, list, dict]:
    run = tmp_path / name
    proc = launch(2, run, tmp_path / "cache", *SGD, "--train-iters", "40", "--eval-iters", "0",
                  "--fl-group-size", "1", "--fl-sync-interval", "8", *flags, env_extra={"FL_MEGATRON_FAULT": FAULT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = {}
    for g in range(2):  # each group's own step records: (step, elapsed)
        lines = (run / "groups" / f"group_{g:05d}.jsonl").read_text().splitlines()
        steps[g] = [(r["step"], r["elapsed_s"]) for r in map(json.loads, lines)]
    return json.loads((run / "summary.json").read_text()), federation_records(run), steps


def _planned_rate(records: list) -> float:
    """The federation's tokens per second from its first sync to its last full round's sync: each
    round's tokens as its record gives them (fixed H: H steps of both groups)."""
    first, last = records[0], records[-2]
    tokens, previous = 0, first["step"]
    for r in records[1:-1]:
        tokens += sum(r["group_tokens"]) if "group_tokens" in r else (r["step"] - previous) * 2 * TOKENS_PER_STEP
        previous = r["step"]
    return tokens / (last["elapsed_s"] - first["elapsed_s"])


def _solo_rate(steps: list) -> float:
    """A group's tokens per second alone: tokens per step over its median step time."""
    times = [b[1] - a[1] for a, b in zip(steps, steps[1:]) if b[0] == a[0] + 1]
    return TOKENS_PER_STEP / statistics.median(times)


def test_balanced_steps_keep_a_slow_group_from_holding_up_the_fast_one(tmp_path):
    summary, records, steps = _run(tmp_path, "balanced", "--fl-balance-steps")
    # the plan: one step each first, then 8 steps for the fast group and what fits for the slow one
    assert records[0]["group_tokens"] == [TOKENS_PER_STEP, TOKENS_PER_STEP]
    planned = [r["group_tokens"] for r in records[1:]]
    # the slow group is 0.25 s slower per step: 3.1x the fast one's 0.12 s on an idle machine, 2x
    # when a loaded machine adds 0.13 s to both; in the fast group's 8 steps (or 9, where one more
    # raises the rate) it fits 2 to 4 (a CI run failed the former bound of 3; the plan is now shown)
    assert all(t[0] == 8 * TOKENS_PER_STEP and 2 * TOKENS_PER_STEP <= t[1] <= 4 * TOKENS_PER_STEP
               for t in planned[:-1]), planned
    # every group's steps are its records', and the tokens the summary counts are the budget's
    assert summary["group_steps"] == [len(steps[0]), len(steps[1])]
    assert summary["tokens"] == TOKENS_PER_STEP * sum(summary["group_steps"]) >= 40 * 2 * TOKENS_PER_STEP
    # the average is weighted by the tokens: the fast group's share is its tokens' share
    for r in records:
        tokens = r["group_tokens"]
        assert r["group_weights"] == pytest.approx([t / sum(tokens) for t in tokens])
    solo = _solo_rate(steps[0]) + _solo_rate(steps[1])
    balanced, balanced_whole = _planned_rate(records) / solo, summary["tokens_per_s"] / solo

    summary, records, steps = _run(tmp_path, "fixed")
    assert summary["tokens"] == 40 * 2 * TOKENS_PER_STEP and "group_tokens" not in records[0]
    solo = _solo_rate(steps[0]) + _solo_rate(steps[1])
    fixed, fixed_whole = _planned_rate(records) / solo, summary["tokens_per_s"] / solo
    print(f"federation tokens/s over the sum of solo rates, planned rounds (whole run): balanced {balanced:.3f} "
          f"({balanced_whole:.3f}), fixed H {fixed:.3f} ({fixed_whole:.3f})")
    assert balanced >= 0.9 and fixed <= 0.75, (balanced, fixed)


@pytest.mark.parametrize("flags, message", [
    (("--fl-group-intervals", "8,x"), "'x' is not one"),
    (("--fl-group-intervals", "8,4,2"), "gives 3 counts for 2 groups"),
    (("--fl-group-intervals", "8,4", "--fl-balance-steps"), "give one of them"),
    (("--fl-balance-steps", "--fl-overlap-steps", "1"), "overlap_steps=1"),
    (("--fl-balance-steps", "--fl-fragments", "2"), "fragments=2"),
    (("--fl-balance-steps", "--fl-tune"), "tune: it picks one H"),
    (("--fl-balance-steps", "--fl-topology", "ring"), "topology ring"),
    (("--fl-balance-steps", "--fl-disable-sync"), "the groups must sync"),
    (("--fl-balance-steps", "--fl-group-size", "8"), "a single federation group"),
])
def test_what_per_group_step_counts_refuse_is_named(flags, message):
    """No processes: the flags resolved for 8 ranks in 2 groups of 4."""
    from fl_megatron.config import resolve
    from fl_megatron.config.flags import parse_args

    group = [] if "--fl-group-size" in flags else ["--fl-group-size", "4"]
    with pytest.raises(ValueError) as e:
        cfg, _ = parse_args(["--ranks-per-node", "4", *group, *flags])
        resolve(cfg, 8)
    assert message in str(e.value)


def test_a_run_stopped_mid_plan_resumes_with_every_groups_losses_and_lr_bit_for_bit(tmp_path):
    """--fl-group-intervals 4,2 with adamw, nesterov and a linear decay, 2 groups of 1 rank, a
    budget of 15 federation steps: rounds of 3 (6 steps of b tokens over B = 2 b), group 0's step j
    of round k at 3k + 3j/4 on the learning-rate schedule, group 1's at 3k + 3j/2. The first run
    saves every 3 and stops at the sync of federation step 6 (--exit-interval 5 falls at the first
    sync past it); the resumed run goes on from each group's own step (8 and 4) with the
    uninterrupted run's per-group losses and learning rates, bit for bit, and the same federation
    records."""
    import subprocess
    import sys

    cache, ckpt = tmp_path / "cache", str(tmp_path / "ckpt")
    flags = ("--train-iters", "15", "--fl-group-size", "1", "--fl-group-intervals", "4,2", "--optimizer", "adamw",
             "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "linear", "--fl-outer-optimizer", "nesterov",
             "--eval-iters", "0")
    runs = {"whole": (), "first": ("--exit-interval", "5", "--save", ckpt, "--save-interval", "3"),
            "rest": ("--save", ckpt, "--load", ckpt)}
    for name, extra in runs.items():
        proc = launch(2, tmp_path / name, cache, *flags, *extra, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    def records(name: str, group: int) -> dict:
        lines = (tmp_path / name / "groups" / f"group_{group:05d}.jsonl").read_text().splitlines()
        return {r["step"]: (r["loss"], r["lr"]) for r in map(json.loads, lines)}

    from fl_megatron.config import TrainingConfig
    from fl_megatron.training.lr_schedule import learning_rate
    schedule = TrainingConfig(train_iters=15, lr=1e-3, min_lr=1e-4, lr_decay_style="linear")
    lr = {g: {s: v[1] for s, v in records("whole", g).items()} for g in range(2)}
    assert json.loads((tmp_path / "whole" / "summary.json").read_text())["group_steps"] == [20, 10]
    assert [lr[0][s] for s in (1, 4, 5, 20)] == [learning_rate(p, schedule) for p in (0, 2.25, 3, 14.25)]
    assert [lr[1][s] for s in (1, 2, 3, 10)] == [learning_rate(p, schedule) for p in (0, 1.5, 3, 13.5)]
    meta = json.loads((tmp_path / "ckpt" / "iter_0000006" / "metadata.json").read_text())
    assert meta["federation"]["rounds"]["group_steps"] == [8, 4] and meta["iteration"] == 6
    for group, (stopped_at, last) in enumerate(((8, 20), (4, 10))):
        whole, first, rest = records("whole", group), records("first", group), records("rest", group)
        assert sorted(whole) == list(range(1, last + 1)) and max(first) == stopped_at
        assert sorted(rest) == list(range(stopped_at + 1, last + 1))  # on from the group's own step
        assert all(rest[s] == whole[s] for s in rest) and all(first[s] == whole[s] for s in first), group
    feds = {name: [(r["step"], r["loss"], r["group_tokens"]) for r in federation_records(tmp_path / name)]
            for name in ("whole", "rest")}
    assert [s for s, _, _ in feds["whole"]] == [3, 6, 9, 12, 15] and feds["rest"] == feds["whole"][2:]
    # a run without per-group counts refuses the checkpoint, naming why, before it trains
    proc = launch(2, tmp_path / "plain", cache, *flags[:4], "--load", ckpt, timeout=300)
    assert proc.returncode != 0 and "trained with per-group step counts" in proc.stdout + proc.stderr
    export = subprocess.run([sys.executable, "tools/convert_checkpoint_to_hf.py", "--checkpoint", ckpt, "--output",
                             str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert export.returncode == 0 and (tmp_path / "hf" / "config.json").exists(), export.stderr[-2000:]


def test_an_equal_plan_trains_exactly_as_one_h_for_all(tmp_path):
    """--fl-group-intervals 4,4 runs the rounds' code path (its clock, its vote fields, its lr
    positions) and must train exactly as --fl-sync-interval 4 does: the same losses and learning
    rates in every group's records, bit for bit, over a warm-up and a cosine decay, with the last
    round cut to the 2 steps left."""
    flags = ("--train-iters", "10", "--fl-group-size", "1", "--fl-sync-interval", "4", "--optimizer", "adamw",
             "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
             "--eval-iters", "0")
    for name, extra in (("plain", ()), ("plan", ("--fl-group-intervals", "4,4"))):
        proc = launch(2, tmp_path / name, tmp_path / "cache", *flags, *extra, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for g in range(2):
        runs = [[(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in map(json.loads, (
            tmp_path / name / "groups" / f"group_{g:05d}.jsonl").read_text().splitlines())] for name in ("plain", "plan")]
        assert runs[0] == runs[1] and len(runs[0]) == 10 and len({lr for _, _, lr, _ in runs[0]}) > 5
    feds = [[(r["step"], r["loss"], r["group_losses"]) for r in federation_records(tmp_path / name)]
            for name in ("plain", "plan")]
    assert feds[0] == feds[1] and [s for s, _, _ in feds[0]] == [4, 8, 10]


def _weighted_job(rank, world, tmp, cache):
    """Groups of 2 and 1 ranks (FSDP2, atoms): each alone for 4 and 2 steps, then federated with
    --fl-group-intervals 4,2 (one round, the last), then the same with group 1 sick at its sync."""
    import os

    from fl_test_utils import make_trainer, tiny_config

    def config(name, steps, sync_interval, intervals=""):
        cfg = tiny_config(f"{tmp}/{name}", cache, group_size=None, sync_interval=sync_interval, steps=steps)
        cfg.federation.group_sizes, cfg.federation.group_intervals = "2,1", intervals
        cfg.parallel.ranks_per_node = 3
        return cfg

    def trained(cfg):
        trainer = make_trainer(cfg)
        trainer.train()
        state = {k: v.tolist() for k, v in trainer.backend.full_state_dict().items()}
        steps = trainer.rounds.own_steps if trainer.rounds else None
        trainer.close()
        return trainer.group, state, steps

    out = {"alone_4": trained(config("alone4", 4, 0)), "alone_2": trained(config("alone2", 2, 0))}
    # B = 2 + 1 rank-steps; the round trains 4 x 2 + 2 x 1 = 10 of them: --train-iters 3 (9) is one round
    out["fed"] = trained(config("fed", 3, 4, "4,2"))
    os.environ["FL_MEGATRON_FAULT"] = "nan-shard:1@2"
    out["sick"] = trained(config("sick", 3, 4, "4,2"))
    del os.environ["FL_MEGATRON_FAULT"]
    return out


def test_the_sync_is_the_token_weighted_mean_of_the_groups_alone_bit_for_bit(tmp_path):
    """Groups of 2 and 1 ranks trained 4 and 2 steps: 8 and 2 rank-steps of tokens, weights 1.6 and
    0.4 (their tokens over the mean). After the sync every rank holds (1.6 a + 0.4 b) / 2 of the
    groups' states trained alone, bit for bit in fp32 (the weight applied, the sum, the halving, as
    the reference does them); a group sick at the sync is left out and every rank takes the other's."""
    import torch

    from fl_megatron.local_ranks import run_ranks

    results = run_ranks(3, _weighted_job, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    a = {k: torch.tensor(v) for k, v in next(r["alone_4"][1] for r in results if r["alone_4"][0] == 0).items()}
    b = {k: torch.tensor(v) for k, v in next(r["alone_2"][1] for r in results if r["alone_2"][0] == 1).items()}
    for r in results:
        group, state, steps = r["fed"]
        assert steps == (4, 2)[group]
        for k, v in state.items():
            assert torch.equal(torch.tensor(v), (a[k] * 1.6 + b[k] * 0.4) / 2), k
        assert not all(torch.equal(torch.tensor(v), (a[k] + b[k]) / 2) for k, v in state.items())  # not the plain mean
        assert r["sick"][1] == {k: v.tolist() for k, v in a.items()}
