"""``sbatch-gen doctor``, Slurm: do the partition's nodes fit the profile (GPUs of the GRES type, CPUs,
memory, features), and are there enough of them, up? Torch-free."""

from __future__ import annotations

import re
from collections.abc import Callable

from sbatch_gen.doctor.common import Check, error, leading_int, ok, skip, split_list, warn
from sbatch_gen.doctor.slurm_facts import SlurmDoctor


def node_gpus(gres: str, gpu_type: str | None) -> int:
    """GPUs of a node's Gres= (``gpu:h200:8(S:0-1),nic:2``) of the given type (any type when None)."""
    total = 0
    for item in split_list(re.sub(r"\([^)]*\)", "", gres)):
        parts = item.split(":")
        if parts[0] != "gpu":
            continue
        typ: str | None = None
        if len(parts) == 1:
            count = 1
        elif len(parts) == 2 and parts[1].isdigit():
            count = int(parts[1])
        else:
            typ, count = parts[1], (leading_int(parts[2]) if len(parts) > 2 else 1) or 0
        if gpu_type is None or (typ is not None and typ.lower() == gpu_type.lower()):
            total += count
    return total


def node_cpus(node: dict[str, str]) -> int:
    return leading_int(node.get("CPUEfctv") or node.get("CPUTot")) or 0


def mem_mb(mem: str) -> int:
    """``480G`` -> MB (Slurm's unit without a suffix is MB)."""
    m = re.fullmatch(r"(\d+)([KMGT]?)", mem)
    if m is None:
        return 0
    n, unit = int(m.group(1)), m.group(2) or "M"
    return {"K": n // 1024, "M": n, "G": n * 1024, "T": n * 1024 * 1024}[unit]


def features_match(constraint: str, features: list[str]) -> bool | None:
    """Whether a node's features satisfy a constraint of plain names joined by ``&`` (or ``,``) or by ``|``;
    None for anything else (counts, brackets: the test-only row is the check for those)."""
    have = {f.lower() for f in features}
    if re.fullmatch(r"[\w.-]+([&,][\w.-]+)*", constraint):
        return all(f.lower() in have for f in re.split(r"[&,]", constraint))
    if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", constraint):
        return any(f.lower() in have for f in constraint.split("|"))
    return None


_BAD_STATES = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "FUTURE", "INVAL", "NOT_RESPONDING"}


def node_usable(node: dict[str, str]) -> bool:
    state = node.get("State", "")
    if state.endswith("*"):  # not responding
        return False
    return not ({s.upper() for s in re.split(r"[+]", state.rstrip("~#!%$@^-"))} & _BAD_STATES)


def _names(nodes: list[dict[str, str]], limit: int = 6) -> str:
    names = [n.get("NodeName", "?") for n in nodes]
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _grouped(nodes: list[dict[str, str]], key: Callable[[dict[str, str]], str]) -> str:
    groups: dict[str, list[dict[str, str]]] = {}
    for n in nodes:
        groups.setdefault(key(n), []).append(n)
    return "; ".join(f"{k} ({_names(v, 3)})" for k, v in groups.items())


def check_nodes(d: SlurmDoctor) -> list[Check]:
    s = d.profile.slurm
    gres = f"gpu:{s.gpu_type}:{s.gpus_per_node}" if s.gpu_type else f"gpu:{s.gpus_per_node}"
    exp_gpus = f">= {s.gpus_per_node} GPUs per node (gres {gres})"
    exp_cpus = f">= {s.cpus_per_task} CPUs per node (slurm.cpus_per_task)"
    exp_mem = f">= {s.mem} memory per node (slurm.mem)" if s.mem not in (None, "0") else "slurm.mem"
    exp_feat = f"features {s.constraint} (slurm.constraint)" if s.constraint else "slurm.constraint"
    exp_nodes = f">= {s.nodes} nodes that fit (slurm.nodes)"
    part = d.part()
    if part is None:
        gone = f"no partition {d.partition}"
        return [skip(c, e, gone) for c, e in [("gpus", exp_gpus), ("cpus", exp_cpus), ("nodes", exp_nodes)]]
    nodes = d.facts.nodes(d.partition)
    rows: list[Check] = []
    fits: list[Callable[[dict[str, str]], bool]] = []
    where = f"in partition {d.partition}"

    # GPUs
    if s.gpus_per_node == 0:
        rows.append(skip("gpus", "CPU site (slurm.gpus_per_node 0)", "-"))
    else:
        good = [n for n in nodes if node_gpus(n.get("Gres", ""), s.gpu_type) >= s.gpus_per_node]
        fits.append(lambda n: node_gpus(n.get("Gres", ""), s.gpu_type) >= s.gpus_per_node)
        have = _grouped(nodes, lambda n: n.get("Gres") or "(null)") or "no nodes"
        if good:
            rows.append(ok("gpus", exp_gpus, f"{len(good)} of {len(nodes)} nodes: {_names(good)}"))
        else:
            rows.append(
                error(
                    "gpus",
                    exp_gpus,
                    f"none of {len(nodes)} nodes {where}; Gres: {have}",
                    f"no node {where} has {gres}: set slurm.partition to a partition with such nodes, or "
                    "slurm.gpu_type / slurm.gpus_per_node to what the nodes have",
                )
            )

    # CPUs
    good = [n for n in nodes if node_cpus(n) >= s.cpus_per_task]
    fits.append(lambda n: node_cpus(n) >= s.cpus_per_task)
    if good:
        rows.append(ok("cpus", exp_cpus, f"{len(good)} of {len(nodes)} nodes: {_names(good)}"))
    else:
        most = max((node_cpus(n) for n in nodes), default=0)
        rows.append(
            error(
                "cpus",
                exp_cpus,
                f"at most {most} CPUs per node {where}",
                f"lower slurm.cpus_per_task to at most {most}, or use a partition with bigger nodes",
            )
        )

    # memory
    if s.mem in (None, "0"):
        rows.append(skip("memory", exp_mem, "unset or 0 (all of a node's memory)"))
    else:
        want = mem_mb(s.mem)
        good = [n for n in nodes if (leading_int(n.get("RealMemory")) or 0) >= want]
        fits.append(lambda n: (leading_int(n.get("RealMemory")) or 0) >= want)
        if good:
            rows.append(ok("memory", exp_mem, f"{len(good)} of {len(nodes)} nodes: {_names(good)}"))
        else:
            most = max((leading_int(n.get("RealMemory")) or 0 for n in nodes), default=0)
            rows.append(
                error(
                    "memory",
                    exp_mem,
                    f"at most RealMemory={most} MB per node {where}",
                    f"lower slurm.mem to at most {most}M (or 0 for all of a node's memory)",
                )
            )

    # features
    if not s.constraint:
        rows.append(skip("constraint", exp_feat, "unset"))
    else:
        constraint = s.constraint

        def feats(n: dict[str, str]) -> list[str]:
            return split_list(n.get("AvailableFeatures"))

        if features_match(constraint, []) is None:
            rows.append(
                skip(
                    "constraint",
                    exp_feat,
                    "an expression the doctor does not evaluate: see the test-only row",
                )
            )
        else:
            good = [n for n in nodes if features_match(constraint, feats(n))]
            fits.append(lambda n: bool(features_match(constraint, feats(n))))
            if good:
                rows.append(ok("constraint", exp_feat, f"{len(good)} of {len(nodes)} nodes: {_names(good)}"))
            else:
                have = _grouped(nodes, lambda n: n.get("AvailableFeatures") or "(null)") or "no nodes"
                rows.append(
                    error(
                        "constraint",
                        exp_feat,
                        f"no node {where} has them; features: {have}",
                        f"no node {where} has the features {constraint}: fix slurm.constraint, or use "
                        "another partition",
                    )
                )

    # how many nodes fit all of it
    fitting = [n for n in nodes if all(f(n) for f in fits)]
    usable = [n for n in fitting if node_usable(n)]
    max_nodes = leading_int(part.get("MaxNodes"))
    if max_nodes is not None and max_nodes < s.nodes:
        rows.append(
            error(
                "nodes",
                exp_nodes,
                f"MaxNodes={max_nodes} for partition {d.partition}",
                f"partition {d.partition} takes jobs of at most {max_nodes} nodes: lower slurm.nodes",
            )
        )
    elif len(fitting) < s.nodes:
        rows.append(
            error(
                "nodes",
                exp_nodes,
                f"{len(fitting)} of {len(nodes)} nodes {where} fit",
                f"the job can never start: {s.nodes} nodes asked, {len(fitting)} fit; lower slurm.nodes or "
                "use another partition",
            )
        )
    elif len(usable) < s.nodes:
        down = [n for n in fitting if not node_usable(n)]
        rows.append(
            warn(
                "nodes",
                exp_nodes,
                f"{len(fitting)} fit, {len(usable)} up; down or drained: "
                + _grouped(down, lambda n: n.get("State", "?")),
                f"the job waits until {s.nodes - len(usable)} more of these nodes are back (or the "
                "administrators resume them)",
            )
        )
    else:
        rows.append(ok("nodes", exp_nodes, f"{len(fitting)} fit ({len(usable)} up): {_names(fitting)}"))
    return rows
