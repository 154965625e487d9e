#!/usr/bin/env python3
"""sbatch-gen's node program: what runs on every node of a job, in Python: the preflight, the
environment's fingerprint and the training step's supervision (run-trainer).

One file, standard library only, Python 3.8 or newer: it runs with whatever python the node has once the
job's environment is active (the project's venv, a conda environment, a container image without
sbatch-gen), and imports nothing of the package. `sbatch-gen render` writes it beside the renders as
`sbatch-gen-node.py`, and every render that runs it pins its sha256: the Slurm job copies it into the run
dir (`<run dir>/node/`) before its first step, the SSH launcher ships it to every host with the node
program it already sends over ssh. A change to this file is one file in review, not one hunk per render.

    python3 sbatch-gen-node.py preflight NAME=VALUE...
    python3 sbatch-gen-node.py fingerprint
    python3 sbatch-gen-node.py run-trainer --stop-file FILE --stopped-rc N -- COMMAND...
    python3 sbatch-gen-node.py omp-threads CPUS PROCS

``preflight`` prints one line, ``preflight ok on NODE: ...`` on stdout (status 0) or ``preflight FAILED on
NODE: problem; problem...`` on stderr (status 1), where NODE is $SLURMD_NODENAME, else the host name (the
Slurm job's leave_behind reads the FAILED lines). ``preflight_settings`` lists the settings. /sys and /proc
are read under $SBATCH_GEN_SYSFS_ROOT (unset on a real node; a fake node in the tests); nvidia-smi and
numactl are looked up on PATH, as torchrun does. Torch is never imported here: what needs this node's python
and its packages (the trainer module, torch, torchrun's flags) is asked of that python in a subprocess.
``run-trainer`` runs torchrun (COMMAND) with SIGTERM ignored, turns a SIGTERM into a stop request, and
says in one line what the stop left (``run_trainer``). When torchrun exits non-zero without a completed stop
and ran the companion trainer of a cross-region run, node 0 announces the region's leave in the mailbox for
it (``leave_to_announce``, ``announce_leave``: this node's python runs ``-m sbatch_gen.train.xr.leave``,
bounded in time), so the other regions stop waiting for it at once; run-trainer's status stays COMMAND's.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping

# ---- small readers --------------------------------------------------------------------------------


def sysfs_root() -> str:
    """The root /sys and /proc are read under ($SBATCH_GEN_SYSFS_ROOT, empty on a real node)."""
    return os.environ.get("SBATCH_GEN_SYSFS_ROOT", "")


def read_line(path: str) -> str | None:
    """The first line of ``path`` without its newline; None if it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    if not text:
        return None
    return text.split("\n", 1)[0]


def cpulist_cpus(cpulist: str) -> list[int]:
    """The CPU numbers of a kernel cpulist ("0-3,8,10-11"); parts that are neither N nor N-M are skipped."""
    cpus: list[int] = []
    for part in re.sub(r"\s", "", cpulist).split(","):
        m = re.fullmatch(r"(\d+)-(\d+)", part)
        if m:
            cpus += range(int(m.group(1)), int(m.group(2)) + 1)
        elif re.fullmatch(r"\d+", part):
            cpus.append(int(part))
    return cpus


def siblings_path(cpu: int) -> str:
    """Where sysfs lists the hardware threads of logical CPU ``cpu``'s core."""
    return f"{sysfs_root()}/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"


def physical_core(cpu: int) -> int | None:
    """The physical core of logical CPU ``cpu``, named by its first hardware thread (the first CPU of its
    thread_siblings_list), as torch names it; None when that cannot be read."""
    first = re.split(r"[,-]", read_line(siblings_path(cpu)) or "", maxsplit=1)[0]
    return int(first) if re.fullmatch(r"\d+", first) else None


def sorted_dirs(path: str) -> list[str]:
    """The names of the directories in ``path``, sorted (none if it cannot be listed)."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(n for n in names if os.path.isdir(os.path.join(path, n)))


def run(argv: list[str], timeout: float = 60.0) -> tuple[int, str, str]:
    """(status, stdout, stderr) of a command; 127 and a shell-like message when it cannot be started."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: command not found"
    except (OSError, subprocess.TimeoutExpired) as e:
        return 126, "", f"{argv[0]}: {e}"
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def iface_ipv4(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (SIOCGIFADDR: images without iproute2 too); None if none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = struct.pack("256s", name[:15].encode())
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24])
    except OSError:
        return None


def interface_names() -> list[str]:
    """The interfaces of this network namespace (/sys/class/net shows the one sysfs was mounted in)."""
    try:
        return sorted(n for _, n in socket.if_nameindex())
    except OSError:
        return sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []


# ---- topology.numa_binding ------------------------------------------------------------------------


def check_numa_binding(mode: str) -> tuple[bool, list[str]]:
    """topology.numa_binding MODE: (passed, [summary] or the problem lines).

    torchrun --numa-binding=MODE starts each worker under `numactl --physcpubind=<CPUs>`, the CPUs this
    process may use on the NUMA node of the worker's GPU, and raises (no fallback: the job fails, and would
    be requeued to fail again) when numactl is not on PATH or that set is empty. This repeats torch's own
    reading (torch/numa/binding.py, as of torch 2.13): GPU -> PCI address ->
    /sys/bus/pci/devices/<addr>/numa_node (-1, "no NUMA information", counts as node 0, as torch counts
    it) -> /sys/devices/system/node/node<N>/cpulist, intersected with Cpus_allowed_list of this process
    (the job step's cpuset, which torchrun inherits). Mode exclusive also needs a physical core per GPU of
    the node; mode socket needs a usable CPU on every NUMA node the kernel lists as possible.
    """
    root = sysfs_root()
    field = f"topology.numa_binding={mode}"
    problems: list[str] = []
    numactl = shutil.which("numactl")
    if numactl is None:
        problems.append(
            f"{field}: numactl is not on PATH; torchrun starts every worker under numactl and fails without it"
            " (install numactl on the node or in the image, or unset topology.numa_binding)"
        )
    allowed_list = ""
    try:
        with open(f"{root}/proc/self/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    allowed_list = line[len("Cpus_allowed_list:") :].strip()
    except OSError:
        pass
    if not allowed_list:
        return False, [*problems, f"{field}: cannot read Cpus_allowed_list from {root}/proc/self/status"]
    allowed = set(cpulist_cpus(allowed_list))
    rc, out, err = run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"])
    if rc != 0:
        first = (out + err).split("\n", 1)[0]
        return False, [*problems, f"{field}: nvidia-smi --query-gpu=index,uuid,pci.bus_id failed: {first}"]
    every: list[str] = []
    bus_of: dict[str, str] = {}
    uuid_of: dict[str, str] = {}
    for line in out.splitlines():
        parts = [x for x in re.split(r"[,\s]+", line.strip(), maxsplit=2) if x]
        if not parts:
            continue
        idx = parts[0]
        every.append(idx)
        uuid_of[idx] = parts[1] if len(parts) > 1 else ""
        bus_of[idx] = parts[2] if len(parts) > 2 else ""
    # The GPUs torchrun's workers get: CUDA_VISIBLE_DEVICES (indices or GPU-UUID prefixes), else every one.
    visible: list[str] = []
    cvd = re.sub(r"\s", "", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if cvd:
        entries = cvd.split(",")
        if entries[-1] == "":
            entries.pop()
        for e in entries:
            idx = ""
            if re.fullmatch(r"\d+", e) and e in bus_of:
                idx = e
            elif e.startswith("GPU-"):
                idx = next((k for k in every if uuid_of[k].startswith(e)), "")
            if not idx:
                print(
                    f"note: CUDA_VISIBLE_DEVICES entry {e} is no GPU that nvidia-smi lists: its NUMA node is not"
                    " checked",
                    file=sys.stderr,
                )
                continue
            visible.append(idx)
    else:
        visible = every
    gpus_on: dict[int, list[str]] = {}
    for idx in visible:
        bus = bus_of[idx].lower()
        # nvidia-smi: 00000000:18:00.0; sysfs and torch: 0000:18:00.0
        m = re.fullmatch(r"([0-9a-f]+):([0-9a-f]{2}:[0-9a-f]{2})\.[0-7]", bus)
        if not m:
            problems.append(
                f"{field}: GPU {idx}: cannot read its PCI address from nvidia-smi's pci.bus_id '{bus}'"
            )
            continue
        addr = f"{int(m.group(1), 16):04x}:{m.group(2)}.0"
        path = f"{root}/sys/bus/pci/devices/{addr}/numa_node"
        text = read_line(path) or ""
        if not re.fullmatch(r"-?\d+", text):
            problems.append(
                f"{field}: GPU {idx} ({addr}): cannot read its NUMA node from {path}, where torch reads it"
            )
            continue
        gpus_on.setdefault(max(int(text), 0), []).append(idx)
    summary: list[str] = []
    for node in sorted(gpus_on):
        gpus = ",".join(gpus_on[node])
        path = f"{root}/sys/devices/system/node/node{node}/cpulist"
        node_list = read_line(path)
        if node_list is None:
            problems.append(
                f"{field}: GPU {gpus} on NUMA node {node}, but {path} cannot be read (torch reads the node's CPUs there)"
            )
            continue
        usable = [c for c in cpulist_cpus(node_list) if c in allowed]
        cores: set[int] = set()
        unreadable = ""
        for c in usable if mode == "exclusive" else []:
            core = physical_core(c)
            if core is None:
                unreadable = f"{field}: cannot read the physical core of CPU {c} from {siblings_path(c)} (torch's exclusive mode reads it)"
                break
            cores.add(core)
        if unreadable:
            problems.append(unreadable)
            continue
        if not usable:
            problems.append(
                f"{field}: GPU {gpus} on NUMA node {node} (CPUs {node_list}), but this job step may only run on"
                f" CPUs {allowed_list}: torchrun fails to start its workers (give the step CPUs on every GPU's"
                " NUMA node, e.g. more slurm.cpus_per_task, or unset topology.numa_binding)"
            )
            continue
        k = len(gpus_on[node])
        if mode == "exclusive" and len(cores) < k:
            problems.append(
                f"{field}: NUMA node {node} has {len(cores)} physical cores this job step may use for its {k} GPUs"
                f" ({gpus}); torch's exclusive mode needs one per GPU (use node, or give the step more CPUs)"
            )
            continue
        summary.append(f"GPU {gpus} on NUMA node {node} ({len(usable)} usable CPUs)")
    if mode == "socket":
        # torch's socket mode takes one usable CPU of every NUMA node the kernel lists as possible
        # (memory-only nodes too, e.g. a GH200's GPU memory): a node without one makes it fail.
        possible = read_line(f"{root}/sys/devices/system/node/possible") or ""
        for node in cpulist_cpus(possible):
            if node in gpus_on:
                continue
            node_list = read_line(f"{root}/sys/devices/system/node/node{node}/cpulist") or ""
            if not any(c in allowed for c in cpulist_cpus(node_list)):
                problems.append(
                    f"{field}: NUMA node {node} has no CPU this job step may run on (CPUs: {node_list or 'none'});"
                    " torch's socket mode looks at every NUMA node and fails on it (use node)"
                )
    if problems:
        return False, problems
    return True, [
        f"numactl {numactl}; {', '.join(summary) or 'no GPU to bind'}; job step CPUs {allowed_list}"
    ]


# ---- nccl.ib_hca / nccl.ib_link_layer -------------------------------------------------------------


def ib_hca_in_use(profile_spec: str, env: Mapping[str, str]) -> tuple[str | None, str]:
    """What NCCL will read on this node, ENV being the environment the training step gets (the profile's
    exports are defaults: a value given at submit time, or in the SSH launcher's environment, wins):
    (the NCCL_IB_HCA to check, "" or how to name it when it is not the profile's) or (None, why nothing is
    checked). Not checked: NCCL_IB_DISABLE=1, an empty NCCL_IB_HCA (NCCL picks the adapters) and a '^' list
    (the adapters it leaves out)."""
    if env.get("NCCL_IB_DISABLE") == "1":
        return None, "NCCL_IB_DISABLE=1 in the environment: HCAs not checked"
    value = env.get("NCCL_IB_HCA", profile_spec)
    if value == profile_spec:
        return value, ""
    if not value:
        return None, "NCCL_IB_HCA empty in the environment (NCCL picks the adapters): HCAs not checked"
    if value.startswith("^"):
        return None, f"NCCL_IB_HCA={value} in the environment (adapters left out): HCAs not checked"
    return value, f"NCCL_IB_HCA={value} from the environment, not nccl.ib_hca's {profile_spec}"


def check_ib_hcas(spec: str, want: str, source: str = "nccl.ib_hca") -> tuple[bool, list[str]]:
    """nccl.ib_hca (SPEC, as NCCL_IB_HCA) and nccl.ib_link_layer (WANT): (passed, [summary] or problems),
    each problem opening with SOURCE, where SPEC comes from.

    SPEC is NCCL_IB_HCA as NCCL reads it: '=' first for exact names, else each name is a prefix and NCCL uses
    every adapter starting with it; name:port selects one port, a bare name every port of the adapter. NCCL
    uses a selected port whatever its link layer, so an Ethernet storage or management port in the list
    carries training traffic. Every name must match an adapter in /sys/class/infiniband (a prefix: at least
    one), and every port it selects must have WANT in ports/<port>/link_layer (InfiniBand, or Ethernet for
    RoCE) and be ACTIVE in ports/<port>/state: NCCL silently skips a port that is down, leaving the node a
    link short.
    """
    base = f"{sysfs_root()}/sys/class/infiniband"
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    adapters = sorted_dirs(base)
    have = []
    for d in adapters:
        lls = [
            f"{p}:{read_line(f'{base}/{d}/ports/{p}/link_layer') or '?'}"
            for p in sorted_dirs(f"{base}/{d}/ports")
        ]
        have.append(f"{d} (port {' '.join(lls) or 'none'})")
    problems: list[str] = []
    checked: list[str] = []
    entries = spec.split(",")
    if entries and entries[-1] == "":
        entries.pop()
    for entry in entries:
        name, _, port = entry.partition(":")
        devs = [d for d in adapters if (d == name if exact else d.startswith(name))]
        if not devs:
            what = (
                f"adapter {name}" if exact else f"adapter starting with {name} (nccl.ib_hca_exact is false)"
            )
            problems.append(
                f"{source}: no {what} on this node; have: {', '.join(have) or 'none (no RDMA driver loaded?)'}"
            )
            continue
        for dev in devs:
            ports = [port] if port else sorted_dirs(f"{base}/{dev}/ports")
            if not ports:
                problems.append(f"{source}: adapter {dev} has no ports in {base}/{dev}/ports")
            for p in ports:
                ll = read_line(f"{base}/{dev}/ports/{p}/link_layer")
                if ll is None:
                    problems.append(
                        f"{source}: adapter {dev} has no port {p} ({base}/{dev}/ports/{p}/link_layer cannot be read)"
                    )
                elif ll != want:
                    problems.append(
                        f"{source}: {dev} port {p} has link layer {ll}, but nccl.ib_link_layer is {want}: NCCL"
                        f" would send training traffic over it (take it out of nccl.ib_hca, name the right port"
                        f" as {dev}:N, or set nccl.ib_link_layer)"
                    )
                else:
                    state = read_line(f"{base}/{dev}/ports/{p}/state")
                    if state is not None and state.endswith("ACTIVE"):
                        checked.append(f"{dev}:{p}")
                    else:
                        problems.append(
                            f"{source}: {dev} port {p} is not active (state: {state or 'unreadable'}): NCCL"
                            " leaves out a port that is not ACTIVE, so this node would train on fewer links than"
                            " the others (bring the link up or drain the node)"
                        )
    if problems:
        return False, problems
    return True, [f"{' '.join(checked)}: {want}"]


# ---- the rendezvous -------------------------------------------------------------------------------


def check_rendezvous(host: str, port: int, node_id: int, nnodes: int, timeout: float) -> tuple[bool, str]:
    """Node 0 listens on the c10d port for a moment and every other node connects to it, so a busy port, a
    wrong address or a firewall shows up here and not as a hang inside torchrun. Without a host only node
    0's port is tried. (passed, what it found or the problem)."""
    deadline = time.monotonic() + timeout
    if host:
        try:
            socket.getaddrinfo(host, port)
        except OSError as e:
            return False, f"rendezvous host {host} does not resolve: {e}"
    if node_id == 0:
        srv = socket.socket()
        with srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                srv.bind(("", port))
            except OSError as e:
                return (
                    False,
                    f"cannot listen on rendezvous port {port}: {e.strerror} (torchrun.rdzv_port; another launch?)",
                )
            srv.listen(nnodes)
            srv.settimeout(1.0)
            seen = 0
            while host and seen < nnodes - 1:
                if time.monotonic() > deadline:
                    return (
                        False,
                        f"only {seen} of {nnodes - 1} other nodes reached {host}:{port} within {timeout:g} s",
                    )
                try:
                    conn, _ = srv.accept()
                except OSError:  # the accept timed out (socket.timeout, an OSError before Python 3.10 too)
                    continue
                with conn:
                    conn.settimeout(5.0)
                    try:
                        while conn.recv(64):
                            pass
                    except OSError:
                        pass
                seen += 1
        return True, f"rendezvous port {port} free" + (
            f", {seen} other nodes reached {host}" if host and seen else ""
        )
    if not host:
        return True, ""
    while True:
        try:
            with socket.create_connection((host, port), timeout=5.0) as c:
                c.sendall(b"preflight")
            return True, f"rendezvous {host}:{port} reached"
        except OSError as e:
            if time.monotonic() > deadline:
                return False, f"rendezvous endpoint {host}:{port} not reachable within {timeout:g} s: {e}"
            time.sleep(0.5)


# ---- the run's bucket ------------------------------------------------------------------------------

# Run by this node's python (the trainer's, with its boto3) as `python -c`, argv[1] a JSON object of the
# s3_* settings: a LIST of at most one key under the prefix, with the credentials the trainer will use (the
# variables it names, else the shared-credentials profile, else boto3's default chain), one attempt, within
# the timeout to connect and to read. Prints one JSON object: the endpoint it asked, and, on failure, the
# problem and the profile field most likely behind it. Never prints a credential.
S3_PROBE = r"""
import json, os, sys
s = json.loads(sys.argv[1])
creds = "cross_region.transport.credentials"
out = {"endpoint": s.get("s3_endpoint") or "(AWS)"}
def done(error=None, key=None):
    if error is not None:
        out["error"], out["key"] = " ".join(str(error).split())[:300], key
    print(json.dumps(out))
    sys.exit(0)
try:
    import boto3, botocore.config, botocore.exceptions
except Exception as e:
    done(f"boto3 not importable by {sys.executable}: {type(e).__name__}: {e}", "python_env")
kw = {}
if s.get("s3_key_env"):
    for arg, field in (("aws_access_key_id", "s3_key_env"), ("aws_secret_access_key", "s3_secret_env"),
                       ("aws_session_token", "s3_token_env")):
        name = s.get(field)
        if not name:
            continue
        value = os.environ.get(name)
        if not value:
            which = {"s3_key_env": "access_key_id_env", "s3_secret_env": "secret_access_key_env",
                     "s3_token_env": "session_token_env"}[field]
            done(f"environment variable {name} is not set on this node", f"{creds}.{which}")
        kw[arg] = value
t = float(s.get("s3_timeout_s") or 10)
try:
    session = boto3.session.Session(profile_name=s.get("s3_profile") or None,
                                    region_name=s.get("s3_region") or None, **kw)
    client = session.client("s3", endpoint_url=s.get("s3_endpoint") or None, config=botocore.config.Config(
        connect_timeout=t, read_timeout=t, retries={"total_max_attempts": 1, "mode": "standard"},
        s3={"addressing_style": s.get("s3_addressing") or "auto"}))
    out["endpoint"] = client.meta.endpoint_url
    prefix = (s.get("s3_prefix") or "").strip("/")
    client.list_objects_v2(Bucket=s["s3_bucket"], Prefix=prefix + "/" if prefix else "", MaxKeys=1)
except botocore.exceptions.ProfileNotFound as e:
    done(e, creds + ".profile")
except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError) as e:
    done(e, creds)
except botocore.exceptions.ClientError as e:
    err = e.response.get("Error", {})
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    code, msg = err.get("Code", ""), err.get("Message", "")
    key = "cross_region.transport.bucket" if code == "NoSuchBucket" or status == 404 else creds
    said = " ".join(dict.fromkeys(str(x) for x in (status, code) if x))  # "404 404": once
    done(said + (f": {msg}" if msg else ""), key)
except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError,
        botocore.exceptions.ReadTimeoutError) as e:
    done(e, "cross_region.transport.endpoint_url")
except Exception as e:
    done(f"{type(e).__name__}: {e}", "cross_region.transport")
done()
"""

S3_SETTINGS = (
    "s3_bucket",
    "s3_prefix",
    "s3_endpoint",
    "s3_addressing",
    "s3_region",
    "s3_profile",
    "s3_key_env",
    "s3_secret_env",
    "s3_token_env",
    "s3_timeout_s",
)


def check_bucket(python: str, s: dict[str, str]) -> tuple[bool, str]:
    """Whether this node reaches the run's bucket (S3_PROBE, run by ``python``): (passed, what it found or
    the problem, with the bucket, the endpoint and the profile field)."""
    timeout = float(s["s3_timeout_s"] or 10)
    settings = {k: s[k] for k in S3_SETTINGS if s[k]}
    where = f"s3 bucket {s['s3_bucket']}"
    # importing boto3 takes a second or two; one connect and one read of at most the timeout each
    rc, out, err = run([python, "-c", S3_PROBE, json.dumps(settings)], timeout=2 * timeout + 30)
    try:
        got = json.loads(out.strip().splitlines()[-1]) if rc == 0 and out.strip() else None
    except ValueError:
        got = None
    if not isinstance(got, dict):
        said = one_line(err)[-300:] or f"status {rc}"
        return False, f"cannot check {where} with {python}: {said} (cross_region.transport)"
    at = f"{where} at {got.get('endpoint')}"
    if got.get("error") is None:
        return True, f"{at} reachable"
    return False, f"cannot reach {at}: {got['error']} ({got.get('key') or 'cross_region.transport'})"


# ---- what this node's python finds ----------------------------------------------------------------

# Run by this node's python as `python -c` (the current directory first on sys.path, as for torchrun's
# workers): one JSON object: for each name, whether importlib finds it (its parent packages are imported,
# the module itself is not), and torchrun's source and torch's version, read, not imported (torch's own
# import takes seconds).
PROBE = r"""
import importlib.util, json, pathlib, re, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = importlib.util.find_spec(name) is not None
    except Exception:
        found[name] = False
run_py = version = None
try:
    root = pathlib.Path(importlib.util.find_spec("torch").origin).parent
    run_py = (root / "distributed" / "run.py").read_text()
    version = re.search("__version__ = .([0-9][^'\x22]*)", (root / "version.py").read_text()).group(1)
except Exception:
    run_py = version = None
print(json.dumps({"found": found, "run_py": run_py, "version": version}))
"""


def probe_python(python: str, names: list[str]) -> dict | None:
    """What ``python`` finds (PROBE) from the current directory; None if it could not say."""
    rc, out, _ = run([python, "-c", PROBE, *names], timeout=120.0)
    try:
        got = json.loads(out.strip().splitlines()[-1]) if rc == 0 and out.strip() else None
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def _has_flag(run_py: str, flag: str) -> bool:
    """Whether torchrun's source (torch/distributed/run.py) names FLAG (or its underscore spelling)."""
    return flag in run_py or flag[:2] + flag[2:].replace("-", "_") in run_py


# torchrun flags a render may use that older torch releases lack: the first torch release whose
# torch/distributed/run.py has each (read from the released wheels: 2.8.0 has none of them, 2.9.0
# --numa-binding, 2.10.0 --signals-to-handle too, 2.12.0 --shutdown-timeout too), and the profile field that
# puts it on torchrun's command line. validate and doctor say it before submission (sbatch_gen/launch.py), the
# preflight checks every node's torch before torchrun would refuse them.
TORCHRUN_FLAG_SINCE = {
    "--numa-binding": (2, 9),
    "--signals-to-handle": (2, 10),
    "--shutdown-timeout": (2, 12),
}
TORCHRUN_FLAG_KEY = {
    "--numa-binding": "topology.numa_binding",
    "--signals-to-handle": "trainer.stop_protocol",
    "--shutdown-timeout": "trainer.stop_protocol",
}
# Under stop_protocol sbatch-gen these two only keep SIGTERM from torchrun's agent (the stop goes through the
# stop file) and bound the shutdowns after signals no stop sends: on a torch without them, run-trainer starts
# torchrun through its compat shim instead, which keeps SIGTERM from the agent itself, and drops them
# (torchrun_command, torchrun_main --keep-sigterm).
COMPAT_FLAGS = ("--signals-to-handle", "--shutdown-timeout")


def newer_flags(argv: list[str]) -> list[str]:
    """The flags of TORCHRUN_FLAG_SINCE that torchrun's arguments ARGV give, in their order."""
    names = [a.split("=", 1)[0] for a in argv]
    return [f for f in dict.fromkeys(names) if f in TORCHRUN_FLAG_SINCE]


def _flag_settings(flags: str, stop_protocol: str) -> list[tuple[str, str, str, bool]]:
    """torchrun_flags (names, comma-separated) under STOP_PROTOCOL: (flag, its profile field, the first torch
    with it, whether run-trainer's compat shim does without it)."""
    out = []
    for flag in filter(None, flags.split(",")):
        key = TORCHRUN_FLAG_KEY.get(flag, flag)
        if key == "trainer.stop_protocol":
            key += f": {stop_protocol}"
        since = ".".join(map(str, TORCHRUN_FLAG_SINCE[flag])) if flag in TORCHRUN_FLAG_SINCE else ""
        out.append((flag, key, since, stop_protocol == "sbatch-gen" and flag in COMPAT_FLAGS))
    return out


def missing_torchrun_flags(flags: str, probe: dict | None, stop_protocol: str = "sbatch-gen") -> list[str]:
    """The problems of torchrun_flags: flags this render uses that this node's torchrun lacks (its
    torch/distributed/run.py does not name them) and that torchrun cannot do without (not ``compat``:
    :func:`shimmed_torchrun_flags`). No torch at all is the torch check's to report."""
    if not probe or probe.get("run_py") is None or probe.get("version") is None:
        return []
    problems = []
    for flag, key, since, compat in _flag_settings(flags, stop_protocol):
        if not compat and not _has_flag(probe["run_py"], flag):
            need = f"torch >= {since}" if since else "a newer torch"
            problems.append(f"torchrun of torch {probe['version']} has no {flag} ({key}): use {need}")
    return problems


def shimmed_torchrun_flags(flags: str, probe: dict | None, stop_protocol: str = "sbatch-gen") -> list[str]:
    """The ``compat`` flags of torchrun_flags this node's torchrun lacks: run-trainer starts it through the
    compat shim (:func:`torchrun_main`) without them."""
    if not probe or probe.get("run_py") is None:
        return []
    settings = _flag_settings(flags, stop_protocol)
    return [f for f, _, _, compat in settings if compat and not _has_flag(probe["run_py"], f)]


# ---- the environment's fingerprint ------------------------------------------------------------------


def env_fingerprint() -> str:
    """python_env in one line: torch's version, Python's, the architecture, and a digest of every installed
    package's name and version, read from their metadata (nothing is imported). paths.pin_code: a run
    records it when it is submitted; every attempt, on every node, must find the same."""
    import hashlib
    import importlib.metadata as md

    dists = sorted({f"{d.metadata['Name']}=={d.version}" for d in md.distributions() if d.metadata["Name"]})
    try:
        torch = md.version("torch")
    except md.PackageNotFoundError:
        torch = "none"
    digest = hashlib.sha256("\n".join(dists).encode()).hexdigest()[:16]
    return f"torch {torch}, Python {platform.python_version()} on {platform.machine()}, {len(dists)} packages ({digest})"


def fingerprint_main(args: list[str]) -> int:
    """`fingerprint`: print env_fingerprint()."""
    if args:
        print("usage: sbatch-gen-node.py fingerprint", file=sys.stderr)
        return 2
    print(env_fingerprint())
    return 0


# ---- the CPU threads per process ----------------------------------------------------------------------


def cores_per_cpu(cpus: list[int]) -> float:
    """The physical cores among these logical CPUs, per CPU: 1.0 without SMT, 0.5 with two hardware threads
    per core (:func:`physical_core`); 1.0 when a CPU's core cannot be read."""
    cores = set()
    for c in cpus:
        core = physical_core(c)
        if core is None:
            return 1.0
        cores.add(core)
    return len(cores) / len(cpus) if cpus else 1.0


def omp_threads(cpus: int, procs: int, affinity: list[int]) -> int:
    """OMP_NUM_THREADS for each of ``procs`` processes sharing ``cpus`` allocated CPUs: an even share of the
    physical cores among them (Slurm counts hardware threads as CPUs; torch's intra-op threads gain nothing
    from a core's second thread), as the CPUs this process may run on (``affinity``) are made; at least 1."""
    return max(1, int(cpus * cores_per_cpu(affinity) + 0.5) // max(1, procs))


def omp_threads_main(args: list[str]) -> int:
    """omp-threads CPUS PROCS: prints :func:`omp_threads` for the CPUs this process may run on."""
    if len(args) != 2 or not all(a.isdigit() for a in args):
        print("usage: sbatch-gen-node.py omp-threads CPUS PROCS", file=sys.stderr)
        return 2
    print(omp_threads(int(args[0]), int(args[1]), sorted(os.sched_getaffinity(0))))
    return 0


# ---- the preflight ----------------------------------------------------------------------------------

# The preflight's settings and their defaults (empty or 0: not checked). The launchers pass them as
# NAME=VALUE words (templates/slurm-job.sh.j2: preflight_nodes, with the training script's PREFLIGHT_ARGS;
# templates/ssh-lib.sh.j2: preflight_main, from the launcher's settings), then, after `--`, torchrun's
# arguments where the launcher has them (the Slurm job's TORCHRUN_ARGS): the torchrun flags (torchrun_flags)
# and the NUMA binding (numa) checked are those it gives.
#   setup_error=E     what went wrong before this program could run (the SSH launcher's cd to the launch
#                     directory, the python_env activation): reported first; nothing that needs the
#                     environment's python is checked then
#   module=M          trainer.module: importable, with torch, by this node's python (torchrun on PATH too)
#   script=S          trainer.script: readable; torch importable by this node's python (torchrun on PATH too)
#   torchrun_flags=L  FLAG,...: torchrun flags this render uses that older torch releases lack; this node's
#                     torch must have each (its torch/distributed/run.py names it; TORCHRUN_FLAG_SINCE), but
#                     those run-trainer's compat shim does without (COMPAT_FLAGS, under stop_protocol sbatch-gen)
#   stop_protocol=P   trainer.stop_protocol
#   config=F          trainer.config: readable
#   data=P            paths.data: exists
#   ifname=I          network.socket_ifname: exists and has an IPv4 address (NCCL/Gloo bind to it)
#   gpus=N gpus_key=K N GPUs per node, as the profile field K says. Exactly N must be visible
#                     (CUDA_VISIBLE_DEVICES, else what nvidia-smi lists): torchrun starts N processes and local
#                     rank i takes GPU i, so a missing GPU fails the job later, and an extra one idles, unnoticed,
#                     because the profile is wrong for this node (OMP_NUM_THREADS is the cores / N as well).
#   log_topology=1    log `nvidia-smi topo -m` (GPU sites)
#   numa=MODE         topology.numa_binding: check_numa_binding
#   hcas=H link_layer=L   nccl.ib_hca as NCCL_IB_HCA and nccl.ib_link_layer: check_ib_hcas, of the
#                     NCCL_IB_HCA the training step gets (ib_hca_in_use: a value given at submit time wins)
#   run_dir=R         paths.run_dir: created if missing, writable
#   shared_marker=F   a file node 0's launcher wrote into the run dir: every other node must see it, or the
#                     run dir is not one filesystem all nodes share (checkpoints and stop files need one)
#   node_id=I nnodes=N   this node's rank (0: the rendezvous host) and the node count
#   rdzv_port=P       torchrun.rdzv_port: node 0 can listen on it (no other launch holds it)
#   rdzv_host=H connect_timeout_s=T   and every other node reaches H:P within T s (every node runs its
#                     preflight at the same time, as srun does)
#   health_check=CMD  preflight.health_check: the site's own node check, run by bash; non-zero fails the node
#   env_fingerprint=F paths.pin_code: the fingerprint of the python_env the run started with
#                     (env_fingerprint); this node's must be the same
#   s3_bucket=B s3_prefix=P s3_endpoint=URL s3_addressing=A s3_region=R s3_profile=N s3_key_env=V
#   s3_secret_env=V s3_token_env=V s3_timeout_s=T   cross_region's s3 transport: this node's python lists at
#                     most one key of bucket B under P with the credentials the trainer will use (the
#                     variables named, else the profile N, else boto3's chain), T s to connect and to read
#                     (check_bucket); the launcher delivers the variables' values (sbatch_gen/credentials.py)
PREFLIGHT_SETTINGS = {
    "setup_error": "",
    "module": "",
    "script": "",
    "torchrun_flags": "",
    "stop_protocol": "sbatch-gen",
    "config": "",
    "data": "",
    "ifname": "",
    "gpus": "0",
    "gpus_key": "",
    "log_topology": "0",
    "numa": "",
    "hcas": "",
    "link_layer": "",
    "run_dir": "",
    "shared_marker": "",
    "node_id": "0",
    "nnodes": "1",
    "rdzv_port": "",
    "rdzv_host": "",
    "connect_timeout_s": "60",
    "health_check": "",
    "env_fingerprint": "",
    "s3_bucket": "",
    "s3_prefix": "",
    "s3_endpoint": "",
    "s3_addressing": "",
    "s3_region": "",
    "s3_profile": "",
    "s3_key_env": "",
    "s3_secret_env": "",
    "s3_token_env": "",
    "s3_timeout_s": "",
}


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def working_dir() -> str:
    """The current directory as the launcher's shell names it ($PWD when that is where we are)."""
    pwd = os.environ.get("PWD", "")
    try:
        if pwd and os.path.samefile(pwd, "."):
            return pwd
    except OSError:
        pass
    return os.getcwd()


def preflight(s: dict[str, str]) -> tuple[list[str], list[str]]:
    """Every check the settings ask for: (what passed, the problems), in the order of the node's line."""
    ok: list[str] = []
    bad: list[str] = []
    node = node_name()
    pwd = working_dir()
    python = ""
    if s["setup_error"]:
        bad.append(s["setup_error"])
    else:
        found = shutil.which("python")
        if found is None:
            bad.append("python not found on PATH (python_env)")
        else:
            python = found
            ok.append(f"{platform.machine()} python {platform.python_version()} {python}")
    if python:
        torchrun = shutil.which("torchrun")
        if torchrun:
            ok.append(f"torchrun {torchrun}")
        else:
            bad.append("torchrun not found on PATH (python_env)")
    if python and s["env_fingerprint"]:
        # this program runs on the environment's python (`python -I`): its packages are the environment's
        now = env_fingerprint()
        if now == s["env_fingerprint"]:
            ok.append("python_env as the run started (paths.pin_code)")
        else:
            bad.append(
                f"python_env is not the one the run started with: it is {now}, the run's is "
                f"{s['env_fingerprint']} (paths.pin_code)"
            )
    entry = s["module"] or s["script"]
    probe = None
    if python and (entry or s["torchrun_flags"]):
        probe = probe_python(python, [s["module"], "torch"] if s["module"] else ["torch"])
    if python and s["torchrun_flags"]:
        bad += missing_torchrun_flags(s["torchrun_flags"], probe, s["stop_protocol"])
        shimmed = shimmed_torchrun_flags(s["torchrun_flags"], probe, s["stop_protocol"])
        if shimmed and probe:
            ok.append(
                f"torch {probe['version']}: torchrun without {', '.join(shimmed)}, through run-trainer's compat shim"
            )
    torch_missing = f"torch not importable by {python} from {pwd} (python_env)"
    if s["script"]:
        if os.access(s["script"], os.R_OK):
            ok.append(f"trainer script {s['script']}")
        else:
            bad.append(f"trainer script {s['script']} not readable from {pwd} (trainer.script)")
        if python:
            if probe and probe["found"].get("torch"):
                ok.append("torch importable")
            else:
                bad.append(torch_missing)
    if python and s["module"]:
        found_names = probe["found"] if probe else {}
        if not found_names.get(s["module"]):
            bad.append(
                f"trainer module {s['module']} not importable by {python} from {pwd} (trainer.module, python_env)"
            )
        if not found_names.get("torch"):
            bad.append(torch_missing)
        if found_names.get(s["module"]) and found_names.get("torch"):
            ok.append(f"{s['module']} and torch importable")
    if s["config"]:
        if os.access(s["config"], os.R_OK):
            ok.append(f"train config {s['config']}")
        else:
            bad.append(f"train config {s['config']} not readable from {pwd} (trainer.config)")
    if s["data"]:
        if os.path.exists(s["data"]):
            ok.append(f"data path {s['data']}")
        else:
            bad.append(f"data path {s['data']} does not exist (paths.data)")
    if s["ifname"]:
        addr = iface_ipv4(s["ifname"])
        if addr:
            ok.append(f"interface {s['ifname']} {addr}")
        else:
            names = interface_names()
            if s["ifname"] in names:
                bad.append(f"network interface {s['ifname']} has no IPv4 address (network.socket_ifname)")
            else:
                bad.append(
                    f"network interface {s['ifname']} does not exist (network.socket_ifname); have: {' '.join(names)}"
                )
    gpus = int(s["gpus"] or 0)
    if gpus > 0:
        if shutil.which("nvidia-smi") is None:
            bad.append(f"nvidia-smi not found, but the site has {gpus} GPUs per node ({s['gpus_key']})")
        else:
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            if cvd:
                visible = len([x for x in cvd.split(",") if x])
            else:
                visible = len([x for x in run(["nvidia-smi", "-L"])[1].splitlines() if x.startswith("GPU ")])
            if visible == gpus:
                ok.append(f"{visible} GPUs")
            else:
                bad.append(f"{visible} GPUs visible, the profile expects {gpus} ({s['gpus_key']})")
            if s["log_topology"] not in ("", "0"):
                _, out, err = run(["nvidia-smi", "topo", "-m"])
                for line in (out + err).splitlines():
                    print(f"[{node} topo] {line}", flush=True)
    if s["numa"]:
        passed, lines = check_numa_binding(s["numa"])
        if passed:
            ok.append(f"NUMA binding {s['numa']}: {lines[0]}")
        else:
            bad += lines
    if s["hcas"]:
        spec, said = ib_hca_in_use(s["hcas"], os.environ)
        if spec is None:
            ok.append(said)
        else:
            passed, lines = check_ib_hcas(spec, s["link_layer"], said or "nccl.ib_hca")
            if passed:
                ok.append(f"HCAs {lines[0]}{f' ({said})' if said else ''}")
            else:
                bad += lines
    if s["run_dir"]:
        probe_file = f"{s['run_dir']}/.preflight.{node}.{os.getpid()}"
        try:
            os.makedirs(s["run_dir"], exist_ok=True)
            with open(probe_file, "w"):
                pass
            os.unlink(probe_file)
            ok.append(f"run dir {s['run_dir']} writable")
        except OSError:
            bad.append(f"run dir {s['run_dir']} cannot be created or is not writable (paths.run_dir)")
    if s["shared_marker"] and int(s["node_id"]) > 0:
        if os.path.exists(s["shared_marker"]):
            ok.append("run dir shared with node 0")
        else:
            bad.append(
                f"run dir {s['run_dir']} is not the one node 0 sees (checkpoints need a filesystem all nodes share)"
            )
    if s["health_check"]:
        try:
            p = subprocess.run(
                ["bash", "-c", s["health_check"]],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                check=False,
            )
            rc, out = p.returncode, p.stdout.decode(errors="replace")
        except OSError as e:
            rc, out = 127, str(e)
        if rc == 0:
            ok.append("health check passed")
        else:
            last = [x for x in out.splitlines() if x][-1:]
            said = f": {last[0][:300]}" if last else ""
            bad.append(f"health check failed{said} (preflight.health_check)")
    if python and s["s3_bucket"]:
        passed, said = check_bucket(python, s)
        (ok if passed else bad).append(said)
    # The rendezvous last: it waits for the other nodes. After a failure only node 0's port is tried (the
    # launcher ends the other nodes' preflights when one fails).
    if python and s["rdzv_port"]:
        host = "" if bad else s["rdzv_host"]
        passed, said = check_rendezvous(
            host, int(s["rdzv_port"]), int(s["node_id"]), int(s["nnodes"]), float(s["connect_timeout_s"])
        )
        if passed:
            if said:
                ok.append(said)
        else:
            bad.append(said or "rendezvous check failed")
    return ok, bad


def preflight_main(args: list[str]) -> int:
    """`preflight NAME=VALUE... [-- TORCHRUN_ARG...]`: check this node and say so in one line (see the
    module's docstring and PREFLIGHT_SETTINGS)."""
    s = dict(PREFLIGHT_SETTINGS)
    cut = args.index("--") if "--" in args else len(args)
    argv = args[cut + 1 :]
    for a in args[:cut]:
        name, eq, value = a.partition("=")
        if not eq or name not in s:
            print(f"preflight: unknown setting '{a}'", file=sys.stderr)
            return 2
        s[name] = value
    # torchrun's own arguments: the flags it is given, and its NUMA binding
    s["torchrun_flags"] = ",".join(filter(None, (s["torchrun_flags"], *newer_flags(argv))))
    for i, a in enumerate(argv):
        if a.startswith("--numa-binding=") or (a == "--numa-binding" and i + 1 < len(argv)):
            s["numa"] = a.split("=", 1)[1] if "=" in a else argv[i + 1]
    # the node's one line is the contract: a bug in a check is one problem in it, not a traceback
    try:
        ok, bad = preflight(s)
    except Exception as e:
        ok, bad = [], [f"the preflight itself failed: {type(e).__name__}: {e} (sbatch-gen-node.py)"]
    node = node_name()
    if bad:
        print(f"preflight FAILED on {node}: {'; '.join(bad)}", file=sys.stderr, flush=True)
        # under srun --kill-on-bad-exit this task's exit tears the step down at once, and the line above
        # could be lost on its way to the batch log: give the forwarding a moment first
        if os.environ.get("SLURM_STEP_ID"):
            time.sleep(1)
        return 1
    print(f"preflight ok on {node}: {', '.join(ok)}", flush=True)
    return 0


# ---- run-trainer: the training step on one node ----------------------------------------------------

# What the trainer writes beside the stop file (sbatch_gen/contract.py: this program imports nothing of the
# package; tests/node checks they are the same).
ACK_SUFFIX = ".ack"
STOPPING_SUFFIX = ".stopping"
FATAL_SUFFIX = ".fatal"


def log(message: str) -> None:
    """One line on stderr, as the launchers' bash `log` writes it: ``[sbatch-gen <UTC time>] MESSAGE``. Never
    fails (the node's log may be gone when a signal arrives)."""
    line = f"[sbatch-gen {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}] {message}\n"
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def one_line(text: str) -> str:
    """``text`` with its control characters (a newline in a JSON string) as spaces."""
    return "".join(c if c >= " " else " " for c in text)


def stop_outcome(stop_file: str) -> str | None:
    """What a stop left behind, in one line: from STOP_FILE.ack (JSON, the first rank of every node writes it
    once the stop checkpoint is complete) "stopped after step N (why): checkpoint PATH complete" (or "nothing
    to checkpoint yet"); else the trainer's own line in STOP_FILE.stopping (the save it began did not
    complete: what the next attempt redoes); None when there is neither."""
    ack = stop_file + ACK_SUFFIX
    if os.path.exists(ack):
        record: object = None
        try:
            with open(ack, "rb") as f:
                record = json.loads(f.read(4000).decode("utf-8", "replace"))
        except (OSError, ValueError):
            pass
        got = record if isinstance(record, dict) else {}
        step, ckpt, why = got.get("step"), got.get("checkpoint"), got.get("reason")
        step = str(step) if isinstance(step, int) and not isinstance(step, bool) else "?"
        why = one_line(why) if isinstance(why, str) and why else "stop requested"
        held = (
            f"checkpoint {one_line(ckpt)} complete"
            if isinstance(ckpt, str) and ckpt
            else "nothing to checkpoint yet"
        )
        return f"stopped after step {step} ({why}): {held}"
    stopping = stop_file + STOPPING_SUFFIX
    if os.path.exists(stopping):
        said = read_line(stopping) or ""
        return f"WARNING: the stop checkpoint did not complete: {one_line(said[:500])}"
    return None


def child_pids(pid: int) -> list[int]:
    """The children of process ``pid``: /proc/PID/task/*/children, else (a kernel without
    CONFIG_PROC_CHILDREN) every process whose parent /proc/N/stat names PID."""
    kids: list[int] = []
    listed = False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                kids += [int(x) for x in f.read().split()]
            listed = True
        except (OSError, ValueError):
            pass
    if not listed:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 1 and fields[1] == str(pid):
                kids.append(int(name))
    return sorted(set(kids))


class TrainingStep:
    """One node's training step: COMMAND (torchrun) and the SIGTERM handler of this program around it."""

    def __init__(self, stop_file: str, node: str) -> None:
        self.stop_file = stop_file
        self.node = node
        self.pid = 0  # COMMAND's, once started
        self.ended = False  # COMMAND has exited (and was reaped)

    def on_sigterm(self, signum: int, frame: object) -> None:  # noqa: ARG002 - signal API
        """The SIGTERM handler: a failure in it is logged and never ends this program (it must wait for
        COMMAND and say what the stop left)."""
        try:
            self.stop()
        except Exception as e:
            log(f"WARNING: handling SIGTERM on {self.node} failed: {type(e).__name__}: {e}")

    def stop(self) -> None:
        """A SIGTERM to this program (Slurm signals every process of the job step on a preemption, a requeue
        or scancel): the stop request, in this order, which the trainer relies on:

        1. a line in the stop file, "SIGTERM to the training step on NODE", written and closed, then one log
           line;
        2. only then SIGTERM to COMMAND's children, torchrun's workers (torchrun itself ignores it), which may
           not get Slurm's own (process-group tracking; torchrun starts them in sessions of their own).

        A worker that gets a SIGTERM therefore finds the stop file already there: the trainer can tell this
        stop from torchrun's own teardown after a crash (a SIGTERM with no stop file appearing shortly after).
        A stop file that cannot be written is logged; the SIGTERM still goes on (the workers' signal
        handler is then the only stop request). Every SIGTERM does both again."""
        if self.ended or not self.pid:
            return
        line = f"SIGTERM to the training step on {self.node}\n"
        try:
            with open(self.stop_file, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:
            log(
                f"WARNING: SIGTERM on {self.node}: cannot write the stop file {self.stop_file} ({e.strerror or e});"
                " the trainer hears of the stop from the SIGTERM alone"
            )
        else:
            log(f"SIGTERM on {self.node}: asking the trainer to checkpoint and stop ({self.stop_file})")
        for pid in child_pids(self.pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass  # gone meanwhile


def _ignore_sigterm() -> None:
    """COMMAND's process between fork and exec: SIGTERM ignored (torchrun inherits SIG_IGN), then the
    signal unblocked (the mask survives exec: blocked, the workers would never get it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])


# ---- an older torch: torchrun without --signals-to-handle / --shutdown-timeout ---------------------------


def this_torchrun_source() -> str | None:
    """torch/distributed/run.py of the torch this python finds (read, not imported), or None."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return None
        return (pathlib.Path(spec.origin).parent / "distributed" / "run.py").read_text()
    except (OSError, ImportError, ValueError):
        return None


def _after_env(command: list[str]) -> int:
    """Where COMMAND's program is: after ``env NAME=VALUE...`` (the SSH launcher's tagged torchrun), else 0."""
    at = 0
    if command and os.path.basename(command[0]) == "env":
        at = 1
        while at < len(command) and "=" in command[at] and not command[at].startswith("-"):
            at += 1
    return at


def _torch_entry_point(name: str) -> bool:
    """Whether ``name`` on PATH is torch's own torchrun (the console script pip writes: it imports
    torch.distributed.run), not a site's wrapper or a test's stand-in, which run as they are."""
    path = shutil.which(name)
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    first = head.split(b"\n", 1)[0]
    return (
        first.startswith(b"#!") and b"python" in first and b"from torch.distributed.run import main" in head
    )


def this_program() -> list[str]:
    """How this python runs this program again: its file, or (shipped as text by the SSH launcher and run with
    ``python -I -c TEXT``) its text, read back from this process's command line."""
    path = globals().get("__file__")
    if path:
        return [os.path.abspath(path)]
    with open("/proc/self/cmdline", "rb") as f:
        words = f.read().split(b"\0")
    return ["-c", words[words.index(b"-c") + 1].decode()]


def slurm_rendezvous(args: list[str], local_ifname: str = "") -> list[str]:
    """ARGS (torchrun's), in a Slurm job step, with the rendezvous named as the SSH launcher names it: node 0 of
    the allocation (SLURM_NODEID 0, the node the launch made the endpoint) hosts the c10d store (``is_host`` in
    --rdzv-conf; torchrun would guess from the endpoint's host name), and --local-addr is LOCAL_IFNAME's
    address (network.socket_ifname; torchrun's default is this host's FQDN). What ARGS give stays, but a
    --log-dir (torchrun.rank_logs) gets this node's name appended: one folder per node."""
    if os.environ.get("SLURM_NODEID") is None:
        return args
    is_host = f"is_host={1 if os.environ['SLURM_NODEID'] == '0' else 0}"
    out, i, conf_seen = [], 0, False
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if name in ("--rdzv-conf", "--rdzv_conf") and not conf_seen:
            conf_seen = True
            if not eq and i + 1 < len(args):
                name, value = a, args[i + 1]
                i += 1
            if _is_host([f"--rdzv-conf={value}"]) is None:
                value = f"{value},{is_host}" if value else is_host
            out.append(f"--rdzv-conf={value}")
        else:
            out.append(a)
        i += 1
    if not conf_seen:
        out.insert(0, f"--rdzv-conf={is_host}")
    # torchrun.rank_logs: the batch shell gave every node the attempt's folder; each node writes into its own
    out = [
        f"--log-dir={os.path.join(a.split('=', 1)[1], node_name())}"
        if a.split("=", 1)[0] in ("--log-dir", "--log_dir") and "=" in a
        else a
        for a in out
    ]
    addr = iface_ipv4(local_ifname) if local_ifname else None
    if addr and not any(a.split("=", 1)[0] in ("--local-addr", "--local_addr") for a in args):
        out.insert(0, f"--local-addr={addr}")
    return out


def torchrun_command(
    command: list[str], exit_barrier_s: int | None = None, local_ifname: str = ""
) -> list[str]:
    """COMMAND, or where it runs torch's ``torchrun``: this python running this program's ``torchrun``
    (:func:`torchrun_main`) with COMMAND's arguments, EXIT_BARRIER_S and LOCAL_IFNAME. On a torch without a
    flag of COMPAT_FLAGS that COMMAND gives, the flag is dropped and the agent kept from SIGTERM (one line says
    so): under stop_protocol sbatch-gen those flags only keep SIGTERM from the agent and bound the shutdowns
    after SIGINT/SIGHUP/SIGQUIT, which no stop sends. A ``torchrun`` on PATH that is not torch's entry point
    (a site's wrapper) runs as given, and so does any other program."""
    at = _after_env(command)
    if at >= len(command) or os.path.basename(command[at]) != "torchrun":
        return command
    head, args = command[:at], command[at + 1 :]
    given = [a for a in args if a.split("=", 1)[0] in COMPAT_FLAGS]
    src = this_torchrun_source()
    lacking = [
        f
        for f in COMPAT_FLAGS
        if src is not None and any(a.split("=", 1)[0] == f for a in given) and not _has_flag(src, f)
    ]
    if not lacking and not _torch_entry_point(command[at]):
        return command
    wrapper: list[str] = []
    if exit_barrier_s is not None:
        wrapper += ["--exit-barrier-s", str(exit_barrier_s)]
    if local_ifname:
        wrapper += ["--local-ifname", local_ifname]
    if lacking:
        args = [a for a in args if a.split("=", 1)[0] not in COMPAT_FLAGS]
        wrapper.append("--keep-sigterm")
        log(
            f"this torch's torchrun has no {', '.join(lacking)}: it runs through the node program's compat shim, "
            "which keeps SIGTERM from its agent (the stop goes through the stop file); "
            f"{', '.join(a.split('=', 1)[0] for a in given)} dropped"
        )
    return [*head, sys.executable, *this_program(), "torchrun", *wrapper, "--", *args]


# After the exit barrier, how long the agent that hosts the store waits for the others to have left it.
EXIT_HANDOFF_S = 30.0
EXIT_LEFT_KEY = "sbatch-gen/left-exit-barrier"
# After a worker failed, how long its agent gives the other workers between SIGTERM and SIGKILL (torch: 30 s).
TEARDOWN_S = 10


def _is_host(args: list[str]) -> bool | None:
    """``is_host`` of torchrun's --rdzv-conf in ARGS (None: not given, torchrun guesses)."""
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in ("--rdzv-conf", "--rdzv_conf"):
            conf = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            for pair in conf.split(","):
                k, _, v = pair.partition("=")
                if k.strip() == "is_host":
                    return v.strip().lower() in ("1", "true", "yes", "y", "on")
    return None


def _patch_exit_barrier(timeout_s: float | None, is_host: bool | None) -> None:
    """torchrun's exit barrier, bounded by TIMEOUT_S (None: torch's) and without its race: an agent that
    passed it counts itself on the store once its rendezvous is shut down, and the agent that hosts the store
    (IS_HOST) stays until every agent has (at most EXIT_HANDOFF_S); a barrier that times out or breaks is one
    line, not a traceback. A torch whose agent is not the one this knows keeps its own barrier."""
    try:
        from torch.distributed.elastic.agent.server import api  # noqa: PLC0415 - torch only here
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: PLC0415
            DynamicRendezvousHandler,
        )
        from torch.distributed.elastic.utils import store as store_util  # noqa: PLC0415
    except ImportError:
        return
    agent_cls = api.SimpleElasticAgent
    prefix = getattr(api, "_TERMINAL_STATE_SYNC_ID", None)
    if prefix is None or not hasattr(agent_cls, "_exit_barrier") or not hasattr(store_util, "barrier"):
        return
    passed: list = []  # [(store, agents)] once this agent has passed the barrier

    real_init = agent_cls.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        if timeout_s is not None:
            self._exit_barrier_timeout = timeout_s

    def exit_barrier(self):
        agents = self._worker_group.group_world_size
        timeout = self._exit_barrier_timeout
        start = time.monotonic()
        self._in_exit_barrier = True
        try:
            store_util.barrier(
                store=self._store, world_size=agents, key_prefix=prefix, barrier_timeout=timeout
            )
            passed.append((self._store, agents))
        except api.SignalException:
            raise
        except Exception as e:
            log(
                f"torchrun: this node's workers finished, the other nodes' did not all within {timeout:g} s "
                f"(the exit barrier; {time.monotonic() - start:.0f} s): {type(e).__name__}: {one_line(str(e))[:200]}"
            )
        finally:
            self._in_exit_barrier = False

    real_shutdown = DynamicRendezvousHandler.shutdown

    def shutdown(self):
        done = real_shutdown(self)
        if passed:
            store, agents = passed[0]
            try:
                store.add(EXIT_LEFT_KEY, 1)
                deadline = time.monotonic() + EXIT_HANDOFF_S
                while is_host and store.add(EXIT_LEFT_KEY, 0) < agents and time.monotonic() < deadline:
                    time.sleep(0.05)
            except Exception:  # the host has gone (it waited its bound): nothing is left to hand over
                pass
        return done

    setattr(agent_cls, "__init__", init)  # noqa: B010 - patching torch's class (mypy: method-assign)
    setattr(agent_cls, "_exit_barrier", exit_barrier)  # noqa: B010
    setattr(DynamicRendezvousHandler, "shutdown", shutdown)  # noqa: B010


def _patch_teardown(teardown_s: float) -> None:
    """After a worker failed, torch's agent SIGTERMs the others and SIGKILLs them 30 s later, whatever
    --shutdown-timeout says (the process context closes itself with its default when it finds a failed worker,
    and the agent's _stop_workers calls _shutdown() with its own; the flag bounds only the shutdowns after a
    signal the agent handles). Here TEARDOWN_S: a crash frees the node in seconds. A survivor on sbatch-gen's
    StopRequest exits within TERM_WITHOUT_STOP_S of that SIGTERM anyway; one of a trainer of one's own that
    takes it for a stop cannot finish a collective save with a dead peer. A torch whose classes are not the
    ones this knows keeps its own."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import (  # noqa: PLC0415
            LocalElasticAgent,
        )
        from torch.distributed.elastic.multiprocessing.api import PContext  # noqa: PLC0415
    except ImportError:
        return
    real_stop = getattr(LocalElasticAgent, "_stop_workers", None)
    shutdown = getattr(LocalElasticAgent, "_shutdown", None)
    real_close = getattr(PContext, "close", None)
    if real_stop is None or real_close is None or shutdown is None:
        return
    if "timeout" not in shutdown.__code__.co_varnames or real_close.__code__.co_varnames[:3] != (
        "self",
        "death_sig",
        "timeout",
    ):
        return

    def stop_workers(self, worker_group, *args, **kwargs):
        if args or kwargs:  # a signature this does not know: torch's own
            return real_stop(self, worker_group, *args, **kwargs)
        return self._shutdown(timeout=teardown_s)

    def close(self, death_sig=None, timeout=None):
        # no timeout given: the context closing itself after a failed worker
        return real_close(self, death_sig, teardown_s if timeout is None else timeout)

    setattr(LocalElasticAgent, "_stop_workers", stop_workers)  # noqa: B010
    setattr(PContext, "close", close)  # noqa: B010


def torchrun_main(args: list[str]) -> int:
    """`torchrun [--exit-barrier-s S] [--local-ifname NAME] [--keep-sigterm] -- [torchrun] ARGS...`: torchrun
    (torch.distributed.run.main) in this process, with
    - the exit barrier of :func:`_patch_exit_barrier`: bounded by S (torch's is 300 s, which its command line
      cannot change), without its race (pytorch/pytorch#69520: no traceback after a good job), one line if the
      other nodes do not all finish within it;
    - after a worker failed, the others SIGKILLed TEARDOWN_S after their SIGTERM (:func:`_patch_teardown`);
    - in a Slurm job step, the rendezvous named (:func:`slurm_rendezvous`, NAME's address as --local-addr);
    - with --keep-sigterm, an agent that never installs a SIGTERM handler: SIGTERM keeps the disposition this
      process inherited (ignored, from run-trainer), as --signals-to-handle without SIGTERM does on a newer
      torch. The workers it starts install their own.
    Where ``torchrun`` on PATH is not torch's entry point (a site's wrapper), that program runs ARGS as given."""
    opts = {"--exit-barrier-s": "", "--local-ifname": ""}
    keep_sigterm = False
    while args and args[0] != "--":
        if args[0] in opts and len(args) > 1:
            opts[args[0]] = args[1]
            args = args[2:]
        elif args[0] == "--keep-sigterm":
            keep_sigterm = True
            args = args[1:]
        else:
            break
    if not args or args[0] != "--" or not re.fullmatch(r"([0-9]{1,6})?", opts["--exit-barrier-s"]):
        print(
            "usage: sbatch-gen-node.py torchrun [--exit-barrier-s S] [--local-ifname NAME] [--keep-sigterm] "
            "-- [torchrun] ARGS...",
            file=sys.stderr,
        )
        return 2
    args = args[1:]
    if args[:1] == ["torchrun"]:
        args = args[1:]
        if not keep_sigterm and shutil.which("torchrun") and not _torch_entry_point("torchrun"):
            os.execvp("torchrun", ["torchrun", *args])
    if keep_sigterm:
        real = signal.signal

        def keep(signum, handler):
            if signum == signal.SIGTERM:
                return signal.getsignal(signal.SIGTERM)
            return real(signum, handler)

        signal.signal = keep
    args = slurm_rendezvous(args, opts["--local-ifname"])
    barrier = float(opts["--exit-barrier-s"]) if opts["--exit-barrier-s"] else None
    _patch_exit_barrier(barrier, _is_host(args))
    _patch_teardown(TEARDOWN_S)
    sys.argv = ["torchrun", *args]
    from torch.distributed.run import main as torchrun_main  # noqa: PLC0415 - torch only here

    torchrun_main(args)
    return 0


# ---- a crash: the region's leave, announced for it ---------------------------------------------------------

# The trainers whose arguments the leave announcer reads as its own: the companion trainer, and the same trainer
# with the test faults installed (sbatch_gen.testing.faults).
BUILTIN_TRAINERS = ("sbatch_gen.train", "sbatch_gen.testing.faults")
LEAVE_MODULE = "sbatch_gen.train.xr.leave"
LEAVE_TIMEOUT_S = 10.0  # a store that does not answer must not hold the job
# torchrun's options that take no value (torch/distributed/run.py), besides -m/--module
TORCHRUN_SWITCHES = ("--standalone", "--no-python", "--no_python", "--run-path", "--run_path")


def trainer_of(command: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of the trainer COMMAND starts: ``[env NAME=VALUE...] torchrun ARGS -m MODULE
    ARGS`` (or ``PYTHON -m torch.distributed.run ...``); None for anything else, a script among them."""
    at = _after_env(command)
    rest = command[at + 1 :]
    if at < len(command) and os.path.basename(command[at]) == "torchrun":
        pass
    elif rest[:2] == ["-m", "torch.distributed.run"]:
        rest = rest[2:]
    else:
        return None
    i = 0
    while i < len(rest) - 1:  # torchrun's options, up to its -m/--module (the script is a module)
        word = rest[i]
        if word in ("-m", "--module"):
            return rest[i + 1], rest[i + 2 :]
        if not word.startswith("-"):
            return None  # the script: a file, not a module
        i += 1 if "=" in word or word in TORCHRUN_SWITCHES else 2  # --flag=value, a switch, --flag value
    return None


def node_index() -> str:
    """This node's index in its launcher: $SBATCH_GEN_NODE_RANK (the SSH launcher), else $SLURM_NODEID (a
    Slurm job step), else 0 (one node)."""
    for name in ("SBATCH_GEN_NODE_RANK", "SLURM_NODEID"):
        v = os.environ.get(name, "").strip()
        if v:
            return v
    return "0"


def leave_to_announce(command: list[str], rc: int, stop_file: str) -> list[str] | None:
    """The trainer's arguments to announce this region's leave with, after COMMAND exited with ``rc``; None
    when there is none to announce: a status of 0; a planned stop that completed (the ack: the trainer
    announced its leave itself before its stop checkpoint); ``.fatal`` (the trainer stopped on an error no
    requeue fixes, such as the run dir leased by another live job: not a region gone); a node other than the
    launcher's node 0 (one announcement per region); a trainer other than the companion one (one's own
    script or module: its arguments are not ours to read) or one without ``--xr-enabled``.

    A stop file without an ack is announced: a stop that did not complete (the trainer's own leave record,
    when it wrote one, is kept: the announcer writes nothing over it), or a crash during which a SIGTERM
    reached this program (Slurm's --kill-on-bad-exit after another node's task failed)."""
    if rc == 0:
        return None
    if any(os.path.lexists(stop_file + s) for s in (ACK_SUFFIX, FATAL_SUFFIX)):
        return None
    if node_index() != "0":
        return None
    got = trainer_of(command)
    if got is None or got[0] not in BUILTIN_TRAINERS or "--xr-enabled" not in got[1]:
        return None
    return got[1]


def announce_leave(trainer_args: list[str], rc: int, timeout_s: float = LEAVE_TIMEOUT_S) -> str:
    """Run the leave announcer (this python: ``-m sbatch_gen.train.xr.leave``) with the trainer's arguments,
    for at most ``timeout_s``, and log its one line (its last, or one WARNING line saying why there is
    none); returns that line. Never raises, never prints more than that line."""
    argv = [sys.executable, "-m", LEAVE_MODULE, "--torchrun-status", str(rc), "--", *trainer_args]
    try:
        with subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ) as proc:
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its session: nothing of it outlives the bound
                except OSError:
                    pass
                proc.communicate()
                said = (
                    f"WARNING: the leave announcer did not finish in {timeout_s:g} s (the mailbox did not answer?): "
                    "the other regions find this region gone by its heartbeat or grace_s"
                )
                log(said)
                return said
        lines = [x.strip() for x in out.decode("utf-8", "replace").splitlines() if x.strip()]
        last = one_line(lines[-1][:500]) if lines else ""
        if proc.returncode == 0 and last:
            said = last
        elif last.startswith("WARNING: "):
            said = last
        else:
            status = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
            said = f"WARNING: the leave announcer exited with status {status}" + (f": {last}" if last else "")
    except Exception as e:  # it cannot even start: said, and run-trainer's status stays COMMAND's
        said = f"WARNING: cannot run the leave announcer: {type(e).__name__}: {e}"
    log(said)
    return said


def run_trainer(
    stop_file: str,
    stopped_rc: int,
    command: list[str],
    exit_barrier_s: int | None = None,
    local_ifname: str = "",
) -> int:
    """Run COMMAND (torchrun) on this node with SIGTERM ignored and return its exit status (128+N when signal
    N ended it), or ``stopped_rc`` when STOP_FILE.ack exists once it has exited.

    A SIGTERM that reached torchrun's agent would make it pass the signal on, SIGKILL the workers
    --shutdown-timeout s later and print a traceback. Instead a SIGTERM to this program is the stop
    request of :meth:`TrainingStep.stop` (the stop file first, then SIGTERM to the workers): sbatch-gen's
    trainer and the library's agree on a step, checkpoint, and exit 0 once the first rank of every node has
    written the ack; a trainer of one's own saves in its SIGTERM handler. No signal ends the wait: this
    program waits until COMMAND has exited, then says in one line what the stop left (``node NAME: ...``,
    :func:`stop_outcome`), which the launchers repeat in their own log. After a non-zero status that no
    completed stop explains, node 0 announces a cross-region trainer's leave (:func:`leave_to_announce`,
    :func:`announce_leave`, at most LEAVE_TIMEOUT_S): the status returned is COMMAND's all the same."""
    step = TrainingStep(stop_file, node_name())
    # SIGTERM blocked until COMMAND runs and the handler knows its pid: one that arrives meanwhile is
    # handled then, and COMMAND never runs with this program's handler (reset to the default by exec).
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    signal.signal(signal.SIGTERM, step.on_sigterm)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # a terminal's Ctrl-C reaches torchrun too, which handles it: wait for it as for a SIGTERM
        signal.signal(signal.SIGINT, lambda signum, frame: None)
    given = command
    command = torchrun_command(command, exit_barrier_s, local_ifname)
    try:
        child = subprocess.Popen(command, preexec_fn=_ignore_sigterm)  # preexec_fn: one thread here
    except OSError as e:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        log(f"ERROR: cannot run {command[0]}: {e.strerror or e}")
        return 127 if isinstance(e, FileNotFoundError) else 126
    step.pid = child.pid
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
    rc = child.wait()  # a handled signal does not end it (PEP 475: waitpid is retried)
    step.ended = True
    if rc < 0:
        rc = 128 - rc
    try:
        said = stop_outcome(stop_file)
        if said is not None:
            log(f"node {step.node}: {said}")
        if os.path.exists(stop_file + ACK_SUFFIX):
            return stopped_rc
    except Exception as e:  # what the stop left is said if it can be; COMMAND's status counts
        log(f"WARNING: cannot read what the stop left beside {stop_file}: {type(e).__name__}: {e}")
    try:  # a crash: the other regions hear of it now rather than from a heartbeat going stale
        trainer_args = leave_to_announce(given, rc, stop_file)
        if trainer_args is not None:
            announce_leave(trainer_args, rc)
    except Exception as e:
        log(f"WARNING: cannot announce the leave: {type(e).__name__}: {e}")
    return rc


def run_trainer_main(args: list[str]) -> int:
    """`run-trainer --stop-file FILE --stopped-rc N [--exit-barrier-s S] [--local-ifname NAME] -- COMMAND...`:
    :func:`run_trainer` (S: torchrun's exit barrier; NAME: the interface whose address is torchrun's
    --local-addr in a Slurm step; :func:`torchrun_command`)."""
    opts = {"--stop-file": "", "--stopped-rc": "", "--exit-barrier-s": "", "--local-ifname": ""}
    i = 0
    while i + 1 < len(args) and args[i] in opts:
        opts[args[i]] = args[i + 1]
        i += 2
    command = args[i + 1 :]
    if (
        args[i : i + 1] != ["--"]
        or not command
        or not opts["--stop-file"]
        or not re.fullmatch(r"[0-9]{1,3}", opts["--stopped-rc"])
        or int(opts["--stopped-rc"]) > 255
        or not re.fullmatch(r"([0-9]{1,6})?", opts["--exit-barrier-s"])
    ):
        print(
            "usage: sbatch-gen-node.py run-trainer --stop-file FILE --stopped-rc N [--exit-barrier-s S] "
            "[--local-ifname NAME] -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    barrier = int(opts["--exit-barrier-s"]) if opts["--exit-barrier-s"] else None
    return run_trainer(
        opts["--stop-file"], int(opts["--stopped-rc"]), command, barrier, opts["--local-ifname"]
    )


COMMANDS = {
    "preflight": preflight_main,
    "fingerprint": fingerprint_main,
    "run-trainer": run_trainer_main,
    "torchrun": torchrun_main,
    "omp-threads": omp_threads_main,
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: sbatch-gen-node.py {{{','.join(COMMANDS)}}} ARGS...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
