"""The trainer's log format, one line per message on stderr, for the trainer and the processes it starts
(:mod:`.sinkproc`): their lines read as one log."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    world = os.environ.get("WORLD_SIZE", "1")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}/{world}] %(message)s",
        stream=sys.stderr,
        force=True,
    )
