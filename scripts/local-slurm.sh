#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for the end-to-end tests and for trying renders.
#
#   scripts/local-slurm.sh start    install Slurm, slurmdbd, MariaDB and munge if missing, write the
#                                   config, start munged, MariaDB, slurmdbd (with the accounts, see
#                                   "Accounting"), slurmctld and one slurmd per node, wait until all are idle
#   scripts/local-slurm.sh stop     cancel every job, stop the daemons this script started (by PID), kill
#                                   what is left in the node namespaces, remove namespaces, bridge and
#                                   the /etc/hosts lines this script added
#   scripts/local-slurm.sh status   exit 0 when the cluster is up and both nodes answer, 3 when it is
#                                   stopped, 1 when it is half up (run stop, then start)
#   scripts/local-slurm.sh env      print the variables a client needs (SLURM_CONF=...), one per line
#   scripts/local-slurm.sh preempt-signal on|off
#                                   preemption sends the job's --signal to the batch shell (on) or SIGTERM to
#                                   the job steps (off, Slurm's default); see "Preemption" below
#   scripts/local-slurm.sh preempt-type partition|qos
#                                   who may preempt whom: partition priority (the default) or the job's QOS
#                                   (needs the accounting database); restarts slurmctld
#   scripts/local-slurm.sh node-fail NODE
#                                   a node lost for real: SIGKILL its slurmd (the job's processes on it run
#                                   on, as on a node cut off from the controller) and set it DOWN, which
#                                   ends its jobs as NODE_FAIL (Slurm requeues those that may be requeued)
#   scripts/local-slurm.sh node-back NODE
#                                   start its slurmd again (which ends what is left of the jobs the
#                                   controller moved away) and RESUME it; waits until it is idle
#
# Both start and stop are idempotent. Run as root.
#
# Instances (SBATCH_GEN_SLURM_INSTANCE=NAME, a lowercase letter and up to 4 more letters or digits): a
# second cluster beside the default one, which it never touches: its own state dir
# (/tmp/sbatch-gen-slurm-NAME), node names (NAME-n1, NAME-n2, NAME-g1, ...; controller slurmctl-NAME),
# network namespaces, bridge (br-sbgen-NAME) and veths, subnet, ports, /etc/hosts lines and munged (its socket
# in the state dir). The subnet and ports come from the instance's slot, 1-50 (a checksum of NAME, or
# SBATCH_GEN_SLURM_SLOT): subnet 10.200.SLOT, slurmctld 7000+10*SLOT, slurmdbd +1, MariaDB +2 (each
# setting below still overrides its own). `env` prints the slot. Every command acts on the instance its
# environment names; unset, the default cluster.
#
# Layout (SBATCH_GEN_SLURM_LAYOUT):
#   netns     (default) every node is its own network namespace with its own address and hostname on a
#             bridge that exists only inside this machine: n1=10.200.0.11, n2=10.200.0.12, the
#             controller "slurmctl" on the bridge address 10.200.0.1. Closer to a real cluster: the c10d
#             store lives on one node only and MASTER_ADDR really names a different host.
#   loopback  both slurmd on 127.0.0.1 on different ports (Debian builds Slurm with MULTIPLE_SLURMD).
#
# Settings (environment): SBATCH_GEN_SLURM_STATE (state dir, default /tmp/sbatch-gen-slurm),
# SBATCH_GEN_SLURM_LAYOUT, SBATCH_GEN_SLURM_SUBNET (first three octets, default 10.200.0),
# SBATCH_GEN_SLURM_PORT (slurmctld port, default 6817), SBATCH_GEN_SLURM_CPUS (CPUs each node
# advertises, default 8), SBATCH_GEN_SLURM_MEM_MB (memory each node advertises, default 16000),
# SBATCH_GEN_SLURM_GRACE_S (GraceTime of partition debug and of QOS normal, default 120),
# SBATCH_GEN_SLURM_KILLWAIT_S (KillWait, default 5), SBATCH_GEN_SLURM_ACCOUNTING (1, the default: an
# accounting database that Slurm enforces; 0: none), SBATCH_GEN_SLURM_DB_PORT (MariaDB on 127.0.0.1,
# default 6833), SBATCH_GEN_SLURM_DBD_PORT (slurmdbd on 127.0.0.1, default 6819), SBATCH_GEN_SLURM_PROCTRACK
# (cgroup, the default: ProctrackType=proctrack/cgroup on the machine's cgroup v1 hierarchies, every process
# of a job step tracked, signalled and killed with it, as on production clusters and in SUNK's pods; pgid:
# the step's process groups only, which a process in a session of its own escapes).
#
# Accounting (SBATCH_GEN_SLURM_ACCOUNTING=1): a MariaDB server of this cluster's own (data in the state dir,
# listening on 127.0.0.1 only, wiped on every start) behind slurmdbd, with
# AccountingStorageEnforce=associations,limits,qos: a job must name an account and QOS its user may use.
# AccountingStoreFlags=job_env: the database keeps what each batch job was submitted with (sacct --env-vars).
# Accounts sbgen (root's default), lab and llm-xr (the account the committed GPU sites name); QOS normal
# (GraceTime=SBATCH_GEN_SLURM_GRACE_S) and urgent (may preempt normal, PreemptMode=REQUEUE). Only root has
# associations: submit as root.
#
# Preemption (docs/slurm.md, "Preemption on your cluster"): PreemptType=preempt/partition_prio with
# PreemptMode=REQUEUE. A job in partition "high" (PriorityTier 10) preempts the jobs it needs the nodes of:
#   debug   (default) GraceTime=SBATCH_GEN_SLURM_GRACE_S: the job steps get SIGTERM at once, the job is
#           killed and requeued by Slurm when the grace ends (if it still runs)
#   sunk    the same nodes, GraceTime=0: killed at once (SIGTERM, SIGKILL KillWait later), as SUNK's pod
#           scheduler preempts a Slurm job by default
#   lab     the same nodes, AllowAccounts=lab AllowQos=normal: a partition that restricts who may use it
#   short   the same nodes, MaxTime=SBATCH_GEN_SLURM_SHORT_MAXTIME (00:10:00): a partition with a time limit
#   scripts/local-slurm.sh preempt-signal on|off   sets SlurmctldParameters=preempt_send_user_signal (a
#           preemption then sends the job's --signal to the batch shell instead of SIGTERM to the steps)
#           and reconfigures the running cluster; `start` always begins with it off.
#   scripts/local-slurm.sh preempt-type qos   sets PreemptType=preempt/qos: a job of QOS urgent preempts
#           jobs of QOS normal (whose GraceTime applies) in any partition; partition priority no longer
#           counts. `preempt-type partition` goes back; `start` always begins with partition.
#
# The processes live in the same mount namespace as the caller, so every path (the repository, its
# .venv) is the same on the nodes as here.

set -euo pipefail

log() { printf 'local-slurm%s: %s\n' "${INSTANCE:+ ($INSTANCE)}" "$*" >&2; }
die() { log "error: $*"; exit 1; }

INSTANCE=${SBATCH_GEN_SLURM_INSTANCE:-}
if [[ -n $INSTANCE ]]; then
  [[ $INSTANCE =~ ^[a-z][a-z0-9]{0,4}$ ]] ||
    die "SBATCH_GEN_SLURM_INSTANCE must be a lowercase letter and up to 4 more letters or digits, not '$INSTANCE'"
  SLOT=${SBATCH_GEN_SLURM_SLOT:-$(($(printf %s "$INSTANCE" | cksum | cut -d' ' -f1) % 50 + 1))}
  if ! [[ $SLOT =~ ^[0-9]+$ ]] || ((SLOT < 1 || SLOT > 50)); then die "SBATCH_GEN_SLURM_SLOT must be 1-50, not '$SLOT'"; fi
  # everything that names or addresses the cluster, distinct from the default one and from other slots
  NAME_PREFIX=$INSTANCE-
  DEFAULT_STATE=/tmp/sbatch-gen-slurm-$INSTANCE
  DEFAULT_SUBNET=10.200.$SLOT
  DEFAULT_CTLD_PORT=$((7000 + 10 * SLOT))
  DEFAULT_DBD_PORT=$((7001 + 10 * SLOT))
  DEFAULT_DB_PORT=$((7002 + 10 * SLOT))
  LOOPBACK_PORT0=$((17000 + 10 * SLOT))
else
  SLOT=0
  NAME_PREFIX=
  DEFAULT_STATE=/tmp/sbatch-gen-slurm
  DEFAULT_SUBNET=10.200.0
  DEFAULT_CTLD_PORT=6817
  DEFAULT_DBD_PORT=6819
  DEFAULT_DB_PORT=6833
  LOOPBACK_PORT0=17000
fi

STATE=${SBATCH_GEN_SLURM_STATE:-$DEFAULT_STATE}
PROCTRACK=${SBATCH_GEN_SLURM_PROCTRACK:-cgroup}
LAYOUT=${SBATCH_GEN_SLURM_LAYOUT:-netns}
SUBNET=${SBATCH_GEN_SLURM_SUBNET:-$DEFAULT_SUBNET}
CTLD_PORT=${SBATCH_GEN_SLURM_PORT:-$DEFAULT_CTLD_PORT}
NODE_CPUS=${SBATCH_GEN_SLURM_CPUS:-8}
NODE_MEM_MB=${SBATCH_GEN_SLURM_MEM_MB:-16000}
GRACE_S=${SBATCH_GEN_SLURM_GRACE_S:-120}
KILLWAIT_S=${SBATCH_GEN_SLURM_KILLWAIT_S:-5}
ACCOUNTING=${SBATCH_GEN_SLURM_ACCOUNTING:-1}
DB_PORT=${SBATCH_GEN_SLURM_DB_PORT:-$DEFAULT_DB_PORT}
DBD_PORT=${SBATCH_GEN_SLURM_DBD_PORT:-$DEFAULT_DBD_PORT}
SHORT_MAXTIME=00:10:00

# Compute nodes that run jobs: small, CPU only, partition "debug" (the default).
CPU_NODES=("${NAME_PREFIX}n1" "${NAME_PREFIX}n2")
# Nodes shaped like the production sites, in partition "gpu", so that `sbatch --test-only` can check
# every #SBATCH line of their renders (GPU gres with types, constraints, --mem=0, --exclusive) with only
# the partition overridden. Their GPUs are character devices cloned from /dev/null. Jobs can run there
# too, but nothing here needs that. SBATCH_GEN_SLURM_GPU_SHAPES=0 leaves them out.
#   g1, g2  like the EU site: 2 nodes x 8 H200, 224 CPUs, InfiniBand (feature ib), x86_64
#   gh1     like the US site: 1 GH200, 72 CPUs, aarch64
SHAPE_NODES=("${NAME_PREFIX}g1" "${NAME_PREFIX}g2" "${NAME_PREFIX}gh1")
declare -A SHAPE_SPEC=(
  ["${NAME_PREFIX}g1"]="CPUs=224 RealMemory=2000000 Gres=gpu:h200:8 Features=ib,x86_64,h200"
  ["${NAME_PREFIX}g2"]="CPUs=224 RealMemory=2000000 Gres=gpu:h200:8 Features=ib,x86_64,h200"
  ["${NAME_PREFIX}gh1"]="CPUs=72 RealMemory=480000 Gres=gpu:gh200:1 Features=aarch64,gh200"
)
declare -A SHAPE_GPUS=(["${NAME_PREFIX}g1"]="h200 8" ["${NAME_PREFIX}g2"]="h200 8" ["${NAME_PREFIX}gh1"]="gh200 1")
GPU_PARTITION=gpu
NODES=("${CPU_NODES[@]}")
[[ ${SBATCH_GEN_SLURM_GPU_SHAPES:-1} == 0 ]] || NODES+=("${SHAPE_NODES[@]}")
CTLD_HOST=slurmctl${INSTANCE:+-$INSTANCE}
PARTITION=debug
PREEMPTOR_PARTITION=high
SUNK_PARTITION=sunk
ACCOUNTS_PARTITION=lab
SHORT_PARTITION=short
# accounting: root's default account first; llm-xr is what sites/eu.yaml and sites/us.yaml name
ACCOUNTS=(sbgen lab llm-xr)
PREEMPTOR_QOS=urgent
BRIDGE=br-sbgen${INSTANCE:+-$INSTANCE}
NS_PREFIX=sbgen-  # + the node name, which carries the instance
VETH_PREFIX=sbgen${INSTANCE}-v
# ends each /etc/hosts line this cluster adds (an instance's mark is the default's plus ":NAME", so lines
# are told apart by their end, never by a substring)
HOSTS_MARK="# sbatch-gen local-slurm${INSTANCE:+:$INSTANCE}"
PACKAGES=(slurmctld slurmd slurm-client munge)

CONF=$STATE/etc/slurm.conf
LOG=$STATE/log
OURS=$STATE/started   # one line per daemon this script started: "<name> <pid>"
# what preempt-signal and preempt-type set on the running cluster (write_conf reads it); reset by start
RUNTIME=$STATE/preempt.env
DB_DIR=$STATE/db
# munged: the machine's (/run/munge) for the default cluster; an instance runs its own, socket in its state
# dir, so that neither cluster's stop takes the other's munged away
if [[ -n $INSTANCE ]]; then MUNGE_DIR=$STATE/munge; MUNGE_SOCKET=$MUNGE_DIR/munge.socket.2
else MUNGE_DIR=/run/munge; MUNGE_SOCKET=/run/munge/munge.socket.2; fi

case $LAYOUT in
  netns | loopback) ;;
  *) die "SBATCH_GEN_SLURM_LAYOUT must be netns or loopback, not '$LAYOUT'" ;;
esac
[[ $SUBNET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "SBATCH_GEN_SLURM_SUBNET must look like 10.200.0, not '$SUBNET'"
[[ $GRACE_S =~ ^[0-9]+$ ]] || die "SBATCH_GEN_SLURM_GRACE_S must be a number of seconds, not '$GRACE_S'"
[[ $KILLWAIT_S =~ ^[0-9]+$ ]] || die "SBATCH_GEN_SLURM_KILLWAIT_S must be a number of seconds, not '$KILLWAIT_S'"
[[ $ACCOUNTING == 0 || $ACCOUNTING == 1 ]] || die "SBATCH_GEN_SLURM_ACCOUNTING must be 0 or 1, not '$ACCOUNTING'"
for _port in "$DB_PORT" "$DBD_PORT"; do
  if ! [[ $_port =~ ^[0-9]{1,5}$ ]] || ((_port == 0 || _port > 65535)); then
    die "SBATCH_GEN_SLURM_DB_PORT and SBATCH_GEN_SLURM_DBD_PORT must be TCP ports, not '$_port'"
  fi
done
((ACCOUNTING)) && PACKAGES+=(slurmdbd mariadb-server)
[[ $STATE == /* ]] || die "SBATCH_GEN_SLURM_STATE must be an absolute path, not '$STATE'"

node_addr() {  # node index (1-based) -> address
  if [[ $LAYOUT == netns ]]; then echo "$SUBNET.$((10 + $1))"; else echo 127.0.0.1; fi
}
ctld_addr() { if [[ $LAYOUT == netns ]]; then echo "$SUBNET.1"; else echo 127.0.0.1; fi; }

slurm() { SLURM_CONF=$CONF "$@"; }

# --- processes --------------------------------------------------------------------------------------

alive() {  # pid -> 0 if it runs (zombies count as gone)
  local pid=$1 st
  [[ -n $pid && -r /proc/$pid/stat ]] || return 1
  st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ $st != Z && $st != X ]]
}

comm_of() { cat "/proc/$1/comm" 2>/dev/null || true; }

pid_from_file() {  # pidfile expected-comm -> pid if the file names a live process of that name
  local f=$1 want=$2 pid
  [[ -s $f ]] || return 1
  pid=$(tr -dc '0-9' <"$f")
  alive "$pid" && [[ $(comm_of "$pid") == "$want" ]] && echo "$pid"
}

stop_pid() {  # pid [seconds]: TERM, wait, then KILL
  local pid=$1 wait_s=${2:-10} i
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < wait_s * 10; i++)); do alive "$pid" || return 0; sleep 0.1; done
  log "pid $pid ($(comm_of "$pid")) ignored SIGTERM for ${wait_s}s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do alive "$pid" || return 0; sleep 0.1; done
  log "warning: pid $pid still there after SIGKILL"
}

wait_for() {  # seconds description command...: poll until the command succeeds
  local secs=$1 what=$2 i
  shift 2
  for ((i = 0; i < secs * 10; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  log "timed out after ${secs}s waiting for $what"
  return 1
}

# --- packages and munge -----------------------------------------------------------------------------

ensure_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  command -v ip >/dev/null || missing+=(iproute2)
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  for p in ip nsenter unshare flock runuser; do
    command -v "$p" >/dev/null || die "'$p' not found (iproute2, util-linux)"
  done
}

munge_works() { munge -S "$MUNGE_SOCKET" -n </dev/null 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }

start_munge() {
  if munge_works; then return 0; fi
  [[ -s /etc/munge/munge.key ]] || {
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  }
  local -a args=()
  if [[ -n $INSTANCE ]]; then
    mkdir -p "$MUNGE_DIR"
    chown munge:munge "$MUNGE_DIR"
    chmod 755 "$MUNGE_DIR"
    args=(--socket="$MUNGE_SOCKET" --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log"
      --seed-file="$MUNGE_DIR/munged.seed")
  else
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
  fi
  # a pid file left by a munged that died would make the new one refuse to start
  if [[ -e $MUNGE_DIR/munged.pid ]] && ! pid_from_file "$MUNGE_DIR/munged.pid" munged >/dev/null; then
    rm -f "$MUNGE_DIR/munged.pid"
  fi
  runuser -u munge -- /usr/sbin/munged "${args[@]}" 9>&-
  wait_for 10 "munged" munge_works || die "munged did not come up (see ${args:+$MUNGE_DIR/}munged.log)"
  local pid
  pid=$(pid_from_file "$MUNGE_DIR/munged.pid" munged) || die "munged runs but $MUNGE_DIR/munged.pid names no munged"
  echo "munged $pid" >>"$OURS"
}

# --- accounting: MariaDB and slurmdbd ---------------------------------------------------------------

port_free() {  # port -> 0 if nothing listens on it
  ! command -v ss >/dev/null || [[ -z $(ss -Hltn "sport = :$1" 2>/dev/null) ]]
}

db_sql() { mariadb --no-defaults --socket="$STATE/mariadb.sock" -u root "$@"; }
db_up() { db_sql -e 'SELECT 1' >/dev/null 2>&1; }
db_pid() { pid_from_file "$STATE/mariadbd.pid" mariadbd; }
dbd_pid() { pid_from_file "$STATE/slurmdbd.pid" slurmdbd; }
dbd_up() { slurm sacctmgr -n -P show cluster format=cluster >/dev/null 2>&1; }

start_db() {
  port_free "$DB_PORT" || die "port $DB_PORT is in use on this machine: stop what listens there or set SBATCH_GEN_SLURM_DB_PORT"
  rm -rf "$DB_DIR" "$STATE/mariadb.sock" "$STATE/mariadbd.pid" "$STATE/tmp"
  # a temporary directory of its own: two clusters' databases may be set up at the same time
  mkdir -p "$STATE/tmp"
  mariadb-install-db --no-defaults --datadir="$DB_DIR" --tmpdir="$STATE/tmp" --user=root --auth-root-authentication-method=socket \
    --skip-test-db >"$LOG/mariadb-install.log" 2>&1 || { tail -n 20 "$LOG/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  # a database for this cluster only: no other option file, TCP on 127.0.0.1 for slurmdbd, the socket for root
  /usr/sbin/mariadbd --no-defaults --datadir="$DB_DIR" --tmpdir="$STATE/tmp" --user=root --socket="$STATE/mariadb.sock" \
    --bind-address=127.0.0.1 --port="$DB_PORT" --pid-file="$STATE/mariadbd.pid" --log-error="$LOG/mariadb.log" \
    --skip-name-resolve --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 9>&- >/dev/null 2>&1 &
  wait_for 30 "MariaDB" db_up || { tail -n 20 "$LOG/mariadb.log" >&2 || true; die "MariaDB did not come up"; }
  wait_for 5 "mariadbd pid file" db_pid || die "MariaDB answers but $STATE/mariadbd.pid names no mariadbd"
  echo "mariadbd $(db_pid)" >>"$OURS"
  # slurmdbd's login, local to this machine: the password guards nothing but this throwaway database
  db_sql -e "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'sbgen-local';
             GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "could not create slurmdbd's database user"
}

write_dbd_conf() {
  local f=$STATE/etc/slurmdbd.conf
  # slurmdbd refuses a config others can read (it holds the database password)
  (
    umask 077
    cat >"$f.tmp" <<EOF
# Written by scripts/local-slurm.sh. Regenerated on every start.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$STATE/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=sbgen-local
StorageLoc=slurm_acct_db
EOF
  )
  mv -f "$f.tmp" "$f"
}

start_dbd() {
  port_free "$DBD_PORT" || die "port $DBD_PORT is in use on this machine: stop what listens there or set SBATCH_GEN_SLURM_DBD_PORT"
  write_dbd_conf
  # slurmdbd reads slurmdbd.conf from the directory of SLURM_CONF
  slurm /usr/sbin/slurmdbd 9>&-
  wait_for 15 "slurmdbd pid file" dbd_pid || { tail -n 20 "$LOG/slurmdbd.log" >&2 || true; die "slurmdbd did not start"; }
  echo "slurmdbd $(dbd_pid)" >>"$OURS"
  wait_for 30 "slurmdbd to answer" dbd_up || { tail -n 20 "$LOG/slurmdbd.log" >&2 || true; die "slurmdbd does not answer"; }
}

sam() {  # sacctmgr, answering yes, its output in the log
  slurm sacctmgr -i "$@" >>"$LOG/sacctmgr.log" 2>&1 || { tail -n 5 "$LOG/sacctmgr.log" >&2; die "sacctmgr $*: failed"; }
}

add_associations() {  # before slurmctld starts, so that it loads them at once
  local accounts
  accounts=$(IFS=,; echo "${ACCOUNTS[*]}")
  sam add cluster sbgenlocal
  sam add account "$accounts" Cluster=sbgenlocal Description=local-slurm Organization=sbatch-gen
  sam add qos "$PREEMPTOR_QOS" Preempt=normal PreemptMode=requeue
  sam modify qos normal set GraceTime="$GRACE_S"
  sam add user root Account="$accounts" DefaultAccount="${ACCOUNTS[0]}" Cluster=sbgenlocal
  sam modify user root set qos+="$PREEMPTOR_QOS"
}

# --- network ----------------------------------------------------------------------------------------

ns_of() { echo "$NS_PREFIX$1"; }

net_up() {
  [[ $LAYOUT == netns ]] || return 0
  if ip -4 route show | grep -q "^$SUBNET\.0/24 " && ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    die "$SUBNET.0/24 is already routed on this machine; choose another SBATCH_GEN_SLURM_SUBNET"
  fi
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$(ctld_addr)/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i node ns veth
  for i in "${!NODES[@]}"; do
    node=${NODES[$i]}
    ns=$(ns_of "$node")
    veth=$VETH_PREFIX$((i + 1))
    [[ -e /run/netns/$ns ]] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip link add "$veth" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr replace "$(node_addr $((i + 1)))/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

net_down() {
  local node ns pid i
  for node in "${NODES[@]}"; do
    ns=$(ns_of "$node")
    [[ -e /run/netns/$ns ]] || continue
    # whatever still runs in a node's namespace was started by this cluster (job steps, orphans)
    for i in 1 2 3; do
      mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
      ((${#pids[@]} == 0)) && break
      log "killing ${#pids[@]} leftover process(es) in $ns: ${pids[*]}"
      for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
      sleep 0.5
    done
    ip netns del "$ns" 2>/dev/null || log "warning: could not delete netns $ns"
  done
  for ((i = 1; i <= ${#NODES[@]}; i++)); do
    if ip link show "$VETH_PREFIX$i" >/dev/null 2>&1; then ip link del "$VETH_PREFIX$i" 2>/dev/null || true; fi
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
}

# /etc/hosts may be a bind mount (containers): rewrite it in place, never replace the file.
# Our lines are those that end with " $HOSTS_MARK" (another instance's end otherwise).
hosts_ours() {  # exit 0 if /etc/hosts has a line of this cluster's
  awk -v m=" $HOSTS_MARK" 'length($0) >= length(m) && substr($0, length($0) - length(m) + 1) == m { f = 1 }
    END { exit !f }' /etc/hosts 2>/dev/null
}

hosts_remove() {
  hosts_ours || return 0
  local tmp
  tmp=$(mktemp)
  awk -v m=" $HOSTS_MARK" '!(length($0) >= length(m) && substr($0, length($0) - length(m) + 1) == m)' /etc/hosts >"$tmp"
  cat "$tmp" >/etc/hosts
  rm -f "$tmp"
}

hosts_add() {
  hosts_remove
  local i name lines=()
  for name in "$CTLD_HOST" "${NODES[@]}"; do
    # an existing mapping for one of our names that we did not write would make the cluster ambiguous
    if grep -vF "$HOSTS_MARK" /etc/hosts | sed 's/#.*//' | awk '{for (i = 2; i <= NF; i++) print $i}' | grep -qx "$name"; then
      die "/etc/hosts already maps '$name'; remove that line or use a machine without it"
    fi
  done
  lines+=("$(ctld_addr) $CTLD_HOST $HOSTS_MARK")
  for i in "${!NODES[@]}"; do lines+=("$(node_addr $((i + 1))) ${NODES[$i]} $HOSTS_MARK"); done
  printf '%s\n' "${lines[@]}" >>/etc/hosts
}

# --- config -----------------------------------------------------------------------------------------

is_shape() { [[ -n ${SHAPE_SPEC[$1]:-} ]]; }

write_gres() {  # fake GPU devices and gres.conf for the shape nodes
  local tmp=$STATE/etc/gres.conf.tmp node type count i max=0
  mkdir -p "$STATE/dev"
  for node in "${NODES[@]}"; do
    is_shape "$node" || continue
    read -r type count <<<"${SHAPE_GPUS[$node]}"
    ((count > max)) && max=$count
  done
  for ((i = 0; i < max; i++)); do
    [[ -c $STATE/dev/nvidia$i ]] || mknod "$STATE/dev/nvidia$i" c 1 3
  done
  {
    echo "# Written by scripts/local-slurm.sh: fake GPUs (clones of /dev/null) for the shape nodes."
    for node in "${NODES[@]}"; do
      is_shape "$node" || continue
      read -r type count <<<"${SHAPE_GPUS[$node]}"
      echo "NodeName=$node Name=gpu Type=$type File=$STATE/dev/nvidia[0-$((count - 1))]"
    done
  } >"$tmp"
  mv -f "$tmp" "$STATE/etc/gres.conf"
}

runtime() {  # setting default -> what preempt-signal / preempt-type last set on this cluster
  local v
  v=$(sed -n "s/^$1=//p" "$RUNTIME" 2>/dev/null | tail -n 1)
  echo "${v:-$2}"
}

set_runtime() {  # setting value
  local tmp=$RUNTIME.tmp
  { grep -v "^$1=" "$RUNTIME" 2>/dev/null || true; echo "$1=$2"; } >"$tmp"
  mv -f "$tmp" "$RUNTIME"
}

write_conf() {
  mkdir -p "$STATE/etc" "$LOG" "$STATE/state" "$STATE/spool"
  if [[ $PROCTRACK == cgroup ]]; then
    printf '%s\n' "# Written by scripts/local-slurm.sh: proctrack/cgroup on the machine's cgroup v1 hierarchies" \
      "CgroupPlugin=cgroup/v1" "CgroupMountpoint=/sys/fs/cgroup" "ConstrainCores=no" "ConstrainRAMSpace=no" \
      "ConstrainDevices=no" >"$STATE/etc/cgroup.conf"
  else
    rm -f "$STATE/etc/cgroup.conf"
  fi
  local tmp=$CONF.tmp i spec cpu_list shape_list preempt_type
  preempt_type=$(runtime preempt_type partition)
  {
    echo "# Written by scripts/local-slurm.sh ($LAYOUT layout). Regenerated on every start."
    echo "ClusterName=sbgenlocal"
    echo "SlurmctldHost=$CTLD_HOST($(ctld_addr))"
    cat <<EOF
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# short credential life and a fast scheduler: requeue-to-running in seconds instead of minutes
AuthInfo=cred_expire=5,socket=$MUNGE_SOCKET
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
MpiDefault=none
EOF
    if [[ $PROCTRACK == cgroup ]]; then
      echo "# cgroup (v1 hierarchies, freezer): every process of a job step is tracked and signalled, as on a"
      echo "# production cluster and in SUNK's pods; cgroup.conf beside this file"
      echo "ProctrackType=proctrack/cgroup"
    else
      echo "# pgid: the step's process groups only (linuxproc left orphaned background processes after a job)"
      echo "ProctrackType=proctrack/pgid"
    fi
    cat <<EOF
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.txt
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldPort=$CTLD_PORT
SlurmdPort=6818
# the nodes advertise more CPUs than this machine has
SlurmdParameters=config_overrides
ReturnToService=2
InactiveLimit=0
KillWait=$KILLWAIT_S
PreemptMode=REQUEUE
MinJobAge=3600
Waittime=0
MailProg=/bin/true
EOF
    if ((ACCOUNTING)); then
      echo "# accounting: slurmdbd on 127.0.0.1; a job needs an account and a QOS its user may use"
      echo "AccountingStorageType=accounting_storage/slurmdbd"
      echo "AccountingStorageHost=127.0.0.1"
      echo "AccountingStoragePort=$DBD_PORT"
      echo "AccountingStorageEnforce=associations,limits,qos"
      echo "# the munged socket of the connections to slurmdbd (AuthInfo's socket does not reach them)"
      echo "AccountingStoragePass=$MUNGE_SOCKET"
      echo "# the database keeps each batch job's environment, as many sites do (sacct --env-vars)"
      echo "AccountingStoreFlags=job_env"
    else
      echo "AccountingStorageType=accounting_storage/none"
    fi
    if [[ $preempt_type == qos ]]; then
      echo "# preemption by QOS (local-slurm.sh preempt-type qos): urgent requeues normal, with normal's GraceTime"
      echo "PreemptType=preempt/qos"
    else
      echo "# preemption by partition priority: jobs of \"high\" requeue those of debug (with a grace), sunk (none), lab, short"
      echo "PreemptType=preempt/partition_prio"
    fi
    for i in "${NODES[@]}"; do if is_shape "$i"; then echo "GresTypes=gpu"; break; fi; done
    shape_list=()
    cpu_list=()
    for i in "${!NODES[@]}"; do
      if is_shape "${NODES[$i]}"; then
        spec=${SHAPE_SPEC[${NODES[$i]}]}
        shape_list+=("${NODES[$i]}")
      else
        spec="CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB"
        cpu_list+=("${NODES[$i]}")
      fi
      if [[ $LAYOUT == netns ]]; then
        echo "NodeName=${NODES[$i]} NodeHostname=${NODES[$i]} NodeAddr=$(node_addr $((i + 1))) $spec State=UNKNOWN"
      else
        echo "NodeName=${NODES[$i]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((LOOPBACK_PORT0 + 1 + i)) $spec State=UNKNOWN"
      fi
    done
    local cpus
    cpus=$(IFS=,; echo "${cpu_list[*]}")
    echo "PartitionName=$PARTITION Nodes=$cpus Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_S"
    echo "PartitionName=$SUNK_PARTITION Nodes=$cpus MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=0"
    echo "PartitionName=$ACCOUNTS_PARTITION Nodes=$cpus MaxTime=INFINITE State=UP PriorityTier=1 AllowAccounts=lab AllowQos=normal"
    echo "PartitionName=$SHORT_PARTITION Nodes=$cpus MaxTime=$SHORT_MAXTIME State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_S"
    echo "PartitionName=$PREEMPTOR_PARTITION Nodes=$cpus MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF"
    if [[ $(runtime preempt_signal off) == on ]]; then echo "SlurmctldParameters=preempt_send_user_signal"; fi
    if ((${#shape_list[@]})); then
      echo "PartitionName=$GPU_PARTITION Nodes=$(IFS=,; echo "${shape_list[*]}") MaxTime=INFINITE State=UP"
    fi
  } >"$tmp"
  mv -f "$tmp" "$CONF"
}

# --- daemons ----------------------------------------------------------------------------------------

ctld_pid() { pid_from_file "$STATE/slurmctld.pid" slurmctld; }
slurmd_pid() { pid_from_file "$STATE/slurmd-$1.pid" slurmd; }

ctld_up() { slurm scontrol ping 2>/dev/null | grep -q 'is UP'; }

node_idle() {  # NODE is idle (or running something): it is back
  slurm sinfo -h -N -n "$1" -o '%t' 2>/dev/null | grep -Eqx '(idle|alloc|mix|comp)'
}

nodes_idle() {  # every node idle (or running something): the cluster answers
  local out n
  out=$(slurm sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
  for n in "${NODES[@]}"; do
    grep -Eq "^$n (idle|alloc|mix|comp)\$" <<<"$out" || return 1
  done
}

nodes_really_idle() {
  local out n
  out=$(slurm sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
  for n in "${NODES[@]}"; do grep -q "^$n idle\$" <<<"$out" || return 1; done
}

start_ctld() {
  if command -v ss >/dev/null && [[ -n $(ss -Hltn "sport = :$CTLD_PORT" 2>/dev/null) ]]; then
    die "port $CTLD_PORT is in use on this machine: stop what listens there or set SBATCH_GEN_SLURM_PORT"
  fi
  local -a cmd=(/usr/sbin/slurmctld -i -f "$CONF")
  # slurmctld only serves when the host name equals SlurmctldHost: give it its own UTS namespace
  unshare --uts sh -c "hostname $CTLD_HOST && exec \"\$@\"" sh "${cmd[@]}" 9>&-
  wait_for 15 "slurmctld pid file" ctld_pid || { tail -n 20 "$LOG/slurmctld.log" >&2 || true; die "slurmctld did not start"; }
  echo "slurmctld $(ctld_pid)" >>"$OURS"
  wait_for 15 "slurmctld to answer" ctld_up || { tail -n 20 "$LOG/slurmctld.log" >&2 || true; die "slurmctld does not answer"; }
}

start_slurmd() {
  local node=$1
  local -a cmd=(/usr/sbin/slurmd -f "$CONF" -N "$node")
  if [[ $LAYOUT == netns ]]; then
    nsenter --net="/run/netns/$(ns_of "$node")" unshare --uts sh -c "hostname $node && exec \"\$@\"" sh "${cmd[@]}" 9>&-
  else
    "${cmd[@]}" 9>&-
  fi
  wait_for 15 "slurmd $node" slurmd_pid "$node" || { tail -n 20 "$LOG/slurmd-$node.log" >&2 || true; die "slurmd $node did not start"; }
  echo "slurmd-$node $(slurmd_pid "$node")" >>"$OURS"
}

# --- commands ---------------------------------------------------------------------------------------

status_code() {  # 0 up, 3 stopped, 1 partial
  local any=0 all=1 n
  if ctld_pid >/dev/null; then any=1; else all=0; fi
  if ((ACCOUNTING)); then
    if db_pid >/dev/null; then any=1; else all=0; fi
    if dbd_pid >/dev/null; then any=1; else all=0; fi
  fi
  for n in "${NODES[@]}"; do if slurmd_pid "$n" >/dev/null; then any=1; else all=0; fi; done
  if [[ $LAYOUT == netns ]]; then
    for n in "${NODES[@]}"; do [[ -e /run/netns/$(ns_of "$n") ]] && any=1; done
    ip link show "$BRIDGE" >/dev/null 2>&1 && any=1
  fi
  hosts_ours && any=1
  if ((all)) && ctld_up && nodes_idle; then return 0; fi
  if ((any)); then return 1; fi
  return 3
}

cmd_status() {
  local rc=0
  status_code || rc=$?
  case $rc in
    0) echo "running ($LAYOUT layout, state $STATE)"
       slurm sinfo -N -o '%N %t %c %m %P' || true
       slurm squeue -o '%i %j %T %r %N' || true ;;
    3) echo "stopped" ;;
    *) echo "partial: some pieces run, others do not (run '$0 stop', then '$0 start'); state $STATE"
       [[ -f $OURS ]] && sed 's/^/  started: /' "$OURS" ;;
  esac
  return "$rc"
}

cmd_env() {
  echo "SLURM_CONF=$CONF"
  echo "SBATCH_GEN_SLURM_STATE=$STATE"
  echo "SBATCH_GEN_SLURM_INSTANCE=$INSTANCE"
  echo "SBATCH_GEN_SLURM_SLOT=$SLOT"
  echo "SBATCH_GEN_SLURM_LAYOUT=$LAYOUT"
  echo "SBATCH_GEN_SLURM_HOST_ADDR=$(ctld_addr)"
  echo "SBATCH_GEN_SLURM_NODES=$(IFS=,; echo "${CPU_NODES[*]}")"
  echo "SBATCH_GEN_SLURM_PARTITION=$PARTITION"
  echo "SBATCH_GEN_SLURM_PREEMPTOR_PARTITION=$PREEMPTOR_PARTITION"
  echo "SBATCH_GEN_SLURM_SUNK_PARTITION=$SUNK_PARTITION"
  echo "SBATCH_GEN_SLURM_ACCOUNTS_PARTITION=$ACCOUNTS_PARTITION"
  echo "SBATCH_GEN_SLURM_GRACE_S=$GRACE_S"
  echo "SBATCH_GEN_SLURM_KILLWAIT_S=$KILLWAIT_S"
  echo "SBATCH_GEN_SLURM_SHORT_PARTITION=$SHORT_PARTITION"
  echo "SBATCH_GEN_SLURM_SHORT_MAXTIME=$SHORT_MAXTIME"
  echo "SBATCH_GEN_SLURM_ACCOUNTING=$ACCOUNTING"
  if ((ACCOUNTING)); then
    echo "SBATCH_GEN_SLURM_ACCOUNTS=$(IFS=,; echo "${ACCOUNTS[*]}")"
    echo "SBATCH_GEN_SLURM_PREEMPTOR_QOS=$PREEMPTOR_QOS"
  fi
  if [[ ${SBATCH_GEN_SLURM_GPU_SHAPES:-1} != 0 ]]; then
    echo "SBATCH_GEN_SLURM_GPU_NODES=$(IFS=,; echo "${SHAPE_NODES[*]}")"
    echo "SBATCH_GEN_SLURM_GPU_PARTITION=$GPU_PARTITION"
  fi
}

cmd_start() {
  ensure_packages
  mkdir -p "$STATE"
  local rc=0
  status_code || rc=$?
  if ((rc == 0)); then log "already running ($STATE)"; return 0; fi
  if ((rc == 1)); then log "found a half-started cluster: stopping it first"; do_stop; fi
  : >"$OURS"
  # whatever makes start fail (die, a failing command under set -e): take down what was started
  trap 'start_failed' EXIT
  # a fresh cluster: job ids restart at 1, so the spool (job credentials) must go with the state
  rm -rf "$STATE/state" "$STATE/spool" "$STATE/slurmctld.pid" "$STATE"/slurmd-*.pid "$RUNTIME"
  # keep the previous cluster's logs one start longer (log.prev/), for a look after a failed run
  if [[ -d $LOG ]]; then rm -rf "$STATE/log.prev"; mv "$LOG" "$STATE/log.prev"; fi
  write_conf
  write_gres
  start_munge
  if ((ACCOUNTING)); then
    start_db
    start_dbd
    add_associations
  fi
  net_up
  hosts_add
  start_ctld
  local n
  for n in "${NODES[@]}"; do start_slurmd "$n"; done
  if ! wait_for 30 "nodes ${NODES[*]} to be idle" nodes_really_idle; then
    slurm sinfo -N >&2 || true
    tail -n 20 "$LOG"/slurmd-*.log >&2 || true
    die "nodes did not become idle"
  fi
  trap - EXIT
  log "up: nodes ${NODES[*]} idle ($LAYOUT layout); export SLURM_CONF=$CONF"
}

start_failed() {
  local rc=$?
  trap - EXIT
  log "start failed (exit $rc): stopping what was started; logs stay in $LOG"
  do_stop || true
  exit "$rc"
}

cancel_jobs() {
  ctld_up || return 0
  local ids
  ids=$(slurm squeue -h -o '%i' 2>/dev/null | tr '\n' ' ')
  [[ -n ${ids// /} ]] || return 0
  log "cancelling jobs: $ids"
  # shellcheck disable=SC2086  # one argument per job id
  slurm scancel $ids 2>/dev/null || true
  # wait until no job has processes on a node (COMPLETING clears after slurmstepd has killed the steps)
  wait_for 30 "jobs to end" sh -c "[ -z \"\$(SLURM_CONF='$CONF' squeue -h -t R,CG,S,CF -o %i)\" ]" ||
    log "warning: jobs still running after scancel; their processes are killed below"
}

do_stop() {
  cancel_jobs
  local n pid name
  for n in "${NODES[@]}"; do
    pid=$(slurmd_pid "$n") && stop_pid "$pid" 10
  done
  pid=$(ctld_pid) && stop_pid "$pid" 10
  pid=$(dbd_pid) && stop_pid "$pid" 10
  pid=$(db_pid) && stop_pid "$pid" 30
  # munged only if this script started it
  if [[ -f $OURS ]]; then
    while read -r name pid; do
      [[ $name == munged ]] || continue
      alive "$pid" && [[ $(comm_of "$pid") == munged ]] && stop_pid "$pid" 5
    done <"$OURS"
  fi
  net_down
  hosts_remove
  rm -f "$OURS" "$STATE/slurmctld.pid" "$STATE"/slurmd-*.pid
  rm -rf "$STATE/state" "$STATE/spool" "$DB_DIR" "$STATE/tmp" "$STATE/mariadb.sock" "$STATE/mariadbd.pid" "$STATE/slurmdbd.pid" "$RUNTIME"
}

cmd_stop() {
  [[ -d $STATE ]] || mkdir -p "$STATE"
  do_stop
  local rc=0
  status_code || rc=$?
  ((rc == 3)) || die "something is still there after stop (status $rc); see '$0 status'"
  log "stopped"
}

# preempt-signal on|off: SlurmctldParameters=preempt_send_user_signal in the running cluster's config
cmd_preempt_signal() {
  local want=${1:-}
  [[ $want == on || $want == off ]] || die "usage: $0 preempt-signal on|off"
  ctld_up || die "the cluster is not running (start it first)"
  set_runtime preempt_signal "$want"
  write_conf
  slurm scontrol reconfigure || die "scontrol reconfigure failed"
  wait_for 15 "slurmctld to answer" ctld_up || die "slurmctld does not answer after reconfigure"
  log "preempt_send_user_signal $want"
}

# preempt-type partition|qos: PreemptType of the running cluster (slurmctld reads it only when it starts)
cmd_preempt_type() {
  local want=${1:-}
  [[ $want == partition || $want == qos ]] || die "usage: $0 preempt-type partition|qos"
  ctld_up || die "the cluster is not running (start it first)"
  [[ $want == partition ]] || ((ACCOUNTING)) || die "preempt-type qos needs the accounting database (SBATCH_GEN_SLURM_ACCOUNTING=1)"
  if [[ $(runtime preempt_type partition) == "$want" ]]; then log "PreemptType already preempt/$want"; return 0; fi
  set_runtime preempt_type "$want"
  write_conf
  local pid
  pid=$(ctld_pid) && stop_pid "$pid" 10
  start_ctld  # its job state survives in StateSaveLocation
  wait_for 30 "nodes ${NODES[*]} to answer" nodes_idle || die "nodes do not answer after the slurmctld restart"
  log "PreemptType=preempt/${want/partition/partition_prio}"
}

# node-fail NODE: SIGKILL the node's slurmd, then set the node DOWN (NODE_FAIL for its jobs)
cmd_node_fail() {
  local node=${1:-} pid
  [[ " ${NODES[*]} " == *" $node "* ]] || die "usage: $0 node-fail NODE (one of: ${NODES[*]})"
  ctld_up || die "the cluster is not running (start it first)"
  pid=$(slurmd_pid "$node") || die "slurmd $node is not running"
  kill -KILL "$pid"
  slurm scontrol update NodeName="$node" State=DOWN Reason="node-fail (local-slurm.sh)" \
    || die "scontrol update NodeName=$node State=DOWN failed"
  log "node $node: slurmd killed, node DOWN"
}

# node-back NODE: start the node's slurmd again and RESUME it
cmd_node_back() {
  local node=${1:-}
  [[ " ${NODES[*]} " == *" $node "* ]] || die "usage: $0 node-back NODE (one of: ${NODES[*]})"
  ctld_up || die "the cluster is not running (start it first)"
  slurmd_pid "$node" >/dev/null || start_slurmd "$node"
  slurm scontrol update NodeName="$node" State=RESUME 2>/dev/null || true  # (RESUME of a node that is not DOWN fails)
  wait_for 30 "node $node to be idle" node_idle "$node" || die "node $node is not idle after node-back"
  log "node $node: back"
}

main() {
  local action=${1:-}
  case $action in
    start | stop | preempt-signal | preempt-type | node-fail | node-back) ;;
    status) cmd_status; return ;;
    env) cmd_env; return ;;
    -h | --help | help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; return 0 ;;
    *) echo "usage: $0 start|stop|status|env|preempt-signal on|off|preempt-type partition|qos|node-fail NODE|node-back NODE" >&2; return 2 ;;
  esac
  ((EUID == 0)) || die "must run as root (it starts daemons, network namespaces and edits /etc/hosts)"
  mkdir -p "$STATE"
  # one start/stop at a time
  exec 9>"$STATE/.lock"
  flock -w 120 9 || die "another $0 holds $STATE/.lock"
  shift
  "cmd_${action//-/_}" "$@"
}

main "$@"
