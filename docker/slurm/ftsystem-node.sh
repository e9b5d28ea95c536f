#!/usr/bin/env bash
# One ftsystem agent on this node, started by docker/slurm/ftsystem.sbatch through srun (one task
# per node). The node's place in the step (SLURM_NODEID) gives its replica and node rank:
#   replica   = SLURM_NODEID / (NODES_PER_REPLICA + SPARES_PER_REPLICA)
#   node rank = SLURM_NODEID % (NODES_PER_REPLICA + SPARES_PER_REPLICA), past NODES_PER_REPLICA: a spare
# Arguments: the replica's program (or --address: print the advertised address and exit); the word {replica} in it becomes the replica's index (its
# data shard). Environment: ETCD_ENDPOINTS, JOB_ID, NODES_PER_REPLICA, NPROC_PER_NODE (required),
# SPARES_PER_REPLICA (0), FTSYSTEM (the CLI, default: ftsystem on PATH),
# ADVERTISE_ADDRESS or HOST_INTERFACE (which address other nodes reach this one at),
# FTSYSTEM_API_TOKEN_FILE (the job's token, which the agent requires; ftsystem.sbatch sets it).
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
    exec "${FTSYSTEM:-ftsystem}" agent --etcd "$ETCD_ENDPOINTS" --job "$JOB_ID" \
        --replica-id "r$replica" "${place[@]}" --nodes "$NODES_PER_REPLICA" \
        --nproc-per-node "$NPROC_PER_NODE" --host "$host" --node-id "$(hostname)" \
        -- "${@//\{replica\}/$replica}"  # the timeout: the job spec's (ftsystem.sbatch's TIMEOUT)
}

main "$@"
