"""The launch recipes in examples/: every SLURM script (for every model and layout), the DeepSpeed
hostfile launcher (for every model x layout x cluster) and the Megatron-LM script dry-run with
FL_DRY_RUN=1 and plan the layout they name on 512 ranks; the real launch paths run against fake
srun / scontrol / deepspeed programs and must hand the launcher exactly the arguments the dry run
checked.

Every case's script runs with FL_DRY_RUN=1 and PYTHON=true, which prints the pretrain arguments it
would hand to Python (bash only, milliseconds); all those dry runs then run in one Python process
(importing torch once, not once per case). A few scripts also run their dry run themselves, as a
user would, and must print exactly what the batch printed for them.
"""

import json
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
MEGATRON_LM = EXAMPLES / "megatron-lm" / "gpt3-6.7b-fl-fsdp.sbatch"
MODELS = ("llama3.1-8b", "gpt3-6.7b")  # the first is the scripts' default
LAYOUTS = ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp")
CLUSTERS = {"128x4": (128, 4), "64x8": (64, 8)}
BACKENDS = ("fsdp2", "deepspeed", "megatron")
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


@dataclass(frozen=True)
class Case:
    """One dry run: a script, its arguments, and what it must plan."""

    argv: tuple
    backend: str
    model: str
    layout: str
    cluster: str

    def __str__(self) -> str:
        script = Path(self.argv[1] if self.argv[0] == "bash" else self.argv[0]).name
        return f"{script}:{self.model}:{self.layout}:{self.cluster}"


def _model_arg(model: str) -> tuple:
    """The scripts' model argument: none for the default model (the interface without models)."""
    return () if model == MODELS[0] else (model,)


def _cases() -> list:
    cases = []
    for script in SBATCH_SCRIPTS:
        v = script_variables(script)
        cases += [Case(("bash", str(script), *_model_arg(model), layout), v["BACKEND"], model, layout, v["CLUSTER"])
                  for model in MODELS for layout in LAYOUTS]
    cases += [Case((str(DS_LAUNCHER), str(HOSTFILE), *_model_arg(model), layout, cluster), "deepspeed", model,
                   layout, cluster)
              for model in MODELS for layout in LAYOUTS for cluster in CLUSTERS]
    return cases


CASES = _cases()
# Cases whose script also runs the dry run itself (python, not true): one per kind of script, and
# the default model named explicitly once.
END_TO_END = [
    Case(("bash", str(EXAMPLES / "slurm" / "fsdp2-128x4.sbatch"), "fl-hsdp"), "fsdp2", "llama3.1-8b", "fl-hsdp",
         "128x4"),
    Case(("bash", str(EXAMPLES / "slurm" / "megatron-64x8.sbatch"), "gpt3-6.7b", "fl-fsdp"), "megatron", "gpt3-6.7b",
         "fl-fsdp", "64x8"),
    Case((str(DS_LAUNCHER), str(HOSTFILE), "llama3.1-8b", "hsdp", "64x8"), "deepspeed", "llama3.1-8b", "hsdp",
         "64x8"),
]


def clean_env(**extra) -> dict:
    """This environment without launcher or recipe variables, .venv's bin first on PATH."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "FL_DRY_RUN", "FL_MEGATRON_ROOT", "PYTHON", "DEEPSPEED", "DS_ENV_FILE",
            "MEGATRON_LM_DIR", "DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "PYTHONPATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
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


@dataclass
class Planned:
    """A case's script under FL_DRY_RUN=1 PYTHON=true, and the dry run of the arguments it printed."""

    script: subprocess.CompletedProcess
    args: list
    dry_run: dict


@pytest.fixture(scope="module")
def planned(request, tmp_path_factory) -> dict:
    """Case -> Planned for the selected tests' cases. The scripts run from a directory outside the
    repository (they must find it themselves)."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    selected = list(dict.fromkeys(
        item.callspec.params["case"] for item in request.session.items
        if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})))
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        scripts = list(pool.map(lambda case: run(case.argv, cwd, FL_DRY_RUN="1", PYTHON="true"), selected))
    args = {case: pretrain_args(shown_command(proc.stderr)) for case, proc in zip(selected, scripts)
            if proc.returncode == 0}
    results = dict(zip(args, batch_dry_runs(list(args.values()))))
    return {case: Planned(proc, args.get(case, []), results.get(case, {}))
            for case, proc in zip(selected, scripts)}


def test_every_backend_and_cluster_has_a_slurm_script():
    assert {p.name for p in SBATCH_SCRIPTS} == {f"{b}-{c}.sbatch" for b in BACKENDS for c in CLUSTERS}
    for script in [*SBATCH_SCRIPTS, DS_LAUNCHER, MEGATRON_LM, EXAMPLES / "slurm" / "launch.sh"]:
        assert os.access(script, os.X_OK), f"{script} is not executable"


def test_every_model_has_every_recipe():
    for model in MODELS:
        for backend in BACKENDS:
            names = {p.name for p in (EXAMPLES / model / backend).glob("*.json")}
            expected = {f"{layout}-{cluster}.json" for layout in LAYOUTS for cluster in CLUSTERS}
            if backend == "deepspeed":
                expected |= {f"run-{cluster}.json" for cluster in CLUSTERS}
            assert names == expected, f"{model}/{backend}"


@pytest.mark.parametrize("model", MODELS)
def test_megatron_recipes_are_the_fsdp2_recipes_on_another_backend_with_bf16_gradients(model):
    for layout in LAYOUTS:
        for cluster in CLUSTERS:
            fsdp2 = json.loads((EXAMPLES / model / "fsdp2" / f"{layout}-{cluster}.json").read_text())
            megatron = json.loads((EXAMPLES / model / "megatron" / f"{layout}-{cluster}.json").read_text())
            assert megatron["parallel"] == {**fsdp2["parallel"], "backend": "megatron"}
            assert megatron["training"].pop("run_dir") == f"runs/{model}/megatron-{layout}-{cluster}"
            assert fsdp2["training"].pop("run_dir") == f"runs/{model}/fsdp2-{layout}-{cluster}"
            # megatron keeps a whole gradient buffer per rank: in bf16, as Megatron-LM does by default
            assert megatron["training"].pop("grad_reduce_dtype") == "bf16"
            assert {k: v for k, v in megatron.items() if k != "parallel"} == \
                {k: v for k, v in fsdp2.items() if k != "parallel"}


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


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dry_run_plans_the_layout(case, planned):
    plan = planned[case]
    assert plan.script.returncode == 0, plan.script.stderr
    assert plan.dry_run["returncode"] == 0, f"{plan.dry_run['stderr']}\n{plan.dry_run['stdout']}"
    check_plan(plan.dry_run["stdout"], case.backend, case.model, case.layout, case.cluster)
    args = plan.args
    assert args[-3:] == ["--world-size", "512", "--dry-run"]
    recipe = f"examples/{case.model}/{case.backend}/{case.layout}-{case.cluster}.json"
    if case.backend == "deepspeed":
        assert args[:6] == ["--config", f"examples/{case.model}/deepspeed/run-{case.cluster}.json",
                            "--deepspeed_config", recipe,
                            "--run-dir", f"runs/{case.model}/deepspeed-{case.layout}-{case.cluster}"]
    else:
        assert args[:2] == ["--config", recipe]


@pytest.mark.parametrize("case", END_TO_END, ids=str)
def test_script_runs_the_dry_run_itself(case, planned, tmp_path):
    """As a user runs it: the script starts Python itself and prints what the batch printed."""
    proc = run(case.argv, tmp_path, FL_DRY_RUN="1")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr}\n{proc.stdout}"
    assert shown_command(proc.stderr)[:3] == ["python", "-m", "fl_megatron.pretrain"]
    assert pretrain_args(shown_command(proc.stderr)) == planned[case].args
    assert proc.stdout == planned[case].dry_run["stdout"]
    check_plan(proc.stdout, case.backend, case.model, case.layout, case.cluster)


@pytest.mark.parametrize("argv", [("bash", SBATCH_SCRIPTS[0], "fl-bogus"),
                                  ("bash", SBATCH_SCRIPTS[0], "gpt3-6.7b", "fl-bogus"),
                                  (DS_LAUNCHER, HOSTFILE, "fl-bogus", "128x4"),
                                  (DS_LAUNCHER, HOSTFILE, "gpt3-6.7b", "fl-bogus", "128x4")],
                         ids=["sbatch", "sbatch-model", "launch-deepspeed", "launch-deepspeed-model"])
def test_unknown_layout_fails_naming_the_valid_ones(argv, tmp_path):
    proc = run(argv, tmp_path, FL_DRY_RUN="1")
    assert proc.returncode != 0
    assert "unknown layout 'fl-bogus'" in proc.stderr
    assert "valid layouts: fsdp, hsdp, fl-fsdp, fl-hsdp" in proc.stderr


def test_unknown_model_fails_naming_the_valid_ones(tmp_path):
    proc = run(("bash", SBATCH_SCRIPTS[0], "gpt3-7b", "fl-hsdp"), tmp_path, FL_DRY_RUN="1", PYTHON="true")
    assert proc.returncode == 2
    assert "unknown layout 'gpt3-7b'" in proc.stderr
    assert "a model may come first: llama3.1-8b, gpt3-6.7b (default llama3.1-8b)" in proc.stderr


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


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("script", SBATCH_SCRIPTS, ids=lambda p: p.name)
def test_slurm_job_runs_srun_with_the_dry_run_arguments(script, model, fakes, tmp_path):
    env, log = fakes
    v = script_variables(script)
    nodes, gpus = CLUSTERS[v["CLUSTER"]]
    spool = tmp_path / "spool"  # sbatch runs a copy of the script from somewhere else
    spool.mkdir()
    (spool / "slurm_script").write_text(script.read_text())
    extra = ["--train-iters", "2", "--log-interval", "1"]
    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS_PER_NODE=str(gpus),
                 SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_CPUS_PER_TASK="8", SLURM_SUBMIT_DIR=str(ROOT))
    proc = run(("bash", spool / "slurm_script", *_model_arg(model), "fl-hsdp", *extra), tmp_path, **env, **slurm)
    assert proc.returncode == 0, proc.stderr
    args, seen = recorded(log)
    assert args[:args.index("fl_megatron.pretrain")] == [
        "--kill-on-bad-exit=1", f"--nodes={nodes}", f"--ntasks-per-node={gpus}", "python", "-u", "-m"]
    checked = dry_run_command(("bash", script, *_model_arg(model), "fl-hsdp", *extra), tmp_path)
    assert pretrain_args(args) + ["--world-size", "512", "--dry-run"] == checked
    assert f"examples/{model}/{v['BACKEND']}/fl-hsdp-{v['CLUSTER']}.json" in checked
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


@pytest.mark.parametrize("model", MODELS)
def test_hostfile_launch_runs_deepspeed_with_the_dry_run_arguments(model, fakes, tmp_path):
    env, log = fakes
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# 64 nodes\n" + "".join(f"n{i:03d} slots=8\n" for i in range(64)))
    proc = run((DS_LAUNCHER, hostfile, *_model_arg(model), "fl-hsdp", "64x8"), tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    args, seen = recorded(log)
    assert args[:args.index("fl_megatron.pretrain")] == [
        "--hostfile", str(hostfile), "--num_nodes", "64", "--num_gpus", "8", "--master_addr", "n000",
        "--master_port", seen["MASTER_PORT"], "--no_local_rank", "--module"]
    checked = dry_run_command((DS_LAUNCHER, HOSTFILE, *_model_arg(model), "fl-hsdp", "64x8"), tmp_path)
    assert pretrain_args(args) + ["--world-size", "512", "--dry-run"] == checked
    assert f"examples/{model}/deepspeed/fl-hsdp-64x8.json" in checked
    # what pdsh does not pass on by itself reaches the other hosts through DS_ENV_FILE
    passed = log.with_suffix(".dsenv").read_text().splitlines()
    assert "OMP_NUM_THREADS=1" in passed and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in passed
    assert not Path(seen["DS_ENV_FILE"]).exists()  # removed after the launcher returns

    short = tmp_path / "short"
    short.write_text("n000 slots=8\n")
    proc = run((DS_LAUNCHER, short, "fl-hsdp", "64x8"), tmp_path, **env)
    assert proc.returncode == 2
    assert "needs 64 hosts with slots=8" in proc.stderr


# --- Megatron-LM's own pretrain_gpt.py, patched (examples/megatron-lm) --------------------------

MEGATRON_PREFIX = "fl-megatron megatron-lm: "
# What only the planner is told: the layout Megatron-LM expresses as distributed-optimizer instances.
PLANNER_ONLY = {"--model", "--backend", "--world-size", "--ranks-per-node", "--fl-hsdp-shard-size",
                "--recompute-activations", "--dry-run"}


PATCHED_FILES = ("pretrain_gpt.py", "megatron/training/arguments.py", "megatron/training/training.py")


def flag_values(argv: list) -> dict:
    """--flag -> the words after it up to the next flag (a switch maps to [])."""
    out, flag = {}, None
    for arg in argv:
        if arg.startswith("--"):
            flag = arg
            out[flag] = []
        elif flag is not None:
            out[flag].append(arg)
    return out


def megatron_args(argv: list) -> list:
    """What follows pretrain_gpt.py in a command line."""
    return argv[next(i for i, a in enumerate(argv) if a.endswith("/pretrain_gpt.py")) + 1:]


@pytest.fixture
def megatron_lm(tmp_path) -> dict:
    """A stand-in for a patched Megatron-LM checkout, tokenizer files and data, as environment."""
    mlm = tmp_path / "Megatron-LM"
    (mlm / "megatron" / "training").mkdir(parents=True)
    for name in PATCHED_FILES:  # what tools/apply_megatron_patch.sh adds: calls into fl_megatron
        (mlm / name).write_text("from fl_megatron.integrations import megatron_lm_args\n")
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        (tmp_path / name).write_text("")
    return dict(MEGATRON_LM_DIR=str(mlm), DATA_PATH="0.7 /data/web_text_document 0.3 /data/code_text_document",
                VOCAB_FILE=str(tmp_path / "gpt2-vocab.json"), MERGE_FILE=str(tmp_path / "gpt2-merges.txt"))


def test_megatron_lm_dry_run_plans_its_layout(tmp_path):
    proc = run(("bash", MEGATRON_LM), tmp_path, FL_DRY_RUN="1")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr}\n{proc.stdout}"
    check_plan(proc.stdout, "megatron", "gpt3-6.7b", "fl-fsdp", "64x8")
    plan = shown_command(proc.stderr)
    assert plan[:3] == ["python", "-m", "fl_megatron.pretrain"]
    job = shown_command(proc.stderr, MEGATRON_PREFIX)
    assert job[:4] == ["srun", "--kill-on-bad-exit=1", "--nodes=64", "--ntasks-per-node=8"]
    assert job[job.index("fl-rank") + 1:][:3] == ["python", "-u", "MEGATRON_LM_DIR/pretrain_gpt.py"]
    megatron, planner = flag_values(megatron_args(job)), flag_values(pretrain_args(plan))
    # every number the planner checked is the one Megatron-LM gets
    for flag, values in planner.items():
        if flag not in PLANNER_ONLY:
            assert megatron.get(flag) == values, flag
    assert planner["--fl-hsdp-shard-size"] == ["8"]  # 512 ranks / 64 distributed-optimizer instances
    assert megatron["--num-distributed-optimizer-instances"] == megatron["--fl-num-groups"] == ["64"]
    assert megatron["--use-distributed-optimizer"] == megatron["--bf16"] == []
    assert megatron["--tensor-model-parallel-size"] == megatron["--pipeline-model-parallel-size"] == ["1"]
    assert megatron["--tokenizer-type"] == ["GPT2BPETokenizer"]
    assert megatron["--position-embedding-type"] == ["learned_absolute"]
    assert megatron["--recompute-granularity"] == ["full"]
    assert int(megatron["--save-interval"][0]) % int(megatron["--fl-sync-interval"][0]) == 0


def test_megatron_lm_script_is_the_json_recipe(tmp_path):
    """The Megatron-LM job trains examples/gpt3-6.7b/megatron/fl-fsdp-64x8.json's recipe."""
    proc = run(("bash", MEGATRON_LM), tmp_path, FL_DRY_RUN="1", PYTHON="true")
    assert proc.returncode == 0, proc.stderr
    planner = flag_values(pretrain_args(shown_command(proc.stderr)))
    recipe = json.loads((EXAMPLES / "gpt3-6.7b" / "megatron" / "fl-fsdp-64x8.json").read_text())
    t = recipe["training"]
    for key in ("seq_length", "micro_batch_size", "global_batch_size", "train_iters", "lr_warmup_iters", "lr",
                "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "seed",
                "eval_interval", "eval_iters", "log_interval"):
        assert float(planner["--" + key.replace("_", "-")][0]) == t[key], key
    assert planner["--lr-decay-style"] == [t["lr_decay_style"]]
    assert "--lr-decay-iters" not in planner and "lr_decay_iters" not in t  # the decay spans the run
    assert t["bf16"] and t["recompute_activations"] and "--bf16" in planner and "--recompute-activations" in planner
    assert planner["--model"] == [recipe["model"]["preset"]]
    assert planner["--ranks-per-node"] == [str(recipe["parallel"]["ranks_per_node"])]
    assert planner["--fl-sync-interval"] == [str(recipe["federation"]["sync_interval"])]
    assert 512 // int(planner["--fl-num-groups"][0]) == recipe["federation"]["group_size"]


def test_megatron_lm_job_runs_srun_with_the_dry_run_arguments(fakes, megatron_lm, tmp_path):
    env, log = fakes
    spool = tmp_path / "spool"  # sbatch runs a copy of the script from somewhere else
    spool.mkdir()
    (spool / "slurm_script").write_text(MEGATRON_LM.read_text())
    extra = ["--train-iters", "16", "--use-flash-attn"]
    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="64", SLURM_NTASKS_PER_NODE="8",
                 SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_SUBMIT_DIR=str(ROOT))
    proc = run(("bash", spool / "slurm_script", *extra), tmp_path, **env, **slurm, **megatron_lm)
    assert proc.returncode == 0, proc.stderr
    args, seen = recorded(log)
    mlm = megatron_lm["MEGATRON_LM_DIR"]
    assert args[:5] == ["--kill-on-bad-exit=1", "--nodes=64", "--ntasks-per-node=8", "bash", "-c"]
    assert args[6:10] == ["fl-rank", "python", "-u", f"{mlm}/pretrain_gpt.py"]
    checked = run(("bash", MEGATRON_LM, *extra), tmp_path, FL_DRY_RUN="1", PYTHON="true", **megatron_lm)
    assert checked.returncode == 0, checked.stderr
    assert megatron_args(args) == megatron_args(shown_command(checked.stderr, MEGATRON_PREFIX))
    assert megatron_args(args)[-3:] == extra
    assert flag_values(megatron_args(args))["--data-path"] == megatron_lm["DATA_PATH"].split()
    assert seen["MASTER_ADDR"] == "gpu-a" and seen["MASTER_PORT"].isdigit()
    assert seen["PYTHONPATH"].split(os.pathsep)[0] == mlm
    assert log.with_suffix(".cwd").read_text().strip() == str(ROOT)
    # the per-task wrapper gives Megatron-LM its rank the way torchrun would
    task = subprocess.run(["bash", "-c", args[5], "fl-rank", "bash", "-c", 'echo "$RANK $LOCAL_RANK $WORLD_SIZE"'],
                          env=clean_env(SLURM_PROCID="13", SLURM_LOCALID="5", SLURM_NTASKS="512"),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert task.stdout.split() == ["13", "5", "512"]


@pytest.mark.parametrize("args,env,message", [
    ((), {"unpatch": True}, "is not patched for federated averaging (megatron/training/training.py does not "
                            "call fl_megatron): run tools/apply_megatron_patch.sh"),
    ((), {"PYTHON": "false"}, "false cannot import fl_megatron, which the patched Megatron-LM needs"),
    ((), {"DATA_PATH": ""}, "set DATA_PATH"),
    ((), {"SLURM_JOB_NUM_NODES": "128"}, "needs 64 nodes but this job has SLURM_JOB_NUM_NODES=128"),
    (("--fl-num-groups=32",), {}, "--fl-num-groups is part of the checked layout"),
], ids=["unpatched", "no-fl-megatron", "no-data", "wrong-shape", "layout-flag"])
def test_megatron_lm_job_refuses_before_srun(args, env, message, fakes, megatron_lm, tmp_path):
    fake_env, log = fakes
    if env.pop("unpatch", False):
        (Path(megatron_lm["MEGATRON_LM_DIR"]) / "megatron" / "training" / "training.py").write_text("")
    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="64", SLURM_NTASKS_PER_NODE="8",
                 SLURM_JOB_NODELIST="gpu-[a-b]")
    proc = run(("bash", MEGATRON_LM, *args), tmp_path, **fake_env, **{**slurm, **megatron_lm, **env})
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not log.with_suffix(".args").exists()


@pytest.mark.parametrize("edit,message", [
    (("DIST_OPT_INSTANCES=64", "DIST_OPT_INSTANCES=48"), "DIST_OPT_INSTANCES=48 does not divide the 512 ranks"),
    (("SAVE_INTERVAL=32 ", "SAVE_INTERVAL=30 "), "SAVE_INTERVAL=30 is not a multiple of FL_SYNC_INTERVAL=8"),
    (("--global-batch-size 1024", "--global-batch-size 1000"), "fl_megatron.pretrain: error:"),
], ids=["instances", "save-interval", "planner"])
def test_megatron_lm_layout_typo_fails_the_dry_run(edit, message, tmp_path):
    """A mistyped number in the script fails FL_DRY_RUN=1, before anything is submitted."""
    old, new = edit
    text = MEGATRON_LM.read_text()
    assert text.count(old) == 1
    edited = tmp_path / "gpt3-6.7b-fl-fsdp.sbatch"
    edited.write_text(text.replace(old, new))
    proc = run(("bash", edited), tmp_path, FL_DRY_RUN="1", FL_MEGATRON_ROOT=str(ROOT))
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr
