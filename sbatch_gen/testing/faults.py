"""Faults the tests and benchmarks inject into the cross-region sync, from outside its code: the trainer's
own modules carry no test hook. Torch-free to import (the sync is imported when a fault is installed).

- :func:`withholding`: a region publishes nothing in some rounds, as if its payload always arrived after
  the round closed; it trains on and applies the committed update like any late region. In a test:
  ``monkeypatch.setattr(Exchange, "upload", withholding(Exchange.upload, "us", {2}))``.
- :func:`starting_together`: regions start their first step together, whichever took longer to start up
  (a fresh run's first region publishes theta0 and trains on at once; under load its peer can still be
  importing torch while it passes the round a benchmark waits for).
- ``python -m sbatch_gen.testing.faults ARGS``: the trainer (``python -m sbatch_gen.train ARGS``) with the
  faults that :data:`ENV_WITHHOLD_ROUNDS` and :data:`ENV_START_TOGETHER` name installed first
  (``bench/elastic.py``'s regions run so: :func:`~sbatch_gen.testing.regions.launch_region`'s ``module``).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# "<region>:<round>,<round>,...": that region publishes nothing in those rounds (not an SBATCH_GEN_XR_*
# name: those are the trainer's options, which it refuses when it does not know them)
ENV_WITHHOLD_ROUNDS = "SBATCH_GEN_TEST_WITHHOLD_ROUNDS"
# "<directory>:<processes>": every process waits before its first step until that many have arrived there
ENV_START_TOGETHER = "SBATCH_GEN_TEST_START_TOGETHER"
START_TOGETHER_TIMEOUT_S = 300.0


def _round(tag: str) -> int | None:
    return int(tag[1:]) if tag[:1] == "r" and tag[1:].isdigit() else None


def withholding(upload: Callable[..., Any], region: str, rounds: Iterable[int]) -> Callable[..., Any]:
    """``Exchange.upload`` (``upload``), except that ``region``'s round payloads (kinds delta and grad) of
    ``rounds`` publish nothing: no object, no claim (:func:`~sbatch_gen.train.xr.rounds.run_round` then
    waits for the round without a manifest of its own, and finds itself late). Every rank of the region
    must run it, as every rank calls the upload."""
    withheld = frozenset(int(r) for r in rounds)

    def withheld_upload(self, tag, name, kind, *args, **kw):
        if kind in ("delta", "grad") and name == region and _round(tag) in withheld:
            return None, {}, 0
        return upload(self, tag, name, kind, *args, **kw)

    return withheld_upload


def parse_withheld(value: str) -> tuple[str, frozenset[int]]:
    """``"us:2,7"`` -> ``("us", {2, 7})``."""
    region, _, rounds = value.partition(":")
    if not region or not rounds:
        raise ValueError(f"{ENV_WITHHOLD_ROUNDS}: {value!r} is not <region>:<round>,<round>,...")
    return region.strip(), frozenset(int(r) for r in rounds.split(",") if r.strip())


def starting_together(begin: Callable[..., Any], directory: str, processes: int) -> Callable[..., Any]:
    """``begin`` (the trainer's begin_loop, called once after the resume and the join), except that it first
    marks this process arrived in ``directory`` and waits until ``processes`` have."""

    def begin_together(*args, **kw):
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / str(os.getpid())).touch()
        deadline = time.monotonic() + START_TOGETHER_TIMEOUT_S
        while len(list(d.iterdir())) < processes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{ENV_START_TOGETHER}: {processes} processes never arrived in {d}")
            time.sleep(0.02)
        return begin(*args, **kw)

    return begin_together


def install_from_env(environ: dict[str, str] | None = None) -> None:
    """Install the faults the environment names (:data:`ENV_WITHHOLD_ROUNDS`, :data:`ENV_START_TOGETHER`)
    in this process."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_WITHHOLD_ROUNDS, "")
    if value:
        from sbatch_gen.train.xr.exchange import Exchange

        region, rounds = parse_withheld(value)
        Exchange.upload = withholding(Exchange.upload, region, rounds)  # type: ignore[method-assign]
    value = env.get(ENV_START_TOGETHER, "")
    if value:
        from sbatch_gen.train import trainer

        directory, _, n = value.rpartition(":")
        trainer.begin_loop = starting_together(trainer.begin_loop, directory, int(n))


def main() -> None:
    """The trainer, with the environment's faults installed: ``python -m sbatch_gen.testing.faults ARGS``."""
    install_from_env()
    sys.argv[0] = "sbatch_gen.train"
    runpy.run_module("sbatch_gen.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
