"""Checkpoints: torch.distributed.checkpoint (DCP) directories, all or nothing.

Layout: ``<run-dir>/checkpoints/step-<N>/`` holds DCP's shard files and ``.metadata``; rank 0 writes
``COMPLETE.json`` last (atomically, with every file's size). A directory without a valid marker, or
whose files no longer match the sizes the marker lists (truncated, deleted), is never loaded.
Rank 0 keeps the newest ``keep_last`` complete checkpoints.

The selection helpers at the top are plain filesystem code; torch is imported where it is needed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
import warnings
import zlib
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..contract import CHECKPOINT_MARKER, CHECKPOINTS_DIR
from ..fsutil import write_atomic

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager

log = logging.getLogger("sbatch_gen.train")

MARKER = CHECKPOINT_MARKER
FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    pass


@contextmanager
def _single_process(single: bool):
    """Around a DCP save or load of a single-process run (no_dist): without torch's UserWarning that it
    assumes one process, which it prints on every save and load however no_dist was chosen."""
    if not single:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{step}"


def list_step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory, oldest first (complete or not)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    out.sort()
    return out


def read_marker(path: str | Path) -> dict | None:
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def check_complete(path: str | Path, verify_crc: bool = True) -> str | None:
    """None when ``path`` is a complete checkpoint, else why it is not. Checks every file's size, and
    its CRC32 when the marker has one (``checkpoint.verify: crc32``) and ``verify_crc``."""
    p = Path(path)
    if not (p / MARKER).is_file():
        return f"no {MARKER} (incomplete: the save did not finish)"
    m = read_marker(p)
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
        return f"{MARKER} is unreadable or of an unknown format"
    if not m["files"]:
        return f"{MARKER} lists no files"
    for name, size in m["files"].items():
        f = p / name
        try:
            actual = f.stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the marker says {size} (truncated or overwritten)"
    crcs = m.get("crc32") or {}
    if verify_crc:
        for name, crc in crcs.items():
            if file_crc32(p / name) != crc:
                return f"{name} fails its CRC32 check (corrupted)"
    return None


def newest_complete(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that passes :func:`check_complete`; logs each one it skips."""
    for _step, p in reversed(list_step_dirs(run_dir)):
        why = check_complete(p)
        if why is None:
            return p
        log.warning("checkpoint %s ignored: %s", p, why)
    return None


def marker_step(path: str | Path) -> int:
    m = read_marker(path)
    if m is None:
        raise CheckpointError(f"{path}: no readable {MARKER}")
    return int(m["step"])


def write_marker(path: str | Path, step: int, extra: dict[str, Any] | None = None, crc: bool = False) -> dict:
    """Write the completion marker (atomically, last). Lists every file's size (and CRC32)."""
    p = Path(path)
    files = {}
    for f in sorted(p.iterdir()):
        if f.is_file() and f.name != MARKER and not f.name.startswith(f".{MARKER}"):
            files[f.name] = f.stat().st_size
    marker = {"format": FORMAT, "step": step, "time": time.time(), "files": files, **(extra or {})}
    if crc:
        marker["crc32"] = {name: file_crc32(p / name) for name in files}
    # fsync_dir: the marker's name is what makes the checkpoint complete; it must survive a crash too
    write_atomic(p / MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n", fsync_dir=True)
    return marker


def prune(run_dir: str | Path, keep_last: int, protect: set[Path] | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and incomplete directories older
    than the newest complete one (leftovers of crashed saves). Newer incomplete ones are left alone:
    a save may be in flight there. Returns what was deleted."""
    dirs = list_step_dirs(run_dir)
    complete = [(s, p) for s, p in dirs if check_complete(p, verify_crc=False) is None]
    if not complete:
        return []
    newest = complete[-1][0]
    keep = {p for _, p in complete[-keep_last:]} | (protect or set())
    removed = []
    for s, p in dirs:
        if p in keep:
            continue
        is_complete = any(p == q for _, q in complete)
        if is_complete or s < newest:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def find_enospc(e: BaseException | None) -> OSError | None:
    """The ENOSPC OSError behind ``e``: itself, a cause or context, or one rank's failure inside DCP's
    CheckpointException; None if there is none."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return x
        failures = getattr(x, "failures", None)  # DCP's CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
        todo += [x.__cause__, x.__context__]
    return None


def disk_full_error(path: Path, e: BaseException, need: int = 0) -> OSError | None:
    """An ENOSPC OSError for a save into ``path`` that failed with ``e``, when the disk is full, else None.

    DCP does not always pass ENOSPC on: torch.save's zip writer reports a short write as a RuntimeError
    ("unexpected pos"), wrapped in a CheckpointException. So a failed save on a filesystem with less free
    space than the last checkpoint needed (``need`` bytes; at least 1 MiB) counts as disk full too."""
    try:
        st = os.statvfs(path if path.exists() else path.parent)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if find_enospc(e) is None and (free is None or free >= max(need, 1 << 20)):
        return None
    left = f"{free} bytes free" if free is not None else "free space unknown"
    return OSError(errno.ENOSPC, f"No space left on device ({left})", str(path))


def checkpoint_bytes(path: Path) -> int:
    m = read_marker(path) or {}
    files = m.get("files") if isinstance(m, dict) else None
    return sum(int(v) for v in files.values()) if isinstance(files, dict) else 0


# ---------------------------------------------------------------------------------------------------
# DCP save / load


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    return {
        k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
    }


def checkpoint_keys(path: str | Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def drop_unsaved(state: dict, keys: set[str], subtrees: tuple[str, ...]) -> list[str]:
    """Remove from ``state[name]`` (for each name in ``subtrees``) every leaf whose DCP key (the dotted
    path, e.g. ``rng.rank0.cuda``) is not in the checkpoint's ``keys``; a dict left empty goes too.
    Returns the dropped keys. The rest of ``state`` is untouched: a missing model or optimizer tensor
    stays an error at load time.

    A state dict may ask for more than an older or other process saved: a GPU process asks for its
    CUDA RNG state, which a CPU process never wrote; a cross-region run asks for outer fields added
    since. DCP raises on any requested key the checkpoint lacks, so those are dropped and keep the
    values they have."""
    dropped: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for k in list(node):
            key = f"{prefix}.{k}"
            v = node[k]
            if isinstance(v, dict):
                walk(v, key)
                if not v:
                    del node[k]
            elif key not in keys:
                dropped.append(key)
                del node[k]

    for name in subtrees:
        if isinstance(state.get(name), dict):
            walk(state[name], name)
            if not state[name]:
                del state[name]
    return dropped


def check_model_shapes(path: Path, model_state: dict[str, Any], model_cfg: dict | None = None) -> None:
    """Raise CheckpointError naming the first tensor whose shape differs (or is missing)."""
    shapes = _tensor_shapes(path)
    saved_cfg = (read_marker(path) or {}).get("model")
    problems = []
    for name, t in model_state.items():
        key = f"model.{name}"
        if key not in shapes:
            problems.append(f"{name} is not in the checkpoint")
        elif tuple(shapes[key]) != tuple(t.shape):
            problems.append(
                f"{name} has shape {list(shapes[key])} in the checkpoint, {list(t.shape)} in this model"
            )
    extra = sorted(
        k[len("model.") :] for k in shapes if k.startswith("model.") and k[len("model.") :] not in model_state
    )
    problems += [f"{k} is in the checkpoint but not in this model" for k in extra]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        cfgs = ""
        if saved_cfg is not None and model_cfg is not None and saved_cfg != model_cfg:
            diff = {
                k: (saved_cfg.get(k), model_cfg.get(k))
                for k in model_cfg
                if saved_cfg.get(k) != model_cfg.get(k)
            }
            cfgs = "; model config differs (checkpoint, now): " + ", ".join(
                f"{k}={a}->{b}" for k, (a, b) in diff.items()
            )
        raise CheckpointError(
            f"checkpoint {path} was saved for a different model: " + "; ".join(problems[:3]) + more + cfgs
        )


@dataclass
class SaveResult:
    step: int
    path: Path
    seconds: float
    blocking_seconds: float


class Checkpointer:
    """Saves and loads DCP checkpoints for one run; every rank calls every method (collectives).

    With ``async_save`` the tensors are staged to CPU and written in a background thread over a
    dedicated gloo group; rank 0 writes the marker once the save's future reports success (which
    implies every rank's files and the metadata are written). One stager (DCP's ``DefaultStager``)
    serves every async save of the run: it keeps its CPU copy of each tensor between saves (host memory
    the size of the model and optimizer state, held for the run) and refills it, pinned and with
    non-blocking copies on CUDA, instead of allocating pageable memory on every save. :meth:`close`
    releases it.
    """

    def __init__(
        self,
        run_dir: Path,
        dist_info,
        device,
        keep_last: int,
        async_save: bool,
        marker_extra: dict,
        crc: bool = False,
    ):
        import torch.distributed as dist

        self.run_dir = Path(run_dir)
        self.info = dist_info
        self.device = device
        self.keep_last = keep_last
        self.marker_extra = marker_extra
        self.crc = crc
        self.async_save = async_save and dist_info.is_distributed
        if async_save and not dist_info.is_distributed:
            log.info("checkpoint.async_save needs a process group; saving synchronously in a single process")
        self._pg = dist.new_group(backend="gloo") if self.async_save else None
        # created by the first async save, closed by close(); replaced when staging closed it (torch 2.11)
        self._stager: DefaultStager | None = None
        # The background save in flight: (its future, step, path, t0, blocking seconds).
        self._pending: tuple[Future[None], int, Path, float, float] | None = None
        self.save_times: list[float] = []
        # Steps this process saved or loaded: a complete directory for one of these is the same state.
        # Any other existing directory at a step we reach again is from an abandoned timeline (we
        # resumed from an older checkpoint): it is replaced.
        self.known: set[int] = set()
        self.last_saved: SaveResult | None = None

    # -- helpers
    def _barrier(self) -> None:
        from .dist import barrier

        barrier(self.info, self.device)

    def _finish(self, step: int, path: Path, t0: float, blocking: float) -> SaveResult:
        if self.info.is_main:
            write_marker(path, step, self.marker_extra, crc=self.crc)
            removed = prune(self.run_dir, self.keep_last, protect={path})
            for p in removed:
                log.info("checkpoint %s pruned (keep_last=%d)", p, self.keep_last)
        self.known.add(step)
        res = SaveResult(step, path, time.perf_counter() - t0, blocking)
        self.save_times.append(res.seconds)
        self.last_saved = res
        if self.info.is_main:
            log.info(
                "checkpoint step %d saved to %s in %.2fs (blocking %.2fs)", step, path, res.seconds, blocking
            )
        return res

    def finished_step(self) -> int:
        """The step of the background save in flight if it has finished on this rank, else 0 (never
        blocks). The ranks' futures finish at slightly different moments: the trainer gathers this from
        every rank and calls :meth:`collect` on all of them at the same step, so a failed save stops every
        rank at the same point (one rank alone raising would leave the others in the next collective)."""
        return self._pending[1] if self._pending is not None and self._pending[0].done() else 0

    def collect(self, step: int) -> SaveResult | None:
        """Once some rank saw the background save of ``step`` finish: wait for it here too (a moment at
        most), mark it complete, or raise its failure. Nothing to do for 0 or a save already collected."""
        if not step or self._pending is None or self._pending[1] != step:
            return None
        return self.wait()

    def wait(self) -> SaveResult | None:
        """Block until a background save is complete and marked."""
        if self._pending is None:
            return None
        fut, step, path, t0, blocking = self._pending
        self._pending = None
        try:
            fut.result()  # raises if any rank failed to write
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed(path, e)
            raise
        return self._finish(step, path, t0, blocking)

    def _failed(self, path: Path, e: BaseException) -> None:
        """A save into ``path`` failed: drop the partial directory (rank 0) and, if the disk is full,
        raise that as one ENOSPC OSError (the caller reports it in one line)."""
        if isinstance(e, KeyboardInterrupt | SystemExit):
            return
        need = checkpoint_bytes(self.last_saved.path) if self.last_saved is not None else 0
        full = disk_full_error(path, e, need)
        if self.info.is_main:
            shutil.rmtree(path, ignore_errors=True)  # never loaded (no marker); frees what it took
        if full is not None:
            raise full from e

    # -- save / load
    def save(self, step: int, state: dict, block: bool = False) -> SaveResult | None:
        """Save ``state`` as step ``step``. Returns the result when the save is complete (sync)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = step_dir(self.run_dir, step)
        if step in self.known and check_complete(path, verify_crc=False) is None:
            log.info("checkpoint step %d already complete at %s; not saving again", step, path)
            self.last_saved = SaveResult(step, path, 0.0, 0.0)
            return self.last_saved
        t0 = time.perf_counter()
        if self.info.is_main:
            if path.exists():
                log.warning(
                    "replacing %s (incomplete, or from before the checkpoint this run resumed from)", path
                )
                shutil.rmtree(path)
            path.mkdir(parents=True)
        self._barrier()
        if self.async_save and not block:
            with _single_process(not self.info.is_distributed):
                fut = dcp.async_save(
                    state, checkpoint_id=str(path), process_group=self._pg, async_stager=self.stager()
                )
            # An AsyncSaveResponse comes back only with asynchronous staging, which stager() turns off.
            assert isinstance(fut, Future), f"async_save returned {type(fut).__name__}, not the upload future"
            self._drop_spent_stager()
            self._pending = (fut, step, path, t0, time.perf_counter() - t0)
            return None
        try:
            with _single_process(not self.info.is_distributed):
                dcp.save(state, checkpoint_id=str(path), no_dist=not self.info.is_distributed)
            blocking = time.perf_counter() - t0
            return self._finish(step, path, t0, blocking)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed(path, e)
            raise

    def stager(self) -> DefaultStager:
        """The run's one async-save stager: pinned host memory and non-blocking copies on CUDA (then a
        device sync before the background write starts), plain copies on CPU; staging is synchronous, so
        the training may change the parameters as soon as ``async_save`` returns."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.device.type == "cuda"
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager

    def _drop_spent_stager(self) -> None:
        """Forget the stager if staging closed it. torch 2.11's ``DefaultStager`` closes its copier at the
        end of every stage (pytorch#183413), so a second save through it fails (``KeyError: <class
        'type'>``, first seen by scripts/gpu-check.sh on an H200); there the next save gets a new stager,
        and its pinned buffers (freed by that close anyway). Where staging leaves it open, it is kept."""
        copier = getattr(self._stager, "_state_dict_stager", None)
        if copier is not None and not getattr(copier, "_deepcopy_dispatch", True):
            self._stager = None

    def load(self, path: Path, state: dict, optional: tuple[str, ...] = ()) -> list[str]:
        """Load ``path`` into ``state`` in place (DCP resharding; non-tensor leaves replaced).

        Leaves under the top-level keys in ``optional`` that the checkpoint does not have are removed
        from ``state`` first (see :func:`drop_unsaved`) and returned; anything else missing is an error."""
        import torch.distributed.checkpoint as dcp

        dropped = drop_unsaved(state, checkpoint_keys(path), optional) if optional else []
        with _single_process(not self.info.is_distributed):
            dcp.load(state, checkpoint_id=str(path), no_dist=not self.info.is_distributed)
        self.known.add(marker_step(path))
        return dropped

    def close(self) -> None:
        """Finish a background save; release the stager (a later async save makes a new one)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
