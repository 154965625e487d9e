#!/usr/bin/env bash
# SSH launcher for site 'lab', rendered by sbatch-gen. Do not edit by hand: change the profile
# (or templates/), run `sbatch-gen render --site lab`, review the diff and commit it.
#   profile: sites/lab.yaml
#   inputs sha256: ca0c894c6a653dd0f04ad0960cf0b6025fa978a840e4a0f279521458c2ab01f6
#
# Run it on lab-gpu01 (node 0) from the directory the profile's relative paths refer to;
# every host must have that directory at the same path (shared filesystem or identical checkout).
#   bash out/lab.sh
#       launch; Ctrl-C (SIGINT, SIGTERM, SIGHUP) stops and cleans up every node at once
#   bash out/lab.sh cleanup TAG
#       kill what an earlier launch left behind (if its launcher was SIGKILLed)
#   touch STOP
#       stop after the current attempt: the file is checked between attempts, never mid-attempt
# Exit codes: 0 trained to completion; 1 failed after launch.max_attempts; 2 cannot start (stop file
# present, no IPv4 address on the interface here, sbatch-gen's SSH library or node program missing or not
# the one this script pins, bad arguments); 3 preflight failed on a host before
# the first attempt (before a relaunch it counts as a failed attempt); 4 stopped by the stop file
# after a failed attempt; 128+N interrupted by signal N.
# shellcheck disable=SC2034,SC2153  # settings that the SSH library's functions read; what its launch_setup sets
set -euo pipefail

# ---- hosts: node rank = position among the enabled hosts; node 0 runs here, the others over ssh --
HOSTS=(
  lab-gpu01  # node 0 (this host, local)
  lab-gpu02  # node 1
  lab-gpu03  # node 2
  lab-gpu04  # node 3
  lab-gpu05  # node 4
)
# hosts[5] left out (enabled: false): lab-gpu06 -- GPU 5 drops off the bus under load (Xid 79); out until the board is replaced
NPROC_PER_NODE=8  # node.gpus
GPUS_PER_NODE=8  # node.gpus (the preflight counts the GPUs a node shows: CUDA_VISIBLE_DEVICES, else nvidia-smi's)
IFNAME=bond0  # network.socket_ifname: MASTER_ADDR and NCCL/Gloo sockets

# ---- ssh: options for every connection to the other hosts ----------------------------------------
SSH_OPTS=(
  -o 'BatchMode=yes'
  -o 'ConnectTimeout=10'
  -o 'ServerAliveInterval=15'
  -o 'ServerAliveCountMax=4'
  -l train
  -i /shared/keys/train_ed25519
  -o 'IdentitiesOnly=yes'
  -o 'StrictHostKeyChecking=yes'
  -o 'UserKnownHostsFile=/shared/keys/known_hosts'
)

# ---- torchrun: c10d rendezvous hosted by node 0's torchrun (its flags: node_main) ----------------
RDZV_PORT=29500  # torchrun.rdzv_port
NUMA_BINDING=''  # topology.numa_binding
LOG_TOPOLOGY=1  # topology.log_topology
IB_HCA=''  # nccl.ib_hca: the NCCL_IB_HCA the preflight checks unless the launcher has its own (empty: none)
IB_LINK_LAYER=InfiniBand  # nccl.ib_link_layer: what their ports must be
TORCHRUN_FLAGS='--signals-to-handle,--shutdown-timeout'  # node_main's torchrun flags that older torch lacks: the preflight checks each node's has them
SSH_LIB_SHA256=2a8f02ac457cc5efe9cdf706f784450977e629f6d210095d7829de961d2f956f  # the launcher's and the nodes' functions: sbatch-gen-ssh.sh (render writes it), only with this sha256
NODE_PY_SHA256=04d58079b941ee457e86bb0099b7c8861574b34e072ea9975b1d95c07fb15b1f  # the preflight's checks, the training step's supervision: sbatch-gen-node.py (render writes it), sent to every host

# ---- python_env: activated on every node ---------------------------------------------------------
ENV_KIND=venv  # python_env.kind
ENV_PATH=/shared/envs/lab-gpt  # python_env.path
MODULES=()  # python_env.modules
CODE_DIR=.  # paths.code_dir: first on PYTHONPATH
ENV_HINT='create it on every host'  # what an error about python_env adds

# ---- environment exported on every node before torchrun ------------------------------------------
# The profile's values are defaults: the launcher's value wins on every node (NCCL_DEBUG=INFO bash ...); "always": set anyway
NODE_ENV=(
  # network.socket_ifname
  "NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME-bond0}"
  "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME-bond0}"
  # nccl
  "NCCL_IB_DISABLE=${NCCL_IB_DISABLE-1}"
  "NCCL_P2P_DISABLE=${NCCL_P2P_DISABLE-1}"
  "TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING-1}"
  "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC-300}"
  "NCCL_DEBUG=${NCCL_DEBUG-WARN}"
  "OMP_NUM_THREADS=${OMP_NUM_THREADS-16}"  # derived: the CPUs per process
  "PYTHONUNBUFFERED=${PYTHONUNBUFFERED-1}"  # unbuffered output for the logs
)

# ---- secrets: the variables the profile names, never their values (sbatch_gen/credentials.py) -----
# A required one unset or empty here: the launch does not start. Each node gets the values over ssh's stdin, for the
# preflight and torchrun only: never on a command line, in a file or a log. NAME, its field, required (1) or sent when set (0)
SECRET_ENV=()  # none named
BUCKET_CHECK=()  # none: the preflight checks cross_region's bucket with the s3 transport only

# ---- trainer: its flags are the Slurm scripts' (node_main) ---------------------------------------
TRAINER_MODULE=sbatch_gen.train  # trainer.module
TRAIN_CONFIG=configs/gpt-125m.yaml  # trainer.config (the preflight checks it is readable)
DATA_PATH=/shared/data/lab-gpt  # paths.data (the preflight checks it exists)
FIRST_RESUME=auto  # trainer.resume (every relaunch uses auto)
RUN_DIR=/shared/runs/lab-gpt  # paths.run_dir
LOG_DIR=logs  # paths.log_dir

# ---- launch: attempts, cool-down, cleanup ---------------------------------------------------------
MAX_ATTEMPTS=10  # launch.max_attempts
COOLDOWN_S=900  # launch.cooldown_s
STOP_FILE=STOP  # launch.stop_file
KILL_GRACE_S=60  # launch.kill_grace_s
FAILURE_GRACE_S=300  # launch.failure_grace_s
PREFLIGHT_TIMEOUT_S=120  # launch.preflight_timeout_s
SHARED_RUN_DIR=1  # launch.shared_run_dir
STOP_PROTOCOL=sbatch-gen  # trainer.stop_protocol: how a stop reaches the trainer (cleanup_main)
SITE=lab
# The settings every node gets besides the launch's own (launch_setup, which also sets LOGS): declare -p
# prints them as bash code
NODE_VARS=(NPROC_PER_NODE GPUS_PER_NODE IFNAME RDZV_PORT NUMA_BINDING LOG_TOPOLOGY IB_HCA FAILURE_GRACE_S IB_LINK_LAYER TORCHRUN_FLAGS
  ENV_KIND ENV_PATH MODULES CODE_DIR ENV_HINT NODE_ENV TRAINER_MODULE TRAIN_CONFIG DATA_PATH RUN_DIR
  SHARED_RUN_DIR SECRET_ENV BUCKET_CHECK LOGS DEBUG)
# SBATCH_GEN_DEBUG=1 bash out/lab.sh: NCCL INFO per rank into files, the NCCL flight recorder dumped on a
# timeout (node_main)
DEBUG=${SBATCH_GEN_DEBUG:-0}

# ---- main: what a launch does, in order ------------------------------------------------------------
# For each attempt: the preflight on every node (preflight_all), the launch (launch_all: node_main on every
# node, torchrun there), wait for every node (wait_all) and clean up; then the relaunch decision (at most
# launch.max_attempts attempts, launch.cooldown_s apart, none once launch.stop_file exists). The functions
# it calls are sbatch-gen's SSH library's (the same for every site, pinned by sha256: review it once), but
# node_main, below, which holds this site's settings. The nodes get it over ssh, with the settings above.
main() {
  local r ok resume=$FIRST_RESUME waited
  SSH_LIB=$(pinned_library "$(dirname -- "${BASH_SOURCE[0]}")") || exit 2
  # shellcheck source=/dev/null
  source "$SSH_LIB"
  launch_setup "$(dirname -- "${BASH_SOURCE[0]}")"  # TAG, LOGS, LOCAL_ENV, the node program, NODE_PROGRAM
  case ${1-} in
    "") ;;
    cleanup) shift; cleanup_command "$@" ;;
    -h | --help) usage 0 ;;
    *) usage ;;
  esac
  if [[ -e $STOP_FILE ]]; then die 2 "stop file $STOP_FILE exists: remove it to launch"; fi
  [[ -n $NODE_PY_SRC ]] || die 2 "$NODE_ERROR"
  check_secrets
  mkdir -p -- "$LOGS"
  ln -sfn -- "$SITE.$TAG" "$LOG_DIR/$SITE.latest"
  MASTER_ADDR=$(iface_ipv4 "$IFNAME") || die 2 "interface $IFNAME has no IPv4 address on this host (node 0)"
  # Ctrl-C (SIGINT), SIGTERM, SIGHUP: every node stops (on_signal): SIGTERM to every process tagged $TAG, which
  # the trainer takes as a stop request (it checkpoints and exits), SIGKILL after launch.kill_grace_s; a
  # second signal: SIGKILL at once. Each node then says in one line what the stop left.
  trap 'on_signal INT 130' INT
  trap 'on_signal TERM 143' TERM
  trap 'on_signal HUP 129' HUP
  log "site $SITE: $NNODES nodes x $NPROC_PER_NODE processes, rendezvous $MASTER_ADDR:$RDZV_PORT ($IFNAME), tag $TAG"
  log "hosts: ${HOSTS[*]}; logs in $LOGS; touch $STOP_FILE to stop after the current attempt"
  if [[ $DEBUG == 1 ]]; then
    log "SBATCH_GEN_DEBUG=1: NCCL INFO per rank in $LOGS/attempt-<n>.node-<rank>.nccl.<host>.<pid>.log; on a collective timeout, each rank's NCCL flight recorder in $RUN_DIR/debug/$TAG.attempt-<n>.rank-<rank>"
  fi
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

# ---- the function that holds this site's settings, shipped to every node with the library's ---------------
# Start torchrun on one node and return its exit status (128+N when signal N killed it). Only torchrun and
# what it starts carry the tag (`env` puts it in torchrun's environment): not this shell, nor the node
# program that supervises torchrun (trainer.stop_protocol sbatch-gen); cleanup_main signals exactly those.
node_main() {
  local rank=$1 MASTER_ADDR=$2 ATTEMPT=$3 RESUME=$4 MASTER_PORT=$RDZV_PORT NODE_ADDR IS_HOST=0 rc=0
  receive_secrets
  cd -- "$LAUNCH_DIR" || return 1
  if ((${#NODE_ENV[@]})); then export "${NODE_ENV[@]}"; fi
  activate_env || { echo "$NODE_ERROR"; return 1; }
  NODE_ADDR=$(iface_ipv4 "$IFNAME") || { echo "interface $IFNAME has no IPv4 address"; return 1; }
  if ((rank == 0)); then IS_HOST=1; fi
  # SBATCH_GEN_DEBUG=1: NCCL at INFO, each rank into a file beside this node's log; the flight recorder on a timeout
  if [[ $DEBUG == 1 ]]; then debug_env "$LOGS" "attempt-$ATTEMPT.node-$rank" "$TAG.attempt-$ATTEMPT" || return 1; fi
  export SBATCH_GEN_NODE_RANK="$rank" SBATCH_GEN_ATTEMPT="$ATTEMPT"
  printf 'node %s host %s addr %s rendezvous %s:%s attempt %s resume %s tag %s\n' \
    "$rank" "$HOSTNAME" "$NODE_ADDR" "$MASTER_ADDR" "$MASTER_PORT" "$ATTEMPT" "$RESUME" "$TAG"
  env_without_secrets | grep -E '^(NCCL|GLOO|TORCH|CUDA|OMP)_' | sort || true
  export_secrets  # for torchrun and the trainer, after everything this node prints
  # torchrun's and the trainer's arguments: built once for every launcher (sbatch_gen/launch.py)
  local -a torchrun_args=(
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend=c10d
    --rdzv-id="$TAG.$ATTEMPT" --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
    --rdzv-conf="join_timeout=900,is_host=$IS_HOST"  # torchrun.rdzv_timeout_s
    --local-addr="$NODE_ADDR"
    --max-restarts 0  # torchrun.max_restarts
    --signals-to-handle='SIGINT,SIGHUP,SIGQUIT'  # trainer.stop_protocol: sbatch-gen
    --shutdown-timeout=60  # launch.kill_grace_s
  ) trainer_args=(
    --config "$TRAIN_CONFIG" --run-dir "$RUN_DIR" --resume "$RESUME"
    --data-path "$DATA_PATH"
  )
  # The trainer's stop file of this attempt: it writes the ack (and .stopping, .fatal) next to it
  local stop_file="$RUN_DIR/stop/$TAG.attempt-$ATTEMPT"
  mkdir -p -- "$RUN_DIR/stop" || return 1
  rm -f -- "$stop_file" "$stop_file.ack" "$stop_file.fatal" "$stop_file.stopping"
  export SBATCH_GEN_STOP_FILE="$stop_file"
  # The node program's run-trainer runs torchrun with SIGTERM ignored; 42 after a complete stop checkpoint.
  # A node whose workers are done waits launch.failure_grace_s for the others (torchrun's exit barrier).
  node_py run-trainer --stop-file "$stop_file" --stopped-rc 42 --exit-barrier-s "$FAILURE_GRACE_S" -- \
    env SBATCH_GEN_TAG="$TAG" torchrun "${torchrun_args[@]}" -m "$TRAINER_MODULE" "${trainer_args[@]}" || rc=$?
  return "$rc"
}

# ==== sbatch-gen's bootstrap: how main finds the SSH library =========================================
# pinned_library DIR: the path of sbatch-gen-ssh.sh with sha256 SSH_LIB_SHA256, in DIR (beside this script), else
# in out/; else status 1, having said what it found where.
pinned_library() {
  local f sum said=''
  for f in "$1/sbatch-gen-ssh.sh" out/sbatch-gen-ssh.sh; do
    if ! sum=$(sha256sum 2>/dev/null <"$f"); then said+="; no $f"; continue; fi
    if [[ ${sum%% *} == "$SSH_LIB_SHA256" ]]; then printf '%s\n' "$f"; return 0; fi
    said+="; $f has sha256 ${sum%% *}"
  done
  printf '[sbatch-gen %s] ERROR: the sbatch-gen-ssh.sh this script pins (sha256 %s) is not there%s, in %s (sbatch-gen render writes it beside the renders, with sbatch-gen-node.py: render again, or copy both beside this script)\n' \
    "$(date -u +%FT%TZ)" "$SSH_LIB_SHA256" "${said/#;/:}" "$PWD" >&2
  return 1
}

main "$@"
