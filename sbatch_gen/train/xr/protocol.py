"""The mailbox protocol: rounds, shard objects, manifests, polling, verification, cleanup. Torch-free.

Layout in the store (``<run>`` is the run id, ``<tag>`` a round tag such as ``r000042`` or ``init``)::

    <run>/<tag>/<region>/s00000.bin    objects: the encoded bytes of one or more shards, one after the other
    <run>/<tag>/<region>/s00001.bin
    <run>/<tag>/<region>.done          the manifest, JSON, written LAST (after every object is stored)

A reader that sees ``<region>.done`` may fetch every object it lists: the manifest is the commit point.
It carries the run id, round, step, wire dtype, element count, a layout fingerprint of the model, the
shards with a checksum each (XXH3-128: it catches torn, truncated or corrupted objects at ~14 GB/s a core,
where sha256 manages ~1.6 GB/s; the manifest is not signed, so a cryptographic hash would buy nothing
more), the objects with a checksum per ``chunk`` bytes, and the region's token count (the averaging weight).

The payload is a flat vector of ``numel`` elements; :class:`ShardPlan` cuts it into contiguous element
ranges, the shards, of about ``shard_mb`` MiB each. Every region of the same shape derives the same plan; a
sharded (FSDP) region cuts the payload where its ranks' parameter shards end, too, and packs each rank's
shards into as few objects as ``shard_mb`` allows (:meth:`ShardPlan.pieces`: one object per rank and round
when its part fits). The manifest's index says where each shard lies: its canonical range (``start``,
``numel``), its object (``obj``) and its first byte there (``offset``). A manifest's shards may tile the
payload differently from the reader's plan: a reader takes the elements it needs from the shards that
overlap them (:func:`overlapping`), and of an object only the chunks that hold them (:mod:`.reading`),
each checked against its chunk checksum; an object it needs whole is read whole.
"""

from __future__ import annotations

import bisect
import copy
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from .errors import XRChecksumError, XRLayoutError, XRMissingRound, XRTimeout
from .store import Store
from .traffic import Traffic

# 2: per-shard checksums are XXH3-128 ("digest"), named by the manifest's "checksum"; 3: a region's shards
# are any contiguous tiling of the flat payload (a sharded region cuts it where its ranks' parameter shards
# end), which a reader of another shape reads by overlap: a format-2 reader would misread them; 4: shards
# are packed into objects ("obj", "offset"; "objects" with a checksum per "chunk" bytes), read in ranges: a
# format-3 reader would read a shard's index as its object. This version also reads format 3 (one object
# per shard, read whole).
FORMAT = 4
READS = (3, 4)
CHECKSUM = "xxh3_128"
CHUNK_BYTES = 1 << 20  # an object's integrity chunk: the least a ranged read fetches (and checks)
Buffer = bytes | bytearray | memoryview
# bytes per element of each wire dtype (int4: two values per byte)
ITEMSIZE: dict[str, float] = {"bf16": 2, "fp32": 4, "int8": 1, "fp8": 1, "int4": 0.5}
# int8, fp8 and int4 payloads carry one fp32 scale per QBLOCK elements (of each shard), before the values
# (.scaled)
SCALED = frozenset({"int8", "fp8", "int4"})
QBLOCK = 256


# sparse payloads (.sparse): the wire dtype names the chunk and the entries kept per chunk,
# ``sparse-c<chunk>-k<k>``; every chunk is SPARSE_HEADER bytes of magnitudes, then k packed indices of
# log2(chunk) bits, then k 2-bit codes
SPARSE_HEADER = 8
_SPARSE_RE = re.compile(r"^sparse-c(\d+)-k(\d+)$")


def sparse_wire(chunk: int, k: int) -> str:
    """The wire dtype string of a sparse payload (``sparse-c4096-k41``), as manifests carry it."""
    return f"sparse-c{chunk}-k{k}"


def sparse_params(dtype: str) -> tuple[int, int] | None:
    """``(chunk, k)`` of a sparse wire dtype string; None for any other (or a malformed) one."""
    m = _SPARSE_RE.match(dtype)
    if m is None:
        return None
    c, k = int(m.group(1)), int(m.group(2))
    if c < 2 or c & (c - 1) or c > 1 << 16 or not 1 <= k <= c:
        return None
    return c, k


def sparse_chunk_nbytes(chunk: int, k: int) -> int:
    """Bytes of one chunk of a sparse shard."""
    return SPARSE_HEADER + math.ceil(k * (chunk.bit_length() - 1) / 8) + math.ceil(k / 4)


def blocked(dtype: str) -> bool:
    """Whether the dtype's elements decode by blocks (scaled: QBLOCK; sparse: its chunk), not one by one."""
    return dtype in SCALED or sparse_params(dtype) is not None


def itemsize(dtype: str) -> float:
    """Wire bytes per element (sparse: a chunk's bytes over its elements); raises KeyError for an unknown
    dtype."""
    sp = sparse_params(dtype)
    if sp is not None:
        return sparse_chunk_nbytes(*sp) / sp[0]
    return ITEMSIZE[dtype]


def wire_nbytes(dtype: str, numel: int) -> int:
    """Bytes of a raw shard of ``numel`` elements in the wire dtype: the values (int4: a shard of an odd
    count ends in half a byte of padding), and the scales of the scaled dtypes; sparse: whole chunks."""
    sp = sparse_params(dtype)
    if sp is not None:
        return math.ceil(numel / sp[0]) * sparse_chunk_nbytes(*sp)
    n = math.ceil(numel * ITEMSIZE[dtype])
    return n + 4 * math.ceil(numel / QBLOCK) if dtype in SCALED else n


TAG_INIT = "init"
_ROUND_RE = re.compile(r"^r(\d{6,})$")


def round_tag(r: int) -> str:
    if r < 0:
        raise ValueError(f"round must be >= 0, got {r}")
    return f"r{r:06d}"


def parse_tag(tag: str) -> int | None:
    m = _ROUND_RE.match(tag)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ShardPlan:
    """Contiguous element ranges ``[start, end)`` covering ``numel`` elements."""

    numel: int
    bounds: tuple[tuple[int, int], ...]
    # the owner (position among the region's owners) of each shard; None: round-robin (s mod owners)
    owners: tuple[int, ...] | None = None
    # the object each shard is stored in (its owner's shards, packed); None: each shard is its own object
    objects: tuple[int, ...] | None = None

    @classmethod
    def make(cls, numel: int, itemsize: float, shard_mb: float) -> ShardPlan:
        if numel <= 0:
            raise ValueError(f"numel must be > 0, got {numel}")
        if shard_mb <= 0:
            return cls(numel, ((0, numel),))
        per = max(1, int(int(shard_mb * (1 << 20)) / itemsize))
        n = math.ceil(numel / per)
        return cls(numel, tuple((i * per, min(numel, (i + 1) * per)) for i in range(n)))

    @classmethod
    def pieces(
        cls, numel: int, held: list[tuple[int, int, int]], itemsize: float, shard_mb: float
    ) -> ShardPlan:
        """A sharded region's plan: ``held`` lists ``(start, end, owner)`` ranges that tile ``numel`` in
        order (each rank's parameter shards); each range is cut into shards of about ``shard_mb`` MiB,
        owned by the range's owner."""
        per = max(1, int(int(shard_mb * (1 << 20)) / itemsize)) if shard_mb > 0 else numel
        bounds, owners = [], []
        for lo, hi, who in held:
            for a in range(lo, hi, per):
                bounds.append((a, min(hi, a + per)))
                owners.append(who)
        if not bounds or bounds[0][0] != 0 or bounds[-1][1] != numel:
            raise ValueError(f"the held ranges do not cover 0..{numel}")
        return cls(numel, tuple(bounds), tuple(owners), _packed(bounds, owners, per))

    def __len__(self) -> int:
        return len(self.bounds)

    def object_of(self, s: int) -> int:
        """The object shard ``s`` is stored in."""
        return s if self.objects is None else self.objects[s]

    def owned_objects(self, owner: int, owners: int) -> list[tuple[int, list[int]]]:
        """``owner``'s objects: (object, its shards in order)."""
        out: dict[int, list[int]] = {}
        for s in self.owned(owner, owners):
            out.setdefault(self.object_of(s), []).append(s)
        return list(out.items())

    def owned(self, owner: int, owners: int) -> list[int]:
        """Shards owned by ``owner`` of ``owners`` (round-robin: shard s belongs to s mod owners)."""
        if self.owners is not None:
            return [s for s, o in enumerate(self.owners) if o == owner]
        return [s for s in range(len(self.bounds)) if s % owners == owner]


def _packed(bounds: list[tuple[int, int]], owners: list[int], per: int) -> tuple[int, ...]:
    """Each owner's shards, in order, packed into objects of at most ``per`` elements (each shard holds at
    most that many); objects numbered owner after owner."""
    objects = [0] * len(bounds)
    n = 0
    for who in sorted(set(owners)):
        room = 0
        for s in (s for s, o in enumerate(owners) if o == who):
            size = bounds[s][1] - bounds[s][0]
            if size > room:  # a new object
                n, room = n + 1, per
            objects[s], room = n - 1, room - size
    return tuple(objects)


def overlapping(shards: list[ShardInfo], lo: int, hi: int) -> list[ShardInfo]:
    """The shards (of a checked manifest: they tile the payload in order) that hold elements of
    ``[lo, hi)``."""
    i = max(0, bisect.bisect_right(shards, lo, key=lambda s: s.start) - 1)
    out = []
    while i < len(shards) and shards[i].start < hi:
        out.append(shards[i])
        i += 1
    return out


@dataclass
class ShardInfo:
    index: int
    start: int  # its first element in the canonical flat layout
    numel: int
    nbytes: int  # its encoded bytes
    digest: str  # CHECKSUM of the shard's bytes, hex
    obj: int | None = None  # the object it is stored in (None, format 3: its own object, ``index``)
    offset: int = 0  # its first byte in that object


@dataclass
class ObjectInfo:
    index: int  # the object's key: ``s{index:05d}.bin``
    nbytes: int
    chunks: list[str]  # CHECKSUM of each of the manifest's ``chunk`` bytes of the object, in order, hex


@dataclass
class Manifest:
    run_id: str
    region: str
    tag: str
    kind: str  # "init" | "delta" | "grad"
    step: int
    dtype: str  # wire dtype: "bf16" | "fp32" | "int8" | "fp8" | "int4" | "sparse-c<chunk>-k<k>"
    numel: int
    layout: str  # fingerprint of parameter names/shapes/dtypes
    serialization: str  # "raw" | "torch_save"
    tokens: int
    shards: list[ShardInfo]
    extra: dict = field(default_factory=dict)
    checksum: str = CHECKSUM
    format: int = FORMAT
    # the objects the shards are stored in; none: each shard is its own object, read whole (format 3)
    objects: list[ObjectInfo] = field(default_factory=list)
    chunk: int = 0  # bytes per integrity chunk of an object

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        try:
            d = json.loads(raw)
            if d.get("format") not in READS:
                raise ValueError(
                    f"format {d.get('format')!r}, this version reads formats {' and '.join(map(str, READS))}: "
                    "every region of a run must run the same sbatch-gen version"
                )
            d["shards"] = [ShardInfo(**s) for s in d["shards"]]
            d["objects"] = [ObjectInfo(**o) for o in d.get("objects", [])]
            m = cls(**d)
            m._check_types()
            return m
        except (ValueError, TypeError, KeyError) as e:
            raise XRLayoutError(f"unreadable manifest {where}: {e}") from e

    def _check_types(self) -> None:
        """The index's numbers are integers and its checksums strings (a hostile manifest fails here, in
        one line, rather than deep in a read)."""
        if not all(isinstance(o.chunks, list) for o in self.objects):
            raise ValueError("an object's chunks are not a list")
        ints = [self.numel, self.chunk] + [
            v for s in self.shards for v in (s.index, s.start, s.numel, s.nbytes)
        ]
        ints += [s.offset for s in self.shards] + [s.obj for s in self.shards if s.obj is not None]
        ints += [v for o in self.objects for v in (o.index, o.nbytes)]
        sums = [s.digest for s in self.shards] + [c for o in self.objects for c in o.chunks]
        if not all(type(v) is int for v in ints) or not all(type(c) is str for c in sums):
            raise ValueError(
                "its index holds a number that is not an integer, or a checksum that is not a string"
            )

    def object_of(self, s: ShardInfo) -> int:
        """The object shard ``s`` is stored in."""
        return s.index if s.obj is None else s.obj

    def object_nbytes(self, k: int) -> int:
        return self.objects[k].nbytes if self.objects else self.shards[k].nbytes


@dataclass(frozen=True)
class Expect:
    """What this region expects every manifest of a round to agree on."""

    kind: str
    dtype: str
    numel: int
    layout: str
    serialization: str
    plan: ShardPlan
    # (canonical start, name) of each parameter, in order: a problem names the parameter it lies in
    params: tuple[tuple[int, str], ...] = ()

    def check(self, m: Manifest, run_id: str, tag: str, region: str, where: str) -> None:
        problems = []
        for name, got, want in (
            ("run_id", m.run_id, run_id),
            ("tag", m.tag, tag),
            ("region", m.region, region),
            ("kind", m.kind, self.kind),
            ("dtype", m.dtype, self.dtype),
            ("numel", m.numel, self.numel),
            ("layout", m.layout, self.layout),
            ("serialization", m.serialization, self.serialization),
            ("checksum", m.checksum, CHECKSUM),
        ):
            if got != want:
                problems.append(f"{name} is {got!r}, expected {want!r}")
        if not problems:
            problems += self._tiling(m)
        if not problems:
            problems += self._packing(m)
        if problems:
            hint = " (a different model or config in that region?)" if "layout" in problems[0] else ""
            raise XRLayoutError(
                f"round {tag}: region {region!r} published a mismatched payload at {where}: "
                + "; ".join(problems)
                + hint
            )

    def param(self, element: int) -> str:
        """`` (parameter NAME)`` of the parameter holding canonical ``element``, when the names are known."""
        i = bisect.bisect_right(self.params, element, key=lambda p: p[0]) - 1
        return f" (parameter {self.params[i][1]})" if self.params and 0 <= i else ""

    def _tiling(self, m: Manifest) -> list[str]:
        """The shards must tile the payload in order (any cut: another region's shape may cut it elsewhere)."""
        at = 0
        for i, s in enumerate(m.shards):
            if s.index != i or s.start != at or s.numel <= 0:
                return [
                    f"shard {s.index}{self.param(min(at, self.numel - 1))} covers [{s.start}, "
                    f"{s.start + s.numel}), expected shard {i} from element {at}"
                ]
            at += s.numel
            if self.serialization == "raw" and s.nbytes != wire_nbytes(self.dtype, s.numel):
                return [
                    f"shard {s.index}{self.param(s.start)} has {s.nbytes} bytes, expected "
                    f"{wire_nbytes(self.dtype, s.numel)}"
                ]
        if at != self.numel:
            return [f"the shards cover [0, {at}), expected [0, {self.numel}){self.param(at)}"]
        return []

    def _packing(self, m: Manifest) -> list[str]:
        """Each shard lies inside the object the index names, and the shards of an object fill it exactly
        once; every object carries one checksum per ``chunk`` bytes."""
        if not m.objects:  # format 3: each shard its own object
            bad = next((s for s in m.shards if s.obj is not None or s.offset), None)
            return (
                []
                if bad is None
                else [f"shard {bad.index}{self.param(bad.start)} names an object; none listed"]
            )
        if m.chunk <= 0 or m.chunk % 4:
            return [f"chunk is {m.chunk} bytes, not a positive multiple of 4"]
        for k, o in enumerate(m.objects):
            if o.index != k or o.nbytes <= 0 or len(o.chunks) != -(-o.nbytes // m.chunk):
                return [
                    f"object {o.index} of {o.nbytes} bytes with {len(o.chunks)} chunk checksums is entry {k}"
                ]
        spans: dict[int, list[tuple[int, int, ShardInfo]]] = {}
        for s in m.shards:
            where = f"shard {s.index}{self.param(s.start)}"
            if s.obj is None or not 0 <= s.obj < len(m.objects):
                return [f"{where} is in object {s.obj}; the manifest lists objects 0..{len(m.objects) - 1}"]
            n = m.objects[s.obj].nbytes
            align = 1 if blocked(self.dtype) or self.serialization != "raw" else int(ITEMSIZE[self.dtype])
            if s.offset % align:
                return [f"{where} starts at byte {s.offset} of object {s.obj}, not a multiple of {align}"]
            if s.offset < 0 or s.nbytes <= 0 or s.offset + s.nbytes > n:
                return [
                    f"{where} lies at bytes {s.offset}..{s.offset + s.nbytes} of object {s.obj}, which holds {n}"
                ]
            spans.setdefault(s.obj, []).append((s.offset, s.offset + s.nbytes, s))
        for k, o in enumerate(m.objects):
            at = 0
            for lo, hi, s in sorted(spans.get(k, []), key=lambda x: x[:2]):
                if lo != at:
                    what = "overlaps the shard before it" if lo < at else f"leaves bytes {at}..{lo} unused"
                    return [f"shard {s.index}{self.param(s.start)} in object {k} {what}"]
                at = hi
            if at != o.nbytes:
                return [f"object {k} holds {o.nbytes} bytes, its shards fill {at}"]
        return []


def digest(buf) -> str:
    """The mailbox checksum of ``buf`` (hex); xxhash drops the GIL for large buffers: threads help."""
    import xxhash  # here, not at the top: `sbatch-gen status` reads the mailbox without the train extra

    return xxhash.xxh3_128_hexdigest(buf)


def chunk_digests(buf: Buffer, chunk: int) -> list[str]:
    """The checksum of each ``chunk`` bytes of ``buf``, in order (the last chunk may be shorter)."""
    view = memoryview(buf).cast("B")
    return [digest(view[i : i + chunk]) for i in range(0, len(view), chunk)]


class Stored(NamedTuple):
    """What :meth:`Mailbox.upload_objects` stored of one object."""

    nbytes: int
    chunks: list[str]  # the checksum of each chunk of the object
    digests: list[str]  # the checksum of each of its shards' byte spans


def digest_of_digests(digests: Iterable[str]) -> str:
    """One checksum over a sequence of shard checksums (theta0's fingerprint)."""
    import xxhash

    h = xxhash.xxh3_128()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


def reused(reuse: dict | None, slot: tuple, nbytes: int) -> bytearray:
    """A receive buffer of ``nbytes``, kept in ``reuse`` under ``slot`` between rounds (when given)."""
    b = reuse.get(slot) if reuse is not None else None
    if b is None or len(b) != nbytes:
        b = bytearray(nbytes)
        if reuse is not None:
            reuse[slot] = b
    return b


class Mailbox:
    """One region's view of the mailbox of a run. Thread pool and store client are created once."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        region: str,
        regions: Iterable[str],
        *,
        timeout_s: float = 1800.0,
        keep_rounds: int = 4,
        threads: int = 16,
        poll_min_s: float = 0.002,
        poll_max_s: float = 1.0,
        read_attempts: int = 3,
        chunk_bytes: int = CHUNK_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.region = region
        self.regions = list(regions)
        if region not in self.regions:
            raise ValueError(f"region {region!r} is not in regions {self.regions}")
        self.timeout_s = timeout_s
        self.keep_rounds = keep_rounds
        # Polls start 2 ms apart and back off x1.5 up to 1 s: a manifest is seen within about a third
        # of the time already waited (the faster region's overshoot adds to every round), while a minute
        # of waiting costs ~75 small requests.
        self.poll_min_s, self.poll_max_s = poll_min_s, poll_max_s
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="xr-io")
        # A shard whose checksum fails (corrupted in transit, a torn read) is read again, this often at
        # most; each re-read counts as a retried request of the store (the round records' xr_retries).
        self.read_attempts = max(1, read_attempts)
        self.chunk_bytes = chunk_bytes  # what this region's manifests give as ``chunk``
        self._clock = clock
        # the rounds' transfers in flight, which a background copy's (an outer snapshot's) give way to
        self.traffic = Traffic()
        self.background = False

    def transfers(self) -> AbstractContextManager[None]:
        """Around a round's transfers (this mailbox's objects up or down): counted in :attr:`traffic` as the
        foreground; a background copy's (:meth:`with_threads`) are not."""
        return nullcontext() if self.background else self.traffic.foreground()

    # -- keys --------------------------------------------------------------------------------------
    def shard_key(self, tag: str, region: str, index: int) -> str:
        return f"{self.run_id}/{tag}/{region}/s{index:05d}.bin"

    def manifest_key(self, tag: str, region: str) -> str:
        return f"{self.run_id}/{tag}/{region}.done"

    # -- writing -----------------------------------------------------------------------------------
    def upload_objects(
        self,
        tag: str,
        objects: Iterable[tuple[int, Buffer, Sequence[tuple[int, int]]]],
        region: str | None = None,
    ) -> dict[int, Stored]:
        """Upload this process's objects concurrently: ``(index, bytes, the byte spans of its shards)``;
        returns ``{index: Stored}`` (its chunk checksums at ``chunk_bytes``, its shards' checksums).
        ``objects`` may be a generator that encodes object after object: each one is checksummed and
        uploaded by the thread pool while the caller encodes the next. ``region``: the part's name when it
        is not this region's payload (an outer snapshot's ``theta`` / ``momentum``)."""
        name = region or self.region

        def one(idx: int, buf: Buffer, spans: Sequence[tuple[int, int]]):
            view = memoryview(buf).cast("B")
            chunks = chunk_digests(view, self.chunk_bytes)
            whole = len(view) <= self.chunk_bytes  # one chunk: its checksum is the whole object's
            sums = [
                chunks[0] if whole and (lo, hi) == (0, len(view)) else digest(view[lo:hi]) for lo, hi in spans
            ]
            if self.background:  # an outer snapshot's object: after the round's in flight, if any
                self.traffic.give_way()
            self.store.put(self.shard_key(tag, name, idx), buf)
            return idx, Stored(len(view), chunks, sums)

        futures = []
        with self.transfers():
            try:
                for idx, buf, spans in objects:
                    futures.append(self.pool.submit(one, idx, buf, spans))
            except BaseException:  # the caller's encoder failed: let the uploads in flight finish first
                wait(futures)
                raise
            return dict(f.result() for f in futures)

    def upload_shards(
        self, tag: str, shards: Mapping[int, Buffer] | Iterable[tuple[int, Buffer]], region: str | None = None
    ) -> dict[int, tuple[int, str]]:
        """:meth:`upload_objects` of shards stored one an object: ``{index: (nbytes, digest)}``."""
        items = shards.items() if isinstance(shards, Mapping) else shards
        got = self.upload_objects(tag, ((i, b, [(0, memoryview(b).nbytes)]) for i, b in items), region)
        return {i: (st.nbytes, st.digests[0]) for i, st in got.items()}

    def publish_manifest(self, m: Manifest) -> None:
        if m.region != self.region or m.run_id != self.run_id:
            raise ValueError("a region publishes only its own manifests")
        self.store.put(self.manifest_key(m.tag, m.region), m.to_json())

    # -- reading -----------------------------------------------------------------------------------
    def read_manifest(self, tag: str, region: str) -> Manifest | None:
        key = self.manifest_key(tag, region)
        raw = self.store.get(key)
        return None if raw is None else Manifest.from_json(raw, self.store.describe(key))

    def wait(
        self,
        tag: str,
        regions: Iterable[str],
        expect: Expect,
        *,
        step: int | None = None,
        started: float | None = None,
        slice_s: float | None = None,
        check: Callable[[Manifest, str], None] | None = None,
    ) -> dict[str, Manifest] | None:
        """Poll (with backoff) until every region in ``regions`` has published ``tag``; verify each
        manifest against ``expect`` (after ``check(manifest, region)``, when given). Raises :class:`XRTimeout` naming the regions still missing once
        ``timeout_s`` has passed since ``started`` (default: now). With ``slice_s``, returns ``None``
        after that many seconds without giving up (callers keep other ranks informed in between)."""
        want = list(regions)
        got: dict[str, Manifest] = {}
        now0 = self._clock()
        t0 = now0 if started is None else started
        delay = self.poll_min_s
        next_diag = now0 + min(2.0, self.timeout_s / 4)  # a listing only when a peer is really late
        while True:
            for r in want:
                if r in got:
                    continue
                m = self.read_manifest(tag, r)
                if m is not None:
                    if check is not None:
                        check(m, r)
                    expect.check(m, self.run_id, tag, r, self.store.describe(self.manifest_key(tag, r)))
                    got[r] = m
            missing = [r for r in want if r not in got]
            if not missing:
                return got
            now = self._clock()
            if now >= next_diag:  # cheap most of the time; a listing only now and then
                self._check_not_deleted(tag, missing)
                next_diag = now + 10.0
            if now - t0 >= self.timeout_s:
                at = f" (step {step})" if step is not None else ""
                locs = ", ".join(self.store.describe(self.manifest_key(tag, r)) for r in missing)
                seen = ", ".join(sorted(got)) or "none"
                raise XRTimeout(
                    f"round {tag}{at}: no manifest from region(s) {', '.join(map(repr, missing))} after "
                    f"{self.timeout_s:g} s (looked for {locs}; arrived: {seen}). Is that region running, "
                    f"with run id {self.run_id!r} and the same mailbox?" + self._other_runs(tag, missing)
                )
            if slice_s is not None and now - now0 >= slice_s:
                return None
            time.sleep(min(delay, max(0.0, self.timeout_s - (now - t0)) + 1e-3))
            delay = min(self.poll_max_s, delay * 1.5)

    def _check_not_deleted(self, tag: str, missing: list[str]) -> None:
        """A peer whose manifest for ``tag`` is missing although it has published a LATER round has moved
        on and deleted ``tag`` (keep_rounds): waiting cannot help."""
        r = parse_tag(tag)
        if r is None:
            return
        latest = self.latest_rounds()
        gone = [p for p in missing if latest.get(p, -1) > r]
        if gone:
            raise XRMissingRound(
                f"round {tag}: region(s) {', '.join(map(repr, gone))} already published round "
                f"{round_tag(max(latest[p] for p in gone))} and deleted {tag} (keep_rounds={self.keep_rounds}). "
                "This region resumed from a checkpoint older than the mailbox keeps: checkpoint at least "
                "every keep_rounds outer rounds, or raise keep_rounds."
            )

    def _other_runs(self, tag: str, missing: list[str]) -> str:
        """Diagnosis for a timeout: do the missing regions publish under a different run id?"""
        try:
            keys = self.store.list("")
        except Exception:  # noqa: BLE001 - only a hint
            return ""
        others = sorted(
            {
                k.split("/")[0]
                for k in keys
                if k.count("/") == 2
                and k.split("/")[0] != self.run_id
                and k.rsplit("/", 1)[1] in {f"{r}.done" for r in missing}
            }
        )
        if not others:
            return ""
        return (
            f" The mailbox has manifests from {', '.join(map(repr, missing))} under run id(s) "
            f"{', '.join(map(repr, others))}: the regions disagree on the run id."
        )

    def latest_rounds(self, keys: list[str] | None = None) -> dict[str, int]:
        """Highest round with a manifest, per region (one listing of the run's prefix, or ``keys`` from one)."""
        latest: dict[str, int] = {}
        for key in self.store.list(f"{self.run_id}/") if keys is None else keys:
            parts = key.split("/")
            if len(parts) == 3 and parts[2].endswith(".done"):
                r = parse_tag(parts[1])
                reg = parts[2][: -len(".done")]
                if r is not None and r > latest.get(reg, -1):
                    latest[reg] = r
        return latest

    def download(
        self, tag: str, wants: Iterable[tuple[str, ShardInfo]], reuse: dict | None = None
    ) -> dict[tuple[str, int], Buffer]:
        """Fetch shards stored one an object (a DDP region's, format 3) concurrently and verify each against
        its manifest entry. A store that can map objects (fs) hands out read-only-in-practice views without copying;
        otherwise objects are read into buffers, reused between rounds when the caller keeps ``reuse`` (a
        dict) for that. Re-reads as :meth:`verified`'s."""

        def one(item: tuple[str, ShardInfo]):
            region, info = item
            if info.obj not in (None, info.index) or info.offset:
                raise XRLayoutError(
                    f"round {tag}: shard {info.index} of region {region!r} is packed in object {info.obj}: "
                    "read it with reading.read_objects"
                )
            key = self.shard_key(tag, region, info.index)
            what = f"shard {info.index} of region {region!r}"
            return (region, info.index), self.verified(
                tag,
                what,
                key,
                lambda: self.read_whole(key, info.nbytes, reuse, (region, info.index)),
                lambda buf: digest(buf) == info.digest,
            )

        with self.transfers():
            return dict(self.pool.map(one, list(wants)))

    def read_whole(self, key: str, nbytes: int, reuse: dict | None, slot: tuple) -> Buffer:
        """Object ``key`` of ``nbytes``: mapped (fs), or read into the buffer ``reuse`` keeps for ``slot``."""
        if self.store.maps_objects:
            return self.store.get_view(key, nbytes)
        buf = reused(reuse, slot, nbytes)
        self.store.get_into(key, memoryview(buf))
        return buf

    def verified(
        self, tag: str, what: str, key: str, read: Callable[[], Buffer], ok: Callable[[Buffer], bool]
    ):
        """``read()`` until ``ok`` of what it read (its checksums), ``read_attempts`` reads at most, each
        re-read counted in the store's ``retries``; then :class:`XRChecksumError`: objects are immutable
        once their manifest is visible, so a mismatch that goes away was damage on the way, not in the
        store."""
        for attempt in range(self.read_attempts):
            if attempt:
                self.store.count_retry()
                time.sleep(min(1.0, 0.05 * 2 ** (attempt - 1)))
            buf = read()
            if ok(buf):
                return buf
        reads = f"in {self.read_attempts} reads" if self.read_attempts > 1 else "(read once)"
        raise XRChecksumError(
            f"round {tag}: {what} is corrupted: {CHECKSUM} differs from its manifest {reads} "
            f"({self.store.describe(key)})"
        )

    def with_threads(self, threads: int, name: str, background: bool = False) -> Mailbox:
        """This mailbox (the same store and client) with a thread pool of its own: at most ``threads``
        transfers at a time, beside the ones of this mailbox's pool. ``background`` (outer snapshots): each
        object it uploads first gives way to this mailbox's round transfers in flight (:mod:`.traffic`)."""
        mb = copy.copy(self)
        mb.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        mb.background = background
        return mb

    def close(self, wait: bool = True) -> None:
        """Shut the pool down; ``wait=False``: transfers not yet started are dropped, the running ones are
        left to finish or to die with the process."""
        self.pool.shutdown(wait=wait, cancel_futures=not wait)
