# shellcheck shell=bash
# shellcheck disable=SC2034,SC2120,SC2317,SC2329  # sourced by the SSH launchers: they call these functions (with their arguments) and read what they set
# sbatch-gen's SSH library: the functions of every SSH launcher (out/<site>.sh), the same for every site,
# rendered by sbatch-gen from templates/ssh-lib.sh.j2. Do not edit by hand. A launcher sources it once it has
# checked its sha256 (SSH_LIB_SHA256), then calls launch_setup; its settings (HOSTS, SSH_OPTS, the launch
# settings, STOP_PROTOCOL: trainer.stop_protocol, NODE_VARS) and its node_main are its own.
# Functions only: nothing runs when it is sourced.
#
# ---- shipped to every node with the launcher's node_main (node 0 runs them locally, the others over ssh) ------

# preflight_main RANK: the preflight on this node (templates/_node.j2: preflight, which runs the node program)
# with the launcher's settings, after the cd to the launch directory and the python_env activation (what fails
# there is the first problem): one line, "preflight ok on HOST: ..." or "preflight FAILED on HOST: ...", and
# status 1 if a check failed. Starts nothing.
preflight_main() {
  local rank=$1 marker='' problem=''
  receive_secrets
  if ((SHARED_RUN_DIR)); then marker="$RUN_DIR/.sbatch-gen-shared.$TAG"; fi
  # The environment torchrun gets (a CUDA_VISIBLE_DEVICES in extra_env counts)
  if ((${#NODE_ENV[@]})); then export "${NODE_ENV[@]}"; fi
  if ! cd -- "$LAUNCH_DIR" 2>/dev/null; then
    problem="launch directory $LAUNCH_DIR does not exist"
  elif ! activate_env; then
    problem=$NODE_ERROR
  fi
  # the bucket check lists the bucket with the credentials torchrun will get
  if ((${#BUCKET_CHECK[@]})); then export_secrets; fi
  preflight setup_error="$problem" node_id="$rank" nnodes="$NNODES" \
    ${TRAINER_MODULE:+"module=$TRAINER_MODULE"} ${TRAINER_SCRIPT:+"script=$TRAINER_SCRIPT"} config="$TRAIN_CONFIG" \
    data="$DATA_PATH" ifname="$IFNAME" gpus="$GPUS_PER_NODE" gpus_key=node.gpus log_topology="$LOG_TOPOLOGY" \
    numa="$NUMA_BINDING" hcas="$IB_HCA" link_layer="$IB_LINK_LAYER" run_dir="$RUN_DIR" shared_marker="$marker" \
    rdzv_port="$RDZV_PORT" torchrun_flags="$TORCHRUN_FLAGS" stop_protocol="$STOP_PROTOCOL" "${BUCKET_CHECK[@]}"
}

# receive_secrets: the launcher's NAME=VALUE records (send_secrets), read from stdin to its end, those of
# SECRET_ENV's names kept in SECRET_VALUES; nothing is exported here (export_secrets). A terminal on stdin (a
# function run by hand) is not read.
receive_secrets() {
  local rec i
  SECRET_VALUES=()
  if [[ -t 0 ]]; then return 0; fi
  while IFS= read -r -d '' rec; do
    for ((i = 0; i < ${#SECRET_ENV[@]}; i += 3)); do
      if [[ ${rec%%=*} == "${SECRET_ENV[i]}" ]]; then SECRET_VALUES+=("$rec"); fi
    done
  done
}

# export_secrets: export what receive_secrets kept (a builtin: the values are in no process's argv).
export_secrets() {
  if ((${#SECRET_VALUES[@]})); then export "${SECRET_VALUES[@]}"; fi
}

# env_without_secrets: `env`, without SECRET_ENV's variables (a host's own value of one included).
env_without_secrets() {
  local i unset=()
  for ((i = 0; i < ${#SECRET_ENV[@]}; i += 3)); do unset+=(-u "${SECRET_ENV[i]}"); done
  env "${unset[@]}"
}

# cleanup_main TAG GRACE RANK: kill exactly the processes whose environment holds SBATCH_GEN_TAG=TAG on this
# host. trainer.stop_protocol (STOP_PROTOCOL) sbatch-gen: SIGTERM to all of them, up to GRACE seconds, then
# SIGKILL. signal: SIGTERM to the tops of node RANK's trees only (its torchrun, or a worker whose torchrun is
# gone), which forwards it to its workers once, up to GRACE seconds, then SIGKILL; GRACE 0: SIGKILL at once.
# none: SIGKILL at once (no graceful stop; GRACE is 0). The shell running this never carries the tag itself.
cleanup_main() {
  local tag=$1 grace=$2 rank=${3-} deadline pids=() _
  tagged() {
    grep -lzxFs -e "SBATCH_GEN_TAG=$tag" /proc/[0-9]*/environ 2>/dev/null \
      | sed -n 's#^/proc/\([0-9][0-9]*\)/environ$#\1#p' | grep -vxF -e "$$" -e "$BASHPID" || true
  }
  mapfile -t pids < <(tagged)
  if ((${#pids[@]} == 0)); then printf 'host %s: no process tagged %s\n' "$HOSTNAME" "$tag"; return 0; fi
  if [[ $STOP_PROTOCOL == sbatch-gen ]]; then
    printf 'host %s: SIGTERM to %s processes tagged %s: %s\n' "$HOSTNAME" "${#pids[@]}" "$tag" "${pids[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null || true
  elif [[ $STOP_PROTOCOL == signal ]] && ((grace > 0)); then
    local -A is_tagged=()
    local p ppid tops=()
    for p in "${pids[@]}"; do is_tagged[$p]=1; done
    for p in "${pids[@]}"; do
      ppid=$(awk '$1 == "PPid:" { print $2 }' "/proc/$p/status" 2>/dev/null) || continue
      [[ -n $ppid && -z ${is_tagged[$ppid]:-} ]] || continue
      # one node per host, but two "hosts" may be one machine: torchrun must get one SIGTERM, not two
      if grep -qzxF -e "SBATCH_GEN_NODE_RANK=$rank" "/proc/$p/environ" 2>/dev/null; then tops+=("$p"); fi
    done
    printf 'host %s: SIGTERM to %s of the %s processes tagged %s (torchrun forwards it to its workers): %s\n' \
      "$HOSTNAME" "${#tops[@]}" "${#pids[@]}" "$tag" "${tops[*]}"
    if ((${#tops[@]})); then kill -TERM "${tops[@]}" 2>/dev/null || true; fi
  fi
  deadline=$((SECONDS + grace + 1))  # SECONDS counts whole seconds: +1 makes it the full grace
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

# launch_setup SCRIPT_DIR: the launch's own state, once the library is sourced. TAG: every process started
# for this launch carries SBATCH_GEN_TAG=$TAG in its environment (torchrun's workers inherit it), and cleanup
# kills exactly those. LOCAL_ENV: what node 0 (run here, not over ssh) starts with: what an ssh login gives the
# other hosts (HOME, USER, LOGNAME, SHELL, PATH, the locale ssh_config's SendEnv sends), not this shell's
# whole environment. Every node gets besides only what is named: the profile's exports (NODE_ENV: this
# shell's value of one wins), NODE_VARS, and the secrets SECRET_ENV names (over stdin). NODE_PY_SRC: the node
# program's text (the preflight's checks, run-trainer), from SCRIPT_DIR, else from out/, if it is the one
# this script pins (else empty, and NODE_ERROR says why). NODE_PROGRAM: what a node runs: strict mode, the
# settings NODE_VARS names and the functions it needs (declare -p/-f print them as bash code, every value
# quoted), then "$@".
launch_setup() {
  local name names=()
  LAUNCH_DIR=$(pwd -P)
  NNODES=${#HOSTS[@]}
  USER_NAME=$(id -un)
  TAG="sbg-${USER_NAME//[^A-Za-z0-9_.-]/_}-${RDZV_PORT}-$$"
  LOGS="$LOG_DIR/$SITE.$TAG"
  LOG_FILE="$LOGS/launcher.log"  # log() appends its lines here too
  NODE_PIDS=()
  NODE_RCS=()
  SLEEP_PID=""
  ATTEMPT=0
  LOCAL_ENV=()
  mapfile -t names < <(compgen -e LC_ || true)
  for name in HOME USER LOGNAME SHELL PATH LANG LANGUAGE "${names[@]}"; do
    if [[ -n ${!name+set} ]]; then LOCAL_ENV+=("$name=${!name}"); fi
  done
  NODE_PY_SRC=''
  if find_pinned sbatch-gen-node.py "$NODE_PY_SHA256" "$1/sbatch-gen-node.py" out/sbatch-gen-node.py; then
    NODE_PY_SRC=$(cat -- "$PINNED_FOUND")
  fi
  NODE_PROGRAM="set -euo pipefail
$(declare -p LAUNCH_DIR NNODES TAG NODE_PY_SRC STOP_PROTOCOL "${NODE_VARS[@]}")
$(declare -f preflight_main node_main cleanup_main receive_secrets export_secrets env_without_secrets iface_ipv4 debug_env \
  load_modules activate_env node_py preflight)
\"\$@\""
}


# POSIX single quoting, for the remote login shell.
sq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# check_secrets: exit 2 before anything starts when a variable SECRET_ENV requires is unset or empty here,
# naming each and the profile field that names it.
check_secrets() {
  local i name missing=()
  for ((i = 0; i < ${#SECRET_ENV[@]}; i += 3)); do
    name=${SECRET_ENV[i]}
    if [[ ${SECRET_ENV[i + 2]} == 1 && -z ${!name:-} ]]; then missing+=("$name (${SECRET_ENV[i + 1]})"); fi
  done
  if ((${#missing[@]})); then
    die 2 "not set or empty on this host: $(printf '%s, ' "${missing[@]}" | sed 's/, $//'); every node gets these variables' values from the launcher: export them, then launch again"
  fi
}

# send_secrets FUNCTION: for preflight_main and node_main, the values of SECRET_ENV's variables set here, as
# NAME=VALUE records ending in NUL on stdout (printf is a builtin: no process's argv holds a value); for
# the other functions nothing.
send_secrets() {
  local i name
  case $1 in preflight_main | node_main) ;; *) return 0 ;; esac
  for ((i = 0; i < ${#SECRET_ENV[@]}; i += 3)); do
    name=${SECRET_ENV[i]}
    if [[ -n ${!name:-} ]]; then printf '%s=%s\0' "$name" "${!name}"; fi
  done
}

# run_on RANK LIMIT FUNCTION ARGS...: run a shipped function on node RANK for at most LIMIT seconds (0: no
# limit), its stdin a pipe that carries send_secrets' records and then ends; node 0 in LOCAL_ENV only. Exit status 255: ssh could
# not reach the host; 124: timed out.
run_on() {
  local rank=$1 limit=() cmd a
  if (($2 > 0)); then limit=(timeout "$2"); fi
  shift 2
  if ((rank == 0)); then
    "${limit[@]}" env -i "${LOCAL_ENV[@]}" bash -c "$NODE_PROGRAM" sbatch-gen-node "$@" < <(send_secrets "$1")
  else
    cmd="bash -c $(sq "$NODE_PROGRAM") sbatch-gen-node"
    for a in "$@"; do cmd+=" $(sq "$a")"; done
    "${limit[@]}" ssh "${SSH_OPTS[@]}" -- "${HOSTS[rank]}" "$cmd" < <(send_secrets "$1")
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
    run_on "$r" $((KILL_GRACE_S + 60)) cleanup_main "$TAG" "$KILL_GRACE_S" "$r" >>"$LOGS/cleanup.log" 2>&1 &
    pids[r]=$!
  done
  for r in "${!HOSTS[@]}"; do
    wait "${pids[r]}" || { rc=1; log "cleanup FAILED on $(node_label "$r"): see $LOGS/cleanup.log"; }
  done
  return "$rc"
}

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

# Wait for every node. Once one has ended (failed, or finished while another still runs), the others get
# FAILURE_GRACE_S to end on their own, then every node is cleaned up; a local ssh client still hanging 15 s
# after that is killed. So no node that hangs holds the launch.
wait_all() {
  local r rc running failed_at="" ended_at="" killed_at=""
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
      [[ -n $ended_at ]] || ended_at=$SECONDS
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
    if [[ -n $ended_at && -z $killed_at ]] && ((SECONDS - ${failed_at:-$ended_at} > FAILURE_GRACE_S)); then
      if [[ -n $failed_at ]]; then
        log "attempt $ATTEMPT: killing the remaining nodes"
      else
        log "attempt $ATTEMPT: $running node(s) still running ${FAILURE_GRACE_S}s after one finished (launch.failure_grace_s): killing them"
      fi
      cleanup_all || true
      killed_at=$SECONDS
    elif [[ -n $killed_at ]] && ((SECONDS - killed_at > 15)); then
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
  case $STOP_PROTOCOL in
    sbatch-gen) log "caught SIG$sig: stopping every node (SIGTERM, SIGKILL after ${KILL_GRACE_S}s; signal again to SIGKILL now)" ;;
    signal) log "caught SIG$sig: stopping every node (SIGTERM to torchrun, which forwards it to the workers; SIGKILL after ${KILL_GRACE_S}s; signal again to SIGKILL now)" ;;
    *) log "caught SIG$sig: stopping every node (SIGKILL now: trainer.stop_protocol none)" ;;
  esac
  if [[ -n $SLEEP_PID ]]; then kill "$SLEEP_PID" 2>/dev/null || true; fi
  cleanup_all || true
  mapfile -t pids < <(jobs -p)
  if ((${#pids[@]})); then kill -TERM "${pids[@]}" 2>/dev/null || true; fi
  wait || true
  if [[ $STOP_PROTOCOL == sbatch-gen ]]; then
    node_lines "$LOGS/attempt-$ATTEMPT".node-*.log  # what each node said about the stop, one line each
  fi
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

# usage [0]: how to run the launcher; an error (exit 2), or with 0 (--help) on stdout and exit 0.
usage() {
  local text="usage: $0                launch (run it on ${HOSTS[0]}, from the launch directory)
       $0 cleanup TAG    kill what an earlier launch left behind (its tag is in its log lines)"
  if [[ ${1-} == 0 ]]; then printf '%s\n' "$text"; exit 0; fi
  die 2 "$text"
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

# IPv4 address of an interface (ip, else python's SIOCGIFADDR: images without iproute2); returns 1 if it has
# none.
# shellcheck disable=SC2317,SC2329  # run on the nodes (declare -f)
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

# debug_env LOGS NAME TRACES (SBATCH_GEN_DEBUG=1): NCCL at INFO, each rank into LOGS/NAME.nccl.<host>.<pid>.log,
# and torch's NCCL flight recorder (the TORCH_NCCL_* names: torch 2.13 reads them as its TORCH_FR_* ones), each
# rank's records dumped on a collective timeout into $RUN_DIR/debug/TRACES.rank-<rank>; paths made absolute.
# shellcheck disable=SC2317,SC2329  # run on the nodes (declare -f) by the SSH launcher
debug_env() {
  local logs=$1 traces=$RUN_DIR/debug
  [[ $logs == /* ]] || logs=$PWD/$logs
  [[ $traces == /* ]] || traces=$PWD/$traces
  mkdir -p -- "$logs" "$traces" || return 1
  export NCCL_DEBUG=INFO NCCL_DEBUG_FILE="$logs/$2.nccl.%h.%p.log" TORCH_NCCL_TRACE_BUFFER_SIZE=2000 \
    TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$traces/$3.rank-"
}

# ==== node library =================================================================================
# sbatch-gen's node functions (templates/_node.j2), no site settings: log/die, the python_env activation,
# and, when this render uses them, those that find, stage and run the node program (sbatch-gen-node.py: the
# preflight, the training step's supervision) and node_lines. Every render with the same library sha256
# carries these same lines: review them once (`sbatch-gen diff --all` shows a change to them once, naming
# the files).
# library sha256: f570325cea93d511fc68baad26e2bda42f4dfa0c138d1076b08b9e57c4e2c320
# log MESSAGE...: one timestamped line on stderr, and in $LOG_FILE when set. Never fails (a trap's terminal may be gone).
log() {
  local line; printf -v line '[sbatch-gen %s] %s' "$(date -u +%FT%TZ)" "$*"
  { printf '%s\n' "$line" >&3; [[ -z ${LOG_FILE:-} ]] || printf '%s\n' "$line" >>"$LOG_FILE"; } 3>&2 2>/dev/null || true
}
# die CODE MESSAGE...: log "ERROR: MESSAGE" and exit with CODE.
die() { local code=$1; shift; log "ERROR: $*"; exit "$code"; }

# run_waited [--out VAR] CMD ARG...: CMD run in the background and waited for, its status (--out: its stdout
# in VAR). Bash runs a trap only once a foreground program has returned, and a scancel signals the batch shell
# alone: a slow program in the foreground would keep the job's traps from saying why it ends.
run_waited() {
  local pid rc=0 out='' tmp
  if [[ $1 == --out ]]; then out=$2; shift 2; fi
  if [[ -n $out ]]; then tmp=$(mktemp) || return 1; "$@" >"$tmp" & else "$@" & fi
  pid=$!
  wait "$pid" || rc=$?
  while kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" || rc=$?; done  # a trap ran meanwhile: CMD goes on
  if [[ -n $out ]]; then printf -v "$out" '%s' "$(<"$tmp")"; rm -f -- "$tmp"; fi
  return "$rc"
}

# load_modules: `module load` python_env.modules ($MODULES), after sourcing the module system's shell set-up
# where `module` is not defined (ssh's non-login shells). Lmod's program (and a `module` program) run in the
# background, waited for (run_waited); Lmod's output is applied here, as its `module` function does; another
# module system's `module` function runs in the foreground. Sets NODE_ERROR and returns 1 if that fails.
load_modules() {
  local f ok=1 code
  ((${#MODULES[@]})) || return 0
  if ! type module >/dev/null 2>&1; then
    for f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
      # shellcheck disable=SC1090
      if [[ -r $f ]]; then set +u; source "$f"; set -u; break; fi
    done
  fi
  set +u  # module scripts read unset variables
  if [[ $(type -t module) == function && -x ${LMOD_CMD-} ]]; then
    if run_waited --out code "$LMOD_CMD" bash load "${MODULES[@]}"; then eval "$code" || ok=0; else ok=0; fi
  elif [[ $(type -t module) == file ]]; then
    run_waited module load "${MODULES[@]}" || ok=0
  else
    module load "${MODULES[@]}" || ok=0
  fi
  set -u
  if (( ! ok )); then
    NODE_ERROR="module load ${MODULES[*]} failed (python_env.modules)"
    return 1
  fi
}

# activate_env: python_env on this node: the modules, then the venv or conda environment ($ENV_KIND,
# $ENV_PATH, and a conda env's $ENV_NAME), then $CODE_DIR first on PYTHONPATH. Sets NODE_ERROR and returns 1 when something
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

# find_pinned NAME SHA256 FILE...: the first FILE that is sbatch-gen's NAME with that sha256 (the one this
# script pins; render writes it beside the renders), in PINNED_FOUND; else NODE_ERROR says what each FILE is
# and the status is 1.
find_pinned() {
  local name=$1 sha=$2 f sum said=''
  shift 2
  for f in "$@"; do
    if [[ ! -r $f ]]; then said+="${said:+; }no $f"; continue; fi
    sum=$(sha256sum <"$f" 2>/dev/null) || sum=''
    sum=${sum%% *}
    if [[ $sum == "$sha" ]]; then PINNED_FOUND=$f; return 0; fi
    said+="${said:+; }$f has sha256 ${sum:-unknown}"
  done
  NODE_ERROR="the $name this script pins (sha256 $sha) is not there: $said (sbatch-gen render writes it beside the renders: render again and review the diff)"
  return 1
}

# node_py [--exec] COMMAND ARG...: the node program's COMMAND (preflight, run-trainer), run by this node's
# python: python_env's, else python3 (an image may have no `python`), isolated (-I: no PYTHONPATH, no user
# site; it needs the standard library only). The program is the file $SBATCH_GEN_NODE_PY, or the text
# $NODE_PY_SRC (the SSH launcher ships it). --exec: it replaces this shell (a job step's task: Slurm's
# SIGTERM must reach the program, not a shell it would end). Status 127 when this node has no python (said on
# stderr with --exec; the preflight says it in its own line).
# shellcheck disable=SC2317,SC2329  # run on the nodes (export -f / declare -f)
node_py() {
  local py run=()
  if [[ ${1-} == --exec ]]; then run=(exec); shift; fi
  if ! py=$(command -v python || command -v python3); then
    if ((${#run[@]})); then printf 'sbatch-gen: no python on PATH on %s (python_env): cannot run the node program (%s)\n' "${SLURMD_NODENAME:-$HOSTNAME}" "${1-}" >&2; fi
    return 127
  fi
  if [[ -n ${NODE_PY_SRC-} ]]; then "${run[@]}" "$py" -I -c "$NODE_PY_SRC" "$@"; else "${run[@]}" "$py" -I "$SBATCH_GEN_NODE_PY" "$@"; fi
}

# preflight NAME=VALUE...: check this node before anything starts (the node program's preflight, through
# node_py: its settings are listed there). One line: "preflight ok on NODE: what it found" on stdout (status
# 0), or "preflight FAILED on NODE: problem; problem..." on stderr (status 1), also without any python.
# shellcheck disable=SC2317,SC2329  # run on the nodes (export -f / declare -f), not called here
preflight() {
  local a rc=0 problem='python not found on PATH (python_env)'
  node_py preflight "$@" || rc=$?
  ((rc == 127)) || return "$rc"
  for a in "$@"; do
    if [[ $a == setup_error=?* ]]; then problem=${a#setup_error=}; fi
  done
  printf 'preflight FAILED on %s: %s\n' "${SLURMD_NODENAME:-$(hostname)}" "$problem" >&2
  return 1
}

# node_lines LOG...: the last "node NAME: ..." line of each node's log (the node program's run-trainer says
# in one line what a stop left), through log (launcher side).
# shellcheck disable=SC2317,SC2329  # called by the launcher after a stop
node_lines() {
  local f said
  for f in "$@"; do
    [[ -e $f ]] || continue
    said=$(grep -a -E '^\[sbatch-gen [^]]*\] node [^ ]+: ' -- "$f" | tail -n 1 | sed 's/^\[sbatch-gen [^]]*\] //' || true)
    [[ -z $said ]] || log "$said"
  done
}

# ==== end of node library ==========================================================================
