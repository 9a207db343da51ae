#!/bin/bash
# The 512-GPU recipes with the DeepSpeed backend on a cluster without SLURM, through DeepSpeed's own
# launcher (ssh to every host of a hostfile):
#   examples/deepspeed/launch-deepspeed.sh HOSTFILE [MODEL] LAYOUT CLUSTER [extra pretrain flags...]
#   MODEL: llama3.1-8b (default) | gpt3-6.7b    LAYOUT: fsdp | hsdp | fl-fsdp | fl-hsdp
#   CLUSTER: 128x4 | 64x8 (nodes x GPUs per node)
# Run it on the first host, from a checkout and virtual environment at the same path on every host.
# FL_DRY_RUN=1 starts nothing: it runs the same pretrain arguments here with --dry-run.
# The command building is shared with the SLURM scripts: see examples/slurm/launch.sh.
set -euo pipefail

usage() {
    echo "usage: $0 HOSTFILE [MODEL] LAYOUT CLUSTER [extra pretrain flags...]" >&2
    echo "  MODEL: llama3.1-8b (default), gpt3-6.7b; LAYOUT: fsdp, hsdp, fl-fsdp, fl-hsdp; CLUSTER: 128x4, 64x8" >&2
    exit 2
}

[[ $# -ge 3 ]] || usage
[[ -f $1 ]] || { echo "fl-megatron launch: error: hostfile '$1' does not exist" >&2; exit 2; }
FL_HOSTFILE=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")  # absolute: launch.sh changes directory
shift
# CLUSTER (NODESxGPUS) is the second word, or the third when a MODEL comes first; launch.sh checks the rest.
FL_MODEL_ARG=()
if [[ ! $2 =~ ^[0-9]+x[0-9]+$ && $# -ge 3 && ${3:-} =~ ^[0-9]+x[0-9]+$ ]]; then
    FL_MODEL_ARG=("$1")
    shift
fi
LAYOUT=$1
CLUSTER=$2
shift 2
BACKEND=deepspeed
FL_LAUNCHER=deepspeed
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../slurm" && pwd)/launch.sh" ${FL_MODEL_ARG[@]+"${FL_MODEL_ARG[@]}"} "$LAYOUT" "$@"
