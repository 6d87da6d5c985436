#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for trying the `lm slurm` workflow and for the tests.
#
#   slurm/local_cluster.sh start    install (Debian's slurm-wlm + munge, as root) if needed, then start
#   slurm/local_cluster.sh stop     stop the daemons by their pid files
#   slurm/local_cluster.sh status   exit 0 if the cluster answers
#   slurm/local_cluster.sh env      the line to eval so that sbatch/squeue find this cluster
#
# Everything lives in $LM_SLURM_DIR (default /tmp/lm-slurm): the config, pid files, spool and logs. Each command
# is idempotent. There is no systemd here, so the daemons are started by hand and stopped by their pid files.
set -euo pipefail

DIR="${LM_SLURM_DIR:-/tmp/lm-slurm}"
CONF="$DIR/slurm.conf"
NODE="$(hostname -s)"
export SLURM_CONF="$CONF"

die() { echo "local_cluster.sh: $*" >&2; exit 2; }

running() {  # running PIDFILE: the process of that pid file is alive
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && return
    [[ $(id -u) -eq 0 ]] || die "slurm-wlm and munge are not installed; run this once as root to install them"
    command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get to install them"
    echo "local_cluster.sh: installing slurmctld slurmd slurm-client munge" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null; } \
        || die "could not install slurm-wlm and munge with apt-get"
}

write_config() {
    local cpus mem
    cpus="$(nproc)"
    mem="$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) * 9 / 10 ))"
    mkdir -p "$DIR"/{spool/ctld,spool/d,log}
    # Why these settings: no systemd/cgroups here (pgid process tracking, no task plugin), no accounting daemon,
    # and a requeued job should start again within seconds (cred_expire, sched_interval), as in the tests.
    cat >"$CONF.tmp" <<EOF
ClusterName=lm-local
SlurmctldHost=$NODE
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
SlurmdPidFile=$DIR/slurmd.pid
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$NODE CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

start() {
    install_packages
    write_config
    if ! running "$DIR/munged.pid"; then
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        [[ -s /etc/munge/munge.key ]] || { mungekey --create --force >/dev/null 2>&1 || \
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; \
            chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
        runuser -u munge -- munged --force
        pgrep -u munge -x munged | head -1 >"$DIR/munged.pid"
    fi
    running "$DIR/slurmctld.pid" || slurmctld
    running "$DIR/slurmd.pid" || slurmd -N "$NODE"
    for _ in $(seq 50); do
        if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "local_cluster.sh: cluster lm-local is up (node $NODE, $(nproc) CPUs); $(env_line)" >&2
            return
        fi
        sleep 0.2
    done
    die "the cluster did not come up; see $DIR/log/"
}

stop() {
    local name
    for name in slurmd slurmctld munged; do
        if running "$DIR/$name.pid"; then
            kill "$(cat "$DIR/$name.pid")"
            for _ in $(seq 50); do running "$DIR/$name.pid" || break; sleep 0.1; done
        fi
        rm -f "$DIR/$name.pid"
    done
    echo "local_cluster.sh: stopped" >&2
}

status() {
    running "$DIR/slurmctld.pid" && running "$DIR/slurmd.pid" && sinfo -h >/dev/null 2>&1 \
        || { echo "local_cluster.sh: not running" >&2; return 1; }
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
