#!/usr/bin/env python3
"""Break the sync path one thing at a time and check that a test of `make test` fails.

Each mutation replaces one piece of code (it must occur exactly once) in a throwaway copy of the
tree, runs the tests named for it there (one pytest command, stopping at the first failure) and
reports which test failed and how long that took. A mutation no test catches is a hole in the
tests: the tool exits 1 then. tests/test_mutation_check.py keeps every mutation's code findable.

  python tools/mutation_check.py                     # every mutation (about 3 minutes on 2 cores)
  python tools/mutation_check.py --every-test        # each named test on its own (about 12 minutes)
  python tools/mutation_check.py --only restore      # the mutations whose name contains "restore"
  python tools/mutation_check.py --list              # what each one breaks, and its tests
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str        # what the broken code does
    path: str        # the file, from the repository's root
    old: str         # the code replaced (exactly once in the file)
    new: str
    tests: tuple     # pytest node ids expected to catch it (run in this order, -x)


MUTATIONS = (
    Mutation("average-skipped", "the exact fp32 average sends nothing: every group keeps its own shards",
             "fl_megatron/federation/averaging.py",
             "work = peers.call(dist.all_reduce, region, op=dist.ReduceOp.AVG, group=peers.group, async_op=True)",
             "work = None",
             ("tests/test_engine_fake_backend.py::test_two_groups_end_each_sync_with_the_mean_of_their_shards",
              "tests/test_federation_exactness.py::test_fl_fsdp_equals_fsdp_and_syncs_are_exact")),
    Mutation("wrong-divisor-left-out", "a sync that leaves a sick group out divides by every group, not the senders",
             "fl_megatron/federation/averaging.py", "item.region.div_(item.divisor)",
             "item.region.div_(peers.size)",
             ("tests/test_outer_sync.py::test_a_sick_group_is_left_out_and_reset_to_the_others_average",)),
    Mutation("wrong-divisor-compressed", "the int8/int4/bf16 mean divides by one more than the senders",
             "fl_megatron/federation/compression.py", "mean = torch.stack(pieces).sum(dim=0).div_(contributors)",
             "mean = torch.stack(pieces).sum(dim=0).div_(contributors + 1)",
             ("tests/test_outer_sync.py::test_outer_optimizers_and_compressed_sync",
              "tests/test_outer_sync.py::test_error_feedback_keeps_the_sum_of_what_was_sent_on_track")),
    Mutation("wrong-fragment", "a scheduled sync moves the fragment after the one due",
             "fl_megatron/federation/engine.py",
             "else (self._due_fragment(step),)",
             "else ((self._due_fragment(step) + 1) % self.state.fragments,)",
             ("tests/test_mode_switch.py",
              "tests/test_fragments.py::test_fragments_sync_in_turn_exactly_and_reset_a_sick_group_whole")),
    Mutation("residuals-never-kept", "error feedback keeps no residual: nothing of an encoding's loss is sent again",
             "fl_megatron/federation/averaging.py",
             "            if self.error_feedback:\n                residual = self.residuals.setdefault(index, "
             "torch.zeros_like(region))", "            if self.error_feedback:\n                residual = None",
             ("tests/test_transaction.py", "tests/test_outer_sync.py::test_every_sync_option_on_every_backend")),
    Mutation("sparse-residual-not-decayed", "the sparse sync adds its residual undecayed (--fl-error-feedback-decay "
             "ignored)", "fl_megatron/federation/sparse.py", "residual.mul_(decay).add_(region)",
             "residual.add_(region)",
             ("tests/test_sparse_sync.py::test_a_sparse_sync_moves_the_decoded_top_k_and_keeps_the_rest_decayed",)),
    Mutation("residuals-never-added", "the residual is kept but never added to the next encoding",
             "fl_megatron/federation/compression.py", "            padded[:n].add_(residual, alpha=decay)\n",
             "            pass\n",
             ("tests/test_outer_sync.py::test_error_feedback_keeps_the_sum_of_what_was_sent_on_track",)),
    Mutation("inner-state-average-skipped", "--fl-inner-state average leaves every group's moments as they were",
             "fl_megatron/federation/inner_state.py",
             "        for averager, moments in parts:\n"
             "            moved = averager.average(moments, senders.include, senders.contributors, peers=peers)\n"
             "            stats.inter_group_bytes += moved.inter_group_bytes\n"
             "            stats.intra_group_bytes += moved.intra_group_bytes\n",
             "        pass\n",
             ("tests/test_outer_sync.py::test_inner_state_policies_average_or_reset_the_moments",
              "tests/test_outer_sync.py::test_every_sync_option_on_every_backend")),
    Mutation("rollback-restore-removed", "a sync voted down keeps whatever its partial exchange left",
             "fl_megatron/federation/transaction.py",
             "        if not self.groups.commit():\n            self.restore()\n",
             "        if not self.groups.commit():\n            pass\n",
             ("tests/test_transaction.py", "tests/test_elastic_training.py::"
              "test_a_peer_lost_in_the_middle_of_a_sync_leaves_the_survivors_consistent[fl-fsdp-int8-ef-nesterov]")),
    Mutation("rollback-keeps-inner-state", "a sync voted down keeps the inner moments it averaged or reset",
             "fl_megatron/federation/transaction.py",
             "        if self.inner is not None:\n            self.backend.load_optimizer_transfer_state(self.inner)\n",
             "",
             ("tests/test_transaction.py::test_a_voted_down_sync_leaves_everything_it_touched_as_before",)),
    Mutation("overlapped-rollback-loses-progress", "a voted-down overlapped landing keeps the merge, not the shards "
             "trained since its launch", "fl_megatron/federation/landing.py",
             "        stats = self.overlapper.result(flight.future, flight.averaged)\n        before_merge()\n",
             "        stats = self.overlapper.result(flight.future, flight.averaged)\n",
             ("tests/test_transaction.py::test_a_voted_down_overlapped_sync_keeps_the_steps_trained_since_its_launch",)),
    Mutation("rollback-keeps-new-outer-state", "a first sync voted down keeps the outer momentum it made",
             "fl_megatron/federation/outer.py",
             "            else:  # saved before any outer step: none since (a voted-down first sync made some)\n"
             "                self.optimizer.state.pop(anchor, None)\n",
             "",
             ("tests/test_transaction.py::test_a_voted_down_sync_leaves_everything_it_touched_as_before",)),
    Mutation("split-commit-never-healed", "torchft's step is the training step only: a group that voted down a sync "
             "the others kept is never healed", "fl_megatron/elastic/peer_tier.py",
             "        self._position = position or training_step\n", "        self._position = training_step\n",
             ("tests/test_elastic_training.py::test_a_split_commit_is_repaired_at_the_next_meeting",)),
    Mutation("healed-group-misses-the-stop", "a group that healed at a sync reads the stop only from a vote at its "
             "new step", "fl_megatron/training/trainer.py",
             "(vote.step == done or (sync is not None and vote.step == sync.step))", "vote.step == done",
             ("tests/test_healed_stop.py",)),
    Mutation("peer-deadline-ignored", "a cross-group call that outlives the bound is taken as it returned",
             "fl_megatron/federation/failed_collective.py",
             "        return None if self.error is not None else result\n", "        return result\n",
             ("tests/test_peer_deadline.py",)),
    Mutation("heal-optimizer-transfer-noop", "a healing group takes the shards but not the inner optimizer state",
             "fl_megatron/elastic/healing.py",
             "        self.backend.load_optimizer_transfer_state(state[\"optimizer\"])\n", "",
             ("tests/test_elastic_training.py::test_a_group_killed_between_syncs_heals_from_the_live_ones[fedavg]",)),
    Mutation("recut-noop", "a switch of fragments starts the outer optimizer afresh instead of re-cutting its state",
             "fl_megatron/federation/mode_switch.py",
             "    if not old or not new or old[0].kind != new[0].kind:\n        return\n",
             "    return\n",
             ("tests/test_mode_switch.py",)),
    Mutation("landing-drops-the-sync", "an overlapped sync lands without merging the average: each group goes on alone",
             "fl_megatron/federation/landing.py",
             "        for shard, new in zip(shards, flight.averaged):\n            if include:\n"
             "                shard.add_(new)\n            else:\n                shard.copy_(new)\n",
             "        for shard, own, anchor in zip(shards, flight.own, outer.anchors):\n"
             "            shard.sub_(own).add_(anchor)\n",
             ("tests/test_outer_sync.py::test_overlapped_sync_lands_k_steps_later_keeping_each_groups_progress",)),
)


def apply(tree: Path, mutation: Mutation) -> None:
    """Write `mutation` into the copy `tree`; the code it replaces must occur exactly once."""
    path = tree / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise ValueError(f"{mutation.name}: its code occurs {count} times in {mutation.path}, not once")
    path.write_text(text.replace(mutation.old, mutation.new))


def _pytest(tree: Path, tests: tuple, python: str, timeout: float) -> tuple[list, float, str]:
    """(the failing tests, seconds, the output's end when none failed) of one pytest run, -x."""
    began = time.perf_counter()
    try:
        done = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                               "-m", "not heavy", *tests], cwd=tree, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)})
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        output, code = str(e.stdout or "") + f"\ntimed out after {timeout:.0f} s", -1
    failed = re.findall(r"^FAILED (\S+)", output, re.M) if code != 0 else []
    return failed, time.perf_counter() - began, "" if failed else output[-1500:]


def run(tree: Path, mutation: Mutation, python: str, timeout: float, every_test: bool = False) -> dict:
    """Apply `mutation` to `tree`, run its tests (-x: up to the first that fails; `every_test`:
    each on its own), undo it. The failing tests, and how long the first one's run took."""
    original = (tree / mutation.path).read_text()
    apply(tree, mutation)
    try:
        runs = [_pytest(tree, (test,), python, timeout) for test in mutation.tests] if every_test else \
            [_pytest(tree, mutation.tests, python, timeout)]
    finally:
        (tree / mutation.path).write_text(original)
    failed = [f for found, _, _ in runs for f in found[:1]]
    first = next((r for r in runs if r[0]), runs[0])
    return {"mutation": mutation.name, "caught": bool(failed), "failed": failed, "seconds": round(first[1], 1),
            "missed_by": [t for t, r in zip(mutation.tests, runs) if not r[0]] if every_test else [],
            "tail": "" if failed else runs[-1][2]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run the mutations whose name contains this")
    p.add_argument("--list", action="store_true", help="list the mutations and their tests; run nothing")
    p.add_argument("--python", default=sys.executable, help="the python that runs pytest (default: this one)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per mutation's tests")
    p.add_argument("--every-test", action="store_true",
                   help="run each test a mutation names on its own (not up to the first that fails)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or args.only in m.name]
    if not chosen:
        p.error(f"--only {args.only!r} matches none of: {', '.join(m.name for m in MUTATIONS)}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n  {m.path}\n  " + "\n  ".join(m.tests))
        return 0
    with tempfile.TemporaryDirectory(prefix="fl-mutations-") as scratch:
        tree = Path(scratch) / "tree"
        shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__", ".gpu-carry",
                                                                  "*.egg-info", ".pytest_cache", ".hypothesis"))
        results = []
        for m in chosen:
            print(f"mutation {m.name}: {m.what} ...", flush=True)
            r = run(tree, m, args.python, args.timeout, args.every_test)
            results.append(r)
            verdict = f"caught by {', '.join(r['failed'])}" if r["caught"] else "NOT CAUGHT"
            print(f"  {verdict} in {r['seconds']:.0f} s" + "".join(f"\n  not caught by {t}" for t in r["missed_by"])
                  + (f"\n{r['tail']}" if not r["caught"] else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    missed = [r["mutation"] for r in results if not r["caught"]]
    print(f"{len(results) - len(missed)} of {len(results)} mutations caught" + (f"; missed: {', '.join(missed)}"
                                                                                if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
