"""Joining the job: ranks from the launcher's environment, device choice, process-group init."""

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher (torchrun, srun, ...) says."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    # whether the launcher said how many processes run on this node (else it is a guess)
    local_world_from_launcher: bool = field(default=False, compare=False)
    # elastic mode: this process's rank and size in its own job (one federation group), while
    # rank and world_size place it in the whole federation; None: the job is the federation
    job: tuple | None = field(default=None, compare=False)

    @property
    def job_rank(self) -> int:
        return self.rank if self.job is None else self.job[0]

    @property
    def job_world_size(self) -> int:
        return self.world_size if self.job is None else self.job[1]

    def in_federation(self, group_id: int, num_groups: int, sizes=None) -> "LaunchEnv":
        """Elastic mode: this job is federation group `group_id` of `num_groups` slots; ranks in
        the federation are group_id * group size + job rank (the data and the layout use them), or
        with groups of unequal `sizes` the sizes of the groups before it + job rank."""
        size = self.world_size
        first, world = (group_id * size, num_groups * size) if sizes is None else (sum(sizes[:group_id]), sum(sizes))
        return LaunchEnv(first + self.rank, world, self.local_rank, self.local_world_size,
                         self.local_world_from_launcher, (self.rank, size))

    @property
    def collectives(self) -> str:
        """The job's collective library: NCCL on GPUs, gloo on CPU ranks. FL_MEGATRON_DIST_BACKEND=gloo
        puts CUDA ranks on gloo (collectives staged through host memory: slow, for checks on a
        machine with fewer GPUs than ranks, tools/gpu_check.py's on one GPU); =nccl insists on NCCL."""
        choice = os.environ.get("FL_MEGATRON_DIST_BACKEND", "auto")
        if choice not in ("auto", "nccl", "gloo"):
            raise ValueError(f"FL_MEGATRON_DIST_BACKEND={choice!r} is not one of auto, nccl, gloo")
        on_gpu = self.device.type == "cuda"
        if choice == "nccl" and not on_gpu:
            raise ValueError("FL_MEGATRON_DIST_BACKEND=nccl needs GPU ranks, and these run on the CPU "
                             "(FL_MEGATRON_DEVICE, or torch sees no GPU)")
        return "gloo" if choice == "gloo" or not on_gpu else "nccl"

    @property
    def device(self) -> torch.device:
        """One GPU per rank where CUDA is available (cuda:LOCAL_RANK), else the CPU with gloo.
        FL_MEGATRON_DEVICE=cpu forces CPU ranks (the demo and the tests on a GPU machine);
        more ranks on a node than GPUs is refused (NCCL cannot put two ranks on one GPU), except
        on gloo (FL_MEGATRON_DIST_BACKEND=gloo): rank r then shares GPU r mod (GPUs on the node)."""
        choice = os.environ.get("FL_MEGATRON_DEVICE", "auto")
        if choice not in ("auto", "cpu", "cuda"):
            raise ValueError(f"FL_MEGATRON_DEVICE={choice!r} is not one of auto, cpu, cuda")
        if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ValueError("FL_MEGATRON_DEVICE=cuda but torch sees no GPU (a CPU build of torch, or no driver)")
        count = torch.cuda.device_count()
        if self.local_rank >= count:
            if os.environ.get("FL_MEGATRON_DIST_BACKEND") == "gloo":
                return torch.device("cuda", self.local_rank % count)
            raise ValueError(f"local rank {self.local_rank} has no GPU of its own: this node has {count} and "
                             f"{self.local_world_size} ranks; launch at most {count} per node, or set "
                             "FL_MEGATRON_DEVICE=cpu for CPU ranks on gloo")
        return torch.device("cuda", self.local_rank)


def _int_env(names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


def _slurm_tasks_per_node() -> int | None:
    """First count of SLURM_TASKS_PER_NODE ("4(x128)" or "4,4" -> 4)."""
    value = os.environ.get("SLURM_TASKS_PER_NODE", "")
    digits = value.split("(")[0].split(",")[0]
    return int(digits) if digits.isdigit() else None


def read_launch_env() -> LaunchEnv:
    """Ranks from torchrun's variables, or SLURM's under srun; a single process otherwise."""
    rank = _int_env(("RANK", "SLURM_PROCID"), 0)
    world = _int_env(("WORLD_SIZE", "SLURM_NTASKS"), 1)
    local_rank = _int_env(("LOCAL_RANK", "SLURM_LOCALID"), 0)
    # torchrun: LOCAL_WORLD_SIZE; the deepspeed launcher: LOCAL_SIZE; srun: SLURM_NTASKS_PER_NODE
    local_world = _int_env(("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"), None)
    if local_world is None:
        local_world = _slurm_tasks_per_node()
    from_launcher = local_world is not None
    if local_world is None:
        local_world = world
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} ranks (check RANK / WORLD_SIZE)")
    return LaunchEnv(rank, world, local_rank, local_world, from_launcher)


def init_distributed(env: LaunchEnv, timeout_minutes: float) -> None:
    """Create the default process group (the job's: in elastic mode one federation group's): NCCL on
    GPUs, gloo on CPU (LaunchEnv.collectives); one process needs no launcher."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        if env.local_world_size < env.job_world_size:
            raise ValueError(
                f"MASTER_ADDR is not set and the {env.job_world_size} ranks span several nodes: set it "
                "to the first node's address (under SLURM: export MASTER_ADDR=$(scontrol show "
                "hostnames $SLURM_JOB_NODELIST | head -n 1)) and MASTER_PORT to a free port")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(env.job_rank))
    os.environ.setdefault("WORLD_SIZE", str(env.job_world_size))
    device, backend = env.device, env.collectives
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=env.job_rank, world_size=env.job_world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes),
                            device_id=device if backend == "nccl" else None)
