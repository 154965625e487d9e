"""The contract between the rendered launch scripts and the trainer they start.

Torch-free: the CLI (renderer) and the trainer both import it, so the names below are defined once.
"""

# The trainer exits with this code after it has written a complete checkpoint because a stop was
# requested (SIGUSR1/SIGTERM or the stop file): "checkpointed, requeue me".
EXIT_REQUEUE = 42

# Path of the stop file. The batch shell traps the Slurm signal and creates this file instead of
# signalling torchrun (whose agent dies on SIGUSR1). Every rank polls it; all ranks agree on the stop
# step with a collective.
ENV_STOP_FILE = "SBATCH_GEN_STOP_FILE"

# Rank 0 writes "<stop file>.ack" (JSON: step, checkpoint path) once the stop checkpoint is complete.
# The batch shell waits for it before `scontrol requeue`.
ACK_SUFFIX = ".ack"

# A trainer that stops on an error no requeue can fix (a bad config or flag, the run dir leased by another
# live job) writes "<stop file>.fatal": one line, why. The batch shell then ends the job without a requeue
# and logs that line.
FATAL_SUFFIX = ".fatal"
