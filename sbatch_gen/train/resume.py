"""The resume: which checkpoint (rank 0 picks, every rank gets the same answer), loading it into the
trainer, and falling back to an older one under ``--resume auto`` when one fails to load."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from .state import rng_key, set_rng_state, train_state

log = logging.getLogger("sbatch_gen.train")


class Fatal(Exception):
    """A clear, expected error (bad checkpoint choice, wrong model shape): exit 2 with one message."""


def choose_checkpoint(mode: str, run_dir: Path, skip: set[str]) -> Path | None:
    """The checkpoint ``--resume mode`` names: none, the newest complete one not in ``skip`` (auto), or
    the given directory, which must be a complete checkpoint."""
    from .checkpoint import check_complete, list_step_dirs

    if mode == "none":
        return None
    if mode == "auto":
        for _step, p in reversed(list_step_dirs(run_dir)):
            if str(p) in skip:
                continue
            why = check_complete(p)
            if why is None:
                return p
            log.warning("checkpoint %s ignored: %s", p, why)
        return None
    p = Path(mode)
    why = check_complete(p)
    if why is not None:
        raise Fatal(f"--resume {p}: not a complete checkpoint: {why}")
    return p


def agree_on_checkpoint(t, skip: set[str]) -> Path | None:
    """rank 0 picks; every rank gets the same answer (or the same error)."""
    chosen: str | None = None
    error: str | None = None
    if t.info.is_main:
        try:
            p = choose_checkpoint(t.spec.resume, t.run_dir, skip)
            chosen = str(p) if p is not None else None
        except Fatal as e:
            error = str(e)
    if t.info.is_distributed:
        import torch.distributed as dist

        box = [chosen, error]
        dist.broadcast_object_list(box, src=0)
        chosen, error = box
    if error is not None:
        raise Fatal(error)
    return Path(chosen) if chosen is not None else None


def resume(t) -> tuple[int | None, float | None]:
    """Load the chosen checkpoint into trainer ``t``. Returns (step resumed from or None, load seconds).

    With ``--resume auto`` a checkpoint that fails to load (DCP reports a failure on any rank to
    every rank) is skipped for the next older complete one; a different model shape is fatal."""
    skip: set[str] = set()
    first_error: str | None = None
    while True:
        path = agree_on_checkpoint(t, skip)
        if path is None and skip:
            # Complete checkpoints exist and none loads: starting fresh would train over them (and
            # prune them). Say so and stop; the operator decides (fix, move them, or --resume none).
            raise Fatal(
                f"--resume auto: none of the {len(skip)} complete checkpoint(s) in "
                f"{t.run_dir / 'checkpoints'} loads (newest: {first_error}); not starting "
                "fresh over them: fix or move them, or pass --resume none"
            )
        if path is None:
            log.info(
                "starting fresh (--resume %s, no loadable checkpoint in %s)",
                t.spec.resume,
                t.run_dir / "checkpoints",
            )
            return None, None
        try:
            return load(t, path)
        except Fatal:
            raise
        except Exception as e:  # noqa: BLE001 - reported, then the next older checkpoint
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if t.spec.resume != "auto":
                raise Fatal(f"checkpoint {path} failed to load: {why}") from e
            log.error("checkpoint %s failed to load (%s); trying an older one", path, why)
            first_error = first_error or f"{path.name}: {why}"
            skip.add(str(path))


def load(t, path: Path) -> tuple[int, float]:
    """Load checkpoint ``path`` into trainer ``t``: model, optimizer, step, sampler, RNG, outer state.
    Returns (the step it resumes from, load seconds)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from .checkpoint import CheckpointError, check_model_shapes

    t0 = time.perf_counter()
    try:
        check_model_shapes(path, t.model.state_dict(), t.cfg.model.model_dump())
    except CheckpointError as e:
        raise Fatal(str(e)) from None
    # Ask only for what the checkpoint has under rng and outer: a CPU process wrote no CUDA RNG state,
    # another world size other ranks' RNG, an older version fewer outer fields. Those keep their values.
    state = train_state(t)
    dropped = t.ckpt.load(path, state, optional=("rng", "outer"))
    has_outer = "outer" in state
    set_state_dict(t.model, t.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _load_position(t, path, state["train"])
    _restore_rng(t, path, state.get("rng", {}).get(rng_key(t.info), {}), dropped)
    if t.sync is not None and has_outer:
        t.sync.load_state_dict(state["outer"])
    load_s = time.perf_counter() - t0
    log.info("resumed from %s at step %d in %.2fs", path, t.step, load_s)
    return t.step, load_s


def _load_position(t, path: Path, tr: dict) -> None:
    """The loop's position from a checkpoint's ``train`` state: step, tokens, the sampler; a warning when
    the checkpoint was trained on other data."""
    t.step = int(tr["step"])
    t.tokens_seen = int(tr["tokens_seen"])
    try:
        t.batches.load_state_dict(tr["sampler"])
    except ValueError as e:
        raise Fatal(f"checkpoint {path}: {e}") from None
    if tr.get("data_sha256") != t.shard.sha256:
        log.warning(
            "checkpoint %s was trained on data with sha256 %s, this shard is %s",
            path,
            str(tr.get("data_sha256"))[:16],
            t.shard.sha256[:16],
        )


def _restore_rng(t, path: Path, rng: dict, dropped) -> None:
    """This rank's RNG streams from the checkpoint, or a warning saying which it could not restore."""
    key = rng_key(t.info)
    if "cpu" not in rng:
        log.warning("checkpoint %s has no RNG state for %s (world size changed?): RNG reseeded", path, key)
        return
    set_rng_state(rng, t.device)
    if not ("cuda" in rng and t.device.type == "cuda") and f"rng.{key}.cuda" in dropped:
        log.warning(
            "checkpoint %s has no CUDA RNG state for %s (written by a CPU process?): the "
            "CUDA RNG keeps this process's seed",
            path,
            key,
        )
