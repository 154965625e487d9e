"""Training data: text that ships with every machine, byte-tokenized, one shard file per region.

Preparing is deterministic: the source files are read in sorted order, each document ends with a 0
byte, and each file goes to the region that holds the fewest bytes so far (ties: the first in
``regions``), so the shards differ in size by at most one file. A shard is raw uint8 tokens
(``<region>.bin``) with a JSON sidecar (``<region>.json``: source, file count, size, sha256).
Each region reads only its own shard.

The sampler is deterministic and resumable: every epoch is a seeded permutation of the shard's
non-overlapping windows; one global cursor advances by ``batch_size * world_size`` per micro-batch and
rank r takes its slice. Its position is part of the checkpoint, so a resumed run sees exactly the
batches an uninterrupted one would have seen.

``python -m sbatch_gen.train.data prepare --out data --regions eu,us`` prepares shards ahead of time;
the trainer prepares a missing shard on demand when ``data.path`` is a directory. Torch-free, except
:class:`Batches` (the trainer's loader), which imports torch when it is built.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..fsutil import write_atomic

if TYPE_CHECKING:
    import torch

DOC_END = b"\x00"
SOURCES = ("python-stdlib", "common-licenses")


def _source_root(source: str) -> Path:
    if source == "python-stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    if source == "common-licenses":
        return Path("/usr/share/common-licenses")
    raise ValueError(f"unknown data source {source!r} (known: {', '.join(SOURCES)})")


def source_files(source: str) -> tuple[Path, list[str]]:
    """The source's files as sorted POSIX paths relative to its root."""
    root = _source_root(source)
    if not root.is_dir():
        raise FileNotFoundError(f"data source {source!r}: {root} does not exist on this machine")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if source == "python-stdlib" and not name.endswith(".py"):
                continue
            p = Path(dirpath, name)
            if p.is_file() and not p.is_symlink():
                out.append(p.relative_to(root).as_posix())
    out.sort()
    return root, out


def prepare(
    out_dir: str | Path, regions: list[str], source: str = "python-stdlib", max_bytes: int = 0
) -> dict:
    """Write ``<out_dir>/<region>.bin`` + ``.json`` for every region, and ``manifest.json``."""
    if not regions or len(set(regions)) != len(regions):
        raise ValueError(f"regions must be non-empty and distinct: {regions}")
    root, files = source_files(source)
    parts: list[list[bytes]] = [[] for _ in regions]
    counts = [0] * len(regions)
    total = 0
    used = 0
    sizes = [0] * len(regions)
    for rel in files:
        if max_bytes and total >= max_bytes:
            break
        doc = (root / rel).read_bytes() + DOC_END
        r = min(range(len(regions)), key=lambda i: (sizes[i], i))  # the region with the fewest bytes
        parts[r].append(doc)
        counts[r] += 1
        sizes[r] += len(doc)
        total += len(doc)
        used += 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    region_infos: dict[str, dict[str, object]] = {}
    manifest = {
        "source": source,
        "source_root": str(root),
        "python": sys.version.split()[0],
        "files": used,
        "bytes": total,
        "max_bytes": max_bytes,
        "regions": region_infos,
    }
    for region, chunks, n in zip(regions, parts, counts, strict=True):
        blob = b"".join(chunks)
        info = {
            "region": region,
            "regions": regions,
            "source": source,
            "python": manifest["python"],
            "files": n,
            "tokens": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
        write_atomic(out / f"{region}.bin", blob)
        write_atomic(out / f"{region}.json", (json.dumps(info, indent=2) + "\n").encode())
        region_infos[region] = {k: info[k] for k in ("files", "tokens", "sha256")}
    write_atomic(out / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def shard_path(path: str | Path, region: str) -> Path:
    """``path`` itself when it names a file (or ends in .bin); else ``<path>/<region>.bin``."""
    p = Path(path)
    if p.is_file() or p.suffix == ".bin":
        return p
    return p / f"{region}.bin"


def ensure_shard(path: str | Path, region: str, regions: list[str], source: str, max_bytes: int) -> Path:
    """Return this region's shard, preparing the directory's shards if it is missing."""
    p = shard_path(path, region)
    if p.is_file():
        return p
    if Path(path).suffix == ".bin":
        raise FileNotFoundError(
            f"data shard {p} does not exist (prepare it with "
            f"`python -m sbatch_gen.train.data prepare --out DIR --regions ...`)"
        )
    if region not in regions:
        raise ValueError(f"region {region!r} is not in {regions}")
    prepare(p.parent, regions, source=source, max_bytes=max_bytes)
    return p


@dataclass
class Shard:
    path: Path
    tokens: np.ndarray  # uint8
    sha256: str

    @classmethod
    def open(cls, path: str | Path) -> Shard:
        p = Path(path)
        tokens = np.fromfile(p, dtype=np.uint8)
        return cls(path=p, tokens=tokens, sha256=hashlib.sha256(tokens.tobytes()).hexdigest())


class Sampler:
    """Deterministic, resumable batches of (input, target) windows for one rank."""

    def __init__(self, n_tokens: int, seq_len: int, batch_size: int, rank: int, world_size: int, seed: int):
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.n_windows = (n_tokens - 1) // seq_len
        need = batch_size * world_size
        if self.n_windows < need:
            raise ValueError(
                f"the shard has {n_tokens} tokens = {self.n_windows} windows of {seq_len}, "
                f"fewer than one global micro-batch ({batch_size} x {world_size} ranks)"
            )
        self.epoch = 0
        self.cursor = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = self.epoch
        assert self._perm is not None
        return self._perm

    def next_offsets(self) -> np.ndarray:
        """Token offsets of this rank's next micro-batch; advances the global cursor."""
        need = self.batch_size * self.world_size
        if self.cursor + need > self.n_windows:
            self.epoch += 1
            self.cursor = 0
        perm = self._permutation()
        lo = self.cursor + self.rank * self.batch_size
        idx = perm[lo : lo + self.batch_size]
        self.cursor += need
        return idx.astype(np.int64) * self.seq_len

    def windows(self, tokens: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """This rank's next micro-batch as ``(batch_size, seq_len + 1)`` int64 token windows (inputs are
        ``[:, :-1]``, targets ``[:, 1:]``), written into ``out`` when given; advances the cursor."""
        offs = self.next_offsets()
        if out is None:
            out = np.empty((len(offs), self.seq_len + 1), dtype=np.int64)
        for i, o in enumerate(offs):
            out[i] = tokens[o : o + self.seq_len + 1]
        return out

    def batch(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        win = self.windows(tokens)
        return win[:, :-1], win[:, 1:]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "n_windows": self.n_windows,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }

    def load_state_dict(self, s: dict) -> None:
        if int(s["n_windows"]) != self.n_windows or int(s["seq_len"]) != self.seq_len:
            raise ValueError(
                f"the checkpoint's data position is for {s['n_windows']} windows of {s['seq_len']} tokens, "
                f"this shard has {self.n_windows} windows of {self.seq_len}: the data changed"
            )
        self.epoch = int(s["epoch"])
        self.cursor = int(s["cursor"])


class Batches:
    """The sampler's micro-batches as torch tensors on ``device``, prepared one micro-batch ahead.

    :meth:`next` returns the current micro-batch; :meth:`prefetch` prepares the following one at once
    (the trainer calls it right after queueing a backward, so on a GPU the host-side work and the copy
    overlap the device's compute). On CUDA the windows are written straight into pinned host memory and
    copied with ``non_blocking=True``: the copy is queued on the stream and the host never waits for the
    device here. ``host_s`` counts only the host-side preparation (sampling, the window copy, queueing
    the transfer), so ``data_time_s`` is what data loading costs the host, not the device's backlog.

    The batches and their order are the sampler's, prefetched or not. :meth:`state_dict` is the position
    of the next micro-batch :meth:`next` will return (not of the one prefetched past it), so a checkpoint
    resumes exactly where the training consumed the data. Torch is imported here only.
    """

    def __init__(
        self,
        sampler: Sampler,
        tokens: np.ndarray,
        device: str | torch.device | None = None,
        pin_memory: bool = False,
    ):
        import torch

        self.torch = torch
        self.sampler = sampler
        self.tokens = tokens
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.pin_memory = pin_memory
        self.host_s = 0.0
        self._ahead: tuple[dict, torch.Tensor] | None = None  # (sampler position before it, device windows)

    def _prepare(self) -> tuple[dict, torch.Tensor]:
        torch = self.torch
        t0 = time.perf_counter()
        before = self.sampler.state_dict()
        if self.pin_memory:
            host = torch.empty(
                (self.sampler.batch_size, self.sampler.seq_len + 1), dtype=torch.int64, pin_memory=True
            )
            self.sampler.windows(self.tokens, out=host.numpy())
        else:
            host = torch.from_numpy(self.sampler.windows(self.tokens))
        win = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host
        self.host_s += time.perf_counter() - t0
        return before, win

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the next micro-batch, on the device."""
        if self._ahead is None:
            self._ahead = self._prepare()
        _, win = self._ahead
        self._ahead = None
        return win[:, :-1], win[:, 1:]

    def prefetch(self) -> None:
        """Prepare the micro-batch after the one :meth:`next` returned last (no-op if already done)."""
        if self._ahead is None:
            self._ahead = self._prepare()

    def take_host_s(self) -> float:
        """Host seconds spent preparing batches since the last call."""
        s, self.host_s = self.host_s, 0.0
        return s

    def state_dict(self) -> dict:
        return self._ahead[0] if self._ahead is not None else self.sampler.state_dict()

    def load_state_dict(self, s: dict) -> None:
        self._ahead = None
        self.sampler.load_state_dict(s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sbatch_gen.train.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write one shard per region")
    pp.add_argument("--out", required=True, help="output directory")
    pp.add_argument("--regions", default="local", help="comma-separated region names (default: local)")
    pp.add_argument("--source", default="python-stdlib", choices=SOURCES)
    pp.add_argument("--max-bytes", type=int, default=0, help="cap on the corpus size (0 = all)")
    ip = sub.add_parser("info", help="print a shard's sidecar and token count")
    ip.add_argument("shard")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        regions = [r for r in a.regions.split(",") if r]
        m = prepare(a.out, regions, source=a.source, max_bytes=a.max_bytes)
        for r, info in m["regions"].items():
            print(
                f"{Path(a.out) / (r + '.bin')}: {info['tokens']} tokens from {info['files']} files "
                f"sha256 {info['sha256'][:16]}"
            )
        return 0
    sh = Shard.open(a.shard)
    print(json.dumps({"path": str(sh.path), "tokens": int(sh.tokens.size), "sha256": sh.sha256}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
