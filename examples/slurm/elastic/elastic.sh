# What the elastic SLURM scripts share (submit.sh, group.sbatch, lighthouse.sbatch source it): the
# group layout of a recipe, the lighthouse's command and each group's pretrain arguments, derived
# from the same variables. Sourced; defines functions only. The environment it reads:
#   FL_CLUSTER               128x4 (default) | 64x8: the whole federation's NODESxGPUS_PER_NODE
#   FL_MIN_GROUPS            live groups a sync needs: every group's --fl-min-groups and the
#                            lighthouse's --min_replicas (default: 3/4 of the groups, rounded up)
#   FL_JOIN_TIMEOUT_MS       lighthouse --join_timeout_ms (60000): how long a quorum waits for a
#                            heartbeating group that has not asked to join; above a restart's time
#   FL_HEARTBEAT_TIMEOUT_MS  lighthouse --heartbeat_timeout_ms (5000): silence before a group is dropped
#   FL_LIGHTHOUSE_PORT       the lighthouse's port on its node (29510)
#   FL_LIGHTHOUSE            HOST:PORT of a lighthouse that already runs (then none is submitted)
#   FL_LIGHTHOUSE_FILE       where the lighthouse job writes HOST:PORT for the groups (default
#                            RUN_DIR/launch/lighthouse.addr, on the shared file system)

source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

# Set by these scripts for every group; the same flags among the extra ones are refused.
FL_ELASTIC_FLAGS=(--fl-elastic --fl-lighthouse --fl-group-id --fl-num-groups --fl-min-groups --fl-group-size
                  --world-size)

fl_int() {  # fl_int NAME VALUE MIN: VALUE must be an integer >= MIN
    [[ $2 =~ ^[0-9]+$ ]] && ((10#$2 >= $3)) || fl_die "$1='$2' is not an integer >= $3"
}

fl_address() {  # fl_address NAME VALUE: VALUE must be HOST:PORT
    [[ $2 =~ ^[^[:space:]:]+:[0-9]+$ || $2 =~ ^\[[0-9a-fA-F:]+\]:[0-9]+$ ]] ||
        fl_die "$1='$2' is not a lighthouse address HOST:PORT"
}

fl_elastic_plan() {  # fl_elastic_plan [MODEL] LAYOUT [extra pretrain flags...]
    # fl_read_recipe's variables, then GROUP_SIZE NUM_GROUPS NODES_PER_GROUP MIN_GROUPS RUN_DIR
    # (absolute) and FL_LAUNCH_DIR (RUN_DIR/launch: the jobs' logs, the lighthouse address).
    BACKEND=fsdp2  # elastic mode runs on fsdp2 so far
    CLUSTER=${FL_CLUSTER:-128x4}
    FL_LAYOUTS=(fl-fsdp fl-hsdp)
    FL_LAYOUTS_NOTE=" in elastic mode (one job per federation group)"
    fl_read_recipe "$@"
    local i arg flag recipe=$RECIPES/$LAYOUT-$CLUSTER.json
    RUN_DIR=runs/$MODEL/$RUN_NAME  # the recipe's run_dir, unless an extra --run-dir overrides it
    for ((i = 0; i < ${#FL_EXTRA_ARGS[@]}; i++)); do
        arg=${FL_EXTRA_ARGS[i]}
        for flag in "${FL_ELASTIC_FLAGS[@]}"; do
            if [[ $arg == "$flag" || $arg == "$flag="* ]]; then
                fl_die "$flag is set by the elastic scripts, drop it (the layout gives the groups; FL_MIN_GROUPS the minimum)"
            fi
        done
        if [[ $arg == --run-dir ]]; then RUN_DIR=${FL_EXTRA_ARGS[i + 1]:-}; fi
        if [[ $arg == --run-dir=* ]]; then RUN_DIR=${arg#--run-dir=}; fi
    done
    [[ -n $RUN_DIR ]] || fl_die "--run-dir needs a directory"
    [[ $(<"$recipe") =~ \"group_size\":[[:space:]]*([0-9]+) ]] || fl_die "$recipe sets no federation group_size"
    GROUP_SIZE=${BASH_REMATCH[1]}
    ((GROUP_SIZE % GPUS_PER_NODE == 0 && WORLD_SIZE_PLANNED % GROUP_SIZE == 0)) ||
        fl_die "$recipe: groups of $GROUP_SIZE do not fill whole nodes of $GPUS_PER_NODE GPUs (each group is its own job)"
    NUM_GROUPS=$((WORLD_SIZE_PLANNED / GROUP_SIZE))
    NODES_PER_GROUP=$((GROUP_SIZE / GPUS_PER_NODE))
    MIN_GROUPS=${FL_MIN_GROUPS:-$(((3 * NUM_GROUPS + 3) / 4))}
    if [[ ! $MIN_GROUPS =~ ^[0-9]+$ ]] || ((10#$MIN_GROUPS < 1 || 10#$MIN_GROUPS > NUM_GROUPS)); then
        fl_die "FL_MIN_GROUPS=$MIN_GROUPS: the $LAYOUT layout on $CLUSTER has $NUM_GROUPS groups of $GROUP_SIZE, so min groups must lie in 1 .. $NUM_GROUPS"
    fi
    MIN_GROUPS=$((10#$MIN_GROUPS))
    [[ $RUN_DIR == /* ]] || RUN_DIR=$FL_ROOT/$RUN_DIR
    FL_LAUNCH_DIR=$RUN_DIR/launch
    if [[ -n ${FL_LIGHTHOUSE:-} ]]; then fl_address FL_LIGHTHOUSE "$FL_LIGHTHOUSE"; fi
}

fl_lighthouse_plan() {  # fl_lighthouse_plan MIN_GROUPS: LIGHTHOUSE_PORT and LIGHTHOUSE_CMD, torchft's lighthouse
    fl_int "min groups (FL_MIN_GROUPS)" "$1" 1
    fl_int FL_JOIN_TIMEOUT_MS "${FL_JOIN_TIMEOUT_MS:=60000}" 1
    fl_int FL_HEARTBEAT_TIMEOUT_MS "${FL_HEARTBEAT_TIMEOUT_MS:=5000}" 1
    fl_int FL_LIGHTHOUSE_PORT "${FL_LIGHTHOUSE_PORT:=29510}" 1
    LIGHTHOUSE_PORT=$FL_LIGHTHOUSE_PORT
    LIGHTHOUSE_CMD=("${FL_LIGHTHOUSE_EXE:-torchft_lighthouse}" --bind "0.0.0.0:$LIGHTHOUSE_PORT"
                    --min_replicas "$1" --join_timeout_ms "$FL_JOIN_TIMEOUT_MS"
                    --heartbeat_timeout_ms "$FL_HEARTBEAT_TIMEOUT_MS")
}

fl_group_args() {  # fl_group_args G LIGHTHOUSE: GROUP_ARGS, group G's pretrain arguments
    GROUP_ARGS=("${PRETRAIN_ARGS[@]}" --fl-elastic --fl-lighthouse "$2" --fl-group-id "$1"
                --fl-num-groups "$NUM_GROUPS" --fl-min-groups "$MIN_GROUPS")
}

fl_group_dry_run() {  # fl_group_dry_run G: starts nothing; plans group G's job in this process
    # (--world-size GROUP_SIZE: the job's ranks; pretrain places them in the federation of
    # NUM_GROUPS groups and prints the whole layout). The lighthouse is not contacted.
    fl_group_args "$1" "${FL_LIGHTHOUSE:-LIGHTHOUSE_HOST:${FL_LIGHTHOUSE_PORT:-29510}}"
    fl_show "$PYTHON" -m fl_megatron.pretrain "${GROUP_ARGS[@]}" --world-size "$GROUP_SIZE" --dry-run
    exec "$PYTHON" -m fl_megatron.pretrain "${GROUP_ARGS[@]}" --world-size "$GROUP_SIZE" --dry-run
}
