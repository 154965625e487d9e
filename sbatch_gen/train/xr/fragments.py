"""Streaming DiLoCo's fragments: which parameters each of the F fragments holds, and when each is synced.

**Which parameters.** The units are the model's numbered layers (a parameter whose name has a numeric
component, ``blocks.3.attn.qkv.weight``, belongs to layer ``blocks.3`` with every other parameter of that
prefix) when the model has at least F of them, else single tensors; parameters outside any layer
(embeddings, the final norm, the head) are units of their own. Units go, largest first (ties: model
order), to the fragment with the fewest elements so far (ties: the lowest index): equal layers thus go
round-robin, fragment p holding layers p, p+F, p+2F... (the paper's strided split), and the large
tensors beside them are spread so that every fragment carries about 1/F of the parameters. The flat
buffers hold the fragments one after the other (each a contiguous range, the model's order inside).

**When.** Fragment p is synced at steps ``c*H + floor(H*(p+1)/F)`` (c = 0, 1, ...); the rounds are
numbered in that order: round k syncs fragment ``(k-1) mod F`` at :func:`round_step` ``(k)``. With F = 1
that is round k at step k*H, DiLoCo's own numbering.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_INDEX = re.compile(r"^((?:.*?\.)?\d+)(?:\.|$)")  # the prefix up to and including the first numeric component


def layer_of(name: str) -> str | None:
    """The layer a parameter belongs to (``blocks.3`` for ``blocks.3.attn.qkv.weight``, ``0`` for an
    ``nn.Sequential``'s ``0.weight``), None outside one."""
    m = _INDEX.match(name)
    return m.group(1) if m else None


def units(names: Sequence[str], fragments: int) -> list[list[int]]:
    """The units ``fragments`` fragments are made of, as lists of parameter indices, in model order: whole
    layers (and the tensors outside them) when there are at least ``fragments`` layers, else tensors."""
    layers: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        key = layer_of(n)
        if key is not None:
            layers.setdefault(key, []).append(i)
    if len(layers) < fragments:
        return [[i] for i in range(len(names))]
    out: list[list[int]] = []
    for i, n in enumerate(names):  # a layer where its first parameter is
        key = layer_of(n)
        if key is None:
            out.append([i])
        elif layers[key][0] == i:
            out.append(layers[key])
    return out


def too_few(names: Sequence[str], fragments: int) -> str | None:
    """Why a model with these parameters cannot be split into ``fragments`` fragments, or None."""
    n = len(units(names, fragments))
    if n >= fragments:
        return None
    return (
        f"fragments {fragments}: the model has only {n} parameter tensors to split (each fragment needs one "
        "at least); lower cross_region.fragments"
    )


def assign(names: Sequence[str], numels: Sequence[int], fragments: int) -> list[int]:
    """The fragment of each parameter (in the order given). Raises ValueError when the model has fewer
    units than ``fragments`` (a fragment would be empty)."""
    if fragments < 1:
        raise ValueError(f"fragments must be at least 1, not {fragments}")
    why = too_few(names, fragments)
    if why is not None:
        raise ValueError(why)
    units_ = units(names, fragments)
    sizes = [0] * fragments
    out = [0] * len(names)
    order = sorted(range(len(units_)), key=lambda u: (-sum(numels[i] for i in units_[u]), u))
    for u in order:
        f = min(range(fragments), key=lambda k: (sizes[k], k))
        for i in units_[u]:
            out[i] = f
        sizes[f] += sum(numels[i] for i in units_[u])
    return out


def offsets(inner_steps: int, fragments: int) -> list[int]:
    """The step within a cycle of H at which each fragment is synced: ``floor(H*(p+1)/F)``."""
    return [inner_steps * (p + 1) // fragments for p in range(fragments)]


def round_step(k: int, inner_steps: int, fragments: int) -> int:
    """The step at which round ``k`` (1-based) starts: its fragment's offset in cycle ``(k-1) // F``."""
    c, p = divmod(k - 1, fragments)
    return c * inner_steps + offsets(inner_steps, fragments)[p]


def round_at(step: int, inner_steps: int, fragments: int) -> int:
    """The round that starts at ``step``, or 0 when none does."""
    if step <= 0:
        return 0
    c, rem = divmod(step, inner_steps)
    if rem == 0:
        c, rem = c - 1, inner_steps
    offs = offsets(inner_steps, fragments)
    return c * fragments + offs.index(rem) + 1 if rem in offs else 0


def fragment_of(k: int, fragments: int) -> int:
    """The fragment round ``k`` syncs."""
    return (k - 1) % fragments


def rounds_through(step: int, inner_steps: int, fragments: int) -> int:
    """The last round that starts at or before ``step`` (0: none yet)."""
    if step <= 0:
        return 0
    c, rem = divmod(step, inner_steps)
    return c * fragments + sum(1 for o in offsets(inner_steps, fragments) if o <= rem and o < inner_steps)
