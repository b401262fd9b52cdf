# Shared by the sbatch scripts beside it, which set JOB_NAME, NODES, GPUS_PER_NODE, TIME_LIMIT_MIN,
# ENTRY and ARGS, then call run_job "$@" (extra arguments go to the trainer and replace the same
# flags' values in ARGS: see one_value_per_flag).
# Submit from the repository root:
#
#     sbatch examples/slurm/pretrain_gpt.sbatch
#     bash examples/slurm/pretrain_gpt.sbatch --dry-run   # each node's torchrun command; runs nothing
#
# One torchrun per node (srun + tools/launch_node.py: rendezvous on the job's first node). TensorBoard
# goes to runs/<job name>-<job id>, checkpoints to checkpoints/<job name>, with --save and --load, so a
# requeued job resumes from the latest checkpoint.
#
# Stopping and requeueing: the trainers save and stop EXIT_MARGIN_MIN minutes before the job's end
# (--exit-duration-in-mins, from SLURM_JOB_END_TIME or squeue's time left, else TIME_LIMIT_MIN) and on
# SIGTERM to the job steps (--exit-signal-handler; #SBATCH --signal). A job whose checkpoint advanced
# but did not reach --train-iters requeues itself (at most MAX_REQUEUES times, default 50; never
# with --finetune, which restarts from iteration 0); one that made no progress ends with srun's
# status. scancel, or a pre-emption that signals the batch script, ends the script itself: no
# self-requeue then (Slurm requeues a pre-empted job itself under PreemptMode=REQUEUE).
# torchrun gives its workers 30 s after a SIGTERM of its own, so the time limit, not the signal, is
# the safe way to stop a run whose checkpoint takes longer to write (checkpoints are atomic: an
# interrupted one leaves the previous one as latest).
#
# Environment: PYTHON (default: the repo's .venv/bin/python, made by tools/setup.sh, else python3),
# CHECKPOINT_DIR, TENSORBOARD_DIR, EXIT_MARGIN_MIN (default 10), MAX_REQUEUES (default 50).

# The value of the last "--flag VALUE" or "--flag=VALUE" in the arguments (argparse's last one
# wins), or $2 if there is none.
last_value() {
    local flag=$1 value=$2
    shift 2
    while (($#)); do
        if [[ $1 == "$flag" && $# -gt 1 ]]; then value=$2; elif [[ $1 == "$flag="* ]]; then value=${1#*=}; fi
        shift
    done
    echo "$value"
}

# The arguments, NUL-separated (for read -d ''), with each flag once: where it first stands, with
# the values of its last occurrence, the one argparse keeps. So a flag given after ARGS replaces
# the default on the command line instead of following it there: the printed command then says
# what the trainer runs with, and a multi-value flag (--data-path 0.3 A 0.7 B) is replaced whole.
# A flag is a word "--NAME" or "--NAME=VALUE"; its values are the words up to the next flag.
one_value_per_flag() {
    local words=("$@") starts=() names=() i g name
    local -A last=() printed=()
    for ((i = 0; i < $#; i++)); do
        if [[ ${words[i]} == --?* ]]; then
            name=${words[i]%%=*}
            last[$name]=${#starts[@]}
            starts+=("$i")
            names+=("$name")
        elif ((${#starts[@]} == 0)); then
            printf '%s\0' "${words[i]}"  # before any flag: kept as it is
        fi
    done
    starts+=("$#")
    for ((g = 0; g < ${#names[@]}; g++)); do
        name=${names[g]}
        [[ -z ${printed[$name]:-} ]] || continue
        printed[$name]=1
        i=${last[$name]}
        printf '%s\0' "${words[@]:starts[i]:starts[i + 1] - starts[i]}"
    done
}

has_flag() {
    local flag=$1 arg
    shift
    for arg in "$@"; do [[ $arg == "$flag" ]] && return 0; done
    return 1
}

latest_iteration() {
    local value
    value=$(tr -d '[:space:]' <"$1/latest_checkpointed_iteration.txt" 2>/dev/null || true)
    [[ $value =~ ^[0-9]+$ ]] && echo "$value" || echo 0  # none yet, or "release"
}

# Whole minutes until the job's end: Slurm's end time (23.02+), else squeue's time left, else
# TIME_LIMIT_MIN (the script's own --time).
minutes_left() {
    if [[ -n ${SLURM_JOB_END_TIME:-} ]]; then
        echo $(((SLURM_JOB_END_TIME - $(date +%s)) / 60))
        return
    fi
    local left
    left=$(squeue -h -j "${SLURM_JOB_ID:-0}" -o %L 2>/dev/null || true)
    if [[ $left =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]]; then
        echo $((10#${BASH_REMATCH[2]:-0} * 1440 + 10#${BASH_REMATCH[4]:-0} * 60 + 10#${BASH_REMATCH[5]}))
    else
        echo "$TIME_LIMIT_MIN"
    fi
}

run_job() {
    local dry_run=0 extra=() arg
    for arg in "$@"; do
        if [[ $arg == --dry-run ]]; then dry_run=1; else extra+=("$arg"); fi
    done
    local name=${SLURM_JOB_NAME:-$JOB_NAME}
    local ckpt=${CHECKPOINT_DIR:-checkpoints/$name}
    local tb=${TENSORBOARD_DIR:-runs/$name-${SLURM_JOB_ID:-dry-run}}
    local exit_minutes=$(($(minutes_left) - ${EXIT_MARGIN_MIN:-10}))
    if ((exit_minutes < 1)); then
        echo "warning: the job ends in under ${EXIT_MARGIN_MIN:-10} minutes; the trainers stop after 1" >&2
        exit_minutes=1
    fi
    local args=() word
    while IFS= read -r -d '' word; do args+=("$word"); done < <(one_value_per_flag "${ARGS[@]}" --save "$ckpt" \
        --load "$ckpt" --tensorboard-dir "$tb" --exit-signal-handler --exit-duration-in-mins "$exit_minutes" \
        ${extra[@]+"${extra[@]}"})
    ckpt=$(last_value --save "$ckpt" "${args[@]}")  # the trainer's, should the extra arguments give one
    local python=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
    local launch=("$python" tools/launch_node.py --nproc-per-node "$GPUS_PER_NODE")
    if ((dry_run)); then
        SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-node[1-$NODES]} "${launch[@]}" --dry-run -- "$ENTRY" "${args[@]}"
        return
    fi
    local before after status=0 target
    before=$(latest_iteration "$ckpt")
    srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${launch[@]}" -- "$ENTRY" "${args[@]}" || status=$?
    after=$(latest_iteration "$ckpt")
    target=$(last_value --train-iters 0 "${args[@]}")
    if ((after > before && after < target)); then
        if has_flag --finetune "${args[@]}"; then
            echo "stopped at iteration $after of $target; not requeued: --finetune would restart from 0" \
                "(resubmit without it to resume)"
        elif ((${SLURM_RESTART_COUNT:-0} >= ${MAX_REQUEUES:-50})); then
            echo "stopped at iteration $after of $target; not requeued: requeued ${SLURM_RESTART_COUNT} times already"
        else
            echo "stopped at iteration $after of $target: requeueing job $SLURM_JOB_ID to resume from it"
            scontrol requeue "$SLURM_JOB_ID"
            return 0
        fi
    fi
    return "$status"
}
