"""torchrun entry point for the DDP benchmark: the trainer, with one rank made a straggler.

    BENCH_STRAGGLER_RANK=1 BENCH_STRAGGLER_S=0.1 torchrun ... -m bench.straggler --config ...

The rank whose RANK equals BENCH_STRAGGLER_RANK sleeps BENCH_STRAGGLER_S at the end of every step (the
per-step sleep of :mod:`sbatch_gen.testing.faults`, installed from outside the trainer, as ``python -m
sbatch_gen.testing.faults`` installs it); every other rank runs the unmodified trainer. So the trainer
needs no benchmark-only code.
"""

import os

from sbatch_gen.testing import faults

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("BENCH_STRAGGLER_RANK"):
    faults.install_from_env({faults.ENV_STEP_SLEEP: os.environ.get("BENCH_STRAGGLER_S", "0")})

from sbatch_gen.train.__main__ import _entry  # noqa: E402

_entry()  # the trainer's own ending (flushed, no interpreter teardown), as `python -m sbatch_gen.train`
