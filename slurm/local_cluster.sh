#!/usr/bin/env bash
# A real Slurm cluster on this machine, for tests and CI: munged + slurmctld + two slurmd emulating nodes n1 and n2
# (Debian builds Slurm with MULTIPLE_SLURMD), everything bound to 127.0.0.1.
#
# Usage: bash slurm/local_cluster.sh start|stop|status|env
#   start   installs the Debian packages if missing (needs root), writes the config under $MPO_SLURM_DIR, starts the
#           daemons and waits until both nodes are idle. A no-op when the cluster is already up.
#   stop    cancels this cluster's jobs, then stops exactly the daemons `start` started (by the PIDs it recorded).
#   status  prints the daemons and `sinfo`; exit 0 when up.
#   env     prints `export SLURM_CONF=...` (eval it to use sbatch/sinfo against this cluster from another shell).
#
# Environment: MPO_SLURM_DIR (state directory, default /tmp/mpo-slurm), MPO_SLURM_NODE_CPUS (CPUs each node declares,
# default 8; config_overrides lets a node declare more than the machine has), MPO_SLURM_NODE_GPUS (fake GPUs per node,
# default 0: gres stand-ins made from /dev/null so that `--gpus-per-node` is accepted; there is no GPU behind them).
# Each workaround below says the slurm behaviour it rests on where it is made (numbered "gotcha N").
set -euo pipefail

D=${MPO_SLURM_DIR:-/tmp/mpo-slurm}
CPUS=${MPO_SLURM_NODE_CPUS:-8}
GPUS=${MPO_SLURM_NODE_GPUS:-0}
NODES=(n1 n2)
export SLURM_CONF="$D/slurm.conf"

log() { echo "[local_cluster] $*" >&2; }

# A PID file names a live daemon only if the process exists and is not a zombie (gotcha 5: orphans are reaped late).
alive() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
    [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
            && command -v munged >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        log "Slurm is not installed and this is not root: cannot apt-get install slurmctld slurmd slurm-client munge"
        return 1
    fi
    log "installing slurmctld slurmd slurm-client munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -q >"$D/log/apt.log" 2>&1 \
        && apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >>"$D/log/apt.log" 2>&1 \
        || { log "apt-get failed; see $D/log/apt.log"; tail -5 "$D/log/apt.log" >&2; return 1; }
}

write_config() {
    mkdir -p "$D"/{state,run,log,spool/n1,spool/n2,munge/key,dev}  # spool dirs pre-created (gotcha 6)
    chmod 755 "$D/munge"; chmod 700 "$D/munge/key"                  # munged's permission checks (gotcha 4)
    if [ ! -s "$D/munge/key/munge.key" ]; then
        dd if=/dev/urandom of="$D/munge/key/munge.key" bs=1024 count=1 status=none
        chmod 400 "$D/munge/key/munge.key"
    fi
    local gres_node="" gres_types=""
    if [ "$GPUS" -gt 0 ]; then
        # Fake GPUs (gotcha 7): stand-in device files; jobs then get CUDA_VISIBLE_DEVICES, nothing more.
        gres_types="GresTypes=gpu"
        gres_node="Gres=gpu:$GPUS"
        : >"$D/gres.conf"
        for i in $(seq 0 $((GPUS - 1))); do
            [ -e "$D/dev/gpu$i" ] || mknod "$D/dev/gpu$i" c 1 3 2>/dev/null || touch "$D/dev/gpu$i"
        done
        echo "NodeName=n[1-2] Name=gpu File=$D/dev/gpu[0-$((GPUS - 1))]" >"$D/gres.conf"
    fi
    cat >"$D/slurm.conf.new" <<EOF
ClusterName=mpolocal
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=10
$gres_types
NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$CPUS RealMemory=16000 $gres_node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$D/slurm.conf.new" "$D/slurm.conf"
    # Node names must resolve (gotcha 1): MASTER_ADDR and engine URLs use them.
    grep -qE '^127\.0\.0\.1[[:space:]]+n1[[:space:]]+n2([[:space:]]|$)' /etc/hosts || echo "127.0.0.1 n1 n2" >>/etc/hosts
    # Tools find the config without SLURM_CONF when /etc/slurm/slurm.conf is free or already ours.
    mkdir -p /etc/slurm
    if [ ! -e /etc/slurm/slurm.conf ] || [ "$(readlink /etc/slurm/slurm.conf)" = "$D/slurm.conf" ]; then
        ln -sfn "$D/slurm.conf" /etc/slurm/slurm.conf
    fi
    [ "$GPUS" -gt 0 ] && { [ ! -e /etc/slurm/gres.conf ] || [ -L /etc/slurm/gres.conf ]; } \
        && ln -sfn "$D/gres.conf" /etc/slurm/gres.conf
    return 0
}

# Start one daemon in the foreground under setsid so its exact PID is known (and recorded), unless already running.
start_daemon() {
    local name=$1; shift
    local pidfile="$D/pids/$name.pid"
    alive "$pidfile" && return 0
    setsid "$@" </dev/null >"$D/log/$name.out" 2>&1 &
    echo $! >"$pidfile"
}

nodes_idle() {
    local out
    out=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    for n in "${NODES[@]}"; do
        echo "$out" | grep -qE "^$n (idle|mix|alloc)" || return 1
    done
}

all_alive() {
    for name in munged slurmctld slurmd-n1 slurmd-n2; do alive "$D/pids/$name.pid" || return 1; done
}

start() {
    mkdir -p "$D/log" "$D/pids"
    if all_alive && nodes_idle; then
        log "already up ($D)"; return 0
    fi
    install_packages || return 1
    write_config
    start_daemon munged munged -F --socket="$D/munge/munge.socket" --key-file="$D/munge/key/munge.key" \
        --pid-file="$D/run/munged.pid" --log-file="$D/log/munged.log" --seed-file="$D/run/munged.seed"
    for _ in $(seq 50); do [ -S "$D/munge/munge.socket" ] && break; sleep 0.1; done
    start_daemon slurmctld slurmctld -D -f "$SLURM_CONF"
    for n in "${NODES[@]}"; do start_daemon "slurmd-$n" slurmd -D -N "$n" -f "$SLURM_CONF"; done
    for _ in $(seq 300); do
        if nodes_idle; then log "up: nodes ${NODES[*]} idle (SLURM_CONF=$SLURM_CONF)"; return 0; fi
        all_alive || break
        sleep 0.1
    done
    log "cluster did not come up; daemon logs in $D/log"
    for f in "$D"/log/*.out "$D"/log/slurmctld.log; do [ -f "$f" ] && { echo "== $f" >&2; tail -5 "$f" >&2; }; done
    return 1
}

stop() {
    if alive "$D/pids/slurmctld.pid"; then
        # Cancel this cluster's jobs so their steps (and the processes they started) end before the daemons do.
        squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
        for _ in $(seq 100); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
    fi
    for name in slurmd-n1 slurmd-n2 slurmctld munged; do
        local pidfile="$D/pids/$name.pid"
        if alive "$pidfile"; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
    done
    for name in slurmd-n1 slurmd-n2 slurmctld munged; do
        local pidfile="$D/pids/$name.pid"
        for _ in $(seq 50); do alive "$pidfile" || break; sleep 0.1; done
        if alive "$pidfile"; then kill -9 "$(cat "$pidfile")" 2>/dev/null || true; fi
        rm -f "$pidfile"
    done
    log "stopped"
}

status() {
    local rc=0
    for name in munged slurmctld slurmd-n1 slurmd-n2; do
        if alive "$D/pids/$name.pid"; then echo "$name: running (pid $(cat "$D/pids/$name.pid"))"
        else echo "$name: not running"; rc=1; fi
    done
    [ $rc = 0 ] && sinfo -N 2>/dev/null || true
    return $rc
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$SLURM_CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
