#!/usr/bin/env bash
# A single-node Slurm for CI and the tests: slurm-wlm + munge from Debian, this host as the only node.
# Idempotent: installs what is missing, starts what is not running, then waits (bounded) for the node to
# be idle. State, spool and logs live under $SLURM_CI_DIR (default /tmp/rollout-slurm).
# Usage: cluster/slurm/ci-start.sh   (then `export SLURM_CONF=$SLURM_CI_DIR/slurm.conf` if it is not
# the default; the script also links /etc/slurm/slurm.conf to it so plain `sbatch` finds it).
set -euo pipefail
dir="${SLURM_CI_DIR:-/tmp/rollout-slurm}"
node="$(hostname)"

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

mkdir -p "$dir"/{state,spool,log} /run/munge /etc/slurm
chown munge:munge /run/munge
[ -s /etc/munge/munge.key ] || { /usr/sbin/mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; }
if ! pgrep -u munge -x munged >/dev/null; then
  su -s /bin/sh munge -c /usr/sbin/munged
fi

cpus="$(nproc)"
mem_mb="$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))"
conf="$dir/slurm.conf"
cat >"$conf" <<CONF
ClusterName=rollout
SlurmctldHost=${node}(127.0.0.1)
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=5
NodeName=${node} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE OverSubscribe=FORCE:64 State=UP
CONF
ln -sf "$conf" /etc/slurm/slurm.conf
export SLURM_CONF="$conf"

pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld -f "$conf"
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd -f "$conf"

for _ in $(seq 1 60); do
  state="$(sinfo -h -n "$node" -o %t 2>/dev/null || true)"
  case "$state" in
    idle|mix|alloc) echo "slurm: node $node $state"; exit 0 ;;
    down*|drain*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "slurm: node $node did not become idle within 60 s (state: ${state:-unknown})" >&2
exit 1
