"""torchrun entry point for the DDP benchmark: the trainer, with one rank made a straggler.

    BENCH_STRAGGLER_RANK=1 BENCH_STRAGGLER_S=0.1 torchrun ... -m bench.straggler --config ...

The rank whose RANK equals BENCH_STRAGGLER_RANK gets the trainer's own per-step sleep hook
(``SBATCH_GEN_STEP_SLEEP_S``, applied at the end of every step) set in its environment only; every
other rank runs the unmodified trainer. So the trainer needs no benchmark-only code.
"""

import os

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("BENCH_STRAGGLER_RANK"):
    os.environ["SBATCH_GEN_STEP_SLEEP_S"] = os.environ.get("BENCH_STRAGGLER_S", "0")
else:
    os.environ.pop("SBATCH_GEN_STEP_SLEEP_S", None)

from sbatch_gen.train.__main__ import _entry  # noqa: E402

_entry()  # the trainer's own ending (flushed, no interpreter teardown), as `python -m sbatch_gen.train`
