"""``moto_server`` whose conditional writes are atomic: ``python -m sbatch_gen.testing.moto_atomic ARGS``
takes moto_server's arguments. Torch-free.

moto (5.2) checks a PUT's ``If-None-Match: *`` (or ``If-Match``) and then stores the object, in one of the
threaded server's request threads, without a lock: two conditional creates of one key at the same instant
can both see no object and both succeed, which S3 never allows. It shows under load (a loaded machine widens
the window between the check and the put): the mailbox's create-if-absent race test saw two winners. Here
every conditional PUT holds one lock from its check to its store, so the server answers as S3 does; other
requests are untouched.
"""

from __future__ import annotations

import sys
import threading

from moto.s3.responses import S3Response
from moto.server import main

_CONDITIONAL = threading.Lock()
_put_object = S3Response.put_object


def _atomic_put_object(self):
    if self.headers.get("If-None-Match") or self.headers.get("If-Match"):
        with _CONDITIONAL:
            return _put_object(self)
    return _put_object(self)


S3Response.put_object = _atomic_put_object  # type: ignore[method-assign]

if __name__ == "__main__":
    main(sys.argv[1:])
