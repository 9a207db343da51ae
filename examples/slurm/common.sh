# Functions shared by the launch scripts (launch.sh, elastic/*): messages, and reading a recipe from
# the arguments [MODEL] LAYOUT [extra pretrain flags...]. Sourced; defines functions only.

set -euo pipefail

FL_MODELS=(llama3.1-8b gpt3-6.7b)  # the first is the default; recipes in examples/MODEL/BACKEND/
FL_BACKENDS=(fsdp2 deepspeed megatron)
FL_CLUSTERS=(128x4 64x8)

fl_die() {
    echo "fl-megatron launch: error: $*" >&2
    exit 2
}

fl_one_of() {  # fl_one_of WORD CHOICE... : whether WORD is one of the choices
    local word=$1 choice
    shift
    for choice in "$@"; do [[ $word == "$choice" ]] && return 0; done
    return 1
}

fl_list() {  # "a, b, c"
    local IFS=, joined
    joined="$*"
    echo "${joined//,/, }"
}

fl_show() {  # print a command line to stderr, quoted so that it can be pasted back
    local line
    line=$(printf '%q ' "$@")
    echo "fl-megatron launch: ${line% }" >&2
}

fl_read_recipe() {  # fl_read_recipe [MODEL] LAYOUT [extra pretrain flags...]
    # Needs BACKEND and CLUSTER; FL_LAYOUTS (default: every layout) and FL_LAYOUTS_NOTE (words after
    # "valid layouts") may narrow the choice. Sets MODEL LAYOUT NODES GPUS_PER_NODE WORLD_SIZE_PLANNED
    # FL_ROOT RECIPES RUN_NAME PRETRAIN_ARGS (the recipe's arguments, then the extra flags, which
    # override it) FL_EXTRA_ARGS PYTHON, and changes to the repository root (the recipes' paths and
    # run directories are relative to it).
    [[ -n ${FL_LAYOUTS+set} ]] || FL_LAYOUTS=(fsdp hsdp fl-fsdp fl-hsdp)
    MODEL=${FL_MODELS[0]}
    if [[ $# -gt 0 ]] && fl_one_of "$1" "${FL_MODELS[@]}"; then
        MODEL=$1
        shift
    fi
    LAYOUT=${1:-}
    [[ $# -gt 0 ]] && shift
    if [[ -z $LAYOUT ]]; then
        fl_die "no layout given (arguments: [MODEL] LAYOUT [extra pretrain flags...]); valid layouts${FL_LAYOUTS_NOTE:-}: $(fl_list "${FL_LAYOUTS[@]}")"
    elif ! fl_one_of "$LAYOUT" "${FL_LAYOUTS[@]}"; then
        fl_die "unknown layout '${LAYOUT}'; valid layouts${FL_LAYOUTS_NOTE:-}: $(fl_list "${FL_LAYOUTS[@]}"); a model may come first: $(fl_list "${FL_MODELS[@]}") (default ${FL_MODELS[0]})"
    fi
    fl_one_of "${BACKEND:-}" "${FL_BACKENDS[@]}" || fl_die "BACKEND='${BACKEND:-}' is not one of $(fl_list "${FL_BACKENDS[@]}")"
    if ! fl_one_of "${CLUSTER:-}" "${FL_CLUSTERS[@]}"; then
        fl_die "unknown cluster '${CLUSTER:-}'; valid clusters: $(fl_list "${FL_CLUSTERS[@]}")"
    fi
    NODES=${CLUSTER%x*}
    GPUS_PER_NODE=${CLUSTER#*x}
    WORLD_SIZE_PLANNED=$((NODES * GPUS_PER_NODE))

    FL_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    cd "$FL_ROOT"

    RECIPES=examples/$MODEL/$BACKEND
    RUN_NAME=$BACKEND-$LAYOUT-$CLUSTER
    if [[ $BACKEND == deepspeed ]]; then  # model/training/data from run-CLUSTER.json, ZeRO-3/batch/optimizer/federation from the DS JSON
        PRETRAIN_ARGS=(--config "$RECIPES/run-$CLUSTER.json" --deepspeed_config "$RECIPES/$LAYOUT-$CLUSTER.json"
                       --run-dir "runs/$MODEL/$RUN_NAME")
    else  # fsdp2, megatron: one run JSON (its "parallel" section names the backend)
        PRETRAIN_ARGS=(--config "$RECIPES/$LAYOUT-$CLUSTER.json")
    fi
    local f
    for f in "${PRETRAIN_ARGS[@]}"; do
        if [[ $f == *.json && ! -f $f ]]; then fl_die "recipe $FL_ROOT/$f is missing"; fi
    done
    FL_EXTRA_ARGS=("$@")
    PRETRAIN_ARGS+=("$@")
    PYTHON=${PYTHON:-python}
}
