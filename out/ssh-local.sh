#!/usr/bin/env bash
# SSH launcher for site 'ssh-local', rendered by sbatch-gen. Do not edit by hand: change the profile
# (or templates/), run `sbatch-gen render --site ssh-local`, review the diff and commit it.
#   profile: sites/ssh-local.yaml
#   inputs sha256: 863e805649274d0aaae3f9584240177d24cc49ba436f9d990ef21b1b142bb974
#
# Run it on 127.0.0.1 (node 0) from the directory the profile's relative paths refer to;
# every host must have that directory at the same path (shared filesystem or identical checkout).
#   bash out/ssh-local.sh
#       launch; Ctrl-C (SIGINT, SIGTERM, SIGHUP) stops and cleans up every node at once
#   bash out/ssh-local.sh cleanup TAG
#       kill what an earlier launch left behind (if its launcher was SIGKILLed)
#   touch runs/ssh-local/STOP
#       stop after the current attempt: the file is checked between attempts, never mid-attempt
# Exit codes: 0 trained to completion; 1 failed after launch.max_attempts; 2 cannot start (stop file
# present, no IPv4 address on the interface here, bad arguments); 3 preflight failed on a host before
# the first attempt (before a relaunch it counts as a failed attempt); 4 stopped by the stop file
# after a failed attempt; 128+N interrupted by signal N.
set -euo pipefail

# ---- hosts: node rank = position among the enabled hosts; node 0 runs here, the others over ssh --
HOSTS=(
  127.0.0.1  # node 0 (this host, local)
  localhost  # node 1
)
NPROC_PER_NODE=1  # torchrun.procs_per_node
GPUS_PER_NODE=0  # node.gpus (the preflight counts nvidia-smi's GPUs)
IFNAME=lo  # network.socket_ifname: MASTER_ADDR and NCCL/Gloo sockets

# ---- ssh: options for every connection to the other hosts ----------------------------------------
SSH_OPTS=(
  -o 'BatchMode=yes'
  -o 'ConnectTimeout=5'
  -o 'ServerAliveInterval=5'
  -o 'ServerAliveCountMax=3'
  -p 2222
  -i .state/ssh/id_ed25519
  -o 'IdentitiesOnly=yes'
  -o 'StrictHostKeyChecking=yes'
  -o 'UserKnownHostsFile=.state/ssh/known_hosts'
)

# ---- torchrun: c10d rendezvous hosted by node 0's torchrun ---------------------------------------
RDZV_PORT=29510  # torchrun.rdzv_port
RDZV_TIMEOUT_S=120  # torchrun.rdzv_timeout_s
TORCHRUN_MAX_RESTARTS=0  # torchrun.max_restarts (inside one attempt)
NUMA_BINDING=''  # topology.numa_binding
LOG_TOPOLOGY=0  # topology.log_topology
IB_HCA=''  # nccl.ib_hca as NCCL_IB_HCA: the preflight checks these adapters (empty: none)
IB_LINK_LAYER=InfiniBand  # nccl.ib_link_layer: what their ports must be

# ---- python_env: activated on every node ---------------------------------------------------------
ENV_KIND=venv
ENV_PATH=.venv  # python_env.path
ENV_NAME=''  # (conda only)
MODULES=()  # python_env.modules
CODE_DIR=.  # paths.code_dir: first on PYTHONPATH

# ---- environment exported on every node before torchrun ------------------------------------------
NODE_ENV=(
  # network.socket_ifname
  'GLOO_SOCKET_IFNAME=lo'
  # derived: CPUs per node / processes per node; unbuffered output for the logs
  'OMP_NUM_THREADS=2'
  'PYTHONUNBUFFERED=1'
)

# ---- trainer: the same flags as the Slurm scripts ------------------------------------------------
TRAINER_MODULE=sbatch_gen.train  # trainer.module
TRAINER_ARGS=(
  --config configs/tiny.yaml
  --run-dir runs/ssh-local
)
XR_ARGS=(  # cross_region (disabled)
)
TRAIN_CONFIG=configs/tiny.yaml  # trainer.config (the preflight checks it is readable)
DATA_PATH=''  # paths.data (the preflight checks it exists)
FIRST_RESUME=auto  # trainer.resume (every relaunch uses auto)
RUN_DIR=runs/ssh-local  # paths.run_dir
LOG_DIR=runs/ssh-local/logs  # paths.log_dir

# ---- launch: attempts, cool-down, cleanup ---------------------------------------------------------
MAX_ATTEMPTS=3  # launch.max_attempts
COOLDOWN_S=5  # launch.cooldown_s
STOP_FILE=runs/ssh-local/STOP  # launch.stop_file
KILL_GRACE_S=10  # launch.kill_grace_s
FAILURE_GRACE_S=30  # launch.failure_grace_s
PREFLIGHT_TIMEOUT_S=60  # launch.preflight_timeout_s
SHARED_RUN_DIR=1  # launch.shared_run_dir
SITE=ssh-local

# ===============================================================================================
# Below: fixed logic, the same for every site.
# ===============================================================================================
LAUNCH_DIR=$(pwd -P)
NNODES=${#HOSTS[@]}
USER_NAME=$(id -un)
# The process tag: every process started for this launch carries SBATCH_GEN_TAG=$TAG in its
# environment (torchrun's workers inherit it), and cleanup kills exactly those processes.
TAG="sbg-${USER_NAME//[^A-Za-z0-9_.-]/_}-${RDZV_PORT}-$$"
LOGS="$LOG_DIR/$SITE.$TAG"

# To stderr and the launch's log; never fails (the terminal may be gone when a SIGHUP trap logs).
log() { { printf '[sbatch-gen %s] %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$LOGS/launcher.log" >&3; } 3>&2 2>/dev/null || true; }
die() { local code=$1; shift; printf '[sbatch-gen] error: %s\n' "$*" >&2; exit "$code"; }

# ---- functions shipped to every node (node 0 runs them locally, the others over ssh) ----------

# IPv4 address of an interface; returns 1 if it has none.
iface_ipv4() {
  local addr
  addr=$(ip -4 -o addr show dev "$1" 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }') || true
  [[ -n $addr ]] || return 1
  printf '%s\n' "$addr"
}

# cd to the launch directory, load modules, activate the Python environment, put CODE_DIR first on
# PYTHONPATH. Prints a FAIL line and returns 1 when something is missing.
node_setup() {
  local f
  cd -- "$LAUNCH_DIR" 2>/dev/null || { echo "FAIL launch directory $LAUNCH_DIR does not exist"; return 1; }
  if ((${#MODULES[@]})); then
    if ! type module >/dev/null 2>&1; then
      for f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
        # shellcheck disable=SC1090
        if [[ -r $f ]]; then set +u; source "$f"; set -u; break; fi
      done
    fi
    set +u  # module scripts read unset variables
    if ! module load "${MODULES[@]}"; then set -u; echo "FAIL module load ${MODULES[*]} failed"; return 1; fi
    set -u
  fi
  case $ENV_KIND in
    venv)
      if [[ ! -x $ENV_PATH/bin/python ]]; then echo "FAIL no venv at $ENV_PATH ($ENV_PATH/bin/python missing)"; return 1; fi
      VIRTUAL_ENV=$(cd -- "$ENV_PATH" && pwd -P)
      export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
      ;;
    conda)
      if [[ ! -r $ENV_PATH ]]; then echo "FAIL no conda at $ENV_PATH (python_env.conda_sh)"; return 1; fi
      set +u  # conda's shell functions read unset variables
      # shellcheck disable=SC1090
      source "$ENV_PATH"
      if ! conda activate "$ENV_NAME"; then set -u; echo "FAIL conda activate $ENV_NAME failed"; return 1; fi
      set -u
      ;;
  esac
  if ! f=$(cd -- "$CODE_DIR" 2>/dev/null && pwd -P); then echo "FAIL code directory $CODE_DIR does not exist"; return 1; fi
  export PYTHONPATH="$f${PYTHONPATH:+:$PYTHONPATH}"
}

# Node checks shared by the launchers' preflights (templates/_preflight_checks.j2). Each check prints one
# line per problem on stdout and returns 1 if there is one, else prints one summary line. /sys and /proc
# are read under ${SBATCH_GEN_SYSFS_ROOT:-}: empty on a real node (tests point it at a fake tree);
# nvidia-smi and numactl are looked up on PATH, as torchrun does.

# read_line VAR FILE: the first line of FILE into VAR; returns 1 if FILE cannot be read.
# shellcheck disable=SC2317  # run on the nodes by the preflight (shipped with it), not called here
read_line() {
  local line_read=''
  { IFS= read -r line_read <"$2"; } 2>/dev/null || [[ -n $line_read ]] || return 1
  printf -v "$1" '%s' "$line_read"
}

# The CPU numbers of a kernel cpulist ("0-3,8,10-11"), space-separated.
# shellcheck disable=SC2317  # run on the nodes by the preflight (shipped with it), not called here
cpulist_cpus() {
  local r i
  local -a ranges=() cpus=()
  IFS=, read -r -a ranges <<<"${1//[[:space:]]/}"
  for r in "${ranges[@]}"; do
    if [[ $r =~ ^([0-9]+)-([0-9]+)$ ]]; then
      for ((i = BASH_REMATCH[1]; i <= BASH_REMATCH[2]; i++)); do cpus+=("$i"); done
    elif [[ $r =~ ^[0-9]+$ ]]; then
      cpus+=("$r")
    fi
  done
  echo "${cpus[*]}"
}

# check_numa_binding MODE (topology.numa_binding). torchrun --numa-binding=MODE starts each worker under
# `numactl --physcpubind=<CPUs>`, the CPUs this process may use on the NUMA node of the worker's GPU, and
# raises (no fallback: the job fails, and would be requeued to fail again) when numactl is not on PATH or
# that set is empty. This repeats torch's own reading (torch/numa/binding.py, as of torch 2.13): GPU -> PCI
# address -> /sys/bus/pci/devices/<addr>/numa_node (-1, "no NUMA information", counts as node 0, as torch
# counts it) -> /sys/devices/system/node/node<N>/cpulist, intersected with Cpus_allowed_list of this
# process (the job step's cpuset, which torchrun inherits). Mode exclusive also needs a physical core per
# GPU of the node; mode socket needs a usable CPU on every NUMA node the kernel lists as possible.
# shellcheck disable=SC2317  # run on the nodes by the preflight (shipped with it), not called here
check_numa_binding() {
  local mode=$1 root=${SBATCH_GEN_SYSFS_ROOT:-} bad=0 smi idx uuid bus addr node e c f n k
  local allowed_list='' node_list sib summary='' field="topology.numa_binding=$1" possible
  local -a all=() visible=() entries=()
  local -A bus_of=() uuid_of=() allowed=() gpus_on=() cores=()
  if ! command -v numactl >/dev/null; then
    echo "$field: numactl is not on PATH; torchrun starts every worker under numactl and fails without it" \
      "(install numactl on the node or in the image, or unset topology.numa_binding)"
    bad=1
  fi
  allowed_list=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "$root/proc/self/status" 2>/dev/null) || true
  if [[ -z $allowed_list ]]; then
    echo "$field: cannot read Cpus_allowed_list from $root/proc/self/status"
    return 1
  fi
  for c in $(cpulist_cpus "$allowed_list"); do allowed[$c]=1; done
  if ! smi=$(nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader 2>&1); then
    echo "$field: nvidia-smi --query-gpu=index,uuid,pci.bus_id failed: ${smi%%$'\n'*}"
    return 1
  fi
  while IFS=', ' read -r idx uuid bus; do
    [[ -n $idx ]] || continue
    all+=("$idx")
    bus_of[$idx]=$bus
    uuid_of[$idx]=$uuid
  done <<<"$smi"
  # The GPUs torchrun's workers get: CUDA_VISIBLE_DEVICES (indices or GPU-UUID prefixes), else every one.
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a entries <<<"${CUDA_VISIBLE_DEVICES//[[:space:]]/}"
    for e in "${entries[@]}"; do
      idx=''
      if [[ $e =~ ^[0-9]+$ && -n ${bus_of[$e]+set} ]]; then
        idx=$e
      elif [[ $e == GPU-* ]]; then
        for k in "${all[@]}"; do
          if [[ ${uuid_of[$k]} == "$e"* ]]; then idx=$k; break; fi
        done
      fi
      if [[ -z $idx ]]; then
        echo "note: CUDA_VISIBLE_DEVICES entry $e is no GPU that nvidia-smi lists: its NUMA node is not checked" >&2
        continue
      fi
      visible+=("$idx")
    done
  else
    visible=("${all[@]}")
  fi
  for idx in "${visible[@]}"; do
    bus=${bus_of[$idx],,}
    # nvidia-smi: 00000000:18:00.0; sysfs and torch: 0000:18:00.0
    if [[ ! $bus =~ ^([0-9a-f]+):([0-9a-f]{2}:[0-9a-f]{2})\.[0-7]$ ]]; then
      echo "$field: GPU $idx: cannot read its PCI address from nvidia-smi's pci.bus_id '$bus'"
      bad=1
      continue
    fi
    printf -v addr '%04x:%s.0' "$((16#${BASH_REMATCH[1]}))" "${BASH_REMATCH[2]}"
    f=$root/sys/bus/pci/devices/$addr/numa_node
    node=''
    read_line node "$f" || true
    if [[ ! $node =~ ^-?[0-9]+$ ]]; then
      echo "$field: GPU $idx ($addr): cannot read its NUMA node from $f, where torch reads it"
      bad=1
      continue
    fi
    if ((node < 0)); then node=0; fi
    gpus_on[$node]+="${gpus_on[$node]:+,}$idx"
  done
  for node in $(printf '%s\n' "${!gpus_on[@]}" | sort -n); do
    f=$root/sys/devices/system/node/node$node/cpulist
    node_list=''
    if ! read_line node_list "$f"; then
      echo "$field: GPU ${gpus_on[$node]} on NUMA node $node, but $f cannot be read" \
        "(torch reads the node's CPUs there)"
      bad=1
      continue
    fi
    n=0
    cores=()
    for c in $(cpulist_cpus "$node_list"); do
      [[ -n ${allowed[$c]-} ]] || continue
      n=$((n + 1))
      if [[ $mode == exclusive ]]; then
        sib=''
        f=$root/sys/devices/system/cpu/cpu$c/topology/thread_siblings_list
        if ! read_line sib "$f" || [[ ! ${sib%%[,-]*} =~ ^[0-9]+$ ]]; then
          echo "$field: cannot read the physical core of CPU $c from $f (torch's exclusive mode reads it)"
          bad=1
          continue 2
        fi
        cores[${sib%%[,-]*}]=1  # a core is named by its first logical CPU, as in torch
      fi
    done
    if ((n == 0)); then
      echo "$field: GPU ${gpus_on[$node]} on NUMA node $node (CPUs $node_list), but this job step may only run on" \
        "CPUs $allowed_list: torchrun fails to start its workers (give the step CPUs on every GPU's NUMA node," \
        "e.g. more slurm.cpus_per_task, or unset topology.numa_binding)"
      bad=1
      continue
    fi
    k=$(tr ',' '\n' <<<"${gpus_on[$node]}" | grep -c .)
    if [[ $mode == exclusive ]] && ((${#cores[@]} < k)); then
      echo "$field: NUMA node $node has ${#cores[@]} physical cores this job step may use for its $k GPUs" \
        "(${gpus_on[$node]}); torch's exclusive mode needs one per GPU (use node, or give the step more CPUs)"
      bad=1
      continue
    fi
    summary+="${summary:+, }GPU ${gpus_on[$node]} on NUMA node $node ($n usable CPUs)"
  done
  if [[ $mode == socket ]]; then
    # torch's socket mode takes one usable CPU of every NUMA node the kernel lists as possible
    # (memory-only nodes too, e.g. a GH200's GPU memory): a node without one makes it fail.
    possible=''
    read_line possible "$root/sys/devices/system/node/possible" || true
    for node in $(cpulist_cpus "$possible"); do
      [[ -z ${gpus_on[$node]+set} ]] || continue
      node_list=''
      read_line node_list "$root/sys/devices/system/node/node$node/cpulist" || true
      n=0
      for c in $(cpulist_cpus "$node_list"); do
        if [[ -n ${allowed[$c]-} ]]; then n=1; break; fi
      done
      if ((n == 0)); then
        echo "$field: NUMA node $node has no CPU this job step may run on (CPUs: ${node_list:-none}); torch's socket" \
          "mode looks at every NUMA node and fails on it (use node)"
        bad=1
      fi
    done
  fi
  if ((bad)); then return 1; fi
  echo "numactl $(command -v numactl); ${summary:-no GPU to bind}; job step CPUs $allowed_list"
}

# check_ib_hcas SPEC LINK_LAYER (nccl.ib_hca, nccl.ib_link_layer). SPEC is NCCL_IB_HCA as NCCL reads it:
# '=' first for exact names, else each name is a prefix and NCCL uses every adapter starting with it;
# name:port selects one port, a bare name every port of the adapter. NCCL uses a selected port whatever
# its link layer, so an Ethernet storage or management port in the list carries training traffic.
# Every name must match an adapter in /sys/class/infiniband (a prefix: at least one), and every port it
# selects must have LINK_LAYER in ports/<port>/link_layer (InfiniBand, or Ethernet for RoCE).
# shellcheck disable=SC2317  # run on the nodes by the preflight (shipped with it), not called here
check_ib_hcas() {
  local spec=$1 want=$2 dir=${SBATCH_GEN_SYSFS_ROOT:-}/sys/class/infiniband exact=0 bad=0
  local entry name port dev d p ll lls have='' what
  local -a entries=() devs=() ports=() checked=()
  if [[ $spec == =* ]]; then
    exact=1
    spec=${spec#=}
  fi
  for d in "$dir"/*; do
    [[ -d $d ]] || continue
    lls=''
    for p in "$d"/ports/*; do
      ll='?'
      read_line ll "$p/link_layer" || true
      lls+="${lls:+ }${p##*/}:$ll"
    done
    have+="${have:+, }${d##*/} (port ${lls:-none})"
  done
  IFS=, read -r -a entries <<<"$spec"
  for entry in "${entries[@]}"; do
    name=${entry%%:*}
    port=''
    if [[ $entry == *:* ]]; then port=${entry#*:}; fi
    devs=()
    for d in "$dir"/*; do
      [[ -d $d ]] || continue
      if ((exact)) && [[ ${d##*/} == "$name" ]]; then devs+=("$name"); fi
      if ((!exact)) && [[ ${d##*/} == "$name"* ]]; then devs+=("${d##*/}"); fi
    done
    if ((${#devs[@]} == 0)); then
      if ((exact)); then what="adapter $name"; else what="adapter starting with $name (nccl.ib_hca_exact is false)"; fi
      echo "nccl.ib_hca: no $what on this node; have: ${have:-none (no RDMA driver loaded?)}"
      bad=1
      continue
    fi
    for dev in "${devs[@]}"; do
      ports=()
      if [[ -n $port ]]; then
        ports=("$port")
      else
        for p in "$dir/$dev"/ports/*; do
          if [[ -d $p ]]; then ports+=("${p##*/}"); fi
        done
        if ((${#ports[@]} == 0)); then
          echo "nccl.ib_hca: adapter $dev has no ports in $dir/$dev/ports"
          bad=1
        fi
      fi
      for p in "${ports[@]}"; do
        ll=''
        if ! read_line ll "$dir/$dev/ports/$p/link_layer"; then
          echo "nccl.ib_hca: adapter $dev has no port $p ($dir/$dev/ports/$p/link_layer cannot be read)"
          bad=1
        elif [[ $ll != "$want" ]]; then
          echo "nccl.ib_hca: $dev port $p has link layer $ll, but nccl.ib_link_layer is $want: NCCL would send" \
            "training traffic over it (take it out of nccl.ib_hca, name the right port as $dev:N, or set" \
            "nccl.ib_link_layer)"
          bad=1
        else
          checked+=("$dev:$p")
        fi
      done
    done
  done
  if ((bad)); then return 1; fi
  echo "${checked[*]}: $want"
}

# Preflight on one node: one line per check, returns 1 if any failed. Starts nothing.
preflight_main() {
  local rank=$1 fails=0 torchrun_path addr n m out line
  fail() { printf 'FAIL %s\n' "$*"; fails=$((fails + 1)); }
  printf 'host %s (node %s)\n' "$HOSTNAME" "$rank"
  node_setup || return 1
  if ! command -v python >/dev/null; then fail "python not found (environment: $ENV_KIND $ENV_PATH)"; return 1; fi
  printf 'ok   python %s\n' "$(command -v python)"
  torchrun_path=$(command -v torchrun || true)
  if [[ -n $torchrun_path && -x $torchrun_path ]]; then
    printf 'ok   torchrun %s\n' "$torchrun_path"
  else
    fail "torchrun not found or not executable in the environment (PATH=$PATH)"
  fi
  for m in "$TRAINER_MODULE" torch; do
    if python -c '
import importlib.util, sys
try:
    found = importlib.util.find_spec(sys.argv[1]) is not None
except Exception:  # a missing parent package raises
    found = False
sys.exit(0 if found else 1)' "$m"; then
      printf 'ok   module %s importable\n' "$m"
    else
      fail "module $m not importable with $(command -v python) from $PWD"
    fi
  done
  if ! command -v ip >/dev/null; then
    fail "ip (iproute2) not found: cannot check interface $IFNAME"
  elif addr=$(iface_ipv4 "$IFNAME"); then
    printf 'ok   interface %s %s\n' "$IFNAME" "$addr"
  else
    fail "network interface $IFNAME does not exist or has no IPv4 address"
  fi
  if ((GPUS_PER_NODE > 0)); then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if ((n >= GPUS_PER_NODE)); then printf 'ok   %s GPUs\n' "$n"
    else fail "expected $GPUS_PER_NODE GPUs, nvidia-smi lists ${n:-0}"
    fi
  fi
  if [[ -n $NUMA_BINDING ]]; then
    if out=$(check_numa_binding "$NUMA_BINDING"); then printf 'ok   NUMA binding %s: %s\n' "$NUMA_BINDING" "$out"
    else while IFS= read -r line; do fail "$line"; done <<<"$out"
    fi
  fi
  if [[ -n $IB_HCA ]]; then
    if out=$(check_ib_hcas "$IB_HCA" "$IB_LINK_LAYER"); then printf 'ok   HCAs %s\n' "$out"
    else while IFS= read -r line; do fail "$line"; done <<<"$out"
    fi
  fi
  if [[ -r $TRAIN_CONFIG ]]; then printf 'ok   train config %s\n' "$TRAIN_CONFIG"
  else fail "train config $TRAIN_CONFIG is not readable from $PWD"
  fi
  if [[ -n $DATA_PATH && ! -e $DATA_PATH ]]; then fail "data path $DATA_PATH does not exist"; fi
  if mkdir -p -- "$RUN_DIR" 2>/dev/null && [[ -w $RUN_DIR ]]; then
    printf 'ok   run dir %s writable\n' "$RUN_DIR"
  else
    fail "run dir $RUN_DIR cannot be created or is not writable"
  fi
  if ((SHARED_RUN_DIR && rank > 0)); then
    if [[ -e $RUN_DIR/.sbatch-gen-shared.$TAG ]]; then printf 'ok   run dir shared with node 0\n'
    else fail "run dir $RUN_DIR is not the one node 0 sees (checkpoints need a filesystem all hosts share)"
    fi
  fi
  if ((rank == 0)) && command -v ss >/dev/null && [[ -n $(ss -Hltn "sport = :$RDZV_PORT") ]]; then
    fail "rendezvous port $RDZV_PORT is already in use on node 0 (another launch?)"
  fi
  ((fails == 0))
}

# Start torchrun on one node and return its exit status (128+N when signal N killed it). Only
# torchrun and what it starts carry the tag; this shell does not (its environment is fixed at exec).
node_main() {
  local rank=$1 master_addr=$2 attempt=$3 resume=$4 node_addr is_host=0 numa=() rc=0
  node_setup
  node_addr=$(iface_ipv4 "$IFNAME") || { echo "interface $IFNAME has no IPv4 address"; return 1; }
  if ((rank == 0)); then is_host=1; fi
  if [[ -n $NUMA_BINDING ]]; then numa=(--numa-binding="$NUMA_BINDING"); fi
  if ((${#NODE_ENV[@]})); then export "${NODE_ENV[@]}"; fi
  export SBATCH_GEN_TAG="$TAG" SBATCH_GEN_NODE_RANK="$rank" SBATCH_GEN_ATTEMPT="$attempt"
  printf 'node %s host %s addr %s rendezvous %s:%s attempt %s resume %s tag %s\n' \
    "$rank" "$HOSTNAME" "$node_addr" "$master_addr" "$RDZV_PORT" "$attempt" "$resume" "$TAG"
  env | grep -E '^(NCCL|GLOO|TORCH|CUDA|OMP)_' | sort || true
  if ((LOG_TOPOLOGY)); then nvidia-smi topo -m || true; fi
  torchrun \
    --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$master_addr:$RDZV_PORT" --rdzv-id="$TAG.$attempt" \
    --rdzv-conf="is_host=$is_host,join_timeout=$RDZV_TIMEOUT_S" --local-addr="$node_addr" \
    --max-restarts="$TORCHRUN_MAX_RESTARTS" "${numa[@]}" \
    -m "$TRAINER_MODULE" "${TRAINER_ARGS[@]}" --resume "$resume" "${XR_ARGS[@]}" || rc=$?
  return "$rc"
}

# Kill exactly the processes whose environment holds SBATCH_GEN_TAG=<tag> on this host: SIGTERM,
# up to <grace> seconds, then SIGKILL. The shell running this never carries the tag itself.
cleanup_main() {
  local tag=$1 grace=$2 deadline pids=() _
  tagged() {
    grep -lzxFs -e "SBATCH_GEN_TAG=$tag" /proc/[0-9]*/environ 2>/dev/null \
      | sed -n 's#^/proc/\([0-9][0-9]*\)/environ$#\1#p' | grep -vxF -e "$$" -e "$BASHPID" || true
  }
  mapfile -t pids < <(tagged)
  if ((${#pids[@]} == 0)); then printf 'host %s: no process tagged %s\n' "$HOSTNAME" "$tag"; return 0; fi
  printf 'host %s: SIGTERM to %s processes tagged %s: %s\n' "$HOSTNAME" "${#pids[@]}" "$tag" "${pids[*]}"
  kill -TERM "${pids[@]}" 2>/dev/null || true
  deadline=$((SECONDS + grace))
  while ((SECONDS < deadline)); do
    sleep 0.5
    mapfile -t pids < <(tagged)
    ((${#pids[@]})) || break
  done
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    mapfile -t pids < <(tagged)
    if ((${#pids[@]} == 0)); then printf 'host %s: every process tagged %s is gone\n' "$HOSTNAME" "$tag"; return 0; fi
    printf 'host %s: SIGKILL to %s\n' "$HOSTNAME" "${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
    sleep 0.5
  done
  printf 'host %s: tagged processes survive SIGKILL: %s\n' "$HOSTNAME" "${pids[*]}"
  return 1
}

# ---- launcher side -----------------------------------------------------------------------------

# The program a node runs: strict mode, the settings and functions above (declare -p/-f print them
# as bash code, every value quoted), then "$@".
NODE_VARS=(LAUNCH_DIR NNODES TAG NPROC_PER_NODE GPUS_PER_NODE IFNAME RDZV_PORT RDZV_TIMEOUT_S
  TORCHRUN_MAX_RESTARTS NUMA_BINDING LOG_TOPOLOGY IB_HCA IB_LINK_LAYER ENV_KIND ENV_PATH ENV_NAME MODULES
  CODE_DIR NODE_ENV TRAINER_MODULE TRAINER_ARGS XR_ARGS TRAIN_CONFIG DATA_PATH RUN_DIR SHARED_RUN_DIR)
NODE_PROGRAM="set -euo pipefail
$(declare -p "${NODE_VARS[@]}")
$(declare -f iface_ipv4 node_setup preflight_main node_main cleanup_main read_line cpulist_cpus check_numa_binding check_ib_hcas)
\"\$@\""

# POSIX single quoting, for the remote login shell.
sq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# run_on RANK LIMIT FUNCTION ARGS...: run a shipped function on node RANK with stdin closed, for at
# most LIMIT seconds (0: no limit). Exit status 255: ssh could not reach the host; 124: timed out.
run_on() {
  local rank=$1 limit=() cmd a
  if (($2 > 0)); then limit=(timeout "$2"); fi
  shift 2
  if ((rank == 0)); then
    "${limit[@]}" bash -c "$NODE_PROGRAM" sbatch-gen-node "$@" </dev/null
  else
    cmd="bash -c $(sq "$NODE_PROGRAM") sbatch-gen-node"
    for a in "$@"; do cmd+=" $(sq "$a")"; done
    "${limit[@]}" ssh "${SSH_OPTS[@]}" -- "${HOSTS[rank]}" "$cmd" </dev/null
  fi
}

node_label() { printf 'node %s (%s)' "$1" "${HOSTS[$1]}"; }

exit_meaning() {
  if (($1 == 255)); then printf ' (ssh failed or lost the connection)'
  elif (($1 > 128 && $1 < 160)); then printf ' (SIG%s)' "$(kill -l "$(($1 - 128))")"
  fi
}

# Preflight on every node in parallel; on any failure say what failed where and return 1.
preflight_all() {
  local r rc failed=0 pids=() out marker="$RUN_DIR/.sbatch-gen-shared.$TAG"
  if ((SHARED_RUN_DIR)); then mkdir -p -- "$RUN_DIR" && : >"$marker"; fi
  for r in "${!HOSTS[@]}"; do
    run_on "$r" "$PREFLIGHT_TIMEOUT_S" preflight_main "$r" >"$LOGS/preflight.attempt-$ATTEMPT.node-$r.log" 2>&1 &
    pids[r]=$!
  done
  for r in "${!HOSTS[@]}"; do
    out="$LOGS/preflight.attempt-$ATTEMPT.node-$r.log"
    rc=0
    wait "${pids[r]}" || rc=$?
    if ((rc == 0)); then continue; fi
    failed=1
    case $rc in
      124) log "preflight FAILED on $(node_label "$r"): no answer within ${PREFLIGHT_TIMEOUT_S}s" ;;
      255) log "preflight FAILED on $(node_label "$r"): ssh cannot reach it: $(tail -n 2 "$out" | paste -sd ' ' -)" ;;
      *) log "preflight FAILED on $(node_label "$r"): $(sed -n 's/^FAIL //p' "$out" | paste -sd ';' -)" ;;
    esac
  done
  rm -f -- "$marker"
  ((failed == 0))
}

# Kill every tagged process on every node, in parallel; returns 1 if a node could not be cleaned.
cleanup_all() {
  local r rc=0 pids=()
  for r in "${!HOSTS[@]}"; do
    run_on "$r" $((KILL_GRACE_S + 60)) cleanup_main "$TAG" "$KILL_GRACE_S" >>"$LOGS/cleanup.log" 2>&1 &
    pids[r]=$!
  done
  for r in "${!HOSTS[@]}"; do
    wait "${pids[r]}" || { rc=1; log "cleanup FAILED on $(node_label "$r"): see $LOGS/cleanup.log"; }
  done
  return "$rc"
}

NODE_PIDS=()
NODE_RCS=()
SLEEP_PID=""
ATTEMPT=0

# Sleep in the background and wait for it, so that a signal's trap runs at once.
nap() { sleep "$1" & SLEEP_PID=$!; wait "$SLEEP_PID" || true; SLEEP_PID=""; }

launch_all() {
  local r resume=$1
  for r in "${!HOSTS[@]}"; do
    run_on "$r" 0 node_main "$r" "$MASTER_ADDR" "$ATTEMPT" "$resume" \
      >"$LOGS/attempt-$ATTEMPT.node-$r.${HOSTS[r]}.log" 2>&1 &
    NODE_PIDS[r]=$!
    NODE_RCS[r]=""
  done
  log "attempt $ATTEMPT: started $NNODES nodes (resume $resume); logs $LOGS/attempt-$ATTEMPT.node-*.log"
}

# Wait for every node. Once one has failed, the others get FAILURE_GRACE_S to end on their own, then
# every node is cleaned up; a local ssh client still hanging 15 s after that is killed.
wait_all() {
  local r rc running failed_at="" killed_at=""
  while true; do
    running=0
    for r in "${!HOSTS[@]}"; do
      [[ -n ${NODE_PIDS[r]} ]] || continue
      if kill -0 "${NODE_PIDS[r]}" 2>/dev/null; then running=$((running + 1)); continue; fi
      rc=0
      wait "${NODE_PIDS[r]}" || rc=$?
      NODE_PIDS[r]=""
      NODE_RCS[r]=$rc
      printf '%s\t%s\t%s\t%s\n' "$ATTEMPT" "$r" "${HOSTS[r]}" "$rc" >>"$LOGS/exits.tsv"
      if ((rc == 0)); then
        log "attempt $ATTEMPT: $(node_label "$r") finished"
      else
        log "attempt $ATTEMPT: $(node_label "$r") exited with $rc$(exit_meaning "$rc")"
        if [[ -z $failed_at ]]; then
          failed_at=$SECONDS
          log "attempt $ATTEMPT: the other nodes get ${FAILURE_GRACE_S}s to end before they are killed"
        fi
      fi
    done
    ((running > 0)) || return 0
    if [[ -n $failed_at && -z $killed_at ]] && ((SECONDS - failed_at >= FAILURE_GRACE_S)); then
      log "attempt $ATTEMPT: killing the remaining nodes"
      cleanup_all || true
      killed_at=$SECONDS
    elif [[ -n $killed_at ]] && ((SECONDS - killed_at >= 15)); then
      for r in "${!HOSTS[@]}"; do
        if [[ -n ${NODE_PIDS[r]} ]]; then kill -KILL "${NODE_PIDS[r]}" 2>/dev/null || true; fi
      done
    fi
    nap 1
  done
}

# First signal: SIGTERM to every tagged process on every host (the trainer checkpoints if it can),
# SIGKILL after KILL_GRACE_S. A second signal while that runs: SIGKILL at once.
on_signal() {
  local sig=$1 code=$2 pids=()
  trap 'on_second_signal' INT TERM HUP
  log "caught SIG$sig: stopping every node (SIGTERM, SIGKILL after ${KILL_GRACE_S}s; signal again to SIGKILL now)"
  if [[ -n $SLEEP_PID ]]; then kill "$SLEEP_PID" 2>/dev/null || true; fi
  cleanup_all || true
  mapfile -t pids < <(jobs -p)
  if ((${#pids[@]})); then kill -TERM "${pids[@]}" 2>/dev/null || true; fi
  wait || true
  log "stopped by SIG$sig"
  exit "$code"
}

on_second_signal() {
  trap '' INT TERM HUP
  log "second signal: SIGKILL to every tagged process now"
  KILL_GRACE_S=0
  cleanup_all || true
}

# Node 0 runs where the launcher runs: warn when that does not look like hosts[0] (its name is not
# this host's, nor does it resolve to one of this host's addresses), e.g. when started on another host.
check_launcher_host() {
  local h=${HOSTS[0]} addrs=() a mine
  if [[ $h == "$HOSTNAME" || $h == "${HOSTNAME%%.*}" ]]; then return 0; fi
  mapfile -t addrs < <(getent ahostsv4 "$h" 2>/dev/null | awk '{ print $1 }' | sort -u)
  mine=$(ip -4 -o addr show 2>/dev/null || true)
  for a in "${addrs[@]}"; do
    if [[ $mine == *" inet $a/"* ]]; then return 0; fi
  done
  log "WARNING: node 0 is hosts[0] = $h, but this host is $HOSTNAME and $h is none of its addresses: run the launcher on $h"
}

usage() {
  die 2 "usage: $0                launch (run it on ${HOSTS[0]}, from the launch directory)
       $0 cleanup TAG    kill what an earlier launch left behind (its tag is in its log lines)"
}

# `cleanup TAG`: for a launch that could not clean up itself (the launcher was SIGKILLed, the launch
# host rebooted): kill the processes tagged TAG on every host.
cleanup_command() {
  [[ $# -eq 1 && $1 =~ ^sbg-[A-Za-z0-9_.-]+-[0-9]+-[0-9]+$ ]] || usage
  TAG=$1
  LOGS="$LOG_DIR/$SITE.$TAG"
  mkdir -p -- "$LOGS"
  log "cleanup of $TAG on every host: ${HOSTS[*]}"
  if cleanup_all; then log "no process tagged $TAG is left"; exit 0; fi
  exit 1
}

main() {
  local r ok resume=$FIRST_RESUME waited
  case ${1-} in
    "") ;;
    cleanup) shift; cleanup_command "$@" ;;
    *) usage ;;
  esac
  if [[ -e $STOP_FILE ]]; then die 2 "stop file $STOP_FILE exists: remove it to launch"; fi
  mkdir -p -- "$LOGS"
  ln -sfn -- "$SITE.$TAG" "$LOG_DIR/$SITE.latest"
  MASTER_ADDR=$(iface_ipv4 "$IFNAME") || die 2 "interface $IFNAME has no IPv4 address on this host (node 0)"
  trap 'on_signal INT 130' INT
  trap 'on_signal TERM 143' TERM
  trap 'on_signal HUP 129' HUP
  log "site $SITE: $NNODES nodes x $NPROC_PER_NODE processes, rendezvous $MASTER_ADDR:$RDZV_PORT ($IFNAME), tag $TAG"
  log "hosts: ${HOSTS[*]}; logs in $LOGS; touch $STOP_FILE to stop after the current attempt"
  check_launcher_host
  for ((ATTEMPT = 1; ; ATTEMPT++)); do
    if preflight_all; then
      log "attempt $ATTEMPT/$MAX_ATTEMPTS: preflight passed on every node"
      launch_all "$resume"
      wait_all
      cleanup_all || log "warning: cleanup did not complete on every node"
      ok=1
      for r in "${!HOSTS[@]}"; do
        if [[ ${NODE_RCS[r]} != 0 ]]; then ok=0; fi
      done
      if ((ok)); then log "attempt $ATTEMPT: every node finished: training complete"; exit 0; fi
    elif ((ATTEMPT == 1)); then
      log "aborting: preflight failed, nothing was started (details: $LOGS/preflight.attempt-$ATTEMPT.node-*.log)"
      exit 3
    else
      # A host that went down with the last attempt may come back during the cool-down: retry.
      log "attempt $ATTEMPT: preflight failed, nothing was started; it counts as a failed attempt"
    fi
    if ((ATTEMPT >= MAX_ATTEMPTS)); then log "attempt $ATTEMPT failed and no attempts are left (max $MAX_ATTEMPTS)"; exit 1; fi
    if [[ -e $STOP_FILE ]]; then log "attempt $ATTEMPT failed; $STOP_FILE exists: not relaunching"; exit 4; fi
    log "attempt $ATTEMPT failed: relaunching with --resume auto in ${COOLDOWN_S}s (touch $STOP_FILE to stop instead)"
    for ((waited = 0; waited < COOLDOWN_S; waited++)); do
      if [[ -e $STOP_FILE ]]; then log "$STOP_FILE exists: not relaunching"; exit 4; fi
      nap 1
    done
    resume=auto
  done
}

main "$@"
