"""``python -m sbatch_gen.train``: the stop-file fast exit runs before torch is imported."""

import time

_PROCESS_START = time.time()


def _main() -> int:
    from .cli import parse_args
    from .signals import fast_exit_if_acked, resolve_stop_file

    args = parse_args()
    fast_exit_if_acked(resolve_stop_file(args.stop_file))
    from .trainer import run  # imports torch

    return run(args, process_start=_PROCESS_START)


if __name__ == "__main__":
    raise SystemExit(_main())
