#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine (Debian's slurm-wlm and munge, no systemd), so that
# the sweep test submits real Slurm jobs. Needs root. Safe to run twice: a running cluster is kept.
set -euo pipefail
if sinfo -h -o %t 2>/dev/null | grep -q idle; then
    exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
host="$(hostname -s)"
mkdir -p /run/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /etc/slurm
chown munge:munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --force
    chown munge:munge /etc/munge/munge.key
fi
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
# The node line as slurmd measures this machine, reached over loopback.
node="$(slurmd -C | head -1) NodeAddr=127.0.0.1 State=UNKNOWN"
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=sdquant
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, one job would take the node's whole memory and jobs would run one at a time.
DefMemPerCPU=1024
ReturnToService=2
${node}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
    if sinfo -h -o %t 2>/dev/null | grep -q idle; then
        echo "slurm: node ${host} idle in partition debug"
        exit 0
    fi
    sleep 1
done
echo "slurm did not come up; see /var/log/slurm/" >&2
exit 1
