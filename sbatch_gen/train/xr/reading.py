"""Ranged reads of a region's objects: a reader fetches only the chunks that hold the bytes it needs, and
checks each one against its chunk checksum. Torch-free.

An object (:class:`.protocol.ObjectInfo`) carries one checksum per ``chunk`` bytes (the manifest's). A
reader that needs some byte spans of it reads each run of consecutive chunks that holds them with one
ranged read (:meth:`.store.Store.get_range`), and checks every chunk of the run; a run that fails is read
again, as a whole object is (:meth:`.protocol.Mailbox.verified`). A reader that needs every chunk reads the
object whole (mapped on a directory mailbox). A format-3 manifest (no objects listed) has no chunk
checksums: each of its shards is read whole.

Which bytes hold elements ``a:b`` of a shard (:func:`shard_bytes`): raw bf16/fp32 are the elements' own
bytes; a scaled dtype's (int8/fp8/int4, :mod:`.scaled`) are the scales of the blocks that hold them, then
their values, whole blocks of the shard; a sparse shard's (:mod:`.sparse`) the whole chunks that hold
them, each its own byte range; a ``torch_save`` shard is one blob, read whole.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

from .protocol import (
    ITEMSIZE,
    QBLOCK,
    SCALED,
    Buffer,
    Mailbox,
    Manifest,
    ShardInfo,
    digest,
    reused,
    sparse_chunk_nbytes,
    sparse_params,
)


def shard_bytes(m: Manifest, s: ShardInfo, a: int, b: int) -> tuple[int, int, list[tuple[int, int]]]:
    """``(a2, b2, spans)``: the canonical elements ``a2:b2`` (around ``a:b``, inside shard ``s``) that
    decode alone, and the byte spans of its object that hold them, in wire order (scaled: the scales,
    then the values)."""
    if not (s.start <= a < b <= s.start + s.numel):
        raise ValueError(f"internal: elements {a}:{b} are not in shard {s.index}")
    off, first = s.offset, s.start
    if m.serialization != "raw":
        return first, first + s.numel, [(off, off + s.nbytes)]
    sp = sparse_params(m.dtype)
    if sp is not None:  # whole chunks, each its own bytes, one after the other
        c, per = sp[0], sparse_chunk_nbytes(*sp)
        c0, c1 = (a - first) // c, math.ceil((b - first) / c)
        return first + c0 * c, min(first + s.numel, first + c1 * c), [(off + c0 * per, off + c1 * per)]
    size = ITEMSIZE[m.dtype]
    if m.dtype not in SCALED:
        return a, b, [(off + int((a - first) * size), off + int((b - first) * size))]
    b0, b1 = (a - first) // QBLOCK, math.ceil((b - first) / QBLOCK)  # the blocks that hold a:b
    a2, b2 = first + b0 * QBLOCK, min(first + s.numel, first + b1 * QBLOCK)
    values = off + 4 * math.ceil(s.numel / QBLOCK)
    return (
        a2,
        b2,
        [
            (off + 4 * b0, off + 4 * b1),
            (values + math.floor((a2 - first) * size), values + math.ceil((b2 - first) * size)),
        ],
    )


def chunk_runs(spans: Iterable[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """The runs ``[c0, c1)`` of consecutive chunks that hold ``spans`` (byte ranges), in order."""
    need = sorted({c for lo, hi in spans if hi > lo for c in range(lo // chunk, math.ceil(hi / chunk))})
    runs: list[tuple[int, int]] = []
    for c in need:
        if runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        else:
            runs.append((c, c + 1))
    return runs


class ObjectBytes:
    """The parts of one object that were read: ``(first byte, bytes)`` runs, in order."""

    def __init__(self, runs: Sequence[tuple[int, Buffer]]) -> None:
        self.runs = sorted(runs, key=lambda r: r[0])
        self._starts = [r[0] for r in self.runs]
        self.nbytes = sum(memoryview(b).nbytes for _, b in self.runs)

    def view(self, lo: int, hi: int) -> memoryview:
        """Bytes ``lo:hi`` of the object (inside one run read)."""
        i = bisect.bisect_right(self._starts, lo) - 1
        if i >= 0:
            start, buf = self.runs[i]
            view = memoryview(buf).cast("B")
            if hi - start <= len(view):
                return view[lo - start : hi - start]
        raise ValueError(f"internal: bytes {lo}..{hi} of the object were not read")

    def span_bytes(self, spans: Sequence[tuple[int, int]]) -> Buffer:
        """The bytes of ``spans`` one after the other: a view when they are adjacent, else a copy."""
        if all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
            return self.view(spans[0][0], spans[-1][1])
        return bytearray().join(self.view(lo, hi) for lo, hi in spans)  # writable: torch takes it as is


Want = tuple[str, Manifest, int, list[tuple[int, int]]]  # (region, its manifest, object, byte spans needed)


def read_objects(
    mb: Mailbox, tag: str, wants: Iterable[Want], reuse: dict | None = None
) -> dict[tuple[str, int], ObjectBytes]:
    """Each wanted object's chunks that hold its byte spans, read concurrently (one task per run of
    chunks) and checked: ``{(region, object): ObjectBytes}``. An object whose every chunk is wanted, or
    which has no chunk checksums (format 3), is read whole. ``reuse``: receive buffers kept between rounds."""
    tasks = []
    for region, m, k, spans in wants:
        nbytes = m.object_nbytes(k)
        runs = chunk_runs(spans, m.chunk) if m.objects else []
        if not m.objects or runs == [(0, len(m.objects[k].chunks))]:
            tasks.append((region, m, k, 0, nbytes))
        else:
            tasks += [(region, m, k, c0 * m.chunk, min(nbytes, c1 * m.chunk)) for c0, c1 in runs]

    def one(task):
        region, m, k, lo, hi = task
        return (region, k), (lo, _read_run(mb, tag, region, m, k, lo, hi, reuse))

    got: dict[tuple[str, int], list[tuple[int, Buffer]]] = {}
    with mb.transfers():  # a round's reads: a snapshot's upload gives way to them (.traffic)
        for key, run in mb.pool.map(one, tasks):
            got.setdefault(key, []).append(run)
    return {key: ObjectBytes(runs) for key, runs in got.items()}


def _read_run(mb: Mailbox, tag: str, region: str, m: Manifest, k: int, lo: int, hi: int, reuse) -> Buffer:
    """Bytes ``lo:hi`` of object ``k`` (whole chunks, or the whole object), verified."""
    key = mb.shard_key(tag, region, k)
    nbytes = m.object_nbytes(k)
    if not m.objects:  # format 3: the shard is the object, checked by its checksum
        info = m.shards[k]
        return mb.verified(
            tag,
            f"shard {k} of region {region!r}",
            key,
            lambda: mb.read_whole(key, nbytes, reuse, (region, k)),
            lambda buf: digest(buf) == info.digest,
        )
    chunk, sums = m.chunk, m.objects[k].chunks

    def read() -> Buffer:
        if (lo, hi) == (0, nbytes):
            return mb.read_whole(key, nbytes, reuse, (region, k))
        buf = reused(reuse, (region, k, lo), hi - lo)
        mb.store.get_range(key, lo, memoryview(buf), nbytes)
        return buf

    def ok(buf: Buffer) -> bool:
        view = memoryview(buf).cast("B")
        return all(
            digest(view[a - lo : min(hi, a + chunk) - lo]) == sums[a // chunk] for a in range(lo, hi, chunk)
        )

    what = f"object {k} (bytes {lo}..{hi - 1}) of region {region!r}"
    return mb.verified(tag, what, key, read, ok)
