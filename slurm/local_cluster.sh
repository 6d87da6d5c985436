#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, for trying the `lm slurm` workflow and for the tests.
#
#   slurm/local_cluster.sh start    install (Debian's slurm-wlm + munge, as root) if needed, then start
#   slurm/local_cluster.sh stop     stop the daemons by their pid files, remove the namespaces and links
#   slurm/local_cluster.sh status   exit 0 if the cluster answers
#   slurm/local_cluster.sh env      the line to eval so that sbatch/squeue find this cluster
#
# The nodes lm-node1 and lm-node2 are hosts of their own as far as a job can tell: each slurmd runs in its own network
# namespace (a veth pair to a bridge; 10.77.0.2 and .3, the controller at .1), with its own hostname (a UTS namespace)
# and a hosts file that names both nodes (/etc/netns/NAME/hosts, mounted over /etc/hosts for that slurmd alone). So a
# 2-node job's ranks meet over those addresses, as on a real cluster, and traffic stays on the bridge. The files are
# shared, as on a cluster's shared file system. munge is shared through its socket.
#
# Everything else lives in $LM_SLURM_DIR (default /tmp/lm-slurm): the config, pid files, spool and logs. Each command
# is idempotent. There is no systemd here, so the daemons are started by hand and stopped by their pid files.
set -euo pipefail

DIR="${LM_SLURM_DIR:-/tmp/lm-slurm}"
CONF="$DIR/slurm.conf"
CTL="$(hostname -s)"
NODES=(lm-node1 lm-node2)
NET=10.77.0  # .1 the controller (the bridge), .2 and .3 the nodes
BRIDGE=lm-br0
export SLURM_CONF="$CONF"

die() { echo "local_cluster.sh: $*" >&2; exit 2; }

alive() {  # alive PID: the process exists and has not exited (a zombie, which kill -0 still reaches, has)
    [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}

running() {  # running PIDFILE: the process of that pid file is alive
    [[ -s "$1" ]] && alive "$(cat "$1")"
}

PACKAGES="slurmctld slurmd slurm-client munge iproute2 util-linux"  # util-linux: nsenter and unshare

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && command -v ip >/dev/null && command -v nsenter >/dev/null && return
    [[ $(id -u) -eq 0 ]] || die "$PACKAGES are not all installed; run this once as root to install them"
    command -v apt-get >/dev/null || die "$PACKAGES are not all installed and there is no apt-get to install them"
    echo "local_cluster.sh: installing $PACKAGES" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $PACKAGES >/dev/null \
        || { apt-get update -q >/dev/null \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $PACKAGES >/dev/null; } \
        || die "could not install $PACKAGES with apt-get"
}

write_config() {
    local cpus mem
    cpus="$(nproc)"
    mem="$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) * 9 / 10 ))"
    mkdir -p "$DIR"/{spool/ctld,spool/d-${NODES[0]},spool/d-${NODES[1]},log}
    # Why these settings: no systemd/cgroups here (pgid process tracking, no task plugin), no accounting daemon,
    # and a requeued job should start again within seconds (cred_expire, sched_interval), as in the tests.
    cat >"$CONF.tmp" <<EOF
ClusterName=lm-local
SlurmctldHost=$CTL($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
MinJobAge=3600
KillWait=10
ReturnToService=2
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d-%n
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# Each node has all of this machine's CPUs: a one-node job of 2 processes fits either node, and a 2-node job takes
# one CPU of each. (More would let jobs share the cores, where ranks that wait in gloo's collectives spin.)
NodeName=${NODES[0]} NodeAddr=$NET.2 CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=$NET.3 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

node_up() {  # node_up I NAME: network namespace NAME, its veth end on the bridge at NET.(I+1), its hosts file
    local i=$1 name=$2
    ip netns list | grep -qw "$name" || ip netns add "$name"
    if ! ip netns exec "$name" ip link show lm0 >/dev/null 2>&1; then
        ip link add "lm-veth$i" type veth peer name "lm-peer$i"
        ip link set "lm-peer$i" netns "$name"
        ip netns exec "$name" ip link set "lm-peer$i" name lm0
        ip link set "lm-veth$i" master "$BRIDGE" up
        ip netns exec "$name" ip addr add "$NET.$((i + 1))/24" dev lm0
        ip netns exec "$name" ip link set lm0 up
        ip netns exec "$name" ip link set lo up
    fi
    mkdir -p "/etc/netns/$name"
    printf '127.0.0.1 localhost\n%s.1 %s\n%s.2 %s\n%s.3 %s\n' "$NET" "$CTL" "$NET" "${NODES[0]}" "$NET" "${NODES[1]}" \
        >"/etc/netns/$name/hosts"
}

network_up() {
    [[ $(id -u) -eq 0 ]] || die "the nodes' network namespaces need root"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$NET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    node_up 1 "${NODES[0]}"
    node_up 2 "${NODES[1]}"
}

network_down() {
    local name
    for name in "${NODES[@]}"; do
        ip netns list | grep -qw "$name" && ip netns del "$name"  # takes its veth pair with it
        rm -rf "/etc/netns/$name"
    done
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
    rmdir /etc/netns 2>/dev/null || true
}

start_node() {  # slurmd of node NAME, in its network namespace, under its own hostname and with its hosts file
    local name=$1
    running "$DIR/slurmd-$name.pid" && return
    # nsenter, not `ip netns exec`, which would mount a fresh /sys without the cgroup tree that slurmd looks for.
    nsenter --net="/run/netns/$name" unshare --mount --uts \
        sh -c "mount --bind /etc/netns/$name/hosts /etc/hosts && hostname $name && exec slurmd -N $name"
}

start() {
    install_packages
    write_config
    network_up
    # A munged that answers on its socket is used as it is (stop leaves one it did not start); else start ours.
    if ! running "$DIR/munged.pid" && ! { [[ -S /run/munge/munge.socket.2 ]] && munge -n >/dev/null 2>&1; }; then
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        [[ -s /etc/munge/munge.key ]] || { mungekey --create --force >/dev/null 2>&1 || \
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; \
            chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
        runuser -u munge -- munged --force
        for _ in $(seq 50); do [[ -s /run/munge/munged.pid ]] && break; sleep 0.1; done
        cp /run/munge/munged.pid "$DIR/munged.pid"  # munged's own record of its daemon's pid
    fi
    local fresh=""
    running "$DIR/slurmctld.pid" || { slurmctld; fresh=1; }
    start_node "${NODES[0]}"
    start_node "${NODES[1]}"
    for _ in $(seq 100); do
        if [[ $(sinfo -h -o '%D %T' 2>/dev/null | awk '$2 ~ /^(idle|mixed|allocated)$/ {n += $1} END {print n + 0}') \
              -eq 2 ]]; then
            [[ -z "$fresh" ]] || cancel_stale_jobs
            echo "local_cluster.sh: cluster lm-local is up (nodes ${NODES[*]} at $NET.2-3, $(nproc) CPUs each); \
$(env_line)" >&2
            return
        fi
        sleep 0.2
    done
    die "the cluster did not come up; see $DIR/log/"
}

cancel_stale_jobs() {
    # A controller started anew recovers the jobs of its last run from its spool, but their processes ended with the
    # old daemons: one still "running" there would hold its node's CPUs and memory for ever, and the next 2-node job
    # (a test's) would wait behind it. They are cancelled, so that each start begins with an empty queue.
    local jobs
    jobs="$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')"
    [[ -n "${jobs// /}" ]] || return 0
    echo "local_cluster.sh: cancelling jobs left from the cluster's last run: $jobs" >&2
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 150); do [[ -z "$(squeue -h -o %A 2>/dev/null)" ]] && return 0; sleep 0.2; done
    echo "local_cluster.sh: jobs still queued after 30 s: $(squeue -h -o '%A %T' | tr '\n' ' ')" >&2
}

stop() {
    local name
    for name in "slurmd-${NODES[0]}" "slurmd-${NODES[1]}" slurmctld munged; do
        if running "$DIR/$name.pid"; then
            kill "$(cat "$DIR/$name.pid")"
            for _ in $(seq 50); do running "$DIR/$name.pid" || break; sleep 0.1; done
        fi
        rm -f "$DIR/$name.pid"
    done
    network_down
    echo "local_cluster.sh: stopped" >&2
}

status() {
    running "$DIR/slurmctld.pid" && running "$DIR/slurmd-${NODES[0]}.pid" && running "$DIR/slurmd-${NODES[1]}.pid" \
        && sinfo -h >/dev/null 2>&1 || { echo "local_cluster.sh: not running" >&2; return 1; }
    sinfo
}

env_line() { echo "export SLURM_CONF=$CONF"; }

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) env_line ;;
    *) die "usage: $0 start|stop|status|env" ;;
esac
