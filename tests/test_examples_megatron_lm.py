"""The Megatron-LM recipe in examples/megatron-lm/: the script trains the JSON recipe
examples/gpt3-6.7b/megatron/fl-fsdp-64x8.json, dry-runs its layout with FL_DRY_RUN=1 through
fl_megatron.pretrain, and hands Megatron-LM's own (patched) pretrain_gpt.py every number the planner
checked; its real launch path runs against fake srun / scontrol programs with exactly those
arguments, and refuses before srun when the checkout, data, job or arguments do not fit. A mistyped
number in the script fails its dry run.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from examples_helpers import (EXAMPLES, MEGATRON_LM, ROOT, TIMEOUT_S, check_plan, clean_env, make_fakes,
                              pretrain_args, recorded, run, shown_command)


MEGATRON_PREFIX = "fl-megatron megatron-lm: "
# What only the planner is told: the layout Megatron-LM expresses as distributed-optimizer instances.
PLANNER_ONLY = {"--model", "--backend", "--world-size", "--ranks-per-node", "--fl-hsdp-shard-size",
                "--recompute-activations", "--grad-reduce-dtype", "--dry-run"}
PATCHED_FILES = ("pretrain_gpt.py", "megatron/training/arguments.py", "megatron/training/training.py")


@pytest.fixture
def fakes(tmp_path):
    """A bin directory with srun, deepspeed and scontrol that only record how they were called."""
    return make_fakes(tmp_path)


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
    # Megatron-LM accumulates bf16 gradients unless told otherwise: the plan assumes the same
    assert planner["--grad-reduce-dtype"] == ["bf16"] and "--accumulate-allreduce-grads-in-fp32" not in megatron
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
