"""``python -m sbatch_gen.train``: the stop-file fast exit runs before torch is imported.

The process ends through :func:`~sbatch_gen.train.exiting.exit_process`, without the interpreter's teardown,
which can abort a finished run holding gloo process groups (SIGABRT; that module says why).
"""

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
        stop.fatal(str(e))  # no requeue: the next attempt would read the same flags and config
        return EXIT_CONFIG
    from .trainer import run  # torch is imported from here on

    return run(spec, process_start=_PROCESS_START, stop=stop)


def _entry() -> None:
    import sys

    from .exiting import exit_process

    try:
        code = _main()
    except Exception:  # noqa: BLE001 - reported as the interpreter would, then the same exit
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_process(code)


if __name__ == "__main__":
    _entry()
