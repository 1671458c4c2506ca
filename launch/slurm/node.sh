#!/usr/bin/env bash
# One Slurm task per node (srun --ntasks-per-node=1, from common.sh): start this node's launcher, which starts
# NPROC_PER_NODE training processes and gives them RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
#
#   node.sh torchrun|deepspeed TRAIN_ARGS...     with NNODES, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT exported
#                                                (launch/slurm/slurm_env.py) and Slurm's SLURM_NODEID (node rank)
set -euo pipefail
launcher=$1
shift

# The stop signal (launch/slurm/common.sh forwards SIGUSR1 to every process of the step) must reach the training
# processes only: its default action would kill the launcher. An ignored signal stays ignored across exec, and
# launch/train.py installs its own handler (moe_dist/train/preempt.py), so only it reacts.
trap '' USR1

case "$launcher" in
    torchrun)
        exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --node_rank "$SLURM_NODEID" \
            --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" launch/train.py "$@"
        ;;
    deepspeed)
        # deepspeed --no_ssh reads the nodes and their slots from a hostfile: this node's own copy, from the
        # allocation's node list (node rank k is line k).
        hostfile=$(mktemp "${TMPDIR:-/tmp}/moe_dist-hostfile.XXXXXX")
        scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$NPROC_PER_NODE/" > "$hostfile"
        status=0
        deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$SLURM_NODEID" --master_addr "$MASTER_ADDR" \
            --master_port "$MASTER_PORT" launch/train.py "$@" || status=$?
        rm -f "$hostfile"
        exit "$status"
        ;;
    *)
        echo "error: node.sh: unknown launcher $launcher (torchrun or deepspeed)" >&2
        exit 2
        ;;
esac
