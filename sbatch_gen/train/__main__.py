"""``python -m sbatch_gen.train``: the stop-file fast exit runs before torch is imported."""

import time

_PROCESS_START = time.time()


def _main() -> int:
    from .cli import parse_args
    from .signals import StopRequest, fast_exit_if_acked, resolve_stop_file

    args = parse_args()
    stop_file = resolve_stop_file(args.stop_file)
    fast_exit_if_acked(stop_file)
    # Handlers before the slow imports: a SIGUSR1/SIGTERM during start-up is a stop request, not a death.
    stop = StopRequest(stop_file)
    stop.install()
    from .trainer import run  # imports torch

    return run(args, process_start=_PROCESS_START, stop=stop)


if __name__ == "__main__":
    raise SystemExit(_main())
