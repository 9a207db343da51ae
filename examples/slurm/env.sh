# Environment of a multi-node fl-megatron job. Sourced by examples/slurm/launch.sh right before it
# launches (inside a SLURM job, or by examples/deepspeed/launch-deepspeed.sh); never in a dry run.
# Edit the placeholders for your cluster; a variable already set in the environment wins where noted.

# Rendezvous: rank 0's node and a port on it (every rank reads both; a multi-node job must set them).
if [[ -z ${MASTER_ADDR:-} && -n ${SLURM_JOB_NODELIST:-} ]]; then
    # first node of the job (pipefail off: scontrol may get SIGPIPE once head has its line)
    MASTER_ADDR=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
[[ -n ${MASTER_ADDR:-} ]] || { echo "fl-megatron env.sh: error: MASTER_ADDR is not set" >&2; exit 2; }
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-9500} % 20000))}  # per-job port: two jobs on a node do not clash

# CPU threads per rank: the work is on the GPU; torchrun's default, raise it if data loading needs more.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# srun >= 22.05 no longer inherits sbatch's --cpus-per-task: pass it on explicitly.
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi
# Print progress lines as they come instead of in buffered blocks in the job log.
export PYTHONUNBUFFERED=1
# Cache of the tokenised demo corpus on the shared file system: rank 0 builds it once, every node reads it.
export FL_MEGATRON_CACHE=${FL_MEGATRON_CACHE:-$PWD/.cache/fl-megatron}

# NCCL: only warnings and errors in the log (INFO prints the chosen transports, for debugging).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A failed or timed-out collective aborts the process, so the job ends instead of hanging.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# NCCL's bootstrap/socket interface: the nodes' data network, e.g. ib0 or an Ethernet bond (placeholder).
# export NCCL_SOCKET_IFNAME=ib0
# InfiniBand adapters NCCL may use, e.g. the HCAs next to the GPUs (placeholder; `ibv_devinfo` lists them).
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3
# GPUDirect RDMA between the adapters and the GPUs where the topology allows it (placeholder).
# export NCCL_NET_GDR_LEVEL=PHB

# CUDA_DEVICE_MAX_CONNECTIONS=1 is a Megatron tensor-parallel setting: it makes kernels run in launch
# order, which serialises FSDP2/ZeRO-3's reduce-scatter with the backward compute. fl-megatron has no
# tensor parallelism, so keep CUDA's default (8) even if the site environment sets 1.
unset CUDA_DEVICE_MAX_CONNECTIONS
