"""The elastic SLURM recipes (examples/slurm/elastic/): submit.sh submits a torchft lighthouse job and
one job per federation group, against a fake sbatch; group.sbatch runs srun (fake) with the
arguments its dry run checked and restarts a failed step; lighthouse.sbatch runs the real
torchft_lighthouse and publishes its address. FL_DRY_RUN=1 submits nothing, prints every job's
command and plans one group with pretrain --dry-run --world-size GROUP_SIZE (all such dry runs in
one Python process, as in test_examples.py). Bad input fails before anything is submitted."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from examples_helpers import (EXAMPLES, ROOT, batch_dry_runs, check_plan, clean_env, make_fakes, pretrain_args, run,
                              shown_command)
from fl_megatron.launching.ports import free_port

ELASTIC = EXAMPLES / "slurm" / "elastic"
SUBMIT, GROUP, LIGHTHOUSE = ELASTIC / "submit.sh", ELASTIC / "group.sbatch", ELASTIC / "lighthouse.sbatch"
# layout -> (groups, group size, nodes per group, default min groups) on 128 nodes x 4 GPUs
LAYOUTS = {"fl-hsdp": (16, 32, 8, 12), "fl-fsdp": (128, 4, 1, 96)}
PREFIX = "fl-megatron launch: "

FAKE_SBATCH = """#!/bin/bash
n=$(( $(cat "$FAKE_LOG.n" 2>/dev/null || echo 0) + 1 ))
echo "$n" >"$FAKE_LOG.n"
{ echo call; printf 'arg %s\\n' "$@"; env | grep '^FL_' | sed 's/^/env /'; } >>"$FAKE_LOG.sbatch"
echo "$((1000 + n))"
"""
# srun: records each call; its exit code is the n-th word of FAKE_SRUN_CODES (0 when there is none)
FAKE_SRUN = """#!/bin/bash
n=$(( $(cat "$FAKE_LOG.srun.n" 2>/dev/null || echo 0) + 1 ))
echo "$n" >"$FAKE_LOG.srun.n"
{ echo call; echo "port $MASTER_PORT"; echo "env MASTER_ADDR=$MASTER_ADDR"; printf 'arg %s\\n' "$@"; } >>"$FAKE_LOG.srun"
codes=(${FAKE_SRUN_CODES:-0})
exit "${codes[n - 1]:-0}"
"""


@pytest.fixture
def fakes(tmp_path):
    """PATH with fake sbatch, srun and scontrol; the stem of their logs."""
    env, log = make_fakes(tmp_path)
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN)):
        (tmp_path / "bin" / name).write_text(text)
        (tmp_path / "bin" / name).chmod(0o755)
    return env, log


def calls(path: Path) -> list:
    """[(args, {recorded variable: value}, [MASTER_PORT]), ...]: each recorded call."""
    if not path.exists():
        return []
    out = []
    for block in path.read_text().split("call\n")[1:]:
        lines = block.splitlines()
        out.append(([line[4:] for line in lines if line.startswith("arg ")],
                    dict(line[4:].split("=", 1) for line in lines if line.startswith("env ")),
                    [line[5:] for line in lines if line.startswith("port ")]))
    return out


def printed(stderr: str) -> list:
    """Every command line the script printed."""
    return [shlex.split(line[len(PREFIX):]) for line in stderr.splitlines()
            if line.startswith(PREFIX) and not line[len(PREFIX):].startswith(("error", "elastic", "the ", "submitted"))]


def env_of(command: list) -> tuple[dict, list]:
    """`env A=1 B=2 sbatch ...` -> ({A: 1, B: 2}, [sbatch, ...])."""
    assert command[0] == "env", command
    i = next(i for i, word in enumerate(command[1:], 1) if "=" not in word)
    return dict(word.split("=", 1) for word in command[1:i]), command[i:]


def option(args: list, name: str):
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")), None)


def recipe_run_dir(layout: str) -> Path:
    return ROOT / json.loads((EXAMPLES / "llama3.1-8b" / "fsdp2" / f"{layout}-128x4.json").read_text())["training"]["run_dir"]


# --- dry runs: nothing submitted, every job's command printed, one group planned ------------------

DRY = {"fl-hsdp": dict(FL_MIN_GROUPS="10", FL_JOIN_TIMEOUT_MS="90000", FL_HEARTBEAT_TIMEOUT_MS="3000"),
       "fl-fsdp": {}}  # fl-fsdp: the defaults


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> dict:
    """layout -> (the script's run with PYTHON=true, the dry run of the group it planned)."""
    procs = {}
    for layout in LAYOUTS:
        tmp = tmp_path_factory.mktemp(layout)
        env, log = make_fakes(tmp)
        (tmp / "bin" / "sbatch").write_text(FAKE_SBATCH)
        (tmp / "bin" / "sbatch").chmod(0o755)
        procs[layout] = run((SUBMIT, layout, "--train-iters", "16"), tmp, FL_DRY_RUN="1", PYTHON="true",
                            **env, **DRY[layout])
        assert procs[layout].returncode == 0, procs[layout].stderr
        assert not log.with_suffix(".sbatch").exists(), "a dry run submitted a job"
    args = [pretrain_args(shown_command(procs[layout].stderr)) for layout in LAYOUTS]
    return {layout: (procs[layout], result) for layout, result in zip(LAYOUTS, batch_dry_runs(args))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dry_run_prints_the_lighthouse_and_one_job_per_group(layout, dry):
    groups, size, nodes, default_min = LAYOUTS[layout]
    min_groups = int(DRY[layout].get("FL_MIN_GROUPS", default_min))
    proc, _ = dry[layout]
    commands = printed(proc.stderr)
    launch_dir = recipe_run_dir(layout) / "launch"
    assert f"a sync needs {min_groups} live groups; logs in {launch_dir}" in proc.stderr
    # the lighthouse: its settings are the groups' minimum and the timeouts asked for
    lighthouse = next(c for c in commands if c[0] == "torchft_lighthouse")
    assert lighthouse == ["torchft_lighthouse", "--bind", "0.0.0.0:29510", "--min_replicas", str(min_groups),
                          "--join_timeout_ms", DRY[layout].get("FL_JOIN_TIMEOUT_MS", "60000"),
                          "--heartbeat_timeout_ms", DRY[layout].get("FL_HEARTBEAT_TIMEOUT_MS", "5000")]
    jobs = [env_of(c) for c in commands if c[0] == "env"]
    (lh_env, lh_cmd), group_jobs = jobs[0], jobs[1:]
    assert lh_cmd[0] == "sbatch" and lh_cmd[-1] == str(LIGHTHOUSE)
    assert lh_env["FL_MIN_GROUPS"] == str(min_groups)
    assert lh_env["FL_LIGHTHOUSE_FILE"] == str(launch_dir / "lighthouse.addr")
    assert lh_env["FL_JOIN_TIMEOUT_MS"] == lighthouse[6] and lh_env["FL_HEARTBEAT_TIMEOUT_MS"] == lighthouse[8]
    # one job per group, each with its own slot, its shape, after the lighthouse
    assert len(group_jobs) == groups
    assert [e["FL_GROUP_ID"] for e, _ in group_jobs] == [str(g) for g in range(groups)]
    for env, cmd in group_jobs:
        assert env["FL_MIN_GROUPS"] == str(min_groups) and env["FL_CLUSTER"] == "128x4"
        assert env["FL_LIGHTHOUSE_FILE"] == lh_env["FL_LIGHTHOUSE_FILE"] and env["FL_MEGATRON_ROOT"] == str(ROOT)
        assert (option(cmd, "nodes"), option(cmd, "ntasks-per-node"), option(cmd, "gpus-per-node")) == \
            (str(nodes), "4", "4")
        assert option(cmd, "dependency") == "after:LIGHTHOUSE_JOB_ID"
        assert cmd[cmd.index(str(GROUP)) + 1:] == ["llama3.1-8b", layout, "--train-iters", "16"]
    # the group planned: group 0 of the federation, its job's world the group size
    args = pretrain_args(shown_command(proc.stderr))
    assert args[:2] == ["--config", f"examples/llama3.1-8b/fsdp2/{layout}-128x4.json"]
    assert args[2:] == ["--train-iters", "16", "--fl-elastic", "--fl-lighthouse", "LIGHTHOUSE_HOST:29510",
                        "--fl-group-id", "0", "--fl-num-groups", str(groups), "--fl-min-groups", str(min_groups),
                        "--world-size", str(size), "--dry-run"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dry_run_of_a_group_plans_the_federation_layout(layout, dry):
    _, result = dry[layout]
    assert result["returncode"] == 0, result["stderr"]
    check_plan(result["stdout"], "fsdp2", "llama3.1-8b", layout, "128x4")  # e.g. "16 federation groups of 32"


def test_dry_run_on_the_other_cluster_and_model(fakes, tmp_path):
    """FL_CLUSTER=64x8 with GPT-3 6.7B: 64 groups of one 8-GPU node."""
    env, log = fakes
    proc = run((SUBMIT, "gpt3-6.7b", "fl-fsdp"), tmp_path, FL_DRY_RUN="1", PYTHON="true", FL_CLUSTER="64x8", **env)
    assert proc.returncode == 0, proc.stderr
    jobs = [env_of(c) for c in printed(proc.stderr) if c[0] == "env"][1:]
    assert [e["FL_GROUP_ID"] for e, _ in jobs] == [str(g) for g in range(64)]
    assert all(e["FL_CLUSTER"] == "64x8" and option(c, "nodes") == "1" and option(c, "ntasks-per-node") == "8"
               for e, c in jobs)
    args = pretrain_args(shown_command(proc.stderr))
    assert args[-5:] == ["--fl-min-groups", "48", "--world-size", "8", "--dry-run"]
    [result] = batch_dry_runs([args])
    assert result["returncode"] == 0, result["stderr"]
    check_plan(result["stdout"], "fsdp2", "gpt3-6.7b", "fl-fsdp", "64x8")
    assert not log.with_suffix(".sbatch").exists()


def test_submit_runs_the_dry_run_itself(dry, tmp_path):
    """As a user runs it: Python started by the script prints what the batch printed."""
    proc = run((SUBMIT, "fl-fsdp", "--train-iters", "16"), tmp_path, FL_DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == dry["fl-fsdp"][1]["stdout"]
    assert "128 federation groups of 4 (FSDP: 4 shards)" in proc.stdout


# --- the real paths, against fake sbatch / srun and the real lighthouse ----------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_submit_submits_the_lighthouse_then_every_group(layout, fakes, tmp_path):
    env, log = fakes
    groups, _, nodes, min_groups = LAYOUTS[layout]
    run_dir = tmp_path / "run"
    proc = run((SUBMIT, layout, "--run-dir", run_dir, "--fl-quorum-timeout-minutes", "20"), tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    submitted = calls(log.with_suffix(".sbatch"))
    assert len(submitted) == groups + 1
    (lh_args, lh_env, _), group_jobs = submitted[0], submitted[1:]
    assert lh_args[-1] == str(LIGHTHOUSE) and "--parsable" in lh_args
    assert (lh_env["FL_MIN_GROUPS"], lh_env["FL_JOIN_TIMEOUT_MS"], lh_env["FL_HEARTBEAT_TIMEOUT_MS"]) == \
        (str(min_groups), "60000", "5000")
    address_file = run_dir / "launch" / "lighthouse.addr"
    assert lh_env["FL_LIGHTHOUSE_FILE"] == str(address_file)
    assert sorted(int(e["FL_GROUP_ID"]) for _, e, _ in group_jobs) == list(range(groups))
    for args, job_env, _ in group_jobs:
        assert option(args, "dependency") == "after:1001"  # the lighthouse job's id
        assert option(args, "nodes") == str(nodes)
        assert option(args, "output") == f"{run_dir}/launch/group_{job_env['FL_GROUP_ID']}-%j.out"
        assert job_env["FL_LIGHTHOUSE_FILE"] == str(address_file) and job_env["FL_MIN_GROUPS"] == str(min_groups)
        assert args[args.index(str(GROUP)) + 1:] == ["llama3.1-8b", layout, "--run-dir", str(run_dir),
                                                     "--fl-quorum-timeout-minutes", "20"]
    jobs = (run_dir / "launch" / "jobs").read_text().splitlines()
    assert jobs == ["lighthouse 1001"] + [f"group_{g} {1002 + g}" for g in range(groups)]


def test_submit_with_a_running_lighthouse_submits_groups_only(fakes, tmp_path):
    env, log = fakes
    proc = run((SUBMIT, "fl-hsdp", "--run-dir", tmp_path / "run"), tmp_path, **env, FL_LIGHTHOUSE="lh-node:29600")
    assert proc.returncode == 0, proc.stderr
    submitted = calls(log.with_suffix(".sbatch"))
    assert len(submitted) == 16 and all(str(GROUP) in args for args, _, _ in submitted)
    assert all(e["FL_LIGHTHOUSE"] == "lh-node:29600" and option(a, "dependency") is None for a, e, _ in submitted)


def _group_job(tmp_path, env, *, group="5", codes="", extra=(), **more):
    """group.sbatch of fl-hsdp as sbatch runs it: a copy in a spool directory, inside a SLURM job."""
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    (spool / "slurm_script").write_text(GROUP.read_text())
    address = tmp_path / "lighthouse.addr"
    address.write_text("lh-node:29510\n")
    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="8", SLURM_NTASKS_PER_NODE="4",
                 SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_SUBMIT_DIR=str(ROOT), FL_MEGATRON_ROOT=str(ROOT))
    job_env = {**env, **slurm, "FL_GROUP_ID": group, "FL_MIN_GROUPS": "12", "FL_LIGHTHOUSE_FILE": str(address),
               "FAKE_SRUN_CODES": codes, **more}
    return run(("bash", spool / "slurm_script", "fl-hsdp", *extra), tmp_path, **job_env)


def test_group_job_runs_srun_with_the_dry_run_arguments(fakes, tmp_path):
    env, log = fakes
    extra = ("--train-iters", "2", "--log-interval", "1")
    proc = _group_job(tmp_path, env, extra=extra, MASTER_ADDR="login-node")  # exported by the submitting shell
    assert proc.returncode == 0, proc.stderr
    [(args, seen, _)] = calls(log.with_suffix(".srun"))
    assert seen["MASTER_ADDR"] == "gpu-a"  # this job's first node
    assert args[:args.index("fl_megatron.pretrain")] == ["--kill-on-bad-exit=1", "--nodes=8", "--ntasks-per-node=4",
                                                         "python", "-u", "-m"]
    checked = run((GROUP, "fl-hsdp", *extra), tmp_path, FL_DRY_RUN="1", PYTHON="true", FL_GROUP_ID="5",
                  FL_MIN_GROUPS="12", FL_LIGHTHOUSE="lh-node:29510")
    assert checked.returncode == 0, checked.stderr
    assert pretrain_args(args) + ["--world-size", "32", "--dry-run"] == pretrain_args(shown_command(checked.stderr))
    assert pretrain_args(args)[-9:] == ["--fl-elastic", "--fl-lighthouse", "lh-node:29510", "--fl-group-id", "5",
                                         "--fl-num-groups", "16", "--fl-min-groups", "12"]
    assert "elastic group 5 of 16 on 8 node(s) x 4 GPUs, lighthouse lh-node:29510" in proc.stderr


@pytest.mark.parametrize("codes,max_restarts,runs,rc,says", [
    ("4 137 0", "3", 3, 0, "restart 2 of 3"),
    ("4 4 4", "1", 2, 4, "group 5 failed 2 time(s), last exit code 4"),
    ("2", "3", 1, 2, "not restarting"),
    ("3", "3", 1, 3, "every group sick"),
    ("5", "3", 1, 5, "fewer live groups than --fl-min-groups"),
], ids=["restarted", "gives-up", "config-error", "all-sick", "too-few-groups"])
def test_group_job_restarts_a_failed_step(codes, max_restarts, runs, rc, says, fakes, tmp_path):
    env, log = fakes
    proc = _group_job(tmp_path, env, codes=codes, FL_MAX_RESTARTS=max_restarts)
    assert proc.returncode == rc, proc.stderr
    assert says in proc.stderr
    steps = calls(log.with_suffix(".srun"))
    assert len(steps) == runs
    ports = [int(port[0]) for _, _, port in steps]
    assert ports == list(range(ports[0], ports[0] + runs))  # a fresh rendezvous port per step
    assert all(args == steps[0][0] for args, _, _ in steps)


def test_lighthouse_job_publishes_its_address_and_removes_it(tmp_path):
    if not (ROOT / ".venv" / "bin" / "torchft_lighthouse").exists() and not any(
            (Path(d) / "torchft_lighthouse").exists() for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("torchft_lighthouse is not installed")
    port, address = free_port(), tmp_path / "launch" / "lighthouse.addr"
    env = clean_env(FL_MIN_GROUPS="5", FL_JOIN_TIMEOUT_MS="7000", FL_HEARTBEAT_TIMEOUT_MS="900",
                    FL_LIGHTHOUSE_PORT=str(port), FL_LIGHTHOUSE_FILE=str(address), FL_LIGHTHOUSE_HOST="127.0.0.1",
                    SLURM_SUBMIT_DIR=str(ROOT))
    job = subprocess.Popen(["bash", str(LIGHTHOUSE)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not address.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert address.read_text() == f"127.0.0.1:{port}\n"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it listens
        job.send_signal(signal.SIGTERM)  # scancel
        _, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 143
    assert not address.exists()
    assert f"torchft_lighthouse --bind 0.0.0.0:{port} --min_replicas 5 --join_timeout_ms 7000 " \
           "--heartbeat_timeout_ms 900" in err


# --- bad input: a clear error, nothing submitted or started ---------------------------------------

@pytest.mark.parametrize("argv,env,says", [
    (("fl-bogus",), {}, "unknown layout 'fl-bogus'; valid layouts in elastic mode (one job per federation group): "
                        "fl-fsdp, fl-hsdp"),
    (("hsdp",), {}, "unknown layout 'hsdp'; valid layouts in elastic mode"),
    (("fl-hsdp",), {"FL_MIN_GROUPS": "17"}, "FL_MIN_GROUPS=17: the fl-hsdp layout on 128x4 has 16 groups of 32, "
                                            "so min groups must lie in 1 .. 16"),
    (("fl-fsdp",), {"FL_MIN_GROUPS": "0"}, "min groups must lie in 1 .. 128"),
    (("fl-hsdp",), {"FL_LIGHTHOUSE": "lh-node"}, "FL_LIGHTHOUSE='lh-node' is not a lighthouse address HOST:PORT"),
    (("fl-hsdp",), {"FL_JOIN_TIMEOUT_MS": "1m"}, "FL_JOIN_TIMEOUT_MS='1m' is not an integer >= 1"),
    (("fl-hsdp", "--fl-num-groups", "8"), {}, "--fl-num-groups is set by the elastic scripts, drop it"),
    (("fl-hsdp", "--world-size=32"), {}, "--world-size is set by the elastic scripts"),
    (("fl-hsdp",), {"FL_CLUSTER": "32x16"}, "unknown cluster '32x16'; valid clusters: 128x4, 64x8"),
], ids=["unknown-layout", "one-world-layout", "min-above-groups", "min-zero", "bad-lighthouse", "bad-timeout",
        "launcher-flag", "world-size", "cluster"])
def test_submit_refuses_bad_input_before_submitting(argv, env, says, fakes, tmp_path):
    fake_env, log = fakes
    proc = run((SUBMIT, *argv, "--run-dir", tmp_path / "run"), tmp_path, **fake_env, **env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"{PREFIX}error: ") and says in proc.stderr
    assert not log.with_suffix(".sbatch").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("env,says", [
    ({"FL_LIGHTHOUSE_FILE": ""}, "no lighthouse address: set FL_LIGHTHOUSE=HOST:PORT, or FL_LIGHTHOUSE_FILE"),
    ({"FL_LIGHTHOUSE_FILE": "/nonexistent/lighthouse.addr", "FL_LIGHTHOUSE_WAIT_S": "1"},
     "no lighthouse address in /nonexistent/lighthouse.addr after 1 s: is the lighthouse job running"),
    ({"FL_LIGHTHOUSE": "lh-node:port"}, "FL_LIGHTHOUSE='lh-node:port' is not a lighthouse address"),
    ({"FL_GROUP_ID": "16"}, "FL_GROUP_ID='16' is not a group of the fl-hsdp layout (0 .. 15)"),
    ({"SLURM_JOB_NUM_NODES": "1"}, "a group of the fl-hsdp layout needs 8 node(s) but this job has SLURM_JOB_NUM_NODES=1"),
], ids=["no-lighthouse", "lighthouse-never-up", "bad-lighthouse", "group-id", "shape"])
def test_group_job_refuses_bad_input_before_srun(env, says, fakes, tmp_path):
    fake_env, log = fakes
    proc = _group_job(tmp_path, fake_env, **env)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert not log.with_suffix(".srun").exists()


def test_lighthouse_job_needs_its_settings(tmp_path):
    proc = run(("bash", LIGHTHOUSE), tmp_path, FL_LIGHTHOUSE_FILE=str(tmp_path / "addr"))
    assert proc.returncode == 2 and "FL_MIN_GROUPS is not set" in proc.stderr


def test_elastic_scripts_are_executable_and_strict():
    for script in (SUBMIT, GROUP, LIGHTHOUSE):
        assert os.access(script, os.X_OK), f"{script} is not executable"
    for script in (SUBMIT, GROUP, LIGHTHOUSE, EXAMPLES / "slurm" / "common.sh"):  # elastic.sh sources common.sh
        assert re.search(r"^set -euo pipefail$", script.read_text(), re.M), script
    for script in (SUBMIT, GROUP, LIGHTHOUSE, ELASTIC / "elastic.sh", EXAMPLES / "slurm" / "common.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
