#!/usr/bin/env bash
# One ftsystem agent on this node, started by docker/slurm/ftsystem.sbatch through srun (one task
# per node). The node's place in the step (SLURM_NODEID) gives its replica and node rank:
#   replica   = SLURM_NODEID / (NODES_PER_REPLICA + SPARES_PER_REPLICA)
#   node rank = SLURM_NODEID % (NODES_PER_REPLICA + SPARES_PER_REPLICA), past NODES_PER_REPLICA: a spare
# Arguments: the replica's program (or --address: print the advertised address and exit); the word {replica} in it becomes the replica's index (its
# data shard). Environment: ETCD_ENDPOINTS, JOB_ID, NODES_PER_REPLICA, NPROC_PER_NODE (required),
# SPARES_PER_REPLICA (0), FTSYSTEM (the CLI, default: ftsystem on PATH),
# ADVERTISE_ADDRESS or HOST_INTERFACE (which address other nodes reach this one at),
# FTSYSTEM_API_TOKEN_FILE (the job's token, which the agent requires; ftsystem.sbatch sets it),
# BATCH_NODE, BATCH_NODE_SERVICE (host:port), BATCH_NODE_TIMEOUT, OUT_DIR: the batch node and
# what of it to watch (ftsystem.sbatch sets them; no BATCH_NODE_SERVICE, no watch).
set -euo pipefail

fail() {
    echo "ftsystem-node.sh on $(hostname): $*" >&2
    exit 2
}

# Other nodes connect to this address (rank 0's MASTER_ADDR, Gloo/NCCL, the state servers), so
# it must not be loopback: `hostname -i` is 127.0.1.1 on many Debian-style hosts.
advertised_address() {
    if [[ -n ${ADVERTISE_ADDRESS:-} ]]; then
        echo "$ADVERTISE_ADDRESS"
        return
    fi
    local candidates
    if [[ -n ${HOST_INTERFACE:-} ]]; then
        candidates=$(ip -o -4 addr show dev "$HOST_INTERFACE" | awk '{sub("/.*", "", $4); print $4}')
    else
        candidates=$(hostname -I 2>/dev/null || true)
    fi
    local address
    for address in $candidates; do
        case $address in
            127.* | 169.254.* | *:*) continue ;;  # loopback, link-local; IPv4 only
        esac
        echo "$address"
        return
    done
    fail "no non-loopback IPv4 address${HOST_INTERFACE:+ on $HOST_INTERFACE}: set ADVERTISE_ADDRESS or HOST_INTERFACE"
}

# Slurm keeps a --no-kill job whose batch node died running without its batch script (it only
# takes the node out of the allocation) until the time limit: its agents would train on with
# etcd and the controller gone. The batch node's service (its etcd, else its controller) is
# probed; silent for BATCH_NODE_TIMEOUT s, the node is lost and the job is cancelled, its
# reason in the job's Comment (scontrol show job) and in OUT_DIR/cancelled.
watch_batch_node() {
    local host=${BATCH_NODE_SERVICE%:*} port=${BATCH_NODE_SERVICE##*:}
    local limit=${BATCH_NODE_TIMEOUT%.*} heard=$SECONDS
    local every=$((limit >= 12 ? limit / 6 : 2))
    while sleep "$every"; do
        # bash's /dev/tcp: a connection, nothing sent. A dead host answers no SYN: timeout.
        if timeout "$every" bash -c ": >/dev/tcp/$host/$port" 2>/dev/null; then
            heard=$SECONDS
        elif ((SECONDS - heard >= limit)); then
            local why="batch node ${BATCH_NODE:-?} lost: $BATCH_NODE_SERVICE (its etcd or"
            why+=" controller) silent for $((SECONDS - heard)) s; cancelling job $SLURM_JOB_ID"
            echo "ftsystem-node.sh on $(hostname): $why" >&2
            if [[ -n ${OUT_DIR:-} ]]; then
                echo "$(hostname): $why" >>"$OUT_DIR/cancelled" || true
            fi
            scontrol update JobId="$SLURM_JOB_ID" Comment="ftsystem: $why" || true
            scancel "$SLURM_JOB_ID"
            return
        fi
    done
}

main() {
    if [[ ${1:-} == --address ]]; then  # for ftsystem.sbatch: where etcd and the controller listen
        advertised_address
        return
    fi
    : "${SLURM_NODEID:?run this through srun (docker/slurm/ftsystem.sbatch)}"
    : "${ETCD_ENDPOINTS:?set ETCD_ENDPOINTS}" "${JOB_ID:?set JOB_ID}"
    : "${NODES_PER_REPLICA:?set NODES_PER_REPLICA}" "${NPROC_PER_NODE:?set NPROC_PER_NODE}"
    (($# > 0)) || fail "no program given: $0 PROGRAM ARGS... (e.g. python -m ftsystem.example.train)"
    local slots=$((NODES_PER_REPLICA + ${SPARES_PER_REPLICA:-0}))
    local replica=$((SLURM_NODEID / slots)) slot=$((SLURM_NODEID % slots))
    local place=(--node-rank "$slot")
    if ((slot >= NODES_PER_REPLICA)); then
        place=(--spare)  # takes over the first node rank of its replica that falls free
    fi
    local host
    host=$(advertised_address)
    echo "ftsystem-node.sh: node $SLURM_NODEID ($(hostname), $host): replica r$replica ${place[*]}" >&2
    "${FTSYSTEM:-ftsystem}" agent --etcd "$ETCD_ENDPOINTS" --job "$JOB_ID" \
        --replica-id "r$replica" "${place[@]}" --nodes "$NODES_PER_REPLICA" \
        --nproc-per-node "$NPROC_PER_NODE" --host "$host" --node-id "$(hostname)" \
        -- "${@//\{replica\}/$replica}" &  # the timeout: the job spec's (ftsystem.sbatch's TIMEOUT)
    local agent=$! watcher="" code=0
    # A stop (scancel --signal) reaches every process of the step; one for this shell alone
    # is passed on.
    trap 'kill -TERM "$agent" 2>/dev/null || true' TERM
    trap 'kill -INT "$agent" 2>/dev/null || true' INT
    if [[ -n ${BATCH_NODE_SERVICE:-} ]]; then
        watch_batch_node &
        watcher=$!
    fi
    wait "$agent" || code=$?
    while kill -0 "$agent" 2>/dev/null; do  # the wait was cut short by a trapped signal
        code=0
        wait "$agent" || code=$?
    done
    if [[ -n $watcher ]]; then
        kill "$watcher" 2>/dev/null || true
    fi
    return "$code"
}

main "$@"
