"""The launch recipes in examples/: every SLURM script (for every layout) and the DeepSpeed hostfile
launcher (for every layout x cluster) dry-run with FL_DRY_RUN=1 and plan the layout they name on
512 ranks; the real launch paths run against fake srun / scontrol / deepspeed programs and must
hand the launcher exactly the arguments the dry run checked.

Each dry run is one Python process of a few seconds; they run a few at a time.
"""

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SBATCH_SCRIPTS = sorted((EXAMPLES / "slurm").glob("*.sbatch"))
DS_LAUNCHER = EXAMPLES / "deepspeed" / "launch-deepspeed.sh"
HOSTFILE = EXAMPLES / "deepspeed" / "hostfile.example"
LAYOUTS = ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp")
CLUSTERS = {"128x4": (128, 4), "64x8": (64, 8)}
BACKENDS = ("fsdp2", "deepspeed")
TIMEOUT_S = 120
WORKERS = max(1, min(4, os.cpu_count() or 1))

# The dry run's groups line for each layout on each cluster (512 ranks).
GROUPS_LINE = {
    ("fsdp", "128x4"): "1 group of 512, no federation (FSDP: 512 shards)",
    ("fsdp", "64x8"): "1 group of 512, no federation (FSDP: 512 shards)",
    ("hsdp", "128x4"): "1 group of 512, no federation (HSDP: 128 replicas x 4 shards)",
    ("hsdp", "64x8"): "1 group of 512, no federation (HSDP: 64 replicas x 8 shards)",
    ("fl-fsdp", "128x4"): "128 federation groups of 4 (FSDP: 4 shards)",
    ("fl-fsdp", "64x8"): "64 federation groups of 8 (FSDP: 8 shards)",
    ("fl-hsdp", "128x4"): "16 federation groups of 32 (HSDP: 8 replicas x 4 shards)",
    ("fl-hsdp", "64x8"): "16 federation groups of 32 (HSDP: 4 replicas x 8 shards)",
}

BACKEND_LINE = {"fsdp2": "backend: PyTorch FSDP2 over", "deepspeed": "backend: DeepSpeed ZeRO-3 over"}


def script_variables(path: Path) -> dict:
    """BACKEND and CLUSTER as an sbatch script sets them, and its #SBATCH options."""
    text = path.read_text()
    out = {name: re.search(rf"^{name}=(\S+)", text, re.M).group(1) for name in ("BACKEND", "CLUSTER")}
    out["sbatch"] = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    return out


@dataclass(frozen=True)
class Case:
    """One dry run: a script, its arguments, and what it must plan."""

    argv: tuple
    backend: str
    layout: str
    cluster: str

    def __str__(self) -> str:
        return f"{Path(self.argv[1] if self.argv[0] == 'bash' else self.argv[0]).name}:{self.layout}:{self.cluster}"


def _cases() -> list:
    cases = []
    for script in SBATCH_SCRIPTS:
        v = script_variables(script)
        cases += [Case(("bash", str(script), layout), v["BACKEND"], layout, v["CLUSTER"]) for layout in LAYOUTS]
    cases += [Case((str(DS_LAUNCHER), str(HOSTFILE), layout, cluster), "deepspeed", layout, cluster)
              for layout in LAYOUTS for cluster in CLUSTERS]
    return cases


CASES = _cases()


def clean_env(**extra) -> dict:
    """This environment without launcher or recipe variables, .venv's bin first on PATH."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "FL_DRY_RUN", "FL_MEGATRON_ROOT", "PYTHON", "DEEPSPEED", "DS_ENV_FILE"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run(argv, cwd, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=clean_env(**env), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def shown_command(stderr: str) -> list:
    """The last command line the launch script printed ("fl-megatron launch: CMD...")."""
    lines = [line for line in stderr.splitlines() if line.startswith("fl-megatron launch: ")
             and "error:" not in line and "warning:" not in line]
    assert lines, f"the script printed no command:\n{stderr}"
    return shlex.split(lines[-1][len("fl-megatron launch: "):])


def pretrain_args(argv: list) -> list:
    """What follows `fl_megatron.pretrain` in a command line."""
    return argv[argv.index("fl_megatron.pretrain") + 1:]


@pytest.fixture(scope="module")
def dry_runs(request, tmp_path_factory):
    """The selected dry runs, started together on a few workers, from a directory outside the
    repository (the scripts must find it themselves)."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})]
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    futures = {case: pool.submit(run, case.argv, cwd, FL_DRY_RUN="1") for case in dict.fromkeys(selected)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_every_backend_and_cluster_has_a_slurm_script():
    assert {p.name for p in SBATCH_SCRIPTS} == {f"{b}-{c}.sbatch" for b in BACKENDS for c in CLUSTERS}
    for script in [*SBATCH_SCRIPTS, DS_LAUNCHER, EXAMPLES / "slurm" / "launch.sh"]:
        assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script", SBATCH_SCRIPTS, ids=lambda p: p.name)
def test_sbatch_header_matches_its_cluster(script):
    v = script_variables(script)
    nodes, gpus = CLUSTERS[v["CLUSTER"]]
    assert script.name == f"{v['BACKEND']}-{v['CLUSTER']}.sbatch"
    assert v["sbatch"]["nodes"] == str(nodes)
    assert v["sbatch"]["ntasks-per-node"] == str(gpus)
    assert v["sbatch"]["gpus-per-node"] == str(gpus)


def test_sbatch_scripts_differ_only_in_header_and_two_variables():
    def body(script):
        return [line for line in script.read_text().splitlines()
                if not line.startswith("#") and not re.match(r"(BACKEND|CLUSTER)=", line)]

    first = body(SBATCH_SCRIPTS[0])
    assert all(body(s) == first for s in SBATCH_SCRIPTS[1:])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dry_run_plans_the_layout(case, dry_runs):
    proc = dry_runs[case].result()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr}\n{proc.stdout}"
    lines = [line.strip() for line in proc.stdout.splitlines()]
    nodes, gpus = CLUSTERS[case.cluster]
    assert f"512 ranks on {nodes} nodes x {gpus}" in lines
    assert GROUPS_LINE[(case.layout, case.cluster)] in lines, proc.stdout
    backend = next(line for line in lines if line.startswith("backend: "))
    assert backend.startswith(BACKEND_LINE[case.backend]), backend
    assert "1024 over all ranks" in proc.stdout  # micro-batch 2 x 512 ranks, no accumulation
    assert "activations recomputed" in proc.stdout
    total = float(re.search(r"^\s+total\s+([\d.]+) GiB$", proc.stdout, re.M).group(1))
    assert total < 80, f"memory estimate {total} GiB does not fit an 80 GB GPU"
    args = pretrain_args(shown_command(proc.stderr))
    assert args[-3:] == ["--world-size", "512", "--dry-run"]
    recipe = f"examples/llama3.1-8b/{case.backend}/{case.layout}-{case.cluster}.json"
    if case.backend == "deepspeed":
        assert args[:4] == ["--config", f"examples/llama3.1-8b/deepspeed/run-{case.cluster}.json",
                            "--deepspeed_config", recipe]
    else:
        assert args[:2] == ["--config", recipe]


@pytest.mark.parametrize("argv", [("bash", SBATCH_SCRIPTS[0], "fl-bogus"),
                                  (DS_LAUNCHER, HOSTFILE, "fl-bogus", "128x4")],
                         ids=["sbatch", "launch-deepspeed"])
def test_unknown_layout_fails_naming_the_valid_ones(argv, tmp_path):
    proc = run(argv, tmp_path, FL_DRY_RUN="1")
    assert proc.returncode != 0
    assert "unknown layout 'fl-bogus'" in proc.stderr
    assert "valid layouts: fsdp, hsdp, fl-fsdp, fl-hsdp" in proc.stderr


def test_unknown_cluster_fails_naming_the_valid_ones(tmp_path):
    proc = run((DS_LAUNCHER, HOSTFILE, "fsdp", "32x16"), tmp_path, FL_DRY_RUN="1")
    assert proc.returncode != 0
    assert "valid clusters: 128x4, 64x8" in proc.stderr


# --- the real launch paths, against fake launchers ---------------------------------------------

FAKE_LAUNCHER = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG.args"
env > "$FAKE_LOG.env"
pwd > "$FAKE_LOG.cwd"
if [[ -n ${DS_ENV_FILE:-} ]]; then cp "$DS_ENV_FILE" "$FAKE_LOG.dsenv"; fi
"""
FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] || exit 1
printf 'gpu-a\\ngpu-b\\n'
"""


@pytest.fixture
def fakes(tmp_path):
    """A bin directory with srun, deepspeed and scontrol that only record how they were called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_LAUNCHER), ("deepspeed", FAKE_LAUNCHER), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "launcher"
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {"PATH": path, "FAKE_LOG": str(log)}, log


def recorded(log: Path) -> tuple[list, dict]:
    args = log.with_suffix(".args").read_text().splitlines()
    env = dict(line.split("=", 1) for line in log.with_suffix(".env").read_text().splitlines() if "=" in line)
    return args, env


def dry_run_command(argv, cwd) -> list:
    """The dry run's pretrain arguments, printed by the script without starting Python."""
    proc = run(argv, cwd, FL_DRY_RUN="1", PYTHON="true")
    assert proc.returncode == 0, proc.stderr
    return pretrain_args(shown_command(proc.stderr))


@pytest.mark.parametrize("script", SBATCH_SCRIPTS, ids=lambda p: p.name)
def test_slurm_job_runs_srun_with_the_dry_run_arguments(script, fakes, tmp_path):
    env, log = fakes
    v = script_variables(script)
    nodes, gpus = CLUSTERS[v["CLUSTER"]]
    spool = tmp_path / "spool"  # sbatch runs a copy of the script from somewhere else
    spool.mkdir()
    (spool / "slurm_script").write_text(script.read_text())
    extra = ["--train-iters", "2", "--log-interval", "1"]
    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS_PER_NODE=str(gpus),
                 SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_CPUS_PER_TASK="8", SLURM_SUBMIT_DIR=str(ROOT))
    proc = run(("bash", spool / "slurm_script", "fl-hsdp", *extra), tmp_path, **env, **slurm)
    assert proc.returncode == 0, proc.stderr
    args, seen = recorded(log)
    assert args[:args.index("fl_megatron.pretrain")] == [
        "--kill-on-bad-exit=1", f"--nodes={nodes}", f"--ntasks-per-node={gpus}", "python", "-u", "-m"]
    planned = dry_run_command(("bash", script, "fl-hsdp", *extra), tmp_path)
    assert pretrain_args(args) + ["--world-size", "512", "--dry-run"] == planned
    assert pretrain_args(args)[-4:] == extra
    assert seen["MASTER_ADDR"] == "gpu-a" and seen["MASTER_PORT"].isdigit()
    assert seen["NCCL_DEBUG"] == "WARN" and seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert seen["SRUN_CPUS_PER_TASK"] == "8"
    assert log.with_suffix(".cwd").read_text().strip() == str(ROOT)  # recipe paths are relative to it


def test_slurm_job_of_the_wrong_shape_fails_before_srun(fakes, tmp_path):
    env, log = fakes
    script = EXAMPLES / "slurm" / "fsdp2-128x4.sbatch"
    proc = run(("bash", script, "fl-fsdp"), tmp_path, **env, SLURM_JOB_ID="1", SLURM_JOB_NUM_NODES="64",
               SLURM_NTASKS_PER_NODE="4")
    assert proc.returncode == 2
    assert "needs 128 nodes but this job has SLURM_JOB_NUM_NODES=64" in proc.stderr
    assert not log.with_suffix(".args").exists()


def test_hostfile_launch_runs_deepspeed_with_the_dry_run_arguments(fakes, tmp_path):
    env, log = fakes
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# 64 nodes\n" + "".join(f"n{i:03d} slots=8\n" for i in range(64)))
    proc = run((DS_LAUNCHER, hostfile, "fl-hsdp", "64x8"), tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    args, seen = recorded(log)
    assert args[:args.index("fl_megatron.pretrain")] == [
        "--hostfile", str(hostfile), "--num_nodes", "64", "--num_gpus", "8", "--master_addr", "n000",
        "--master_port", seen["MASTER_PORT"], "--no_local_rank", "--module"]
    planned = dry_run_command((DS_LAUNCHER, HOSTFILE, "fl-hsdp", "64x8"), tmp_path)
    assert pretrain_args(args) + ["--world-size", "512", "--dry-run"] == planned
    # what pdsh does not pass on by itself reaches the other hosts through DS_ENV_FILE
    passed = log.with_suffix(".dsenv").read_text().splitlines()
    assert "OMP_NUM_THREADS=1" in passed and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in passed
    assert not Path(seen["DS_ENV_FILE"]).exists()  # removed after the launcher returns

    short = tmp_path / "short"
    short.write_text("n000 slots=8\n")
    proc = run((DS_LAUNCHER, short, "fl-hsdp", "64x8"), tmp_path, **env)
    assert proc.returncode == 2
    assert "needs 64 hosts with slots=8" in proc.stderr
