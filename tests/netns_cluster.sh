#!/usr/bin/env bash
# A multi-node cluster on one machine: N "nodes" as Linux network namespaces, each with its own address on a
# private bridge, and a training job run across them under `deepspeed --no_ssh` and `torchrun` (run as root).
#
#   sudo tests/netns_cluster.sh [options] [-- TRAIN_ARGS...]
#   sudo tests/netns_cluster.sh --nodes 2 --nproc 2 -- --config configs/debug.json --set parallel.ep=4
#   tests/netns_cluster.sh --check          # exit 0 if namespaces can be created here, 77 (with the reason) if not
#
# Options:
#   --nodes N             nodes (network namespaces), default 2
#   --nproc P             processes per node, default 2
#   --launchers L[,L]     deepspeed | torchrun | torchrun-c10d, default deepspeed,torchrun
#   --run-dir DIR         output root; launcher L writes DIR/L (plus DIR/L/nodeK.log), default runs/netns
#   --script PATH         training script, default launch/train.py (benchmarks/scaling.py: its scaling_worker.py)
#   --subnet A.B.C        private /24 used only inside the created namespaces, default 10.213.7
#   --port PORT           master (rendezvous) port, default 29500
#   --timeout S           wall-clock limit of each launcher on each node, default 600
#   --rdzv-timeout S      torchrun's own rendezvous timeout (its agents meet before train.py starts), default 60
#   --only-nodes K[,K]    start only these node ranks (failure drills: the others are "missing")
#   --master-addr ADDR    override the master address every node is told (failure drills)
#   --master-port PORT    override the master port every node is told (failure drills)
#   --private-run-dir K[,K]  on these node ranks the run directory is a private tmpfs (in the node's own mount
#                         namespace): a run directory that is not shared between nodes (failure drills)
#
# Topology (nothing is added to the host's own network namespace):
#
#   <tag>-hub:  bridge br0, address A.B.C.254 (a host that never runs a master: a "wrong address" target)
#   <tag>-nK:   veth0 = A.B.C.(K+1)/24, its peer enslaved to br0 in the hub; lo up
#
# Gloo is pinned to veth0 (GLOO_SOCKET_IFNAME), so every byte between ranks crosses the veth links. Each node's
# launcher runs in its own process group under `timeout`; the EXIT trap kills what is left inside the namespaces
# (by pid) and deletes the namespaces, which removes their veth links and the bridge. Exit status: 0 if every
# launcher on every started node succeeded, else the first failure's status.
set -euo pipefail

NODES=2 NPROC=2 LAUNCHERS=deepspeed,torchrun RUN_DIR=runs/netns SCRIPT=launch/train.py SUBNET=10.213.7
PORT=29500 TIMEOUT=600 RDZV_TIMEOUT=60 ONLY_NODES="" MASTER_ADDR_OVERRIDE="" MASTER_PORT_OVERRIDE="" CHECK=0
PRIVATE_RUN_DIR=""
TRAIN_ARGS=()

die() { echo "netns_cluster: $*" >&2; exit 2; }

while (($#)); do
    case "$1" in
        --nodes) NODES=$2; shift 2 ;;
        --nproc) NPROC=$2; shift 2 ;;
        --launchers) LAUNCHERS=$2; shift 2 ;;
        --run-dir) RUN_DIR=$2; shift 2 ;;
        --script) SCRIPT=$2; shift 2 ;;
        --subnet) SUBNET=$2; shift 2 ;;
        --port) PORT=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --rdzv-timeout) RDZV_TIMEOUT=$2; shift 2 ;;
        --only-nodes) ONLY_NODES=$2; shift 2 ;;
        --master-addr) MASTER_ADDR_OVERRIDE=$2; shift 2 ;;
        --master-port) MASTER_PORT_OVERRIDE=$2; shift 2 ;;
        --private-run-dir) PRIVATE_RUN_DIR=$2; shift 2 ;;
        --check) CHECK=1; shift ;;
        --) shift; TRAIN_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[[ $SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--subnet: expected A.B.C, got $SUBNET"
((NODES >= 2 && NODES <= 200)) || die "--nodes: expected 2..200, got $NODES"

TAG="mdc$$"  # namespace names carry our pid: concurrent clusters never collide (addresses live inside them)
HUB="$TAG-hub"
CREATED=()   # namespaces to delete on exit
JOB_PIDS=()  # process-group leaders of the launchers we started

cleanup() {
    local rc=$? pid ns
    trap - EXIT INT TERM
    for pid in "${JOB_PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for ns in "${CREATED[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    done
    for ns in "${CREATED[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cannot() { echo "netns_cluster: cannot create network namespaces here: $*" >&2; exit 77; }

preflight() {
    command -v ip >/dev/null || cannot "the 'ip' command (iproute2) is missing (apt-get install iproute2)"
    [[ $(id -u) == 0 ]] || cannot "not root (ip netns needs root and CAP_NET_ADMIN)"
    ip netns add "$TAG-probe" 2>/dev/null || cannot "'ip netns add' failed (no CAP_NET_ADMIN / no netns support?)"
    CREATED+=("$TAG-probe")
    ip -n "$TAG-probe" link add p0 type veth peer name p1 2>/dev/null || cannot "veth links cannot be created"
    ip netns del "$TAG-probe"
    CREATED=()
}

preflight
((CHECK)) && { echo "netns_cluster: network namespaces and veth links can be created here"; exit 0; }

addr_of() { echo "$SUBNET.$(($1 + 1))"; }

up() {
    ip netns add "$HUB"; CREATED+=("$HUB")
    ip -n "$HUB" link set lo up
    ip -n "$HUB" link add br0 type bridge
    ip -n "$HUB" addr add "$SUBNET.254/24" dev br0
    ip -n "$HUB" link set br0 up
    local k ns
    for ((k = 0; k < NODES; k++)); do
        ns="$TAG-n$k"
        ip netns add "$ns"; CREATED+=("$ns")
        ip -n "$ns" link set lo up
        ip -n "$HUB" link add "p$k" type veth peer name veth0 netns "$ns"
        ip -n "$HUB" link set "p$k" master br0 up
        ip -n "$ns" addr add "$(addr_of "$k")/24" dev veth0
        ip -n "$ns" link set veth0 up
    done
    for ((k = 1; k < NODES; k++)); do  # the links carry traffic before any job starts
        # A TCP probe of node 0's master port: "refused" (nothing listens yet) proves the route and the link.
        ip netns exec "$TAG-n$k" python3 -c 'import errno, socket, sys
s = socket.socket(); s.settimeout(5)
sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) in (0, errno.ECONNREFUSED) else 1)' \
            "$(addr_of 0)" "$PORT" || die "node $k cannot reach node 0 at $(addr_of 0)"
    done
    local listing=""
    for ((k = 0; k < NODES; k++)); do listing+="$TAG-n$k=$(addr_of "$k") "; done
    echo "netns_cluster: $NODES nodes up: $listing"
}

node_command() {  # launcher node_rank out_dir -> the command line run inside node k
    local launcher=$1 k=$2 out=$3 master=${MASTER_ADDR_OVERRIDE:-$(addr_of 0)} port=${MASTER_PORT_OVERRIDE:-$PORT}
    local args=("$SCRIPT" "${TRAIN_ARGS[@]}" --run-dir "$out")
    case "$launcher" in
        deepspeed)
            echo deepspeed --hostfile "$out/hostfile" --no_ssh --node_rank "$k" --master_addr "$master" \
                --master_port "$port" "${args[@]@Q}" ;;
        torchrun)
            echo torchrun --nnodes "$NODES" --nproc_per_node "$NPROC" --node_rank "$k" --master_addr "$master" \
                --master_port "$port" --rdzv_conf "timeout=$RDZV_TIMEOUT" "${args[@]@Q}" ;;
        torchrun-c10d)
            # is_host: torchrun guesses whether this node hosts the store by resolving the hostname, which fails
            # when the endpoint is on a secondary NIC (here: every namespace shares the host's hostname).
            echo torchrun --nnodes "$NODES" --nproc_per_node "$NPROC" --rdzv_backend c10d \
                --rdzv_endpoint "$master:$port" --rdzv_id "$TAG" --local_addr "$(addr_of "$k")" \
                --rdzv_conf "is_host=$((k == 0)),join_timeout=$RDZV_TIMEOUT,read_timeout=$RDZV_TIMEOUT" \
                "${args[@]@Q}" ;;
        *) die "unknown launcher $launcher" ;;
    esac
}

veth_bytes() {  # node -> "tx rx" bytes of its veth0 so far
    ip netns exec "$TAG-n$1" cat /sys/class/net/veth0/statistics/tx_bytes /sys/class/net/veth0/statistics/rx_bytes |
        paste -sd' '
}

run_job() {
    local launcher=$1 out="$RUN_DIR/$1" k rc=0 status pid started=() before=()
    mkdir -p "$out"
    : > "$out/hostfile"
    for ((k = 0; k < NODES; k++)); do echo "node$k slots=$NPROC" >> "$out/hostfile"; done
    for ((k = 0; k < NODES; k++)); do before[k]=$(veth_bytes "$k"); done
    local t0=$SECONDS
    JOB_PIDS=()
    for ((k = 0; k < NODES; k++)); do
        [[ -z $ONLY_NODES || ",$ONLY_NODES," == *",$k,"* ]] || continue
        local cmd
        cmd=$(node_command "$launcher" "$k" "$out")
        if [[ ",$PRIVATE_RUN_DIR," == *",$k,"* ]]; then
            # `ip netns exec` gives the node its own mount namespace: this tmpfs hides the shared directory from
            # this node only (the hostfile is copied in; the node's log is opened outside, before the mount).
            cmd="h=\$(cat ${out@Q}/hostfile) && mount -t tmpfs none ${out@Q} && printf '%s\n' \"\$h\" > ${out@Q}/hostfile && $cmd"
        fi
        echo "netns_cluster: [$launcher] node $k ($(addr_of "$k")): $cmd" | tee "$out/node$k.log"
        # setsid: each node's launcher and its workers form one process group that cleanup can end by id.
        setsid ip netns exec "$TAG-n$k" env GLOO_SOCKET_IFNAME=veth0 PYTHONUNBUFFERED=1 \
            timeout --kill-after=15 "$TIMEOUT" bash -c "$cmd" >> "$out/node$k.log" 2>&1 &
        JOB_PIDS+=($!)
        started+=("$k")
    done
    for ((k = 0; k < ${#JOB_PIDS[@]}; k++)); do
        status=0
        wait "${JOB_PIDS[$k]}" || status=$?
        if ((status != 0)); then
            echo "netns_cluster: [$launcher] node ${started[$k]} failed with status $status;" \
                "its log: $out/node${started[$k]}.log" >&2
            tail -n 5 "$out/node${started[$k]}.log" | sed 's/^/    /' >&2
            ((rc == 0)) && rc=$status
        fi
    done
    JOB_PIDS=()
    echo "netns_cluster: [$launcher] $NODES nodes x $NPROC processes: status $rc after $((SECONDS - t0)) s"
    for ((k = 0; k < NODES; k++)); do
        read -r tx0 rx0 <<< "${before[k]}"
        read -r tx1 rx1 <<< "$(veth_bytes "$k")"
        echo "netns_cluster: [$launcher] node $k veth0: sent $((tx1 - tx0)) B, received $((rx1 - rx0)) B"
    done
    return "$rc"
}

up
RC=0
IFS=, read -r -a LAUNCHER_LIST <<< "$LAUNCHERS"
for launcher in "${LAUNCHER_LIST[@]}"; do
    status=0
    run_job "$launcher" || status=$?
    ((RC == 0)) && RC=$status
done
exit "$RC"
