# Shared by the sbatch scripts beside it, which set JOB_NAME, NODES, GPUS_PER_NODE, TIME_LIMIT_MIN,
# TRAIN_ITERS, ENTRY and ARGS, then call run_job "$@". Submit from the repository root:
#
#     sbatch examples/slurm/pretrain_gpt.sbatch
#     bash examples/slurm/pretrain_gpt.sbatch --dry-run   # each node's torchrun command; runs nothing
#
# One torchrun per node (srun + tools/launch_node.py: rendezvous on the job's first node). TensorBoard
# goes to runs/<job name>-<job id>, checkpoints to checkpoints/<job name>, with --save and --load, so a
# requeued job resumes from the latest checkpoint. The trainers save and stop EXIT_MARGIN_MIN minutes
# before the time limit (--exit-duration-in-mins) and on SIGTERM (--exit-signal-handler: SLURM's
# pre-emption, or --signal); a run that stopped before TRAIN_ITERS is requeued. torchrun gives its
# workers 30 s after a SIGTERM of its own, so the time limit, not the signal, is the safe way to stop
# a run whose checkpoint takes longer to write (checkpoints are atomic: an interrupted one leaves the
# previous one as latest).
# Environment: PYTHON (default python3), CHECKPOINT_DIR, TENSORBOARD_DIR, EXIT_MARGIN_MIN (default 10).

run_job() {
    local dry_run=0 extra=() arg
    for arg in "$@"; do
        if [[ $arg == --dry-run ]]; then dry_run=1; else extra+=("$arg"); fi
    done
    local name=${SLURM_JOB_NAME:-$JOB_NAME}
    local ckpt=${CHECKPOINT_DIR:-checkpoints/$name}
    local tb=${TENSORBOARD_DIR:-runs/$name-${SLURM_JOB_ID:-dry-run}}
    local exit_minutes=$((TIME_LIMIT_MIN - ${EXIT_MARGIN_MIN:-10}))
    local args=("${ARGS[@]}" --save "$ckpt" --load "$ckpt" --tensorboard-dir "$tb" --exit-signal-handler
                --exit-duration-in-mins "$exit_minutes" "${extra[@]}")
    local launch=("${PYTHON:-python3}" tools/launch_node.py --nproc-per-node "$GPUS_PER_NODE")
    if ((dry_run)); then
        SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-node[1-$NODES]} "${launch[@]}" --dry-run -- "$ENTRY" "${args[@]}"
        return
    fi
    srun --ntasks-per-node 1 --kill-on-bad-exit 1 "${launch[@]}" -- "$ENTRY" "${args[@]}" || return
    local latest
    latest=$(cat "$ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
    if [[ $latest =~ ^[0-9]+$ ]] && ((latest < TRAIN_ITERS)); then
        echo "stopped at iteration $latest of $TRAIN_ITERS: requeueing job $SLURM_JOB_ID to resume from it"
        scontrol requeue "$SLURM_JOB_ID"
    fi
}
