#!/usr/bin/env bash
# SSH launcher for site 'ssh-local', rendered by sbatch-gen. Do not edit by hand: change the profile
# (or templates/), run `sbatch-gen render --site ssh-local`, review the diff and commit it.
#   profile: sites/ssh-local.yaml
#   inputs sha256: d0446c99ef71bcf09345c7e195ba6a036a8ef3b50da95dabee10ae8a68212354
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

# ---- torchrun: c10d rendezvous hosted by node 0's torchrun (its flags: node_main) ----------------
RDZV_PORT=29510  # torchrun.rdzv_port
NUMA_BINDING=''  # topology.numa_binding
LOG_TOPOLOGY=0  # topology.log_topology
IB_HCA=''  # nccl.ib_hca as NCCL_IB_HCA: the preflight checks these adapters (empty: none)
IB_LINK_LAYER=InfiniBand  # nccl.ib_link_layer: what their ports must be

# ---- python_env: activated on every node ---------------------------------------------------------
ENV_KIND=venv  # python_env.kind
ENV_PATH=.venv  # python_env.path
ENV_NAME=''
MODULES=()  # python_env.modules
CODE_DIR=.  # paths.code_dir: first on PYTHONPATH
ENV_HINT='create it on every host'

# ---- environment exported on every node before torchrun ------------------------------------------
NODE_ENV=(
  # network.socket_ifname
  'GLOO_SOCKET_IFNAME=lo'
  # derived: CPUs per node / processes per node; unbuffered output for the logs
  'OMP_NUM_THREADS=2'
  'PYTHONUNBUFFERED=1'
)

# ---- trainer: its flags are the Slurm scripts' (node_main) ---------------------------------------
TRAINER_MODULE=sbatch_gen.train  # trainer.module
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
LOG_FILE="$LOGS/launcher.log"  # log() appends its lines here too

# ---- main: what a launch does, in order ------------------------------------------------------------
# For each attempt: the preflight on every node (preflight_all), the launch (launch_all: node_main on every
# node, torchrun there), wait for every node (wait_all) and clean up; then the relaunch decision (at most
# launch.max_attempts attempts, launch.cooldown_s apart, none once launch.stop_file exists). The
# functions it calls follow it, then the node library (sbatch-gen's node functions, the same lines in every
# render with the same library sha256), then the program shipped to the nodes and `main "$@"`. This file
# is all that runs: the nodes get its functions over ssh.
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
    # The relaunch decision: at most launch.max_attempts, none once launch.stop_file exists, launch.cooldown_s apart
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

# ---- functions shipped to every node: this launcher's (node 0 runs them locally, the others over ssh;
# with the node library's, below) ----------------------------------------------------------------------
# Preflight on one node (templates/_node.j2: preflight) with this launcher's settings: one line, "preflight
# ok on HOST: ..." or "preflight FAILED on HOST: ...", and status 1 if a check failed. Starts nothing.
preflight_main() {
  local rank=$1 marker=''
  if ((SHARED_RUN_DIR)); then marker="$RUN_DIR/.sbatch-gen-shared.$TAG"; fi
  # The environment torchrun gets (a CUDA_VISIBLE_DEVICES in extra_env counts)
  if ((${#NODE_ENV[@]})); then export "${NODE_ENV[@]}"; fi
  preflight dir="$LAUNCH_DIR" activate=1 node_id="$rank" nnodes="$NNODES" module="$TRAINER_MODULE" \
    config="$TRAIN_CONFIG" data="$DATA_PATH" ifname="$IFNAME" gpus="$GPUS_PER_NODE" gpus_key=node.gpus \
    log_topology="$LOG_TOPOLOGY" numa="$NUMA_BINDING" hcas="$IB_HCA" link_layer="$IB_LINK_LAYER" \
    run_dir="$RUN_DIR" shared_marker="$marker" rdzv_port="$RDZV_PORT" \
    torchrun_flags=--signals-to-handle='trainer.stop_protocol: sbatch-gen,--shutdown-timeout=torchrun.teardown_s'
}

# Start torchrun on one node and return its exit status (128+N when signal N killed it). Only
# torchrun and what it starts carry the tag; this shell does not (its environment is fixed at exec).
node_main() {
  local rank=$1 MASTER_ADDR=$2 ATTEMPT=$3 RESUME=$4 MASTER_PORT=$RDZV_PORT NODE_ADDR IS_HOST=0 rc=0
  cd -- "$LAUNCH_DIR" || return 1
  if ((${#NODE_ENV[@]})); then export "${NODE_ENV[@]}"; fi
  activate_env || { echo "$NODE_ERROR"; return 1; }
  NODE_ADDR=$(iface_ipv4 "$IFNAME") || { echo "interface $IFNAME has no IPv4 address"; return 1; }
  if ((rank == 0)); then IS_HOST=1; fi
  export SBATCH_GEN_TAG="$TAG" SBATCH_GEN_NODE_RANK="$rank" SBATCH_GEN_ATTEMPT="$ATTEMPT"
  printf 'node %s host %s addr %s rendezvous %s:%s attempt %s resume %s tag %s\n' \
    "$rank" "$HOSTNAME" "$NODE_ADDR" "$MASTER_ADDR" "$MASTER_PORT" "$ATTEMPT" "$RESUME" "$TAG"
  env | grep -E '^(NCCL|GLOO|TORCH|CUDA|OMP)_' | sort || true
  # torchrun's and the trainer's arguments: built once for every launcher (sbatch_gen/launch.py)
  local -a torchrun_args=(
    --nnodes "$NNODES"
    --nproc-per-node "$NPROC_PER_NODE"
    --rdzv-backend=c10d
    --rdzv-id="$TAG.$ATTEMPT"
    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
    --rdzv-conf="join_timeout=120,is_host=$IS_HOST"  # torchrun.rdzv_timeout_s
    --local-addr="$NODE_ADDR"
    --max-restarts 0  # torchrun.max_restarts
    --signals-to-handle='SIGINT,SIGHUP,SIGQUIT'  # trainer.stop_protocol: sbatch-gen
    --shutdown-timeout=10  # torchrun.teardown_s
  ) trainer_args=(
    --config "$TRAIN_CONFIG"
    --run-dir "$RUN_DIR"
    --resume "$RESUME"
  )
  # The trainer's stop file of this attempt: it writes the ack (and .stopping, .fatal) next to it
  local stop_file="$RUN_DIR/stop/$TAG.attempt-$ATTEMPT"
  mkdir -p -- "$RUN_DIR/stop" || return 1
  rm -f -- "$stop_file" "$stop_file.ack" "$stop_file.fatal" "$stop_file.stopping"
  export SBATCH_GEN_STOP_FILE="$stop_file"
  # torchrun with SIGTERM ignored; 42 after a complete stop checkpoint (templates/_node.j2)
  run_trainer "$stop_file" 42 torchrun "${torchrun_args[@]}" -m "$TRAINER_MODULE" "${trainer_args[@]}" || rc=$?
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
  elif (($1 == 42)); then printf ' (the trainer checkpointed and stopped)'
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
      *) log "preflight FAILED on $(node_label "$r"): $(sed -n 's/^preflight FAILED on [^:]*: //p' "$out")" ;;
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
  node_lines "$LOGS/attempt-$ATTEMPT".node-*.log  # what each node said about the stop, one line each

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
  LOG_FILE="$LOGS/launcher.log"
  mkdir -p -- "$LOGS"
  log "cleanup of $TAG on every host: ${HOSTS[*]}"
  if cleanup_all; then log "no process tagged $TAG is left"; exit 0; fi
  exit 1
}

# ==== node library =================================================================================
# sbatch-gen's node functions (templates/_node.j2), no site settings: log/die, the python_env activation,
# and those of the preflight (its NUMA and HCA checks) and run_trainer when this render uses them. Every
# render with the same library sha256 carries these same lines: review them once (`sbatch-gen diff --all`
# shows a change to them once, naming the files).
# library sha256: b197c6799bcbc4b6a7a55152496b8572594dbac5ccc87785b715cbf3dd8a42ac
# log MESSAGE...: one timestamped line on stderr, also appended to $LOG_FILE when that is set. Never fails
# (the terminal may be gone when a trap logs).
log() {
  local line
  printf -v line '[sbatch-gen %s] %s' "$(date -u +%FT%TZ)" "$*"
  { printf '%s\n' "$line" >&3; if [[ -n ${LOG_FILE:-} ]]; then printf '%s\n' "$line" >>"$LOG_FILE"; fi; } 3>&2 2>/dev/null \
    || true
}
# die CODE MESSAGE...: log "ERROR: MESSAGE" and exit with CODE.
die() { local code=$1; shift; log "ERROR: $*"; exit "$code"; }

# load_modules: `module load` python_env.modules ($MODULES), after sourcing the module system's shell set-up
# where `module` is not defined (ssh's non-login shells). Sets NODE_ERROR and returns 1 if that fails.
load_modules() {
  local f
  ((${#MODULES[@]})) || return 0
  if ! type module >/dev/null 2>&1; then
    for f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
      # shellcheck disable=SC1090
      if [[ -r $f ]]; then set +u; source "$f"; set -u; break; fi
    done
  fi
  set +u  # module scripts read unset variables
  if ! module load "${MODULES[@]}"; then
    set -u
    NODE_ERROR="module load ${MODULES[*]} failed (python_env.modules)"
    return 1
  fi
  set -u
}

# activate_env: python_env on this node: the modules, then the venv or conda environment ($ENV_KIND,
# $ENV_PATH, $ENV_NAME), then $CODE_DIR first on PYTHONPATH. Sets NODE_ERROR and returns 1 when something
# is missing.
activate_env() {
  local dir
  load_modules || return 1
  case $ENV_KIND in
    venv)
      if [[ ! -x $ENV_PATH/bin/python ]]; then
        NODE_ERROR="venv $ENV_PATH not found: no $ENV_PATH/bin/python (python_env.path)${ENV_HINT:+; $ENV_HINT}"
        return 1
      fi
      VIRTUAL_ENV=$(cd -- "$ENV_PATH" && pwd -P)
      export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
      ;;
    conda)
      if [[ ! -r $ENV_PATH ]]; then
        NODE_ERROR="conda not found: cannot read $ENV_PATH (python_env.conda_sh)"
        return 1
      fi
      set +u  # conda's shell functions read unset variables
      # shellcheck disable=SC1090
      source "$ENV_PATH"
      if ! conda activate "$ENV_NAME"; then
        set -u
        NODE_ERROR="conda activate $ENV_NAME failed (python_env.name or prefix)${ENV_HINT:+; $ENV_HINT}"
        return 1
      fi
      set -u
      ;;
  esac
  if ! dir=$(cd -- "$CODE_DIR" 2>/dev/null && pwd -P); then
    NODE_ERROR="code directory $CODE_DIR does not exist (paths.code_dir)"
    return 1
  fi
  export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
}

# Node checks shared by the launchers' preflights (templates/_preflight_checks.j2). Each check prints one
# line per problem on stdout and returns 1 if there is one, else prints one summary line. /sys and /proc
# are read under ${SBATCH_GEN_SYSFS_ROOT:-}: empty on a real node (tests point it at a fake tree);
# nvidia-smi and numactl are looked up on PATH, as torchrun does.

# read_line VAR FILE: the first line of FILE into VAR; returns 1 if FILE cannot be read.
# shellcheck disable=SC2317,SC2329  # run on the nodes by the preflight (shipped with it), not called here
read_line() {
  local line_read=''
  { IFS= read -r line_read <"$2"; } 2>/dev/null || [[ -n $line_read ]] || return 1
  printf -v "$1" '%s' "$line_read"
}

# The CPU numbers of a kernel cpulist ("0-3,8,10-11"), space-separated.
# shellcheck disable=SC2317,SC2329  # run on the nodes by the preflight (shipped with it), not called here
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
# shellcheck disable=SC2317,SC2329  # run on the nodes by the preflight (shipped with it), not called here
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
# selects must have LINK_LAYER in ports/<port>/link_layer (InfiniBand, or Ethernet for RoCE) and be
# ACTIVE in ports/<port>/state: NCCL silently skips a port that is down, leaving the node a link short.
# shellcheck disable=SC2317,SC2329  # run on the nodes by the preflight (shipped with it), not called here
check_ib_hcas() {
  local spec=$1 want=$2 dir=${SBATCH_GEN_SYSFS_ROOT:-}/sys/class/infiniband exact=0 bad=0
  local entry name port dev d p ll lls st have='' what
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
          st='unreadable'
          read_line st "$dir/$dev/ports/$p/state" || true
          if [[ $st == *ACTIVE ]]; then
            checked+=("$dev:$p")
          else
            echo "nccl.ib_hca: $dev port $p is not active (state: $st): NCCL leaves out a port that is not" \
              "ACTIVE, so this node would train on fewer links than the others (bring the link up or drain" \
              "the node)"
            bad=1
          fi
        fi
      done
    done
  done
  if ((bad)); then return 1; fi
  echo "${checked[*]}: $want"
}

# IPv4 address of an interface (ip, else python's SIOCGIFADDR: images without iproute2); returns 1 if it has
# none.
# shellcheck disable=SC2317,SC2329  # run on the nodes (shipped with the preflight)
iface_ipv4() {
  local addr='' py
  if command -v ip >/dev/null; then
    addr=$(ip -4 -o addr show dev "$1" 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }') || true
  elif py=$(command -v python3 || command -v python); then
    addr=$("$py" -c 'import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", sys.argv[1][:15].encode()))[20:24]))' \
      "$1" 2>/dev/null) || true
  fi
  [[ -n $addr ]] || return 1
  printf '%s\n' "$addr"
}

# preflight NAME=VALUE...: check this node before anything starts, and say so in one line: "preflight ok on
# NODE: what it found" on stdout (return 0), or "preflight FAILED on NODE: problem; problem..." on stderr
# (return 1), where NODE is $SLURMD_NODENAME, else the host name. Every check runs, so one line names every
# problem of the node; only the rendezvous check, which waits for the other nodes, is skipped after a failure
# (the launcher ends the other nodes' preflights when one fails). Settings (unset or empty: not checked):
#   dir=D             cd to D first (the launch directory)
#   activate=1        activate python_env first (activate_env; the Slurm batch shell has done it already)
#   module=M          trainer.module: importable, with torch, by this node's python (torchrun on PATH too)
#   torchrun_flags=L  FLAG=KEY,...: torchrun flags this render uses that older torch releases lack; this
#                     node's torch must have each (its torch/distributed/run.py names it), KEY the profile field
#   config=F          trainer.config: readable
#   data=P            paths.data: exists
#   ifname=I          network.socket_ifname: exists and has an IPv4 address (NCCL/Gloo bind to it)
#   gpus=N gpus_key=K N GPUs per node, as the profile field K says. Exactly N must be visible (CUDA_VISIBLE_DEVICES,
#                     else what nvidia-smi lists): torchrun starts N processes and local rank i takes GPU i, so a
#                     missing GPU fails the job later, and an extra one idles, unnoticed, because the profile is
#                     wrong for this node (OMP_NUM_THREADS is cpus / N as well).
#   log_topology=1    log `nvidia-smi topo -m` (GPU sites)
#   numa=MODE         topology.numa_binding: check_numa_binding MODE
#   hcas=H link_layer=L   nccl.ib_hca as NCCL_IB_HCA and nccl.ib_link_layer: check_ib_hcas H L
#   run_dir=R         paths.run_dir: created if missing, writable
#   shared_marker=F   a file node 0's launcher wrote into the run dir: every other node must see it, or the
#                     run dir is not one filesystem all nodes share (checkpoints and stop files need one)
#   node_id=I nnodes=N   this node's rank (0: the rendezvous host) and the node count
#   rdzv_port=P       torchrun.rdzv_port: node 0 can listen on it (no other launch holds it)
#   rdzv_host=H connect_timeout_s=T   and every other node reaches H:P within T s (every node runs its
#                     preflight at the same time, as srun does)
#   health_check=CMD  preflight.health_check: the site's own node check, run by bash; non-zero fails the node
# shellcheck disable=SC2317,SC2329  # run on the nodes (export -f / declare -f), not called here
preflight() {
  local -A s=([dir]='' [activate]=0 [module]='' [torchrun_flags]='' [config]='' [data]='' [ifname]='' [gpus]=0 [gpus_key]=''
    [log_topology]=0 [numa]='' [hcas]='' [link_layer]='' [run_dir]='' [shared_marker]='' [node_id]=0 [nnodes]=1
    [rdzv_port]='' [rdzv_host]='' [connect_timeout_s]=60 [health_check]='')
  local a node=${SLURMD_NODENAME:-$(hostname)} python='' out line visible addr names probe m host
  local -a ok=() bad=()
  for a in "$@"; do
    if [[ $a != *=* || -z ${s[${a%%=*}]+set} ]]; then echo "preflight: unknown setting '$a'" >&2; return 2; fi
    s[${a%%=*}]=${a#*=}
  done
  if [[ -n ${s[dir]} ]] && ! cd -- "${s[dir]}" 2>/dev/null; then
    bad+=("launch directory ${s[dir]} does not exist")
  elif ((s[activate])) && ! activate_env; then
    bad+=("$NODE_ERROR")
  elif ! python=$(command -v python); then
    bad+=("python not found on PATH (python_env)")
  else
    ok+=("$(python -c 'import platform; print(platform.machine(), "python", platform.python_version())') $python")
  fi
  if [[ -n $python ]]; then
    if out=$(command -v torchrun); then ok+=("torchrun $out"); else bad+=("torchrun not found on PATH (python_env)"); fi
  fi
  if [[ -n $python && -n ${s[torchrun_flags]} ]]; then
    # read, not imported: torch's own import takes seconds; no torch at all is the torch check's to report
    out=$(python -c '
import importlib.util, pathlib, re, sys
try:
    root = pathlib.Path(importlib.util.find_spec("torch").origin).parent
    src = (root / "distributed" / "run.py").read_text()
    ver = re.search("__version__ = .([0-9][^\x27\x22]*)", (root / "version.py").read_text()).group(1)
except Exception:
    sys.exit(0)
for pair in sys.argv[1].split(","):
    flag, key = pair.split("=", 1)
    if flag not in src and flag[:2] + flag[2:].replace("-", "_") not in src:
        print(f"torchrun of torch {ver} has no {flag} ({key}): use a newer torch")' "${s[torchrun_flags]}" 2>/dev/null) || out=''
    while IFS= read -r line; do if [[ -n $line ]]; then bad+=("$line"); fi; done <<<"$out"
  fi
  if [[ -n $python && -n ${s[module]} ]]; then
    # find_spec imports the parent packages (a missing one raises) but not the module itself
    out=$(python -c '
import importlib.util, sys
for name in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(name) is not None
    except Exception:
        found = False
    if not found:
        print(name)' "${s[module]}" torch 2>/dev/null) || out="${s[module]} torch"
    for m in $out; do
      if [[ $m == torch ]]; then bad+=("torch not importable by $python from $PWD (python_env)")
      else bad+=("trainer module $m not importable by $python from $PWD (trainer.module, python_env)")
      fi
    done
    if [[ -z $out ]]; then ok+=("${s[module]} and torch importable"); fi
  fi
  if [[ -n ${s[config]} ]]; then
    if [[ -r ${s[config]} ]]; then ok+=("train config ${s[config]}")
    else bad+=("train config ${s[config]} not readable from $PWD (trainer.config)")
    fi
  fi
  if [[ -n ${s[data]} ]]; then
    if [[ -e ${s[data]} ]]; then ok+=("data path ${s[data]}"); else bad+=("data path ${s[data]} does not exist (paths.data)"); fi
  fi
  if [[ -n ${s[ifname]} ]]; then
    if addr=$(iface_ipv4 "${s[ifname]}"); then
      ok+=("interface ${s[ifname]} $addr")
    else
      # The interfaces of this network namespace (/sys/class/net shows the one sysfs was mounted in).
      names=$(python -c 'import socket; print(*sorted(n for _, n in socket.if_nameindex()))' 2>/dev/null) \
        || names=$(cd /sys/class/net && echo *)
      if [[ " $names " == *" ${s[ifname]} "* ]]; then
        bad+=("network interface ${s[ifname]} has no IPv4 address (network.socket_ifname)")
      else
        bad+=("network interface ${s[ifname]} does not exist (network.socket_ifname); have: $names")
      fi
    fi
  fi
  if ((s[gpus] > 0)); then
    if ! command -v nvidia-smi >/dev/null; then
      bad+=("nvidia-smi not found, but the site has ${s[gpus]} GPUs per node (${s[gpus_key]})")
    else
      if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        visible=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
      else
        visible=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
      fi
      if ((visible == s[gpus])); then ok+=("$visible GPUs")
      else bad+=("$visible GPUs visible, the profile expects ${s[gpus]} (${s[gpus_key]})")
      fi
      if ((s[log_topology])); then
        nvidia-smi topo -m 2>&1 | sed "s/^/[$node topo] /" || true
      fi
    fi
  fi
  if [[ -n ${s[numa]} ]]; then
    if out=$(check_numa_binding "${s[numa]}"); then ok+=("NUMA binding ${s[numa]}: $out")
    else while IFS= read -r line; do bad+=("$line"); done <<<"$out"
    fi
  fi
  if [[ -n ${s[hcas]} ]]; then
    if out=$(check_ib_hcas "${s[hcas]}" "${s[link_layer]}"); then ok+=("HCAs $out")
    else while IFS= read -r line; do bad+=("$line"); done <<<"$out"
    fi
  fi
  if [[ -n ${s[run_dir]} ]]; then
    probe="${s[run_dir]}/.preflight.$node.$$"
    if { mkdir -p -- "${s[run_dir]}" && : >"$probe" && rm -f -- "$probe"; } 2>/dev/null; then
      ok+=("run dir ${s[run_dir]} writable")
    else
      bad+=("run dir ${s[run_dir]} cannot be created or is not writable (paths.run_dir)")
    fi
  fi
  if [[ -n ${s[shared_marker]} ]] && ((s[node_id] > 0)); then
    if [[ -e ${s[shared_marker]} ]]; then ok+=("run dir shared with node 0")
    else bad+=("run dir ${s[run_dir]} is not the one node 0 sees (checkpoints need a filesystem all nodes share)")
    fi
  fi
  if [[ -n ${s[health_check]} ]]; then
    if out=$(bash -c "${s[health_check]}" 2>&1 </dev/null); then
      ok+=("health check passed")
    else
      line=$(grep . <<<"$out" | tail -n 1 | cut -c 1-300 || true)
      bad+=("health check failed${line:+: $line} (preflight.health_check)")
    fi
  fi
  # Rendezvous: node 0 listens on the c10d port for a moment and every other node connects to it, so a busy
  # port, a wrong address or a firewall shows up here and not as a hang inside torchrun. Without a host (or
  # after a failure) only node 0's port is tried.
  if [[ -n $python && -n ${s[rdzv_port]} ]]; then
    host=${s[rdzv_host]}
    if ((${#bad[@]})); then host=''; fi
    if out=$(python - "$host" "${s[rdzv_port]}" "${s[node_id]}" "${s[nnodes]}" "${s[connect_timeout_s]}" <<'PY'
import socket, sys, time
def fail(msg):
    print(msg)
    sys.exit(1)
host, port, node_id, nnodes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
deadline = time.monotonic() + timeout
if host:
    try:
        socket.getaddrinfo(host, port)
    except OSError as e:
        fail(f"rendezvous host {host} does not resolve: {e}")
if node_id == 0:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(("", port))
    except OSError as e:
        fail(f"cannot listen on rendezvous port {port}: {e.strerror} (torchrun.rdzv_port; another launch?)")
    srv.listen(nnodes)
    srv.settimeout(1.0)
    seen = 0
    while host and seen < nnodes - 1:
        if time.monotonic() > deadline:
            fail(f"only {seen} of {nnodes - 1} other nodes reached {host}:{port} within {timeout:g} s")
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        conn.settimeout(5.0)
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        conn.close()
        seen += 1
    srv.close()
    print(f"rendezvous port {port} free" + (f", {seen} other nodes reached {host}" if host and seen else ""))
elif host:
    while True:
        try:
            with socket.create_connection((host, port), timeout=5.0) as c:
                c.sendall(b"preflight")
            break
        except OSError as e:
            if time.monotonic() > deadline:
                fail(f"rendezvous endpoint {host}:{port} not reachable within {timeout:g} s: {e}")
            time.sleep(0.5)
    print(f"rendezvous {host}:{port} reached")
PY
    ); then
      if [[ -n $out ]]; then ok+=("$out"); fi
    else
      bad+=("${out:-rendezvous check failed}")
    fi
  fi
  if ((${#bad[@]})); then
    out=${bad[0]}
    for line in "${bad[@]:1}"; do out+="; $line"; done
    printf 'preflight FAILED on %s: %s\n' "$node" "$out" >&2
    # under srun --kill-on-bad-exit this task's exit tears the step down at once, and the line above could
    # be lost on its way to the batch log: give the forwarding a moment first
    if [[ -n ${SLURM_STEP_ID-} ]]; then sleep 1; fi
    return 1
  fi
  out=${ok[0]-}
  for line in "${ok[@]:1}"; do out+=", $line"; done
  printf 'preflight ok on %s: %s\n' "$node" "$out"
}

# stop_outcome STOP_FILE: one line on what a stop left behind: from STOP_FILE.ack (JSON, the first rank of
# every node writes it once the stop checkpoint is complete) "stopped after step N (why): checkpoint PATH
# complete"; else the trainer's own line in STOP_FILE.stopping (the save it began did not complete:
# what the next attempt redoes); status 1 when there is neither.
# shellcheck disable=SC2317,SC2329  # run on the nodes (export -f / declare -f)
stop_outcome() {
  local ack=$1.ack stopping=$1.stopping
  if [[ -e $ack ]]; then
    # the ack is one line of JSON, {"step": N, "checkpoint": "PATH" or null, "reason": "...", ...}; strings
    # are shown as JSON writes them
    local json step ckpt why
    json=$(head -c 4000 -- "$ack" | tr -d '\n')
    step=$(sed -n 's/.*"step": *\([0-9][0-9]*\).*/\1/p' <<<"$json")
    ckpt=$(sed -n 's/.*"checkpoint": *"\(\([^"\\]\|\\.\)*\)".*/\1/p' <<<"$json")
    why=$(sed -n 's/.*"reason": *"\(\([^"\\]\|\\.\)*\)".*/\1/p' <<<"$json")
    printf 'stopped after step %s (%s): %s\n' "${step:-?}" "${why:-stop requested}" \
      "$(if [[ -n $ckpt ]]; then printf 'checkpoint %s complete' "$ckpt"; else printf 'nothing to checkpoint yet'; fi)"
  elif [[ -e $stopping ]]; then
    printf 'WARNING: the stop checkpoint did not complete: %s\n' "$(head -n 1 -- "$stopping" | cut -c 1-500)"
  else
    return 1
  fi
}

# node_lines LOG...: run_trainer's last "node NAME: ..." line of each node's log, through log (launcher side).
# shellcheck disable=SC2317,SC2329  # called by the launcher after a stop
node_lines() {
  local f said
  for f in "$@"; do
    [[ -e $f ]] || continue
    said=$(grep -a -E '^\[sbatch-gen [^]]*\] node [^ ]+: ' -- "$f" | tail -n 1 | sed 's/^\[sbatch-gen [^]]*\] //' || true)
    [[ -z $said ]] || log "$said"
  done
}

# run_trainer STOP_FILE STOPPED_RC COMMAND...: run COMMAND (torchrun) on this node with SIGTERM ignored. A
# SIGTERM that reached torchrun's agent (Slurm signals every process of a job step on a preemption, a requeue
# or scancel; the SSH launcher's stop) would make it pass the signal on, SIGKILL the workers
# --shutdown-timeout s later and print a traceback. Instead, SIGTERM to this shell appends a line to the stop
# file and is handed on to torchrun's workers (its children), which may not get Slurm's own (process-group
# tracking; torchrun starts them in sessions of their own): sbatch-gen's trainer and the library's agree on a
# step, checkpoint, and exit 0 once the first rank of every node has written the ack; a trainer of one's
# own saves in its SIGTERM handler. This node then says in one line what happened ("node
# NAME: ..."): STOPPED_RC after a complete stop checkpoint, else COMMAND's exit status.
# shellcheck disable=SC2317,SC2329  # run on the nodes (export -f / declare -f)
run_trainer() {
  local stop_file=$1 stopped_rc=$2 node=${SLURMD_NODENAME:-$HOSTNAME} pid rc said
  shift 2
  trap 'log "SIGTERM on $node: asking the trainer to checkpoint and stop ($stop_file)"
        printf "SIGTERM to the training step on %s\n" "$node" >>"$stop_file" 2>/dev/null || true
        kill -TERM $(cat /proc/"$pid"/task/*/children 2>/dev/null) 2>/dev/null || true' TERM
  (trap '' TERM; exec "$@") &
  pid=$!
  while :; do  # a trapped SIGTERM ends `wait` early: wait again until COMMAND has exited
    rc=0
    wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - TERM
  if said=$(stop_outcome "$stop_file"); then
    log "node $node: $said"
    if [[ -e $stop_file.ack ]]; then return "$stopped_rc"; fi
  fi
  return "$rc"
}

# ==== end of node library ==========================================================================

# The program a node runs: strict mode, the settings and functions above (declare -p/-f print them
# as bash code, every value quoted), then "$@".
NODE_VARS=(LAUNCH_DIR NNODES TAG NPROC_PER_NODE GPUS_PER_NODE IFNAME RDZV_PORT NUMA_BINDING LOG_TOPOLOGY IB_HCA
  IB_LINK_LAYER ENV_KIND ENV_PATH ENV_NAME MODULES CODE_DIR ENV_HINT NODE_ENV TRAINER_MODULE TRAIN_CONFIG
  DATA_PATH RUN_DIR SHARED_RUN_DIR)
NODE_PROGRAM="set -euo pipefail
$(declare -p "${NODE_VARS[@]}")
$(declare -f preflight_main node_main cleanup_main preflight iface_ipv4 load_modules activate_env read_line cpulist_cpus check_numa_binding check_ib_hcas log run_trainer stop_outcome)
\"\$@\""

main "$@"
