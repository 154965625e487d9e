"""Regions as threads of one test process."""

from __future__ import annotations

import threading


def in_threads(fn, regions, join_s: float = 120):
    """Run fn(region) for every region concurrently; return {region: result}; re-raise the first error."""
    out, errs = {}, []

    def go(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=go, args=(r,)) for r in regions]
    for t in ts:
        t.start()
    for t in ts:
        t.join(join_s)
    if errs:
        raise errs[0]
    return out
