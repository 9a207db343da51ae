"""Pieces of the launch-recipe tests (test_examples.py, test_examples_megatron_lm.py): the paths of
examples/, the models, layouts and clusters the recipes cover, what a dry run must print for each,
running a script with a clean environment and reading the command it printed, running many dry runs
in one Python process, and fake srun / scontrol / deepspeed programs that only record their calls."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SBATCH_SCRIPTS = sorted((EXAMPLES / "slurm").glob("*.sbatch"))
DS_LAUNCHER = EXAMPLES / "deepspeed" / "launch-deepspeed.sh"
HOSTFILE = EXAMPLES / "deepspeed" / "hostfile.example"
MEGATRON_LM = EXAMPLES / "megatron-lm" / "gpt3-6.7b-fl-fsdp.sbatch"
MODELS = ("llama3.1-8b", "gpt3-6.7b")  # the first is the scripts' default
LAYOUTS = ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp")
CLUSTERS = {"128x4": (128, 4), "64x8": (64, 8)}
BACKENDS = ("fsdp2", "deepspeed", "megatron")
TIMEOUT_S = 120

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
# The megatron backend's whole line: the distributed optimizer over S ranks, HSDP all-reduces over P.
MEGATRON_LINE = {
    ("fsdp", "128x4"): "backend: megatron-core DistributedOptimizer over 512 ranks",
    ("fsdp", "64x8"): "backend: megatron-core DistributedOptimizer over 512 ranks",
    ("hsdp", "128x4"): "backend: megatron-core DistributedOptimizer over 4 ranks, "
                       "gradient shards all-reduced over 128 replicas each step",
    ("hsdp", "64x8"): "backend: megatron-core DistributedOptimizer over 8 ranks, "
                      "gradient shards all-reduced over 64 replicas each step",
    ("fl-fsdp", "128x4"): "backend: megatron-core DistributedOptimizer over 4 ranks",
    ("fl-fsdp", "64x8"): "backend: megatron-core DistributedOptimizer over 8 ranks",
    ("fl-hsdp", "128x4"): "backend: megatron-core DistributedOptimizer over 4 ranks, "
                          "gradient shards all-reduced over 8 replicas each step",
    ("fl-hsdp", "64x8"): "backend: megatron-core DistributedOptimizer over 8 ranks, "
                         "gradient shards all-reduced over 4 replicas each step",
}
# The model line's start and the tokens of one step (micro-batch 2 x 512 ranks = 1024 samples).
MODEL_LINE = {"llama3.1-8b": "model: llama3.1-8b, 8,030,261,248 parameters",
              "gpt3-6.7b": "model: gpt3-6.7b, 6,658,404,352 parameters"}
STEP_TOKENS = {"llama3.1-8b": "8,388,608 tokens of seq 8192 per step",
               "gpt3-6.7b": "2,097,152 tokens of seq 2048 per step"}

# Runs all dry runs given on stdin (a JSON list of argument lists) in this one process.
BATCH_DRY_RUN = """
import contextlib, io, json, sys
from fl_megatron.pretrain import main
results = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
json.dump(results, sys.stdout)
"""


def script_variables(path: Path) -> dict:
    """BACKEND and CLUSTER as an sbatch script sets them, and its #SBATCH options."""
    text = path.read_text()
    out = {name: re.search(rf"^{name}=(\S+)", text, re.M).group(1) for name in ("BACKEND", "CLUSTER")}
    out["sbatch"] = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    return out


def clean_env(**extra) -> dict:
    """This environment without launcher or recipe variables, .venv's bin first on PATH."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "FL_DRY_RUN", "FL_MEGATRON_ROOT", "PYTHON", "DEEPSPEED", "DS_ENV_FILE",
            "MEGATRON_LM_DIR", "DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "PYTHONPATH", "SBATCH",
            "TORCHFT_LIGHTHOUSE", "FL_GROUP_ID", "FL_CLUSTER", "FL_MIN_GROUPS", "FL_MAX_RESTARTS"}
    # the elastic scripts' FL_LIGHTHOUSE* and FL_*_TIMEOUT_MS (examples/slurm/elastic/elastic.sh)
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "FL_LIGHTHOUSE"))
           and not (k.startswith("FL_") and k.endswith("_TIMEOUT_MS"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run(argv, cwd, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=clean_env(**env), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def shown_command(stderr: str, prefix: str = "fl-megatron launch: ") -> list:
    """The last command line the launch script printed ("fl-megatron launch: CMD...")."""
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)
             and "error:" not in line and "warning:" not in line]
    assert lines, f"the script printed no command:\n{stderr}"
    return shlex.split(lines[-1][len(prefix):])


def pretrain_args(argv: list) -> list:
    """What follows `fl_megatron.pretrain` in a command line."""
    return argv[argv.index("fl_megatron.pretrain") + 1:]


def batch_dry_runs(arg_lists: list) -> list:
    """`fl_megatron.pretrain ARGS` for each ARGS, in one Python process started at the repository
    root (where the scripts run it): [{returncode, stdout, stderr}, ...]."""
    if not arg_lists:
        return []
    proc = subprocess.run([sys.executable, "-c", BATCH_DRY_RUN], input=json.dumps(arg_lists), cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S + 5 * len(arg_lists))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def check_plan(stdout: str, backend: str, model: str, layout: str, cluster: str) -> None:
    """A dry run's report plans LAYOUT of MODEL on CLUSTER with BACKEND, in 80 GB."""
    lines = [line.strip() for line in stdout.splitlines()]
    nodes, gpus = CLUSTERS[cluster]
    assert f"512 ranks on {nodes} nodes x {gpus}" in lines
    assert GROUPS_LINE[(layout, cluster)] in lines, stdout
    assert any(line.startswith(MODEL_LINE[model]) for line in lines), stdout
    backend_line = next(line for line in lines if line.startswith("backend: "))
    if backend == "megatron":
        assert backend_line == MEGATRON_LINE[(layout, cluster)]
    else:
        assert backend_line.startswith(BACKEND_LINE[backend]), backend_line
    assert "1024 over all ranks" in stdout  # micro-batch 2 x 512 ranks, no accumulation
    assert STEP_TOKENS[model] in stdout
    assert "activations recomputed" in stdout
    total = float(re.search(r"^\s+total\s+([\d.]+) GiB$", stdout, re.M).group(1))
    assert total < 80, f"memory estimate {total} GiB does not fit an 80 GB GPU"


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


def make_fakes(tmp_path: Path) -> tuple[dict, Path]:
    """A bin directory with srun, deepspeed and scontrol that only record how they were called:
    (the environment that puts them first on PATH, the stem of their log files)."""
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

