"""A region in one process, without torch: publish a payload as a round, or exchange one with the others.

For the protocol tests and the benchmarks (a scripted peer region); the trainer goes through
:mod:`sbatch_gen.train.xr.exchange` instead.
"""

from __future__ import annotations

from sbatch_gen.train.xr.protocol import ITEMSIZE, Expect, Mailbox, Manifest, ShardInfo, ShardPlan


def publish(
    mb: Mailbox,
    tag: str,
    payload: bytes | bytearray | memoryview,
    *,
    kind: str,
    dtype: str,
    layout: str,
    step: int,
    tokens: int,
    shard_mb: float,
    extra: dict | None = None,
    write: bool = True,
) -> tuple[Manifest, Expect]:
    """Publish ``payload`` (raw bytes of ``dtype`` elements) as round ``tag``: shards, then the manifest
    (``write=False``: the caller claims the round with it, :meth:`.membership.Membership.claim`). If the
    region already published ``tag`` (a requeued job re-entering the round), that stands."""
    view = memoryview(payload).cast("B")
    size = ITEMSIZE[dtype]
    if view.nbytes % size:
        raise ValueError(f"payload of {view.nbytes} bytes is not a whole number of {dtype} elements")
    plan = ShardPlan.make(view.nbytes // size, size, shard_mb)
    expect = Expect(kind, dtype, plan.numel, layout, "raw", plan)
    own = mb.read_manifest(tag, mb.region) if write else None
    if own is not None:
        expect.check(own, mb.run_id, tag, mb.region, mb.store.describe(mb.manifest_key(tag, mb.region)))
        return own, expect
    sums = mb.upload_shards(tag, {i: view[lo * size : hi * size] for i, (lo, hi) in enumerate(plan.bounds)})
    m = Manifest(
        mb.run_id,
        mb.region,
        tag,
        kind,
        step,
        dtype,
        plan.numel,
        layout,
        "raw",
        tokens,
        [ShardInfo(i, lo, hi - lo, *sums[i]) for i, (lo, hi) in enumerate(plan.bounds)],
        extra or {},
    )
    if write:
        mb.publish_manifest(m)
    return m, expect


def exchange(
    mb: Mailbox, tag: str, payload: bytes | bytearray | memoryview, **kw
) -> dict[str, tuple[Manifest, bytes]]:
    """``{region: (manifest, payload)}`` for every region of ``mb``, this one's included, once all have
    published ``tag``. Keyword arguments as for :func:`publish`."""
    _, expect = publish(mb, tag, payload, **kw)
    manifests = mb.wait(tag, mb.regions, expect, step=kw.get("step"))
    bufs = mb.download(tag, [(r, s) for r, m in manifests.items() for s in m.shards])
    return {r: (m, b"".join(bytes(bufs[(r, s.index)]) for s in m.shards)) for r, m in manifests.items()}
