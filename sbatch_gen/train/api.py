"""The public library for your own trainer: the stop request and the cross-region DiLoCo wrapper.

The whole surface is this module; the companion trainer (``python -m sbatch_gen.train``) uses exactly it.
Importing it pulls in neither the renderer (jinja2, the site profiles) nor torch: :class:`StopRequest` and
the option parsing are torch-free, :class:`DiLoCo` imports torch when it is built. A training script::

    from sbatch_gen.train.api import DiLoCo, StopRequest, XRTimeout, cross_region_from_args, exit_process

    stop = StopRequest.from_env()          # $SBATCH_GEN_STOP_FILE, set by the rendered job
    stop.exit_if_acked()                   # this attempt already checkpointed: exit 0 before any work
    stop.install()                         # SIGUSR1/SIGTERM become a stop request, never a crash
    xr, argv = cross_region_from_args()    # the --xr-* flags (else SBATCH_GEN_XR_*); argv: your own flags
    ... init_process_group, model, DDP, optimizer, load your checkpoint ...
    diloco = DiLoCo(model, xr, run_dir=run_dir) if xr.enabled else None   # collective
    if diloco and checkpoint: diloco.load_state_dict(checkpoint["diloco"])
    step = diloco.start(step) if diloco else step   # theta0 alignment; a region that was away catches up
    code = 0
    while step < total:
        step += 1
        ... forward, backward, optimizer.step() ...
        rec = diloco.after_step(step, tokens) if diloco else None   # an outer round every inner_steps steps
        if rec and "xr_adopted_step" in rec: step = rec["xr_adopted_step"]   # was behind: fast-forwarded
        if stop.agree():                   # one collective: every rank stops after the same step
            log.info(stop.saving(step, last_saved_step))   # what is redone if the save does not complete
            ... save a checkpoint holding diloco.state_dict() ...
            diloco.leave(step, stop.reason())
            stop.acknowledge(step, path)   # collective: each node's first rank writes <stop file>.ack
            code = stop.exit_code()        # 0 under a launcher (it reads the ack), else EXIT_REQUEUE
            break
    ... destroy_process_group() ...
    exit_process(code)                     # sys.exit without the teardown that can abort gloo (SIGABRT)

``step`` is the 1-based number of the optimizer step just taken, the same on every rank; ``tokens`` is the
number of tokens the whole REGION consumed in that step (all its ranks together), the same on every rank.
A region's share of a round is weighted by its tokens. docs/own-trainer.md has the whole contract.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import xr_options
from ..contract import ENV_STOP_FILE, EXIT_REQUEUE
from ..xr_options import CrossRegion
from .exiting import exit_process
from .signals import StopRequest
from .xr.errors import XRError, XRNoQuorum, XRTimeout

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .xr.sync import OuterSync

__all__ = [
    "DiLoCo",
    "CrossRegion",
    "CrossRegionError",
    "ENV_STOP_FILE",
    "EXIT_REQUEUE",
    "StopRequest",
    "XRError",
    "XRNoQuorum",
    "XRTimeout",
    "add_cross_region_arguments",
    "cross_region_from_args",
    "cross_region_from_env",
    "exit_process",
]


class CrossRegionError(ValueError):
    """The ``--xr-*`` flags or ``SBATCH_GEN_XR_*`` variables are invalid; the message has one line per
    problem, naming the flag or variable."""


def _problems(e: Exception, env: bool) -> str:
    """One line per problem, naming the flag (or variable) the user set; a check between several of them
    names them all by their prefix."""
    from pydantic import ValidationError

    if not isinstance(e, ValidationError):
        return str(e)
    lines = []
    for err in e.errors(include_url=False):
        flag = xr_options.flag_of(err["loc"])
        if flag is None:
            where = "SBATCH_GEN_XR_* variables" if env else "--xr-* flags"
        else:
            where = xr_options.env_name(flag) if env else flag
        lines.append(f"{where}: {err['msg']}")
    return "\n".join(lines)


def add_cross_region_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``--xr-*`` flags on your own parser; read them back with
    ``cross_region_from_args(namespace=args)``."""
    xr_options.add_arguments(parser)


def cross_region_from_env(environ: Mapping[str, str] | None = None) -> CrossRegion:
    """The cross-region options from ``SBATCH_GEN_XR_*`` variables (``--xr-foo-bar`` is
    ``SBATCH_GEN_XR_FOO_BAR``; what a render exports when ``trainer.args`` has no ``{xr_args}``). Disabled
    when none is set. Raises :class:`CrossRegionError`."""
    from pydantic import ValidationError

    try:
        return xr_options.from_env(os.environ if environ is None else environ)
    except (ValidationError, ValueError) as e:
        raise CrossRegionError(_problems(e, env=True)) from None


def xr_flags_given(namespace: argparse.Namespace) -> bool:
    """Whether any ``--xr-*`` flag was given (then the environment is not read)."""
    return any(v not in (None, False) for k, v in vars(namespace).items() if k.startswith("xr_"))


def cross_region_from_args(
    argv: Sequence[str] | None = None,
    *,
    namespace: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[CrossRegion, list[str]]:
    """The cross-region options and the arguments that are not ``--xr-*`` flags (in order).

    ``argv`` defaults to ``sys.argv[1:]``; pass ``namespace=`` instead when your parser registered the flags
    (:func:`add_cross_region_arguments`). Without any ``--xr-*`` flag the environment is read
    (:func:`cross_region_from_env`); with neither, the result is disabled (``xr.enabled`` is False).
    Raises :class:`CrossRegionError` naming each bad flag."""
    from pydantic import ValidationError

    rest: list[str] = []
    if namespace is None:
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        xr_options.add_arguments(parser)
        namespace, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        typos = [a.split("=", 1)[0] for a in rest if a.startswith("--xr-")]
        if typos:  # a misspelt --xr-* flag must not pass for one of the trainer's own
            known = xr_options.flag_names()
            raise CrossRegionError(
                "\n".join(
                    f"{t}: unknown cross-region flag"
                    + "".join(f"; did you mean {c}?" for c in difflib.get_close_matches(t, known, n=1))
                    for t in typos
                )
            )
    if not xr_flags_given(namespace):
        return cross_region_from_env(environ), rest
    try:
        return xr_options.from_namespace(namespace), rest
    except ValidationError as e:
        raise CrossRegionError(_problems(e, env=False)) from None


class DiLoCo:
    """Cross-region sync around any ``nn.Module`` (plain or wrapped in DDP), on plain ``torch.distributed``:
    DiLoCo (``xr.sync: diloco``, an outer Nesterov round every ``inner_steps`` steps, elastic) or per-step
    gradient averaging (``xr.sync: grad``; then call :meth:`before_optimizer_step`).

    Collective: every rank of the region builds it, after ``init_process_group`` (or in a single process)
    and after the model is on its device. The inner optimizer is yours and stays untouched: DiLoCo only
    rewrites the parameters (in place) after a round. Errors are :class:`XRError` subclasses, raised on
    every rank of the region alike, with nothing changed: :class:`XRTimeout` from :meth:`start` or
    :class:`XRNoQuorum` from :meth:`after_step` mean "not enough regions now": checkpoint and exit
    :data:`EXIT_REQUEUE`."""

    def __init__(
        self,
        model: nn.Module,
        xr: CrossRegion,
        *,
        run_dir: str | Path | None = None,
        log: Callable[[dict], None] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if not xr.enabled:
            raise CrossRegionError("cross-region sync is disabled (no --xr-enabled): nothing to build")
        import torch

        from .dist import dist_info_from_process_group
        from .xr.modes import create

        if device is None:
            device = next(iter(model.parameters())).device
        self.xr = xr
        self._model = model
        self._sync: OuterSync = create(
            xr,
            model,
            torch.device(device),
            dist_info_from_process_group(),
            Path(run_dir) if run_dir is not None else None,
            log,
        )

    @property
    def mode(self) -> str:
        """``diloco`` or ``grad``."""
        return self.xr.sync

    @property
    def round(self) -> int:
        """The last outer round this region applied."""
        return int(self._sync.round)

    def start(self, step: int = 0) -> int:
        """Before the first step, after loading your checkpoint (and :meth:`load_state_dict`): a fresh run
        takes theta0 from the first region, a region that was away fast-forwards to the run. Returns the step
        to continue from (``step``, or later when the region caught up: the model then holds the run's
        parameters for that step). Raises :class:`XRTimeout` when the run has no quorum now."""
        self._sync.align(step)
        adopted = self._sync.catch_up(step)
        return step if adopted is None else int(adopted)

    def before_optimizer_step(self, step: int, tokens: int) -> None:
        """``sync: grad`` only (a no-op for DiLoCo): replace ``.grad`` with the token-weighted average over
        regions. Call it after backward (and DDP's all-reduce), before clipping and ``optimizer.step()``."""
        self._sync.before_optimizer_step(step, tokens)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the model's gradients to a global L2 norm of ``max_norm`` and return the norm before
        clipping, like ``torch.nn.utils.clip_grad_norm_``, but summed in one fixed order
        (:mod:`.gradnorm`): the same bits in every region whatever its sharding (FSDP2 over any number of
        ranks, or DDP). With ``sync: grad`` clip with this, after :meth:`before_optimizer_step`: torch's
        norm differs in the last bits between regions sharded differently, and their models drift apart.
        Collective in a sharded region."""
        from .gradnorm import clip_grads

        return clip_grads(list(self._model.parameters()), max_norm, self._sync.device, canonical=True)

    def after_step(self, step: int, tokens: int) -> dict | None:
        """After ``optimizer.step()``: count the step's tokens; every ``inner_steps`` steps run the outer
        round and return its record (timings, members, bytes; for your metrics). A record with
        ``xr_adopted_step`` means this region was behind and fast-forwarded: continue from that step.
        Raises :class:`XRNoQuorum` when the round found too few regions (the model keeps its local step)."""
        return self._sync.after_optimizer_step(step, tokens)

    def finish(self, step: int) -> dict | None:
        """After the last ``after_step``, before the final checkpoint: with ``overlap: eager`` or
        ``streaming`` wait for the round still in flight (streaming: merge it) and give the model the run's
        shared parameters, so every region ends on the same bits; returns that round's record (None without a round in flight). In every mode it marks the
        run as finished: :meth:`close` then waits (up to ``timeout_s``) for an outer snapshot still
        uploading, which it calls off otherwise. Raises :class:`XRNoQuorum` like :meth:`after_step`
        (checkpoint and requeue: the round runs again after :meth:`start`)."""
        return self._sync.finish(step)

    def leave(self, step: int, reason: str = "stopped") -> None:
        """A planned stop or the end: the other regions stop waiting for this one (best effort)."""
        self._sync.leave(step, reason)

    def state_dict(self) -> dict:
        """The outer state for your checkpoint: counters, and on the ranks that hold it (rank 0 always)
        ``theta_outer`` and the momentum. Save rank 0's (or use torch.distributed.checkpoint)."""
        return self._sync.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Collective, before :meth:`start`: every rank loads the saved dict (rank 0's is enough)."""
        self._sync.load_state_dict(state)

    def outer_bytes(self) -> int:
        """Bytes of outer state this rank holds (0 on ranks that hold none)."""
        return self._sync.outer_bytes()

    def close(self) -> None:
        """Stop the heartbeat and close the mailbox (after :meth:`finish`: once the last snapshot is up)."""
        self._sync.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
