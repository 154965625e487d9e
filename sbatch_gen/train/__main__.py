"""``python -m sbatch_gen.train``: the stop-file fast exit runs before torch is imported.

The process ends through :func:`_exit`: what a normal interpreter exit does while Python is still whole
(non-daemon threads joined, atexit handlers, stdio flushed), then ``os._exit``. The teardown that would
follow (modules and objects freed, C++ static destructors) is skipped: gloo process groups that objects of
the run still hold keep worker threads that may drop the last reference to a finished collective there;
that needs the GIL, which a finalizing interpreter no longer hands out, and the thread then aborts the
process ("terminate called without an active exception"), turning a finished run's exit code into SIGABRT.
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


def _exit(code: int) -> None:
    """End the process with ``code`` without the interpreter's teardown (see the module docstring)."""
    import atexit
    import os
    import sys
    import threading

    try:
        shutdown_threads = getattr(threading, "_shutdown", None)  # what Py_Finalize runs first
        if shutdown_threads is not None:
            shutdown_threads()
        atexit._run_exitfuncs()  # logging.shutdown (flushes the log handlers), the heartbeat's stop, ...
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or gone: nothing left to flush
                pass
        os._exit(code)


def _entry() -> None:
    import sys

    try:
        code = _main()
    except Exception:  # noqa: BLE001 - reported as the interpreter would, then the same exit
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


if __name__ == "__main__":
    _entry()
