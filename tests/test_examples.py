"""The launch recipes in examples/: every SLURM script (for every model and layout) and the DeepSpeed
hostfile launcher (for every model x layout x cluster) dry-run with FL_DRY_RUN=1 and plan the layout
they name on 512 ranks; the real launch paths run against fake srun / scontrol / deepspeed programs
and must hand the launcher exactly the arguments the dry run checked. (The Megatron-LM script's
tests are in test_examples_megatron_lm.py.)

Every case's script runs with FL_DRY_RUN=1 and PYTHON=true, which prints the pretrain arguments it
would hand to Python (bash only, milliseconds); all those dry runs then run in one Python process
(importing torch once, not once per case). A few scripts also run their dry run themselves, as a
user would, and must print exactly what the batch printed for them.
"""

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples_helpers import (BACKENDS, CLUSTERS, DS_LAUNCHER, EXAMPLES, HOSTFILE, LAYOUTS, MEGATRON_LM, MODELS,
                              ROOT, SBATCH_SCRIPTS, batch_dry_runs, check_plan, dry_run_command, make_fakes,
                              pretrain_args, recorded, run, script_variables, shown_command)

WORKERS = max(1, min(4, os.cpu_count() or 1))


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
            # its local layer spec attends unfused (the s x s scores): half the micro-batch, twice
            # the accumulation, the same global batch
            m, f = megatron["training"], fsdp2["training"]
            if model == "llama3.1-8b":
                assert (m.pop("micro_batch_size"), m.pop("gradient_accumulation_steps")) == \
                    (f.pop("micro_batch_size") // 2, f.pop("gradient_accumulation_steps") * 2)
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

@pytest.fixture
def fakes(tmp_path):
    """A bin directory with srun, deepspeed and scontrol that only record how they were called."""
    return make_fakes(tmp_path)


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
