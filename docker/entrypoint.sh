#!/bin/sh
# Entrypoint of the ddiloco image: `docker run IMAGE <ddiloco command> [flags]`.
# Flags may also come from DDILOCO_* variables (see `ddiloco <command> --help`).
#
# For a learner started as root with NET_ADMIN it first shapes the datacenter link:
#   DDILOCO_WAN_PROFILE  lan | wan | wan-slow | wan-mixed (ddiloco/wan/profiles.json)
#   DDILOCO_DATACENTER   this learner's datacenter index (picks the rate, and the shard)
#   DDILOCO_WAN_DEV      device to shape (default: the one routing to the coordinator)
# and then drops to the unprivileged ddiloco user. Shaping that fails stops the container:
# a run that was meant to be shaped must not silently train on an unshaped link.
#
# Mutual TLS: a service reads its identity folder from DDILOCO_TLS_DIR. A replicated learner
# (one service, many replicas, one secret for all) gets DDILOCO_TLS_BUNDLE, the run's
# learners.json (`ddiloco certs setup`), and its datacenter index picks its own certificate,
# learner-<index>, written to DDILOCO_TLS_DIR before anything dials.
#
# Outer shards: with DDILOCO_OUTER_SHARDS > 1 an outer replica takes its shard index from
# DDILOCO_TASK_SLOT (Swarm), JOB_COMPLETION_INDEX (a Kubernetes Indexed Job) or, with
# DDILOCO_SHARD_FROM=replica, from its container name (Compose), and advertises its own address (replicas share the service's DNS name): the
# first one starting with DDILOCO_ADVERTISE_PREFIX when set (the network learners reach it on).
#
# Swarm and Kubernetes have no depends_on, so DDILOCO_WAIT_FOR="host:port ..." waits until
# each answers the gRPC health check; DDILOCO_TASK_SLOT (1-based, from {{.Task.Slot}}) or
# JOB_COMPLETION_INDEX gives a replicated learner its datacenter index, and with
# DDILOCO_DATACENTER_FROM=replica (Compose, which has neither) its container name does:
# <project>-<service>-<n> is datacenter n-1 (`ddiloco wan replica-index`).
set -eu

log() { echo "[entrypoint] $*" >&2; }

case "${1:-}" in
    "" | -h | --help) exec ddiloco --help ;;
    coordinator | outer | learner | health | run | wan | simulate | chaos | netns | certs) role=$1 ;;
    *) exec "$@" ;; # a plain command: a shell, or `cat` of a report
esac
for arg in "$@"; do
    case "$arg" in -h | --help) exec ddiloco "$@" ;; esac
done

if [ -z "${DDILOCO_DATACENTER:-}" ]; then
    if [ -n "${DDILOCO_TASK_SLOT:-}" ]; then
        export DDILOCO_DATACENTER="dc$((DDILOCO_TASK_SLOT - 1))"
    elif [ -n "${JOB_COMPLETION_INDEX:-}" ]; then # a Kubernetes Indexed Job
        export DDILOCO_DATACENTER="dc$JOB_COMPLETION_INDEX"
    elif [ "${DDILOCO_DATACENTER_FROM:-}" = replica ]; then # Compose deploy.replicas
        # without its index a learner of wan-mixed would be shaped to another's rate: stop
        index=$(ddiloco wan replica-index) || { log "cannot tell which replica this is"; exit 1; }
        export DDILOCO_DATACENTER="dc$index"
    fi
fi

if [ "$role" = learner ] && [ -z "${DDILOCO_ADVERTISE:-}" ]; then
    # Replicas of one service share its DNS name; each must advertise its own address.
    bind=${DDILOCO_BIND:-0.0.0.0:50060}
    addr=$(hostname -i 2> /dev/null | awk '{print $1}')
    if [ -n "$addr" ]; then export DDILOCO_ADVERTISE="$addr:${bind##*:}"; fi
fi

if [ "$role" = outer ] && [ "${DDILOCO_OUTER_SHARDS:-1}" != 1 ]; then
    if [ -z "${DDILOCO_SHARD:-}" ]; then
        if [ -n "${DDILOCO_TASK_SLOT:-}" ]; then
            export DDILOCO_SHARD="$((DDILOCO_TASK_SLOT - 1))"
        elif [ -n "${JOB_COMPLETION_INDEX:-}" ]; then
            export DDILOCO_SHARD="$JOB_COMPLETION_INDEX"
        elif [ "${DDILOCO_SHARD_FROM:-}" = replica ]; then
            # without its index a shard would serve another's fragments: stop
            index=$(ddiloco wan replica-index) || { log "cannot tell which outer shard this is"; exit 1; }
            export DDILOCO_SHARD="$index"
        fi
    fi
    if [ -z "${DDILOCO_SHARD:-}" ]; then
        log "outer shard of $DDILOCO_OUTER_SHARDS without an index (DDILOCO_SHARD, DDILOCO_TASK_SLOT, JOB_COMPLETION_INDEX or DDILOCO_SHARD_FROM=replica)"
        exit 1
    fi
    addr=""
    for a in $(hostname -i 2> /dev/null); do
        case "$a" in "${DDILOCO_ADVERTISE_PREFIX:-}"*) addr=$a && break ;; esac
    done
    if [ -z "$addr" ]; then
        log "no address of this outer shard starts with '${DDILOCO_ADVERTISE_PREFIX:-}' ($(hostname -i 2> /dev/null))"
        exit 1
    fi
    bind=${DDILOCO_BIND:-0.0.0.0:50052}
    export DDILOCO_ADVERTISE="$addr:${bind##*:}"
    log "outer shard ${DDILOCO_SHARD:-?} of $DDILOCO_OUTER_SHARDS at $DDILOCO_ADVERTISE"
fi

if [ "$role" = learner ] && [ -n "${DDILOCO_TLS_BUNDLE:-}" ]; then
    index=${DDILOCO_DATACENTER#dc}
    case "$index" in
        "" | *[!0-9]*)
            log "cannot tell which learner certificate to take (DDILOCO_DATACENTER=${DDILOCO_DATACENTER:-})"
            exit 1
            ;;
    esac
    if [ -z "${DDILOCO_TLS_DIR:-}" ]; then
        log "DDILOCO_TLS_BUNDLE needs DDILOCO_TLS_DIR (where this learner's identity is written)"
        exit 1
    fi
    ddiloco certs unbundle "$DDILOCO_TLS_BUNDLE" --name "learner-$index" --into "$DDILOCO_TLS_DIR" > /dev/null
    if [ "$(id -u)" = 0 ] && id ddiloco > /dev/null 2>&1; then chown -R ddiloco:ddiloco "$DDILOCO_TLS_DIR"; fi
    log "mutual TLS as learner-$index"
fi

wait_deadline=$(($(date +%s) + ${DDILOCO_WAIT_TIMEOUT:-300}))
for target in ${DDILOCO_WAIT_FOR:-}; do
    until ddiloco health "$target" --timeout 2 > /dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$wait_deadline" ]; then
            log "gave up waiting for $target to become healthy"
            exit 1
        fi
        sleep 2
    done
    log "$target is healthy"
done

if [ "$role" = learner ] && [ -n "${DDILOCO_WAN_PROFILE:-}" ]; then
    export DDILOCO_WAN_DEV="${DDILOCO_WAN_DEV:-auto}"
    export DDILOCO_WAN_TOWARDS="${DDILOCO_WAN_TOWARDS:-${DDILOCO_COORDINATOR:-}}"
    ddiloco wan apply
fi

if [ "$(id -u)" = 0 ] && [ "${DDILOCO_KEEP_ROOT:-0}" != 1 ] && id ddiloco > /dev/null 2>&1; then
    # Nothing after shaping needs privileges: drop the user and every capability.
    exec setpriv --reuid=ddiloco --regid=ddiloco --init-groups --inh-caps=-all --bounding-set=-all \
        -- env HOME=/home/ddiloco ddiloco "$@"
fi
exec ddiloco "$@"
