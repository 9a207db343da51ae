# Builds and launches `python -m fl_megatron.pretrain` for the recipes in examples/MODEL/BACKEND/
# (the arguments are read by fl_read_recipe in common.sh).
# Sourced, not run, by examples/slurm/*.sbatch and examples/deepspeed/launch-deepspeed.sh, which set:
#   BACKEND      fsdp2 | deepspeed | megatron
#   CLUSTER      128x4 | 64x8: NODESxGPUS_PER_NODE (the sbatch header must ask for the same)
#   FL_LAUNCHER  srun (default) | deepspeed (then FL_HOSTFILE: a DeepSpeed hostfile, absolute path)
# and pass: [MODEL] LAYOUT [extra pretrain flags...]; MODEL is llama3.1-8b (the default) or
# gpt3-6.7b; the extra flags come last, so they override the recipe.
#
# FL_DRY_RUN=1: start nothing (no srun, scontrol or deepspeed); run the same pretrain arguments in
# this one process with --world-size NODES*GPUS_PER_NODE --dry-run, which validates the layout and
# prints it with memory and communication estimates.
# PYTHON (default: python) and DEEPSPEED (default: deepspeed) name the programs to run.

set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
fl_read_recipe "$@"  # MODEL, LAYOUT, NODES, GPUS_PER_NODE, PRETRAIN_ARGS, ...; cd to the repository root
FL_LAUNCHER=${FL_LAUNCHER:-srun}
fl_one_of "$FL_LAUNCHER" srun deepspeed || fl_die "FL_LAUNCHER='$FL_LAUNCHER' is not srun or deepspeed"

if [[ $FL_LAUNCHER == deepspeed ]]; then
    # Hostfile lines: "HOST slots=N"; '#' starts a comment. A real run needs exactly NODES hosts
    # with slots=GPUS_PER_NODE; a dry run only warns (one example hostfile serves both clusters).
    [[ -f ${FL_HOSTFILE:-} ]] || fl_die "hostfile '${FL_HOSTFILE:-}' does not exist"
    FL_HOSTS=()
    FL_BAD_SLOTS=()
    while read -r line || [[ -n $line ]]; do
        line=${line%%#*}
        [[ -z ${line//[[:space:]]/} ]] && continue
        [[ $line =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+slots=([0-9]+)[[:space:]]*$ ]] ||
            fl_die "$FL_HOSTFILE: '$line' is not a 'HOST slots=N' line"
        FL_HOSTS+=("${BASH_REMATCH[1]}")
        [[ ${BASH_REMATCH[2]} == "$GPUS_PER_NODE" ]] || FL_BAD_SLOTS+=("${BASH_REMATCH[1]}")
    done <"$FL_HOSTFILE"
    [[ ${#FL_HOSTS[@]} -gt 0 ]] || fl_die "$FL_HOSTFILE lists no hosts"
    if [[ ${#FL_HOSTS[@]} != "$NODES" || ${#FL_BAD_SLOTS[@]} != 0 ]]; then
        problem="the $CLUSTER recipe needs $NODES hosts with slots=$GPUS_PER_NODE but $FL_HOSTFILE lists ${#FL_HOSTS[@]} host(s)"
        [[ ${#FL_BAD_SLOTS[@]} == 0 ]] || problem+=", ${#FL_BAD_SLOTS[@]} of them without slots=$GPUS_PER_NODE"
        [[ ${FL_DRY_RUN:-0} == 1 ]] || fl_die "$problem"
        echo "fl-megatron launch: warning: $problem (ignored by the dry run)" >&2
    fi
fi

if [[ ${FL_DRY_RUN:-0} == 1 ]]; then
    fl_show "$PYTHON" -m fl_megatron.pretrain "${PRETRAIN_ARGS[@]}" --world-size "$WORLD_SIZE_PLANNED" --dry-run
    exec "$PYTHON" -m fl_megatron.pretrain "${PRETRAIN_ARGS[@]}" --world-size "$WORLD_SIZE_PLANNED" --dry-run
fi

if [[ $FL_LAUNCHER == srun ]]; then
    # One task per GPU; ranks come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID.
    [[ -n ${SLURM_JOB_ID:-} ]] ||
        fl_die "not inside a SLURM job: submit this script with sbatch (FL_DRY_RUN=1 checks the recipe without SLURM)"
    [[ ${SLURM_JOB_NUM_NODES:-} == "$NODES" ]] ||
        fl_die "the $CLUSTER recipe needs $NODES nodes but this job has SLURM_JOB_NUM_NODES=${SLURM_JOB_NUM_NODES:-unset}; fix #SBATCH --nodes or use the script for your cluster"
    [[ ${SLURM_NTASKS_PER_NODE:-} == "$GPUS_PER_NODE" ]] ||
        fl_die "the $CLUSTER recipe needs $GPUS_PER_NODE tasks (GPUs) per node but this job has SLURM_NTASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-unset}; fix #SBATCH --ntasks-per-node"
    source "$FL_ROOT/examples/slurm/env.sh"
    echo "fl-megatron launch: $MODEL $RUN_NAME on $SLURM_JOB_NUM_NODES nodes x $GPUS_PER_NODE GPUs, master $MASTER_ADDR:$MASTER_PORT" >&2
    FL_CMD=(srun --kill-on-bad-exit=1 --nodes="$NODES" --ntasks-per-node="$GPUS_PER_NODE"
            "$PYTHON" -u -m fl_megatron.pretrain "${PRETRAIN_ARGS[@]}")
    fl_show "${FL_CMD[@]}"
    exec "${FL_CMD[@]}"
fi

# DeepSpeed's launcher: ssh (pdsh) to every host of the hostfile, GPUS_PER_NODE processes on each;
# ranks come from RANK / WORLD_SIZE / LOCAL_RANK (--no_local_rank: no --local_rank argument).
export MASTER_ADDR=${MASTER_ADDR:-${FL_HOSTS[0]}}  # rank 0 runs on the first host
source "$FL_ROOT/examples/slurm/env.sh"
# pdsh passes on NCCL_* by itself; everything else env.sh set reaches the other hosts through this file.
DS_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/fl-megatron-ds-env.XXXXXX")
export DS_ENV_FILE
trap 'rm -f "$DS_ENV_FILE"' EXIT
for var in OMP_NUM_THREADS PYTHONUNBUFFERED FL_MEGATRON_CACHE TORCH_NCCL_ASYNC_ERROR_HANDLING; do
    echo "$var=${!var}" >>"$DS_ENV_FILE"
done
FL_CMD=("${DEEPSPEED:-deepspeed}" --hostfile "$FL_HOSTFILE" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE"
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --no_local_rank
        --module fl_megatron.pretrain "${PRETRAIN_ARGS[@]}")
fl_show "${FL_CMD[@]}"
"${FL_CMD[@]}"
