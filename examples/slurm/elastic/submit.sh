#!/bin/bash
# Elastic mode on SLURM (README, "Elastic mode"): submits a torchft lighthouse job, then one job per
# federation group (group.sbatch), each its own world and failure domain:
#   examples/slurm/elastic/submit.sh [MODEL] LAYOUT [extra pretrain flags...]
#   LAYOUT on FL_CLUSTER=128x4 (the default; 512 GPUs): fl-hsdp: 16 groups of 32 GPUs (8 nodes x 4
#   each) | fl-fsdp: 128 groups of 4 (1 node each). On 64x8: 16 groups of 4 nodes, 64 of 1 node.
#   MODEL: llama3.1-8b (default) | gpt3-6.7b. The extra flags reach every group and override the recipe.
# Run it from a checkout and virtual environment every node sees (a login node). The group jobs
# start once the lighthouse job runs (--dependency=after) and read its HOST:PORT from
# RUN_DIR/launch/lighthouse.addr (or FL_LIGHTHOUSE_FILE); with FL_LIGHTHOUSE=HOST:PORT (a lighthouse
# that already runs) no lighthouse job is submitted. Logs and the job ids go to RUN_DIR/launch/.
# Settings (elastic.sh): FL_MIN_GROUPS (default 3/4 of the groups), FL_JOIN_TIMEOUT_MS,
# FL_HEARTBEAT_TIMEOUT_MS, FL_LIGHTHOUSE_PORT, FL_CLUSTER; group.sbatch: FL_MAX_RESTARTS.
# SBATCH (default sbatch) and PYTHON (default python) name the programs.
# FL_DRY_RUN=1 submits nothing: it prints the lighthouse's command and every sbatch command, then
# plans group 0 in this process with pretrain --dry-run --world-size GROUP_SIZE.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/elastic.sh"
fl_elastic_plan "$@"
fl_lighthouse_plan "$MIN_GROUPS"
SBATCH=${SBATCH:-sbatch}
DRY=${FL_DRY_RUN:-0}

# What every job must agree on; sbatch passes it on (--export=ALL, with the rest of this environment).
JOB_ENV=(FL_MEGATRON_ROOT="$FL_ROOT" FL_CLUSTER="$CLUSTER" FL_MIN_GROUPS="$MIN_GROUPS")
if [[ -n ${FL_LIGHTHOUSE:-} ]]; then
    JOB_ENV+=(FL_LIGHTHOUSE="$FL_LIGHTHOUSE")
else
    FL_LIGHTHOUSE_FILE=${FL_LIGHTHOUSE_FILE:-$FL_LAUNCH_DIR/lighthouse.addr}
    JOB_ENV+=(FL_LIGHTHOUSE_FILE="$FL_LIGHTHOUSE_FILE")
fi
echo "fl-megatron launch: elastic $MODEL $RUN_NAME: $NUM_GROUPS groups of $GROUP_SIZE ($NODES_PER_GROUP node(s) x $GPUS_PER_NODE GPUs each), a sync needs $MIN_GROUPS live groups; logs in $FL_LAUNCH_DIR" >&2

JOB_IDS=()
submit() {  # submit NAME COMMAND...: JOB_ID of the job it submits (a dry run only prints the command)
    local name=$1 out
    shift
    fl_show "$@"
    if [[ $DRY == 1 ]]; then
        JOB_ID=${name^^}_JOB_ID
        return
    fi
    out=$("$@") ||
        fl_die "submitting $name failed${JOB_IDS[*]:+; cancel the jobs already submitted: scancel ${JOB_IDS[*]}}"
    JOB_ID=${out%%;*}  # --parsable: "ID" or "ID;CLUSTER"
    [[ $JOB_ID =~ ^[0-9]+$ ]] || fl_die "$SBATCH printed '$out' for $name, not a job id"
    JOB_IDS+=("$JOB_ID")
    echo "$name $JOB_ID" >>"$FL_LAUNCH_DIR/jobs"
}

if [[ $DRY != 1 ]]; then
    mkdir -p "$FL_LAUNCH_DIR"
    : >"$FL_LAUNCH_DIR/jobs"
fi
AFTER=()
if [[ -z ${FL_LIGHTHOUSE:-} ]]; then
    [[ $DRY == 1 ]] || rm -f "$FL_LIGHTHOUSE_FILE"  # an old run's address must not be read
    echo "fl-megatron launch: the lighthouse job runs:" >&2
    fl_show "${LIGHTHOUSE_CMD[@]}"
    submit lighthouse env "${JOB_ENV[@]}" FL_JOIN_TIMEOUT_MS="$FL_JOIN_TIMEOUT_MS" \
        FL_HEARTBEAT_TIMEOUT_MS="$FL_HEARTBEAT_TIMEOUT_MS" FL_LIGHTHOUSE_PORT="$LIGHTHOUSE_PORT" \
        "$SBATCH" --parsable --export=ALL --output="$FL_LAUNCH_DIR/lighthouse-%j.out" "$HERE/lighthouse.sbatch"
    AFTER=(--dependency="after:$JOB_ID")
fi
for ((g = 0; g < NUM_GROUPS; g++)); do
    submit "group_$g" env "${JOB_ENV[@]}" FL_GROUP_ID="$g" \
        "$SBATCH" --parsable --export=ALL --job-name="fl-megatron-g$g" --nodes="$NODES_PER_GROUP" \
        --ntasks-per-node="$GPUS_PER_NODE" --gpus-per-node="$GPUS_PER_NODE" ${AFTER[@]+"${AFTER[@]}"} \
        --output="$FL_LAUNCH_DIR/group_$g-%j.out" "$HERE/group.sbatch" "$MODEL" "$LAYOUT" \
        ${FL_EXTRA_ARGS[@]+"${FL_EXTRA_ARGS[@]}"}
done

if [[ $DRY == 1 ]]; then
    fl_group_dry_run 0
fi
echo "fl-megatron launch: submitted ${#JOB_IDS[@]} jobs (names and ids in $FL_LAUNCH_DIR/jobs); stop them all: scancel \$(cut -d' ' -f2 $FL_LAUNCH_DIR/jobs)" >&2
