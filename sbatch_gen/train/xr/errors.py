"""Errors of the cross-region mailbox. Torch-free.

Every message names what a person needs to act on: the round tag, the region and the mailbox location.
"""

from __future__ import annotations


class XRError(RuntimeError):
    """Base class: cross-region synchronisation failed (nothing was committed)."""


class XRTimeout(XRError):
    """A peer region did not publish its part of a round in time."""


class XRChecksumError(XRError):
    """A shard object does not match the checksum or size its manifest promises."""


class XRLayoutError(XRError):
    """A peer published a payload with a different layout, dtype, run id or shard plan."""


class XRMissingRound(XRError):
    """A round needed to catch up (after a resume) was already deleted from the mailbox."""


class StoreError(XRError):
    """The object store failed (after its retries)."""


class XRNoQuorum(XRTimeout):
    """A round found fewer than ``min_regions`` regions within ``timeout_s``: checkpoint and requeue."""

    def __init__(self, message: str, missing: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])


class XRBehind(XRError):
    """The run committed rounds past this region's and the ones it needs are gone: fast-forward."""

    def __init__(self, message: str, latest: int | None = None) -> None:
        super().__init__(message)
        self.latest = latest


class XRCancelled(XRError):
    """A round running in the background was called off (the region is stopping or closing)."""


class XRSettingsError(XRLayoutError):
    """Two regions of a run disagree on a setting their rounds must share (H, the outer step, the wire, ...)."""
