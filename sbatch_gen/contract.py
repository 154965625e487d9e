"""The contract between the rendered launch scripts and the trainer they start.

Torch-free: the CLI (renderer) and the trainer both import it, so the names below are defined once.
"""

# "Checkpointed, requeue me": after a complete stop checkpoint (a stop was requested by SIGUSR1/SIGTERM or
# the stop file, or the trainer stopped on its own), once the ack below is written. Under a launcher (a stop
# file is set) the trainer exits 0 instead: the ack is what the launcher reads, and a non-zero exit would
# make torchrun print a ChildFailedError traceback for a planned stop. A trainer that exits 42 after its
# ack still works (with that traceback). Without a stop file (run by hand), 42 is the only signal.
EXIT_REQUEUE = 42

# Path of the stop file. The batch shell traps the Slurm signal and creates this file instead of
# signalling torchrun (whose agent dies on SIGUSR1). Every rank polls it; all ranks agree on the stop
# step with a collective.
ENV_STOP_FILE = "SBATCH_GEN_STOP_FILE"

# The first rank of every node writes "<stop file>.ack" (JSON: step, checkpoint path, reason, time) once the
# stop checkpoint is complete on every rank, so every node's launcher shell sees it on its own filesystem.
# The batch shell waits for it before `scontrol requeue`; each node says in one line what it holds.
ACK_SUFFIX = ".ack"

# The first rank of every node writes "<stop file>.stopping" (one line) when the stop checkpoint starts:
# its step, the newest complete checkpoint and the steps redone if the save does not complete (the cluster
# may kill the job first). Without an ack next to it, the launcher says that line: what will be redone.
STOPPING_SUFFIX = ".stopping"

# A trainer that stops on an error no requeue can fix (a bad config or flag, the run dir leased by another
# live job) writes "<stop file>.fatal": one line, why. The batch shell then ends the job without a requeue
# and logs that line.
FATAL_SUFFIX = ".fatal"

# In a Slurm job step run-trainer writes (appends to) the stop file BEFORE it hands SIGTERM on to the workers.
# So under torchrun in a Slurm step a worker that gets SIGTERM and finds no stop file within this many seconds
# takes it for torchrun's agent tearing the workers down after another one failed (it gives them its own
# 30 s, whatever --shutdown-timeout says) and exits at once: a crash frees the node in seconds.
TERM_WITHOUT_STOP_S = 5.0

# A checkpoint is "<run dir>/<CHECKPOINTS_DIR>/step-<N>/" and complete once <CHECKPOINT_MARKER> is in it (the
# trainer writes it last, atomically). The batch shell reads the newest complete step to tell an attempt
# that made progress from one that did not (preemption.max_requeues_without_progress).
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_MARKER = "COMPLETE.json"

# The code a run runs (paths.pin_code): "<commit> <clean|dirty>" of paths.code_dir when the run was submitted,
# exported by the Slurm job to the trainer, which records it in summary.json as "code".
ENV_PINNED_CODE = "SBATCH_GEN_PINNED_CODE"
# The run a Slurm job belongs to: the job id of its submission, shared by its requeues and by the
# continuation jobs after a time limit (which start only once their predecessor has ended): the run-dir
# lease lets a job of the same run take over.
ENV_RUN_JOB = "SBATCH_GEN_RUN_JOB"
