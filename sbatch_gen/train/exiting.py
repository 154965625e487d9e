"""How a training process ends: :func:`exit_process`. Torch-free.

A normal interpreter exit tears everything down after the atexit handlers: modules and objects are freed
and C++ static destructors run. A gloo process group that an object of the run still holds (DDP's reducer,
an async checkpoint's group, the cross-region sync's groups) keeps worker threads that may drop the last
reference to a finished collective during that teardown. That needs the GIL, which a finalizing interpreter
no longer hands out, and the thread aborts the process ("terminate called without an active exception"):
a finished run, or a stop that wrote its checkpoint and ``.ack``, then ends in SIGABRT, and torchrun reports
a failure with a traceback. :func:`exit_process` does what a normal exit does while Python is still whole,
then ends the process without the teardown.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``: join the non-daemon threads, run the atexit handlers (logging's
    flush among them), flush stdout and stderr, then ``os._exit(code)``, skipping the interpreter's
    teardown (see the module docstring). Call it last, in place of ``sys.exit(code)``, after
    ``destroy_process_group()``."""
    try:
        shutdown_threads = getattr(threading, "_shutdown", None)  # what Py_Finalize runs first
        if shutdown_threads is not None:
            shutdown_threads()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or gone: nothing left to flush
                pass
        os._exit(code)
