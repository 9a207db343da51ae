"""Reading ranks from torchrun's and SLURM's environment variables."""

import pytest

from fl_megatron.training.launch import LaunchEnv, init_distributed, read_launch_env

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
        "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "MASTER_ADDR", "LOCAL_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_single_process_without_a_launcher(clean_env):
    assert read_launch_env() == LaunchEnv(0, 1, 0, 1)


def test_torchrun_variables(clean_env):
    for k, v in dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4").items():
        clean_env.setenv(k, v)
    assert read_launch_env() == LaunchEnv(5, 8, 1, 4)


def test_deepspeed_launcher_variables(clean_env):
    # deepspeed's launcher names the processes on this node LOCAL_SIZE
    for k, v in dict(RANK="6", WORLD_SIZE="8", LOCAL_RANK="2", LOCAL_SIZE="4").items():
        clean_env.setenv(k, v)
    assert read_launch_env() == LaunchEnv(6, 8, 2, 4)


def test_slurm_variables_with_compressed_tasks_per_node(clean_env):
    for k, v in dict(SLURM_PROCID="130", SLURM_NTASKS="512", SLURM_LOCALID="2",
                     SLURM_TASKS_PER_NODE="4(x128)").items():
        clean_env.setenv(k, v)
    assert read_launch_env() == LaunchEnv(130, 512, 2, 4)


def test_bad_values_are_named(clean_env):
    clean_env.setenv("WORLD_SIZE", "eight")
    with pytest.raises(ValueError, match="WORLD_SIZE='eight'"):
        read_launch_env()
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("RANK", "4")
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        read_launch_env()


def test_multi_node_needs_a_master_address(clean_env):
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        init_distributed(LaunchEnv(0, 8, 0, 4), timeout_minutes=1)


def test_device_choice_one_gpu_per_rank_or_cpu(monkeypatch):
    """cuda:LOCAL_RANK where torch sees GPUs, the CPU otherwise; FL_MEGATRON_DEVICE forces it;
    more ranks on a node than GPUs is refused with the fix (a 1-GPU box once put 4 ranks on cuda:0)."""
    import pytest
    import torch

    from fl_megatron.training.launch import LaunchEnv

    env = LaunchEnv(rank=5, world_size=8, local_rank=1, local_world_size=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("FL_MEGATRON_DEVICE", raising=False)
    assert env.device == torch.device("cuda", 1)
    monkeypatch.setenv("FL_MEGATRON_DEVICE", "cpu")
    assert env.device == torch.device("cpu")
    monkeypatch.setenv("FL_MEGATRON_DEVICE", "auto")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="local rank 1 has no GPU of its own: this node has 1 and 4 ranks"):
        _ = env.device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert env.device == torch.device("cpu")
    monkeypatch.setenv("FL_MEGATRON_DEVICE", "cuda")
    with pytest.raises(ValueError, match="torch sees no GPU"):
        _ = env.device
    monkeypatch.setenv("FL_MEGATRON_DEVICE", "gpu")
    with pytest.raises(ValueError, match="is not one of auto, cpu, cuda"):
        _ = env.device


def test_gloo_on_cuda_shares_a_gpu_and_nccl_insists_on_gpus(monkeypatch):
    """FL_MEGATRON_DIST_BACKEND=gloo: CUDA ranks on gloo, several to a GPU (rank r on GPU r mod
    count), as tools/gpu_check.py runs two groups on one GPU; nccl needs GPU ranks; auto: NCCL on
    GPUs, gloo on CPU; anything else is refused by name."""
    import pytest
    import torch

    from fl_megatron.training.launch import LaunchEnv

    env = LaunchEnv(rank=3, world_size=4, local_rank=3, local_world_size=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("FL_MEGATRON_DEVICE", "cuda")
    monkeypatch.setenv("FL_MEGATRON_DIST_BACKEND", "gloo")
    assert (env.device, env.collectives) == (torch.device("cuda", 1), "gloo")
    monkeypatch.setenv("FL_MEGATRON_DIST_BACKEND", "nccl")
    with pytest.raises(ValueError, match="local rank 3 has no GPU of its own"):
        _ = env.collectives
    first = LaunchEnv(rank=1, world_size=4, local_rank=1, local_world_size=4)
    assert (first.device, first.collectives) == (torch.device("cuda", 1), "nccl")
    monkeypatch.setenv("FL_MEGATRON_DIST_BACKEND", "auto")
    assert first.collectives == "nccl"
    monkeypatch.setenv("FL_MEGATRON_DEVICE", "cpu")
    assert first.collectives == "gloo"
    monkeypatch.setenv("FL_MEGATRON_DIST_BACKEND", "nccl")
    with pytest.raises(ValueError, match="nccl needs GPU ranks"):
        _ = first.collectives
    monkeypatch.setenv("FL_MEGATRON_DIST_BACKEND", "mpi")
    with pytest.raises(ValueError, match="'mpi' is not one of auto, nccl, gloo"):
        _ = first.collectives


def test_deterministic_mode_asks_torch_for_deterministic_kernels(monkeypatch):
    """--deterministic-mode (what an exact resume on CUDA compares with): torch's deterministic
    algorithms on (warning, not stopping, where an op has none), cuBLAS's fixed workspace set
    before its first handle unless the user chose one, cuDNN's autotuner off."""
    import os

    import torch

    from fl_megatron.config.flags import parse_args
    from fl_megatron.training.determinism import make_deterministic

    assert parse_args(["--deterministic-mode"])[0].training.deterministic_mode is True
    assert parse_args([])[0].training.deterministic_mode is False
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        make_deterministic()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and not torch.backends.cudnn.benchmark
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        make_deterministic()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)
