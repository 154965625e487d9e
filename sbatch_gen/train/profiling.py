"""``train.profile``: a torch profiler trace of a few steps, one Chrome trace per rank under
``<run-dir>/profile/``. Off by default; nothing of it runs in the steps outside the window."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("sbatch_gen.train")


class StepProfiler:
    """Records steps ``first..last`` (the part of them this process trains) with ``torch.profiler``: started
    before the first, stopped after the last (or at :meth:`close`, when the loop ends inside the window),
    then the trace written as ``<run-dir>/profile/rank<R>.steps-<a>-<b>.json`` (a temp file, then a rename).
    Each profiled step is one ``step N`` range, its parts ``forward_backward`` and ``optimizer`` in it."""

    def __init__(self, first: int, last: int, run_dir: Path, rank: int, device) -> None:
        self.first, self.last = first, last
        self.dir = Path(run_dir) / "profile"
        self.rank, self.cuda = rank, getattr(device, "type", "cpu") == "cuda"
        self._prof: Any = None
        self._step: Any = None
        self._began: int | None = None
        self._ended: int | None = None

    @classmethod
    def create(cls, opts, run_dir: Path, rank: int, device, first_step: int) -> StepProfiler | None:
        """None when ``train.profile`` is off, or its steps are all behind this process (a resume)."""
        if opts is None:
            return None
        last = opts.start_step + opts.steps - 1
        if last < first_step:
            return None
        return cls(max(opts.start_step, first_step), last, run_dir, rank, device)

    def before_step(self, step: int) -> None:
        if self._prof is None and self._began is None and self.first <= step <= self.last:
            import torch.profiler as tp

            acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = tp.profile(activities=acts)
            self._prof.start()
            self._began = step
            log.info("profiler: recording steps %d..%d", step, self.last)
        if self._prof is not None:
            self._step = self.label(f"step {step}")
            self._step.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._end_range()
        self._ended = step
        if step >= self.last:
            self.close()

    def label(self, name: str) -> contextlib.AbstractContextManager:
        """A named range in the trace while recording, else a null context."""
        if self._prof is None:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(name)

    def _end_range(self) -> None:
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None

    def close(self) -> Path | None:
        """Stop recording (if it is) and write the trace; returns its path."""
        if self._prof is None:
            return None
        self._end_range()
        prof, self._prof = self._prof, None
        prof.stop()
        last = self._ended if self._ended is not None else self._began
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.steps-{self._began}-{last}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
        log.info("profiler: wrote %s (steps %d..%d)", path, self._began, last)
        return path
