"""What ``sbatch-gen doctor`` asks a Slurm cluster, asked once per run and shared by the checks. Torch-free.

Only read-only commands: ``scontrol show config|partition|node|hostnames`` and ``sacctmgr show qos``. A
command that answers with an error raises :class:`QueryFailed`; the check that needed it becomes an error row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sbatch_gen.doctor.common import Result, Runner, grace_seconds, parse_config, parse_oneliner, split_list
from sbatch_gen.loader import LoadedSite
from sbatch_gen.profiles.slurm import SlurmProfile
from sbatch_gen.render import Rendered


class QueryFailed(Exception):
    """A Slurm command answered with an error (the controller is down, a typo in a name, ...)."""

    def __init__(self, what: str, result: Result):
        super().__init__(f"{what}: {result.message()}")
        self.what = what
        self.result = result


@dataclass
class SlurmFacts:
    """The cluster's answers, each fetched once, on first use."""

    runner: Runner
    _cache: dict[str, object] = field(default_factory=dict)

    def _run(self, *argv: str) -> Result:
        return self.runner(argv)

    def _cached(self, key: str, fetch: Callable[[], object]) -> object:
        if key not in self._cache:
            self._cache[key] = fetch()
        return self._cache[key]

    def config(self) -> dict[str, str]:
        def fetch() -> dict[str, str]:
            r = self._run("scontrol", "show", "config")
            if r.rc != 0:
                raise QueryFailed("scontrol show config", r)
            return parse_config(r.out)

        return self._cached("config", fetch)  # type: ignore[return-value]

    def partitions(self) -> dict[str, dict[str, str]]:
        def fetch() -> dict[str, dict[str, str]]:
            r = self._run("scontrol", "-o", "show", "partition")
            if r.rc != 0:
                raise QueryFailed("scontrol -o show partition", r)
            recs = [parse_oneliner(line) for line in r.out.splitlines() if line.startswith("PartitionName=")]
            return {rec["PartitionName"]: rec for rec in recs}

        return self._cached("partitions", fetch)  # type: ignore[return-value]

    def nodes(self, partition: str) -> list[dict[str, str]]:
        """The nodes of a partition (``scontrol -o show node``, by each node's Partitions= list; where
        Slurm does not print that, by the partition's Nodes= expanded with ``scontrol show hostnames``)."""

        def fetch() -> list[dict[str, str]]:
            r = self._run("scontrol", "-o", "show", "node")
            if r.rc != 0:
                raise QueryFailed("scontrol -o show node", r)
            return [parse_oneliner(line) for line in r.out.splitlines() if line.startswith("NodeName=")]

        every: list[dict[str, str]] = self._cached("nodes", fetch)  # type: ignore[assignment]
        if any("Partitions" in n for n in every):
            return [n for n in every if partition in split_list(n.get("Partitions"))]
        expr = self.partitions()[partition].get("Nodes", "")
        if not expr or expr == "(null)":
            return []
        r = self._run("scontrol", "show", "hostnames", expr)
        if r.rc != 0:
            raise QueryFailed(f"scontrol show hostnames {expr}", r)
        names = set(r.out.split())
        return [n for n in every if n.get("NodeName") in names]

    def accounting(self) -> tuple[bool, set[str]]:
        """(the cluster runs slurmdbd, the AccountingStorageEnforce words)."""
        cfg = self.config()
        dbd = cfg.get("AccountingStorageType", "") == "accounting_storage/slurmdbd"
        enforce = {w.lower() for w in split_list(cfg.get("AccountingStorageEnforce"))} - {"none", "0"}
        return dbd, enforce

    def qos(self, name: str) -> tuple[str, int | None] | None:
        """(PreemptMode, GraceTime s) of a QOS from the accounting database; None if it has no such QOS."""

        def fetch() -> tuple[str, int | None] | None:
            r = self._run("sacctmgr", "-n", "-P", "show", "qos", name, "format=name,preemptmode,gracetime")
            if r.rc != 0:
                raise QueryFailed(f"sacctmgr show qos {name}", r)
            for line in r.out.splitlines():
                cols = line.strip().split("|")
                if len(cols) >= 3 and cols[0].lower() == name.lower():
                    return cols[1].strip(), grace_seconds(cols[2])
            return None

        return self._cached(f"qos:{name}", fetch)  # type: ignore[return-value]


@dataclass
class SlurmDoctor:
    site: LoadedSite
    profile: SlurmProfile
    renders: list[Rendered]
    facts: SlurmFacts
    runner: Runner
    cwd: Path
    user: str

    @property
    def partition(self) -> str:
        return self.profile.slurm.partition

    def part(self) -> dict[str, str] | None:
        return self.facts.partitions().get(self.partition)
