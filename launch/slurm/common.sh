# Sourced by launch/slurm/train_*.sbatch in the batch shell, from the repository root: map the allocation
# (slurm_env.py), start one launcher per node (node.sh), forward the stop signal, requeue a stopped job.

EXIT_STOPPED=3  # launch/train.py: stopped on request after saving a checkpoint (moe_dist/train/preempt.py)
STOP_FORWARDED=0

# Start "$@" in the background and wait for it; a SIGUSR1 to this shell (#SBATCH --signal=B:USR1@300, or
# `scancel --signal=USR1 --batch JOB`) is forwarded to it: srun passes it on to every process of its step, and
# the training processes stop at the next step boundary with a checkpoint. Returns its exit status.
run_forwarding_usr1() {
    "$@" &
    local pid=$! rc
    local say='echo "moe_dist: SIGUSR1: asking the training processes to stop with a checkpoint"'
    trap "STOP_FORWARDED=1; $say; kill -USR1 $pid" USR1
    while :; do
        rc=0
        wait "$pid" || rc=$?
        # wait returns >128 when a trapped signal interrupts it; the step may still be running.
        ((rc > 128)) && kill -0 "$pid" 2>/dev/null || break
    done
    ((rc > 128)) && { rc=0; wait "$pid" || rc=$?; }  # it ended meanwhile: its own status, kept by bash
    trap - USR1
    return "$rc"
}

# run_training torchrun|deepspeed TRAIN_ARGS...: the whole job; exits with the training's status.
run_training() {
    local launcher=$1 vars rc
    shift
    # Bad input (an allocation that does not fit the layout, a bad config): its one line, exit 2, no step started.
    vars=$("${PYTHON:-python3}" launch/slurm/slurm_env.py "$@") || exit "$?"
    eval "$vars"
    export NNODES NPROC_PER_NODE MASTER_ADDR MASTER_PORT
    echo "moe_dist: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): $NNODES nodes x $NPROC_PER_NODE" \
        "processes = world $WORLD, $launcher, master $MASTER_ADDR:$MASTER_PORT"
    # --resume always: the first start finds no checkpoint and starts fresh, a requeued one continues.
    # --kill-on-bad-exit: one node's launcher failing ends the others at once instead of at their timeouts.
    run_forwarding_usr1 srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
        bash launch/slurm/node.sh "$launcher" "$@" --resume
    rc=$?
    # torchrun reports any non-zero worker status as 1: a stop it passed on is known from the forwarded signal.
    if ((rc == EXIT_STOPPED || (STOP_FORWARDED && rc != 0 && rc != 2))); then
        echo "moe_dist: stopped with a checkpoint (status $rc): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        exit "$EXIT_STOPPED"
    fi
    exit "$rc"
}
