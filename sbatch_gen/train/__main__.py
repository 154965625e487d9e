"""``python -m sbatch_gen.train``: the stop-file fast exit runs before torch is imported."""

import time

_PROCESS_START = time.time()


def _main() -> int:
    import sys

    from .cli import parse_args
    from .signals import StopRequest, fast_exit_if_acked, resolve_stop_file
    from .spec import EXIT_CONFIG, RunSpec, SpecError

    args = parse_args()
    stop_file = resolve_stop_file(args.stop_file)
    fast_exit_if_acked(stop_file)
    # Handlers before the slow imports: a SIGUSR1/SIGTERM during start-up is a stop request, not a death.
    stop = StopRequest(stop_file)
    stop.install()
    try:
        spec = RunSpec.from_args(args)  # the only place the flags are read
    except SpecError as e:
        print(e, file=sys.stderr)
        return EXIT_CONFIG
    from .trainer import run  # torch is imported from here on

    return run(spec, process_start=_PROCESS_START, stop=stop)


if __name__ == "__main__":
    raise SystemExit(_main())
