"""The failure comparison's plan and counting (tools/cluster_bench/failures.py) against values
worked out by hand from their definitions, and bench_cluster's checks of its flags. No processes."""

import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_cluster  # noqa: E402
from cluster_bench.failures import (HEAL_SLACK_S, SETUPS, default_kill, federated_count, heal_expectation,  # noqa: E402
                                    last_sync_before, markdown, one_world_count, plan_problems, ratio_checks,
                                    table_rows)


def test_last_sync_before_a_kill_in_the_forward_backward():
    # H = 4: steps 4, 8, ... sync at their end; a kill inside step s keeps the syncs of steps < s
    assert [last_sync_before(s, 4) for s in (1, 4, 5, 6, 8, 9)] == [0, 0, 4, 4, 4, 8]
    assert last_sync_before(7, 1) == 6


def test_default_kill_is_mid_second_interval_rank_1_of_group_1():
    assert default_kill(2, 4) == (6, 3)     # 4 + 4 // 2; group 1 starts at rank 2, its rank 1
    assert default_kill(4, 8) == (12, 5)
    assert default_kill(1, 4) == (6, 1)     # one rank per group: rank 0 of group 1
    assert default_kill(2, 1) == (2, 3)     # H = 1: at least one step into the interval


def test_plan_problems_name_each_bad_setting():
    assert plan_problems(3, 2, 16, 4, 6, 3) == []
    assert plan_problems(3, 2, 16, 4, 12, 5) == []      # the last allowed step and rank
    assert plan_problems(3, 2, 16, 4, 5, 0) == []       # the first allowed step
    [one] = plan_problems(1, 2, 16, 4, 6, 1)
    assert "at least 2 nodes" in one
    [steps] = plan_problems(3, 2, 18, 4, 6, 3)
    assert "--steps 18" in steps and "--sync-interval 4" in steps
    for kill_step in (4, 13):
        [kill] = plan_problems(3, 2, 16, 4, kill_step, 3)
        assert f"--kill-step {kill_step} must lie in (4, 12]" in kill
    [rank] = plan_problems(3, 2, 16, 4, 6, 6)
    assert "--kill-rank 6" in rank and "6 ranks" in rank
    assert len(plan_problems(1, 1, 10, 4, 2, 1)) == 4


def test_one_world_counts_every_step_once_and_the_redone_ones():
    assert one_world_count(16, 100, None, None) == {"tokens": 1600, "group_steps_lost": 0, "steps_redone": 0,
                                                    "steps_trained": 16}
    # checkpoint of step 4, killed in step 6: step 5 trained twice
    assert one_world_count(16, 100, 4, 6) == {"tokens": 1600, "group_steps_lost": 0, "steps_redone": 1,
                                              "steps_trained": 17}
    assert one_world_count(16, 100, 4, 8)["steps_redone"] == 3
    assert one_world_count(16, 100, 4, 5)["steps_redone"] == 0


def test_federated_count_leaves_out_the_outage():
    assert federated_count(16, 3, 300, {}) == {"tokens": 4800, "group_steps_lost": 0, "lost_by_group": {},
                                               "steps_redone": 0, "group_steps_trained": 48}
    # group 1's last sync step 4, healed at step 8: 4 group-steps of 100 tokens lost
    count = federated_count(16, 3, 300, {1: (4, 8)})
    assert (count["tokens"], count["group_steps_lost"], count["lost_by_group"], count["group_steps_trained"]) == \
        (4400, 4, {1: 4}, 44)
    never = federated_count(16, 3, 300, {1: (4, None)})    # never came back: steps 5 ... 16 lost
    assert (never["tokens"], never["group_steps_lost"]) == (3600, 12)
    with pytest.raises(ValueError, match="healed before its last sync"):
        federated_count(16, 3, 300, {1: (8, 4)})


def test_heal_expectation_holds_only_for_one_timely_heal_with_whole_live_groups():
    ok, text = heal_expectation(6, 4, 8, heal_s=1.0, interval_s=2.0, live_groups_whole=True, heals=1)
    assert ok
    # last sync 4; step 5 trained and lost, steps 6 ... 8 missed until the heal at step 8
    assert "lost 4 group-steps = 1 trained since its last sync (step 4) + 3 while" in text
    assert "heal at step 8" in text and "1 heal(s)" in text
    assert heal_expectation(6, 4, 8, 2.0 + HEAL_SLACK_S, 2.0, True, 1)[0]     # the slack's edge
    assert not heal_expectation(6, 4, 8, 2.01 + HEAL_SLACK_S, 2.0, True, 1)[0]
    assert not heal_expectation(6, 4, 8, 1.0, 2.0, True, 2)[0]
    assert not heal_expectation(6, 4, 8, 1.0, None, True, 1)[0]
    assert not heal_expectation(6, 4, 8, None, 2.0, True, 1)[0]
    ok, text = heal_expectation(6, 4, 8, 1.0, 2.0, False, 1)
    assert not ok and "did NOT train every step" in text
    ok, text = heal_expectation(6, 4, None, None, None, True, 0)
    assert not ok and "never healed" in text and "step 4" in text
    # with 2 fragments the records show a sync of one fragment at step 5, the last the group took part in:
    # the text counts from there, as the table's lost group-steps do
    ok, text = heal_expectation(6, 4, 12, 1.0, 2.0, True, 1, last_sync=5)
    assert ok and "lost 7 group-steps = 0 trained since its last sync (step 5) + 7 while" in text


def _result(setup, faulted, wall_s, goodput):
    return {"setup": setup, "faulted": faulted, "wall_s": wall_s, "tokens": int(wall_s * goodput),
            "goodput": goodput, "eval_loss": 5.0}


def test_table_rows_ratios_to_the_same_setups_fault_free_run():
    rows = table_rows([_result("one-world", False, 10.0, 100.0), _result("one-world", True, 12.5, 80.0),
                       _result("torchft", True, 20.0, 30.0), _result("elastic", False, 8.0, 50.0),
                       _result("elastic", True, 10.0, 40.0)])
    ratios = [(r["setup"], r["run"], r["wall_ratio"], r["goodput_ratio"]) for r in rows]
    assert ratios == [("one-world", "fault-free", 1.0, 1.0), ("one-world", "kill", 1.25, 0.8),
                      ("torchft", "kill", None, None), ("elastic", "fault-free", 1.0, 1.0),
                      ("elastic", "kill", 1.25, 0.8)]
    table = markdown(rows)
    assert "| kill | 12.5 | 1.25 | 1,000 | 80 | 0.80 |" in table
    assert "| kill | 20.0 | - | 600 | 30 | - |" in table


def _parse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        bench_cluster.parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


SHAPE = ["--nodes", "3", "--ranks-per-node", "2", "--steps", "16", "--sync-interval", "4"]


def test_parse_fills_the_default_kill_and_output_folder():
    args = bench_cluster.parse(["--failure-compare", *SHAPE])
    assert (args.kill_step, args.kill_rank, args.out) == (6, 3, "runs/bench-cluster-failures")
    assert bench_cluster.failure_comparison(args).setups == SETUPS
    assert bench_cluster.parse(SHAPE).out == "runs/bench-cluster"


def test_rows_pick_the_failure_setups_in_their_own_order():
    args = bench_cluster.parse(["--failure-compare", *SHAPE, "--rows", "torchft", "elastic-best", "one-world"])
    assert bench_cluster.failure_comparison(args).setups == ("one-world", "elastic-best", "torchft")


@pytest.mark.parametrize("kill_step", ["4", "13"])
def test_parse_rejects_a_kill_step_outside_the_run(capsys, kill_step):
    err = _parse_error(capsys, ["--failure-compare", *SHAPE, "--kill-step", kill_step])
    assert f"--kill-step {kill_step} must lie in (4, 12]" in err


def test_parse_rejects_failure_flags_without_failure_compare_and_rows_that_are_not_setups(capsys):
    assert "go with --failure-compare" in _parse_error(capsys, [*SHAPE, "--kill-step", "6"])
    assert "go with --failure-compare" in _parse_error(capsys, [*SHAPE, "--relaunch-delay", "5"])
    assert "--rows fsdp: not a setup of --failure-compare" in _parse_error(capsys, ["--failure-compare", *SHAPE,
                                                                                    "--rows", "fsdp"])
    assert "--kill-rank 6" in _parse_error(capsys, ["--failure-compare", *SHAPE, "--kill-rank", "6"])


def test_stranded_watch_names_groups_left_without_a_quorum_after_the_grace():
    from peers.torchft_launch import StrandedWatch
    watch = StrandedWatch(2, grace_s=60.0)
    assert watch.check([None, None, None], 0.0) is None      # all running
    assert watch.check([0, None, None], 10.0) is None        # two left can still meet
    assert watch.check([0, None, 0], 20.0) is None           # one left: the grace starts
    assert watch.check([0, None, 0], 79.0) is None
    assert "group(s) [1] still wait for a quorum of 2 groups 60 s" in watch.check([0, None, 0], 80.0)
    assert watch.check([0, 0, 0], 200.0) is None             # all done
    assert watch.check([0, None, 0], 201.0) is None          # the grace starts anew


def test_ratio_checks_divide_the_named_runs_goodputs_against_their_goals():
    def run(setup, faulted, goodput):
        return {"setup": setup, "faulted": faulted, "goodput": goodput}
    results = [run("one-world", False, 1000.0), run("elastic", False, 980.0), run("elastic-best", False, 2000.0),
               run("elastic-best", True, 1790.0), run("torchft", True, 1400.0), run("torchft", False, 1500.0)]
    checks = {(c["setup"], c["bound"]): c for c in ratio_checks(results)}
    kept, over, fp32 = checks[("elastic-best", 0.9)], checks[("elastic-best", 1.3)], checks[("elastic-fp32", 0.97)]
    assert kept["ratio"] == pytest.approx(0.895) and not kept["ok"]       # 1790 / 2000
    assert over["ratio"] == pytest.approx(1790 / 1400) and not over["ok"]  # 1.279
    assert fp32["ratio"] == pytest.approx(0.98) and fp32["ok"]
    results[3]["goodput"] = 1820.0
    assert all(c["ok"] for c in ratio_checks(results))                    # 0.91 and 1.3
    # a setup that was not run gives no check
    assert [c["setup"] for c in ratio_checks(results[:2])] == ["elastic-fp32"]
