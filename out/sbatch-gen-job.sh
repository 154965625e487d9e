# shellcheck shell=bash
# shellcheck disable=SC2034,SC2317,SC2329  # sourced by the training scripts: they call these functions and read what they set
# sbatch-gen's job library for Slurm training scripts (templates/slurm-job.sh.j2), the same for every site:
# a training script (out/<site>.sbatch) pins its sha256, stages it in the run dir and sources it first thing
# in main, so its requeues and continuation jobs run this file whatever the checkout holds by then. It reads
# the script's settings (RUN_DIR, LOG_DIR, STOP_SIGNAL, ...: the script's "settings from the profile") and
# main's state (ATTEMPT, STOP_FILE, ...). Review it once: `sbatch-gen diff --all` shows a change to it once.

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

# stage_node_program: the node program (sbatch-gen-node.py, which node_py runs on every node), pinned by this library,
# staged in the run dir as the script stages this library (stage_pinned), in SBATCH_GEN_NODE_PY for every job step.
stage_node_program() {
  stage_pinned SBATCH_GEN_NODE_PY sbatch-gen-node.py 04d58079b941ee457e86bb0099b7c8861574b34e072ea9975b1d95c07fb15b1f 4cd87941711e8411c8c2be6322dc3297e1c2afc9 || return 1
  export SBATCH_GEN_NODE_PY
}

# rendezvous: MASTER_ADDR, the first node of the allocation (node 0 of every job step: it hosts torchrun's
# rendezvous store on MASTER_PORT, torchrun.rdzv_port), exported with MASTER_PORT for the job steps.
rendezvous() {
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1 || true)
  [[ -n $MASTER_ADDR ]] || die 1 "cannot resolve the first node of SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
  export MASTER_ADDR MASTER_PORT
}

# say_attempt: what this attempt starts from and with, one line each: the job, the nodes, the run dir, the
# environment; a warning when the cluster's Slurm or the node count differs from the profile's, or when the
# previous attempt began a stop checkpoint that did not complete (Slurm ended the job within its grace).
say_attempt() {
  local running previous
  log "site $SITE, job $SLURM_JOB_ID, attempt $ATTEMPT${CONTINUES:+ (continues job ${CONTINUES%%.*})}; newest checkpoint: $(step_name "$START_STEP"); requeues in a row without progress: $(cat -- "$NO_PROGRESS_FILE" 2>/dev/null || echo 0) of at most $MAX_NO_PROGRESS"
  log "nodes ($SLURM_NNODES): $SLURM_JOB_NODELIST; rendezvous $MASTER_ADDR:$MASTER_PORT; $NPROC_PER_NODE processes and $EXPECTED_GPUS GPUs per node"
  log "run dir $RUN_DIR; data ${DATA_PATH:-from the train config}; pinned interface ${PINNED_IFNAME:-none}"
  log "environment: $(env | grep -E '^(NCCL|TORCH|GLOO|OMP)_' | sort | paste -s -d ' ' -)"
  running=$(sinfo --version 2>/dev/null | awk '{print $2}' || true)
  case $running in
    "$EXPECTED_SLURM" | "$EXPECTED_SLURM".*) ;;
    *) log "WARNING: the profile says Slurm $EXPECTED_SLURM (slurm.version), this cluster runs ${running:-unknown}" ;;
  esac
  (( SLURM_NNODES == NNODES )) || log "WARNING: got $SLURM_NNODES nodes, the profile asks for $NNODES (slurm.nodes)"
  previous="$RUN_DIR/stop/${CONTINUES:-$SLURM_JOB_ID.attempt-$((ATTEMPT - 1))}"
  if (( ATTEMPT > 0 )) || [[ -n $CONTINUES ]] && [[ -e $previous.stopping && ! -e $previous.ack ]]; then
    log "WARNING: ${CONTINUES:-attempt $((ATTEMPT - 1))} was ended before its stop checkpoint completed: $(head -n 1 -- "$previous.stopping" | cut -c 1-500)"
  fi
}

# allocated_cpus REQUESTED: the CPUs Slurm allocated to this job on each node, the fewest of any node
# (SLURM_JOB_CPUS_PER_NODE: "112(x2)", "72,64(x3)"), else on this node (SLURM_CPUS_ON_NODE), else REQUESTED
# (slurm.cpus_per_task). A job step given more CPUs than its node has would not start; fewer would leave
# some idle: on an --exclusive node Slurm allocates all of them.
allocated_cpus() {
  local n fewest='' counts=${SLURM_JOB_CPUS_PER_NODE:-}
  for n in ${counts//,/ }; do
    n=${n%%(*}
    if [[ $n =~ ^[1-9][0-9]*$ ]] && { [[ -z $fewest ]] || (( n < fewest )); }; then fewest=$n; fi
  done
  [[ -n $fewest ]] || fewest=${SLURM_CPUS_ON_NODE:-}
  [[ $fewest =~ ^[1-9][0-9]*$ ]] || fewest=$1
  printf '%s\n' "$fewest"
}

# wait_for_ack: after a stop request, up to ACK_TIMEOUT_S s for the trainer's "$STOP_FILE.ack" (its stop
# checkpoint is complete), said in one line either way.
wait_for_ack() {
  local i
  for ((i = 0; i < ACK_TIMEOUT_S; i++)); do
    [[ -e $STOP_FILE.ack ]] && break
    sleep 1
  done
  if [[ -e $STOP_FILE.ack ]]; then
    log "trainer checkpointed: $(cat -- "$STOP_FILE.ack")"
  else
    log "WARNING: no $STOP_FILE.ack within $ACK_TIMEOUT_S s; --resume auto uses the last complete checkpoint"
  fi
}

# node_tails LOG...: the last 20 lines of each node's log of a failed step, into this log.
node_tails() {
  local f
  for f in "$@"; do
    [[ -e $f ]] || continue
    log "last lines of $f:"
    tail -n 20 -- "$f" || true
  done
}

# use_allocated_cpus: slurm.cpus_per_task is a request: every job step takes the CPUs Slurm allocated on a node
# (the fewest of any node: CPUS_PER_TASK), each of its processes an even share of their physical cores
# (OMP_NUM_THREADS: the node program's omp-threads reads the batch node's SMT, the nodes taken to be alike;
# without a python here, of the CPUs),
# unless OMP_NUM_THREADS was set at submit time (OMP_GIVEN says so: a continuation job gets it too, else it
# computes its own).
use_allocated_cpus() {
  CPUS_PER_TASK=$(allocated_cpus "$CPUS_PER_TASK")
  OMP_GIVEN=${OMP_NUM_THREADS+given}
  [[ -z $OMP_GIVEN ]] || return 0
  OMP_NUM_THREADS=$(node_py omp-threads "$CPUS_PER_TASK" "$NPROC_PER_NODE" 2>/dev/null) \
    || OMP_NUM_THREADS=$(( CPUS_PER_TASK >= NPROC_PER_NODE ? CPUS_PER_TASK / NPROC_PER_NODE : 1 ))
  export OMP_NUM_THREADS
}

# start_attempt: this attempt (ATTEMPT; RUN_JOB, the run's first job), its files and state. STOP_FILE (exported
# as SBATCH_GEN_STOP_FILE) hands a stop request to the trainer; TRAIN_LOG, the training step's log per node;
# SBATCH_GEN_DEBUG=1 on a GPU site: debug_env. The run goes on across requeues and continuation jobs; attempts
# in a row that saved no newer checkpoint are counted in NO_PROGRESS_FILE (a new submission starts afresh).
# This job's script is kept (JOB_SCRIPT) for a continuation.
start_attempt() {
  mkdir -p -- "$RUN_DIR/stop" "$LOG_DIR" || die 1 "cannot create $RUN_DIR/stop or $LOG_DIR (paths.run_dir, paths.log_dir)"
  ATTEMPT=${SLURM_RESTART_COUNT:-0}
  # A continuation job (a stop overran the time limit) says which attempt it continues, <job>.attempt-<n>, and
  # the run: the job id of its submission, which names the run's pinned code and its budget count.
  CONTINUES=${SBATCH_GEN_CONTINUES:-}
  RUN_JOB=$SLURM_JOB_ID
  [[ -z $CONTINUES ]] || RUN_JOB=${SBATCH_GEN_RUN_JOB:-$SLURM_JOB_ID}
  export SBATCH_GEN_RUN_JOB=$RUN_JOB  # the trainer's run-dir lease: a job of the same run may take it over
  STOP_FILE="$RUN_DIR/stop/$SLURM_JOB_ID.attempt-$ATTEMPT"
  export SBATCH_GEN_STOP_FILE="$STOP_FILE"
  rm -f -- "$STOP_FILE" "$STOP_FILE.ack" "$STOP_FILE.fatal" "$STOP_FILE.stopping"
  TRAIN_LOG="$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID.attempt-$ATTEMPT.%N.log"
  if [[ ${SBATCH_GEN_DEBUG:-} == 1 ]] && (( EXPECTED_GPUS > 0 )); then
    debug_env "$LOG_DIR" "$SLURM_JOB_NAME-$SLURM_JOB_ID.attempt-$ATTEMPT" "$SLURM_JOB_NAME-$SLURM_JOB_ID.attempt-$ATTEMPT"
    log "SBATCH_GEN_DEBUG=1: NCCL INFO per rank in ${NCCL_DEBUG_FILE%.nccl.*}.nccl.<host>.<pid>.log; on a collective timeout, each rank's NCCL flight recorder in ${TORCH_NCCL_DEBUG_INFO_TEMP_FILE}<rank>"
  fi
  NO_PROGRESS_FILE="$RUN_DIR/stop/$RUN_JOB.requeues-without-progress"
  JOB_SCRIPT="$RUN_DIR/stop/$SLURM_JOB_ID.sbatch"
  START_STEP=$(newest_checkpoint)
  if (( ATTEMPT == 0 )) && [[ -z $CONTINUES ]]; then
    printf '0\n' >"$NO_PROGRESS_FILE"
  fi
  cp -- "$0" "$JOB_SCRIPT" 2>/dev/null || log "WARNING: cannot keep a copy of this script in $JOB_SCRIPT: no continuation job after the time limit"
  BUDGET_SPENT=0
  # the stop hand-off's state (request_stop, wait_step, continue_run)
  SRUN_PID=''  # the training step, once launched
  STOP_REQUESTED=''
  GOT_TERM=0  # TERM to this shell: Slurm itself ends the job (and requeues it when it means to)
  TRAPPED=0
  REQUEUED=0
  ENDING_SAID=0
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

# load_secrets: the secrets the profile names (SECRET_ENV: NAME, the field that names it, required 1 or 0), read
# on this node from $SECRETS_FILE (slurm.secrets_file): NAME=value lines, # comments, a value in
# matching quotes without them, nothing expanded, only SECRET_ENV's names taken; exported by a builtin for the
# job steps (no process's argv holds a value) and never printed. The file must belong to this user and be
# readable by no one else. A value the job's environment held already is dropped first (#SBATCH --export
# leaves the submitting shell's out: with sbatch --export=ALL Slurm keeps it in the job's record). Sets
# NODE_ERROR and returns 1 when the file is unsafe or a required variable is not in it.
load_secrets() {
  local file=$SECRETS_FILE line n=0 name value i owner mode got=() missing=() dropped=()
  for ((i = 0; i < ${#SECRET_ENV[@]}; i += 3)); do
    name=${SECRET_ENV[i]}
    if [[ -n ${!name+set} ]]; then dropped+=("$name"); unset "$name"; fi
  done
  ((${#dropped[@]} == 0)) || log "WARNING: the job's environment held ${dropped[*]} at its start (sbatch --export=ALL? Slurm keeps what a job is submitted with in its record): not used; $SECRETS_FILE is read instead"
  if [[ ! -e $file ]]; then
    for ((i = 0; i < ${#SECRET_ENV[@]}; i += 3)); do
      got+=("${SECRET_ENV[i]}")
      if [[ ${SECRET_ENV[i + 2]} == 1 ]]; then missing+=("${SECRET_ENV[i]} (${SECRET_ENV[i + 1]})"); fi
    done
    if ((${#missing[@]})); then
      NODE_ERROR="no secrets file $file (slurm.secrets_file) on $(hostname): write NAME=value lines for ${missing[*]} into it, chmod 600"
      return 1
    fi
    log "no secrets file $file (slurm.secrets_file): ${got[*]} not set"
    return 0
  fi
  read -r owner mode < <(stat -L -c '%u %a' -- "$file" 2>/dev/null) || true
  if [[ $owner != "$(id -u)" ]]; then
    NODE_ERROR="secrets file $file (slurm.secrets_file) belongs to uid ${owner:-unknown}, not to this job's user (uid $(id -u))"
    return 1
  elif [[ ! $mode =~ ^[0-7]+$ ]] || (( 8#$mode & 8#077 )); then
    NODE_ERROR="secrets file $file (slurm.secrets_file) is mode ${mode:-unknown}: others may read it; chmod 600 $file"
    return 1
  fi
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    [[ ! $line =~ ^[[:space:]]*(#|$) ]] || continue
    if [[ ! $line =~ ^[[:space:]]*(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
      NODE_ERROR="secrets file $file (slurm.secrets_file), line $n: not NAME=value"  # the line itself is never said
      return 1
    fi
    name=${BASH_REMATCH[2]} value=${BASH_REMATCH[3]}
    case $value in \"*\" | \'*\') value=${value:1:${#value}-2} ;; esac
    for ((i = 0; i < ${#SECRET_ENV[@]}; i += 3)); do
      if [[ $name == "${SECRET_ENV[i]}" ]]; then export "$name=$value"; got+=("$name"); fi
    done
  done <"$file" || { NODE_ERROR="cannot read secrets file $file (slurm.secrets_file)"; return 1; }
  for ((i = 0; i < ${#SECRET_ENV[@]}; i += 3)); do
    name=${SECRET_ENV[i]}
    if [[ -z ${!name:-} ]]; then
      unset "$name"
      if [[ ${SECRET_ENV[i + 2]} == 1 ]]; then missing+=("$name (${SECRET_ENV[i + 1]})"); fi
    fi
  done
  if ((${#missing[@]})); then
    NODE_ERROR="secrets file $file (slurm.secrets_file) has no value for ${missing[*]}"
    return 1
  fi
  log "secrets from $file (slurm.secrets_file): ${got[*]:-none}"
}

# pin_code: the code a run runs. A new submission copies $CODE_DIR's files (a git checkout's tracked and
# untracked, not ignored) to $RUN_DIR/code/<job>/ and records "<commit> <clean|dirty> <code dir>" in
# $RUN_DIR/code/<job>.pin; its requeues and continuation jobs (RUN_JOB: the submission's job id) run that copy
# again, whatever the checkout holds by then. CODE_DIR, and trainer.config and trainer.script where they lie
# in it, then point into the copy. KEEP: how many submissions' copies the run dir keeps (prune_code).
pin_code() {
  local keep=$1
  local pinned="$RUN_DIR/code/$RUN_JOB.pin" dir="$RUN_DIR/code/$RUN_JOB" commit dirty from now rc=0
  if (( ATTEMPT == 0 )) && [[ -z $CONTINUES ]]; then
    run_waited copy_code "$dir" "$pinned" || rc=$?  # waited for: a signal during a long copy is heard at once
    if (( rc == 3 )); then
      log "WARNING: paths.code_dir $CODE_DIR is not a git checkout: its code is not pinned (paths.pin_code)"
      return 0
    fi
    (( rc == 0 )) || die 1 "cannot copy paths.code_dir $CODE_DIR to $dir (paths.pin_code)"
    read -r commit dirty from <"$pinned"
    log "code pinned for the run: $CODE_DIR at commit $commit ($dirty), copied to $dir"
    prune_code "$keep"
  fi
  [[ -r $pinned ]] || return 0
  read -r commit dirty from <"$pinned"
  [[ -d $dir ]] || die 1 "the run's pinned code $dir is gone: resubmit to pin the checkout anew (paths.pin_code)"
  if (( ATTEMPT > 0 )) || [[ -n $CONTINUES ]]; then
    now=$(git -C "$CODE_DIR" rev-parse HEAD 2>/dev/null || echo unknown)
    log "running the code pinned when the run was submitted: commit $commit ($dirty) from $dir${now:+; the checkout is at $now now}"
  fi
  pin_path TRAIN_CONFIG "$from" "$dir"
  pin_path TRAINER_SCRIPT "$from" "$dir"
  CODE_DIR=$dir
  export SBATCH_GEN_PINNED_CODE="$commit $dirty"
}

# pin_env: the Python environment a run runs in. A new submission records its fingerprint (the node
# program's: torch's version, Python's, the architecture, a digest of every installed package's name and
# version) in $RUN_DIR/code/<job>.env (and ENV_PINNED, for the preflight to check on every node); its requeues
# and continuation jobs must find the same, or the job ends in one line: resuming the run's checkpoints
# under other versions would change the run silently.
pin_env() {
  local record="$RUN_DIR/code/$RUN_JOB.env" now was
  run_waited --out now node_py fingerprint || die 1 "cannot read the versions of python_env (the node program $SBATCH_GEN_NODE_PY: fingerprint failed)"
  if (( ATTEMPT == 0 )) && [[ -z $CONTINUES ]] || [[ ! -e $record ]]; then
    mkdir -p -- "$RUN_DIR/code"
    printf '%s\n' "$now" >"$record" || die 1 "cannot write $record (paths.pin_code)"
    ENV_PINNED=$now
    log "environment pinned for the run: $now"
    return 0
  fi
  read -r was <"$record" || true
  ENV_PINNED=$was
  [[ $now == "$was" ]] || die 1 "python_env changed since the run started: it was $was, it is $now; not resuming the run under other versions (paths.pin_code): restore the environment, or submit anew to go on with these versions"
  log "running in the environment the run started with: $now"
}

# copy_code DIR PIN: $CODE_DIR's files (a git checkout's tracked and untracked, not ignored) copied to DIR, and
# "<commit> <clean|dirty> <code dir>" written to PIN; status 3 when $CODE_DIR is not a git checkout.
copy_code() {
  local commit dirty=clean
  commit=$(git -C "$CODE_DIR" rev-parse HEAD 2>/dev/null) || return 3
  [[ -z $(git -C "$CODE_DIR" status --porcelain 2>/dev/null) ]] || dirty=dirty
  mkdir -p -- "$RUN_DIR/code" && rm -rf -- "$1" "$1.tmp" && mkdir -p -- "$1.tmp" || return 1
  (cd -- "$CODE_DIR" && git ls-files -z --cached --others --exclude-standard \
    | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$1.tmp" || return 1
  mv -- "$1.tmp" "$1" && printf '%s %s %s\n' "$commit" "$dirty" "$(cd -- "$CODE_DIR" && pwd -P)" >"$2"
}

# prune_code KEEP: of the submissions that pinned their code in $RUN_DIR/code/ (<job>.pin, <job>.env), newest
# first, all but KEEP lose their copy and records, one line each (paths.pin_code_keep); of sbatch-gen's files
# staged in $RUN_DIR/node/, all but the KEEP most recently used of each kind (a job whose copy is gone stages it
# again from git's objects). Never fails.
prune_code() {
  local n=0 when record job kind
  while read -r when record; do
    job=${record%.*}
    (( ++n > $1 )) || continue
    if rm -rf -- "$job" "$job.pin" "$job.env" "$job.tmp" 2>/dev/null; then
      log "removed the pinned code of submission ${job##*/} (paths.pin_code_keep: the newest $1 are kept)"
    else
      log "WARNING: cannot remove $job (paths.pin_code_keep)"
    fi
  done < <(find "$RUN_DIR/code" -maxdepth 1 -name '*.pin' -printf '%T@ %p\n' 2>/dev/null | sort -rn || true)
  for kind in "${JOB_LIB##*/}" "${SBATCH_GEN_NODE_PY##*/}"; do
    n=0
    while read -r when record; do
      [[ $record != "$JOB_LIB" && $record != "$SBATCH_GEN_NODE_PY" ]] || continue  # this job's
      (( ++n >= $1 )) || continue
      if rm -f -- "$record" 2>/dev/null; then
        log "removed ${record##*/}, staged by an earlier submission (paths.pin_code_keep: the $1 most recently used are kept)"
      fi
    done < <(find "$RUN_DIR/node" -maxdepth 1 -name "${kind%%.*}.*.${kind##*.}" -printf '%T@ %p\n' 2>/dev/null | sort -rn || true)
  done
}

# pin_path VAR FROM COPY: the path in VAR, when it lies in FROM and COPY has it, becomes COPY's.
pin_path() {
  local abs
  [[ -n ${!1-} ]] || return 0
  abs=$(realpath -m -- "${!1}")
  if [[ $abs == "$2"/* && -e $3/${abs#"$2"/} ]]; then printf -v "$1" '%s' "$3/${abs#"$2"/}"; fi
}

# request_stop SIGNAL: the traps' handler (run as `request_stop ... || log`: a failure in it is logged, never
# ends this shell). A TERM before the training step ends the attempt once it is said (exit 143).
# shellcheck disable=SC2317,SC2329  # called by main's traps
request_stop() {
  TRAPPED=1
  [[ $1 != TERM ]] || GOT_TERM=1
  if (( REQUEUED )); then
    log "SIG$1 after the requeue: this attempt is over"
    return 0
  fi
  if [[ $1 == TERM ]]; then
    slurm_ends "SIGTERM to the batch shell"
    # before the training step there is nothing to checkpoint, and the attempt is over: end it now, not
    # after the slow steps before the launch (Slurm's SIGKILL would end it there without a word)
    if [[ -z $SRUN_PID ]]; then exit 143; fi
  fi
  if [[ -z $STOP_REQUESTED ]]; then
    STOP_REQUESTED=$1
    if [[ $STOP_PROTOCOL == sbatch-gen ]]; then
      log "SIG$1 received: asking the trainer to checkpoint and stop ($STOP_FILE)"
      printf 'SIG%s to the batch shell\n' "$1" >>"$STOP_FILE" \
        || log "WARNING: cannot write $STOP_FILE: the trainer hears of the stop only from a SIGTERM to the job step"
    else
      log "SIG$1 received (trainer.stop_protocol $STOP_PROTOCOL)"
    fi
  fi
}

# wait_step PID [kill|return]: wait until the job step PID (srun) has exited; its status in rc. A trapped
# signal ends `wait` early: wait again. On a stop request `kill` ends the step; `return` returns at once on
# $STOP_SIGNAL (the caller stops the step).
wait_step() {
  while :; do
    TRAPPED=0
    rc=0
    if [[ ${2-} == return && $STOP_REQUESTED == "$STOP_SIGNAL" ]]; then return 0; fi
    wait "$1" || rc=$?
    (( TRAPPED )) || return 0
    if [[ ${2-} == kill && -n $STOP_REQUESTED ]]; then kill "$1" 2>/dev/null || true; fi
  done
}

# end_attempt: the training step SRUN_PID has exited with status rc (wait_step), or a stop request returned
# early from wait_step (trainer.stop_protocol signal or none): how the attempt ended decides what comes next.
# Exits: 0 when training finished; else through continue_run (a requeue, a continuation job or the end), die
# or leave_behind. In order:
# - a stop by $STOP_SIGNAL: signal: forwarded to torchrun through srun, STOP_GRACE_S s for the trainer to save;
#   none: at once; sbatch-gen: up to ACK_TIMEOUT_S s for the stop checkpoint (wait_for_ack). Then requeued.
# - a SIGTERM to this shell: Slurm decides (slurm_ends): its own requeue, a continuation after the time limit,
#   the end after a scancel.
# - the trainer's complete checkpoint ("$STOP_FILE.ack") without this shell signalled: the stop
#   reached the job steps only (a preemption with GraceTime: once this script has exited Slurm does not
#   requeue), or the trainer stopped on its own (no cross-region quorum within cross_region.timeout_s):
#   requeued.
# - a stop that reached the job steps only (Slurm's record, or the stop file) and a trainer that exited without
#   an ack (one's own that saves on SIGTERM and exits 0): a preemption, not the end: requeued. (A stop file
#   after a failure says less: srun's --kill-on-bad-exit sends SIGTERM to the other nodes' tasks as well.)
# - status 0: training finished. The trainer's "$STOP_FILE.fatal" (a bad config or flag, the run dir in use by
#   another job): every further attempt would fail the same way after its queue wait: the job ends.
# - a failure: a node that broke during the step (a GPU, an HCA, the health check) would fail the next attempt
#   too: with PREFLIGHT=1 every node is checked again and those that fail are left behind (not once Slurm
#   ends or has requeued the job: the allocation is no longer this attempt's); then requeued, within the
#   budget of attempts without progress.
end_attempt() {
  local deadline
  if [[ $STOP_REQUESTED == "$STOP_SIGNAL" && $STOP_PROTOCOL == signal ]]; then
    log "SIG$STOP_SIGNAL to torchrun on every node (through srun); waiting up to $STOP_GRACE_S s for the trainer to save and exit"
    kill -s "$STOP_SIGNAL" "$SRUN_PID" 2>/dev/null || true
    deadline=$((SECONDS + STOP_GRACE_S + 1))  # SECONDS counts whole seconds: +1 makes it the full grace
    while kill -0 "$SRUN_PID" 2>/dev/null && (( SECONDS < deadline )); do
      sleep 1
    done
    if kill -0 "$SRUN_PID" 2>/dev/null; then
      log "WARNING: the training step still runs after $STOP_GRACE_S s; the requeue kills it"
    else
      rc=0
      wait "$SRUN_PID" || rc=$?
      log "training step exited with status $rc"
    fi
    continue_run "stop requested by SIG$STOP_SIGNAL" 42
  elif [[ $STOP_REQUESTED == "$STOP_SIGNAL" && $STOP_PROTOCOL == none ]]; then
    continue_run "SIG$STOP_SIGNAL: no graceful stop (trainer.stop_protocol none): the trainer resumes from its own last checkpoint" 42
  fi
  log "training step exited with status $rc"
  if [[ $STOP_PROTOCOL == sbatch-gen ]]; then
    node_lines "$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID.attempt-$ATTEMPT".*.log  # what each node said, one line each
    if [[ $STOP_REQUESTED == "$STOP_SIGNAL" ]]; then
      wait_for_ack
      continue_run "stop requested by SIG$STOP_REQUESTED" 42
    fi
  fi
  if (( GOT_TERM )); then
    if [[ -e $STOP_FILE.ack ]]; then
      log "trainer checkpointed: $(cat -- "$STOP_FILE.ack")"
    fi
    continue_run "SIGTERM to the batch shell" 143
  elif [[ -e $STOP_FILE.ack ]]; then
    log "trainer checkpointed and asked for a requeue: $(cat -- "$STOP_FILE.ack")"
    continue_run "the trainer stopped after a complete checkpoint" 42
  elif [[ -n $(slurm_ending) ]] || { (( rc == 0 )) && [[ -e $STOP_FILE ]]; }; then
    log "the trainer exited with status $rc after a stop reached the training step, without $STOP_FILE.ack: a preemption, not the end of training"
    continue_run "preempted" 42
  elif (( rc == 0 )); then
    log "training finished"
    exit 0
  elif [[ -e $STOP_FILE.fatal ]]; then
    die "$rc" "the trainer cannot run: $(head -n 1 -- "$STOP_FILE.fatal" | cut -c 1-2000); not requeueing (fix it, then resubmit)"
  fi
  node_tails "$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID.attempt-$ATTEMPT".*.log
  STEP_RC=$rc
  if (( PREFLIGHT )) && [[ -z $(slurm_ending) ]]; then
    log "training step failed with status $STEP_RC: checking the nodes again (preflight)"
    preflight_nodes || leave_behind "its preflight failed after the training step failed with status $STEP_RC"
  fi
  continue_run "training step failed with status $STEP_RC (node failure or trainer error)" "$STEP_RC"
}

# slurm_ending: why Slurm is ending this job, from its record (scontrol): "requeued" (Restarts grew: an
# administrator's requeue, a preemption without GraceTime or at its end, a node failure; Slurm starts the
# next attempt itself), "preempted" (PreemptTime set: a preemption whose GraceTime runs; Slurm signalled the
# job steps only), "timelimit" (Reason=TimeLimit: the job ends as TIMEOUT, which Slurm never requeues),
# "cancelled" (a SIGTERM to this shell and none of those: scancel); nothing while the job is not ending.
slurm_ending() {
  local info restarts
  info=$(job_record)
  restarts=$(job_field "$info" Restarts)
  if [[ $restarts =~ ^[0-9]+$ ]] && (( restarts > ATTEMPT )); then echo requeued
  elif [[ $(job_field "$info" PreemptTime) == [0-9]* ]]; then echo preempted
  elif [[ $(job_field "$info" Reason) == TimeLimit ]]; then echo timelimit
  elif (( GOT_TERM )); then echo cancelled
  fi
}

# job_record: Slurm's record of this job, one line of Key=Value fields (empty when scontrol fails);
# job_field RECORD KEY: one field's value, empty when it is absent or (null).
job_record() { printf ' %s ' "$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null || true)"; }
job_field() {
  local v
  v=$(grep -o " $2=[^ ]*" <<<"$1" | head -n 1 | cut -d= -f2- || true)
  [[ $v == '(null)' ]] || printf '%s' "$v"
}

# newest_checkpoint: the step of the newest complete checkpoint of the run dir (checkpoints/step-N with its
# COMPLETE.json, which the trainer writes last), -1 when there is none; step_name N says it in words.
newest_checkpoint() {
  local m n best=-1
  for m in "$RUN_DIR"/checkpoints/step-*/COMPLETE.json; do
    n=${m%/*}
    n=${n##*/step-}
    if [[ $n =~ ^[0-9]+$ ]] && (( 10#$n > best )); then best=$((10#$n)); fi
  done
  echo "$best"
}
step_name() { if (( $1 < 0 )); then echo "none"; else echo "step $1"; fi; }

# within_budget: once per attempt, count it: one that completed a checkpoint (periodic or stop) newer than the
# one it started from (START_STEP) resets the count of requeues in a row without progress ($NO_PROGRESS_FILE),
# one that Slurm preempted (its record has PreemptTime) leaves it as it is (the cluster's doing, not a crash
# loop), any other adds one. Status 1 once the count is past $MAX_NO_PROGRESS.
within_budget() {
  if (( ! BUDGET_SPENT )); then
    BUDGET_SPENT=1
    if (( $(newest_checkpoint) > START_STEP )); then
      NO_PROGRESS=0
    else
      NO_PROGRESS=$(cat -- "$NO_PROGRESS_FILE" 2>/dev/null || true)
      [[ $NO_PROGRESS =~ ^[0-9]+$ ]] || NO_PROGRESS=0
      [[ $(slurm_ending) == preempted ]] || NO_PROGRESS=$((NO_PROGRESS + 1))
    fi
    printf '%s\n' "$NO_PROGRESS" >"$NO_PROGRESS_FILE" || log "WARNING: cannot write $NO_PROGRESS_FILE"
  fi
  (( NO_PROGRESS <= MAX_NO_PROGRESS ))
}

# slurm_ends WHY: after a SIGTERM to this shell, what Slurm does with the job, said once and acted on in the
# trap itself (KillWait may end this shell before the job step has exited): its own requeue starts the next
# attempt (an administrator's, a preemption without GraceTime or at its end); after the time limit, which
# Slurm never requeues, a continuation job takes over; a scancel ends the run.
slurm_ends() {
  (( ! ENDING_SAID )) || return 0
  ENDING_SAID=1
  case $(slurm_ending) in
    timelimit)
      if within_budget; then
        continue_after_limit "$1"
      else
        log "$1: the time limit ended this job; no continuation: $NO_PROGRESS attempt(s) in a row saved no newer checkpoint, more than preemption.max_requeues_without_progress ($MAX_NO_PROGRESS)"
      fi
      ;;
    cancelled)
      log "$1: the job was cancelled (scancel); not requeueing: submit this script again to resume from the newest checkpoint ($(step_name "$(newest_checkpoint)"))"
      ;;
    *) log "$1: Slurm requeues this job itself; this attempt is over" ;;
  esac
}

# continue_run WHY CODE: this attempt is over; the run goes on (exits). After a SIGTERM to this shell Slurm
# decides (slurm_ends); Slurm's own requeue (a node failure) starts the next attempt by itself; anything else
# is requeued from here, unless more than $MAX_NO_PROGRESS attempts in a row saved no newer checkpoint: then the
# job exits with CODE (42 after a stop: the trainer's "checkpointed, requeue me" exit code).
continue_run() {
  local rc
  if (( GOT_TERM )); then
    slurm_ends "$1"
    exit 143
  fi
  if [[ $(slurm_ending) == requeued ]]; then
    log "$1: Slurm requeues this job itself; this attempt is over"
    exit 0
  elif ! within_budget; then
    log "not requeueing: $NO_PROGRESS attempt(s) in a row saved no newer checkpoint, more than preemption.max_requeues_without_progress ($MAX_NO_PROGRESS): $1"
    exit "$2"
  fi
  log "requeueing job $SLURM_JOB_ID (requeues in a row without progress: $NO_PROGRESS of at most $MAX_NO_PROGRESS): $1"
  REQUEUED=1
  # Once the requeue takes, Slurm sends TERM to every process of the job, scontrol included: ignored
  # from here on (children inherit it), so a requeue that worked is never reported as failed.
  trap '' TERM "$STOP_SIGNAL"
  rc=0
  scontrol requeue "$SLURM_JOB_ID" || rc=$?
  if (( rc != 0 )) && [[ $(slurm_ending) == requeued ]]; then
    log "scontrol requeue exited with status $rc, but the job was requeued"
    rc=0
  fi
  (( rc == 0 )) || die 1 "scontrol requeue failed (status $rc); resubmit: the trainer resumes from the last checkpoint"
  log "requeued: this attempt is over"
  exit 0
}

# stop_before_training: before a job step starts. A stop request, or Slurm ending this job without a word to
# this shell (a preemption with GraceTime signals the job steps only: before the first one, or between two,
# none hears of it, and a step started later never does; or Slurm's own requeue), ends this attempt before
# the step: the run goes on (continue_run exits). The time limit sends this shell TERM: the trap decides.
stop_before_training() {
  local ending
  [[ -z $STOP_REQUESTED ]] || continue_run "stop requested before training started" 42
  ending=$(slurm_ending)
  if [[ $ending == preempted || $ending == requeued ]]; then
    continue_run "$ending before training started (Slurm's record of the job; its signal reaches job steps only, and none ran)" 42
  fi
}

# continue_after_limit WHY: the time limit ended the job before its stop completed, and Slurm does not
# requeue a TIMEOUT: submit this job's script again, to start once this job has ended, with its partition,
# account, QOS, time limit and excluded nodes. It resumes from the newest complete checkpoint and says what
# it redoes.
continue_after_limit() {
  local info key val id args=("--job-name=$SLURM_JOB_NAME" "--dependency=afterany:$SLURM_JOB_ID")
  local continues="$SLURM_JOB_ID.attempt-$ATTEMPT"
  info=$(job_record)
  for key in Partition:partition Account:account QOS:qos TimeLimit:time ExcNodeList:exclude; do
    val=$(job_field "$info" "${key%%:*}")
    [[ -z $val ]] || args+=("--${key#*:}=$val")
  done
  if id=$(
    # this job's own Slurm variables are no input of the new one's (SLURM_CONF names the cluster)
    while IFS= read -r key; do
      [[ $key == SLURM_CONF || $key == SBATCH_GEN_* ]] || unset "$key"
    done < <(compgen -e | grep -E '^(SLURM|SBATCH|SRUN|SALLOC)_' || true)
    # nor this allocation's thread count: the new job computes its own, unless it was given at submit time
    [[ -n ${OMP_GIVEN-} ]] || unset OMP_NUM_THREADS
    SBATCH_GEN_CONTINUES=$continues SBATCH_GEN_RUN_JOB=$RUN_JOB sbatch --parsable "${args[@]}" "$JOB_SCRIPT"
  ); then
    log "$1: the time limit ended this job (Slurm does not requeue a TIMEOUT): continuation job ${id%%;*} submitted, to start when this one has ended, from the newest complete checkpoint ($(step_name "$(newest_checkpoint)"))"
  else
    log "ERROR: $1: the time limit ended this job and no continuation job could be submitted: sbatch $JOB_SCRIPT to resume from the newest complete checkpoint"
  fi
}

# preflight_nodes: the preflight on every node of the allocation, its lines in this log; status 1 when it
# failed on a node, with those nodes in BAD_NODES (words) and those whose preflight.health_check failed in
# SICK_NODES. In the background and `wait`ed, so the traps run; a stop request ends it at once, and a stop
# (a preemption, a scancel: they kill the preflight step too) is no failed node: the run goes on (exits).
# Its settings (sbatch_gen/node_program.py): the script's PREFLIGHT_ARGS after those of the script's settings
# and main's state that every site has (TRAINER_MODULE or TRAINER_SCRIPT, TRAIN_CONFIG, DATA_PATH,
# PINNED_IFNAME, EXPECTED_GPUS, RUN_DIR, MASTER_ADDR:MASTER_PORT, ENV_PINNED when pin_env set it,
# STOP_PROTOCOL), then `--` and TORCHRUN_ARGS: the torchrun flags and the NUMA binding it checks are those the
# training step gets. Each node adds its rank and the node count. This shell writes the marker file: a node
# that does not see it has another filesystem at the run dir.
preflight_nodes() {
  local out err marker="$RUN_DIR/.sbatch-gen-shared.$SLURM_JOB_ID.$ATTEMPT"
  log "preflight on $SLURM_NNODES nodes (preflight.enabled)"
  local -a settings=(
    ${TRAINER_MODULE:+"module=$TRAINER_MODULE"} ${TRAINER_SCRIPT:+"script=$TRAINER_SCRIPT"} config="${TRAIN_CONFIG-}"
    data="$DATA_PATH" ifname="$PINNED_IFNAME" gpus="$EXPECTED_GPUS" gpus_key=slurm.gpus_per_node run_dir="$RUN_DIR"
    shared_marker="$marker" rdzv_host="$MASTER_ADDR" rdzv_port="$MASTER_PORT" ${ENV_PINNED:+"env_fingerprint=$ENV_PINNED"}
    stop_protocol="$STOP_PROTOCOL" "${PREFLIGHT_ARGS[@]}" -- "${TORCHRUN_ARGS[@]}"
  )
  export -f node_py preflight  # srun's bash gets them (the training step's too) from the environment
  : >"$marker"
  out=$(mktemp)
  err=$(mktemp)
  # shellcheck disable=SC2016  # $SLURM_NODEID and $SLURM_NNODES: expanded on each node, by its task's shell
  srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task="$CPUS_PER_TASK" ${CONTAINER_ARGS[@]+"${CONTAINER_ARGS[@]}"} \
    bash -c 'preflight node_id="$SLURM_NODEID" nnodes="$SLURM_NNODES" "$@"' preflight "${settings[@]}" >"$out" 2>"$err" &
  wait_step $! kill
  cat -- "$out" || true
  cat -- "$err" >&2 || true
  BAD_NODES=$(sed -n 's/^preflight FAILED on \([^:]*\):.*/\1/p' -- "$err" | sort -u | paste -sd ' ' - || true)
  SICK_NODES=$(sed -n 's/^preflight FAILED on \([^:]*\):.*(preflight\.health_check).*/\1/p' -- "$err" || true)
  rm -f -- "$marker" "$out" "$err"
  (( rc != 0 )) || return 0
  [[ -z $STOP_REQUESTED && -z $(slurm_ending) ]] || continue_run "stopped during the preflight" 42
  return 1
}

# leave_behind WHY: the preflight failed on BAD_NODES, the health check on SICK_NODES. Requeue without them
# (a running job's ExcNodeList cannot change: scontrol requeuehold, update, release) while at most
# MAX_EXCLUDED nodes are left behind and the partition keeps NNODES others. A failure on every node and not of
# the health check is the profile's or the environment's, not a node's: the job ends. Exits.
leave_behind() {
  local why=$1 failed=$BAD_NODES exc all count left
  if [[ -z $failed ]] || { [[ -z $SICK_NODES ]] && (( $(wc -w <<<"$failed") >= SLURM_NNODES )); }; then
    die 1 "preflight failed (see the preflight FAILED lines above); ${STEP_RC:+after the failed step, }not starting training and not requeueing"
  fi
  exc=$(job_field "$(job_record)" ExcNodeList)
  all=$({ if [[ -n $exc ]]; then scontrol show hostnames "$exc"; fi; tr ' ' '\n' <<<"$failed"; } | grep . | sort -u | paste -sd, -)
  count=$(tr ',' '\n' <<<"$all" | grep -c .)
  left=$(($(sinfo -h -N -p "$SLURM_JOB_PARTITION" -o %N | sort -u | grep -c .) - count))
  if (( count > MAX_EXCLUDED )); then
    die 1 "preflight failed on $failed: leaving it behind would exclude $count nodes ($all), more than preemption.max_excluded_nodes ($MAX_EXCLUDED); not requeueing"
  elif (( left < NNODES )); then
    die 1 "preflight failed on $failed: without $all partition $SLURM_JOB_PARTITION has $left nodes, the job needs $NNODES; not requeueing"
  elif ! within_budget; then
    die 1 "preflight failed on $failed; not requeueing: $NO_PROGRESS attempt(s) in a row saved no newer checkpoint, more than preemption.max_requeues_without_progress ($MAX_NO_PROGRESS)"
  fi
  log "leaving $failed behind ($why): the next attempt excludes $all (preemption.max_excluded_nodes $MAX_EXCLUDED)"
  REQUEUED=1
  trap '' TERM "$STOP_SIGNAL"
  scontrol requeuehold "$SLURM_JOB_ID" || die 1 "scontrol requeuehold failed; resubmit with --exclude=$all"
  scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$all" || log "WARNING: could not exclude $all from the next attempt"
  scontrol release "$SLURM_JOB_ID" || die 1 "scontrol release failed: the job is held; run: scontrol release $SLURM_JOB_ID"
  log "requeued without $all: this attempt is over"
  exit 0
}
