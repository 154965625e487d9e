"""``python -m sbatch_gen.train``: the stop-file fast exit runs before torch is imported."""

import time

_PROCESS_START = time.time()


def _main() -> int:
    import sys

    from .api import StopRequest
    from .cli import parse_args
    from .spec import EXIT_CONFIG, RunSpec, SpecError

    args = parse_args()
    stop = StopRequest.from_env(args.stop_file)
    stop.exit_if_acked()
    # Handlers before the slow imports: a SIGUSR1/SIGTERM during start-up is a stop request, not a death.
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
