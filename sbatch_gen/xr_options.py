"""Cross-region settings: one typed model shared by the site profile, the renderer and the trainer.

Torch-free. The site profile's ``cross_region`` section *is* :class:`CrossRegion`; the renderer turns it
into ``--xr-*`` trainer flags with :func:`to_argv`; the trainer parses them back with
:func:`add_arguments` / :func:`from_namespace`. A trainer whose command line cannot take the flags gets the
same options as ``SBATCH_GEN_XR_*`` environment variables (:func:`to_env` / :func:`from_env`). So a setting
exists exactly once.

Credentials are referenced, never given: an AWS profile name, or the *names* of environment variables
that hold the keys. There is no field that could carry a secret value.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

from pydantic import Field, field_validator

from sbatch_gen.errors import FieldError
from sbatch_gen.strict import StrictModel, check

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
ENV_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_name = Annotated[str, Field(pattern=NAME_RE)]
_env_name = Annotated[str, Field(pattern=ENV_NAME_RE)]
# an AWS profile's name (a section of ~/.aws/config): letters, digits and . _ + @ -, not first a '-'
_aws_profile = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.+@][A-Za-z0-9_.+@-]{0,127}$")]


# ---------------------------------------------------------------------------------------------------
# Value rules shared with the site profile (sbatch_gen.profiles applies them to every string of a profile).

# Unicode bidirectional controls (the "Trojan Source" trick): they reorder how text is displayed, so a
# reviewed diff can show something other than what runs.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def unsafe_chars(v: str) -> list[str]:
    """Characters no profile value may contain: C0 controls, DEL, C1 controls (U+0080-U+009F) and the
    Unicode bidi controls; as ``U+XXXX`` names, sorted."""
    bad = {c for c in v if ord(c) < 32 or 127 <= ord(c) <= 159 or c in _BIDI}
    return [f"U+{ord(c):04X}" for c in sorted(bad)]


def unsafe_chars_message(bad: list[str]) -> str:
    """The message for :func:`unsafe_chars` (never quotes the value)."""
    return (
        f"contains control characters {', '.join(bad)} (newline, tab, C1 or Unicode bidirectional controls: "
        "what a reviewer reads would differ from what runs)"
    )


# Shapes of literal credentials. The generic one: a 40-character token of base64 letters (an AWS secret
# access key), mixed case and digits, random-looking (many character-class changes), not path-like (a leading
# '/', or more than two) and not hex (a git commit id is 40 hex digits). A heuristic: it misses a few percent.
_KEY_SHAPES = (
    (
        "an AWS access key id",
        re.compile(
            r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|APKA|AROA|ASCA)[A-Z0-9]{16}(?![A-Za-z0-9])"
        ),
    ),
    (
        "a GitHub token",
        re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})"),
    ),
    ("a Hugging Face token", re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}")),
    ("a Slack token", re.compile(r"(?<![A-Za-z0-9])xox[abprs]-[A-Za-z0-9-]{10,}")),
    ("an API key", re.compile(r"(?<![A-Za-z0-9])sk-(?:proj-|ant-)?[A-Za-z0-9_-]{32,}")),
    ("a Google API key", re.compile(r"(?<![A-Za-z0-9])AIza[0-9A-Za-z_-]{35}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY")),
)
_SECRET40 = re.compile(r"(?<![A-Za-z0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])")
# a URL whose user part carries a password: scheme://user:password@host
URL_PASSWORD = re.compile(r"://[^/?#@\s:]*:[^/?#@\s]*@")  # (from "://": linear on long values)


def _random_looking(tok: str) -> bool:
    if tok.startswith("/") or tok.count("/") > 2:  # a path
        return False
    if not (re.search(r"[A-Z]", tok) and re.search(r"[a-z]", tok) and re.search(r"[0-9]", tok)):
        return False
    cls = ["U" if c.isupper() else "l" if c.islower() else "d" if c.isdigit() else "o" for c in tok]
    changes = sum(a != b for a, b in zip(cls, cls[1:], strict=False))
    return changes >= 14 and len(set(tok)) >= 22


def credential_shape(v: str) -> str | None:
    """What kind of literal credential ``v`` contains (``None``: none found)."""
    for what, rx in _KEY_SHAPES:
        if rx.search(v):
            return what
    if URL_PASSWORD.search(v):
        return "a URL with a password in its user part (scheme://user:password@host)"
    if any(_random_looking(m.group(0)) for m in _SECRET40.finditer(v)):
        return "a secret key (40 random-looking characters)"
    return None


def credential_message(what: str) -> str:
    """The message for :func:`credential_shape` (never quotes the value)."""
    return (
        f"value <redacted>: looks like {what}; profiles and out/ are committed and reviewed, so a credential "
        "never goes in them: leave it in the environment and give the variable's name (*_env fields)"
    )


def _no_bool(v: object) -> object:
    # YAML reads yes/no/on/off/true/false as booleans, and pydantic would take them as 1/0.
    if isinstance(v, bool):
        raise ValueError("Input should be a number, got a YAML boolean (true/false, yes/no, on/off)")
    return v


class FsTransport(StrictModel):
    """A directory as the mailbox: a shared filesystem, or a local one for demos and tests."""

    kind: Literal["fs"] = Field(default="fs", description="fs: a directory as the mailbox.")
    root: str = Field(
        min_length=1,
        description="Mailbox directory. Every region of the run must see the same directory.",
    )

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        bad = unsafe_chars(v)
        if bad:
            raise ValueError(unsafe_chars_message(bad))
        if "$" in v:
            raise ValueError(
                f"path {v!r} contains '$': variables are not expanded in profile paths; write the path out"
            )
        if v.startswith("~"):
            raise ValueError(f"path {v!r} starts with '~', which is not expanded; write the path out")
        if v.startswith("-"):
            raise ValueError(
                f"path {v!r} starts with '-': the trainer would read it as an option; write ./{v}"
            )
        return v


class S3Credentials(StrictModel):
    """Where the S3 credentials come from. Values are never written here: only names.

    Leave everything unset to use boto3's default chain (environment, instance role, ...).
    """

    profile: _aws_profile | None = Field(
        default=None,
        description="Name of an AWS profile (~/.aws/config, ~/.aws/credentials; AWS_CONFIG_FILE and "
        "AWS_SHARED_CREDENTIALS_FILE where set) to use.",
    )
    access_key_id_env: _env_name | None = Field(
        default=None, description="Name of the environment variable holding the access key id."
    )
    secret_access_key_env: _env_name | None = Field(
        default=None, description="Name of the environment variable holding the secret access key."
    )
    session_token_env: _env_name | None = Field(
        default=None, description="Name of the environment variable holding a session token (optional)."
    )

    @field_validator("profile", "access_key_id_env", "secret_access_key_env", "session_token_env")
    @classmethod
    def _a_name_not_a_key(cls, v: str | None) -> str | None:
        what = credential_shape(v) if v is not None else None
        if what is not None:
            raise ValueError(credential_message(what))
        return v

    @check
    def _pairs(self) -> S3Credentials:
        if (self.access_key_id_env is None) != (self.secret_access_key_env is None):
            raise ValueError("set both access_key_id_env and secret_access_key_env, or neither")
        if self.profile and self.access_key_id_env:
            raise ValueError(
                "use either profile or access_key_id_env/secret_access_key_env, not both (a site whose base "
                "names the variables: set access_key_id_env and secret_access_key_env to null in the site)"
            )
        return self


class S3Transport(StrictModel):
    """An S3 (or S3-compatible) bucket as the mailbox, through one persistent boto3 client."""

    kind: Literal["s3"] = Field(default="s3", description="s3: an S3 or S3-compatible bucket as the mailbox.")
    bucket: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", description="Bucket name.")
    prefix: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9._/-]*$",
        description="Key prefix under which the run's rounds live (no leading slash needed).",
    )
    endpoint_url: str | None = Field(
        default=None,
        pattern=r"^https?://[A-Za-z0-9.:\[\]_-]+(/[A-Za-z0-9._/-]*)?$",
        description="Endpoint of an S3-compatible store; unset for AWS.",
    )
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto", description="S3 addressing style; most S3-compatible stores want 'path'."
    )
    region_name: _name | None = Field(default=None, description="Bucket's region, e.g. eu-central-1.")
    credentials: S3Credentials = Field(
        default_factory=S3Credentials,
        description="Where the credentials come from, by name only (an AWS profile, or the names of "
        "environment variables); all unset: boto3's default chain (environment, shared files, instance role).",
    )

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if v.startswith("-"):
            raise ValueError(f"prefix {v!r} starts with '-': the trainer would read it as an option")
        return v


Transport = Annotated[FsTransport | S3Transport, Field(discriminator="kind")]

# How one region reaches the run's bucket: its own endpoint (a VPC endpoint, an access point, another
# S3-compatible gateway to the same store), addressing style and credential source (variable names, an AWS
# profile, the instance's role). The regions of a run may differ in these; validate compares the rest.
REGION_OWN_TRANSPORT_FIELDS = ("endpoint_url", "addressing_style", "region_name", "credentials")


class CrossRegion(StrictModel):
    """Cross-region training: DDP inside this region, DiLoCo or per-step gradient averaging across regions
    through an object-store mailbox. All regions of one run must agree on every field except ``region``
    (``sbatch-gen validate`` checks it)."""

    enabled: bool = Field(default=False, description="Pass --xr-enabled to the trainer.")
    run_id: _name = Field(
        default="run", description="Identifies the run across regions; the mailbox is keyed by it."
    )
    region: _name = Field(default="local", description="This site's region name.")
    regions: list[_name] = Field(
        default_factory=lambda: ["local"], min_length=1, description="Every region of the run."
    )
    sync: Literal["diloco", "grad"] = Field(
        default="diloco",
        description="diloco: outer Nesterov step every inner_steps; grad: average gradients every step.",
    )
    inner_steps: int = Field(default=100, ge=1, le=1_000_000, description="H: inner steps per outer round.")
    outer_lr: float = Field(
        default=1.0,
        gt=0,
        le=10,
        description="Outer SGD learning rate. The defaults, 1 with outer_momentum 0, are plain parameter "
        "averaging: in bench/results/quality.md (2 regions, from scratch, H 10-100) the best of the grid at "
        "H=10 and within 3% of the best at H 50-100 (there outer_momentum 0.5 was 1.6-2.7% better), while the "
        "literature's 0.7 / 0.9 (tuned for H 100-500 from a pretrained start) was 1.7-10.8% worse. validate "
        "warns about the combinations that measured worse.",
    )
    outer_momentum: float = Field(
        default=0.0, ge=0, lt=1, description="Outer Nesterov momentum (see outer_lr for the default)."
    )
    overlap: Literal["none", "eager", "streaming"] = Field(
        default="none",
        description="diloco: none = training waits at every round until the round has crossed the WAN and is "
        "applied; eager = the exchange of round t runs in the background during the inner steps of round t+1 "
        "and is applied at the next boundary, while this region's own fresh delta is applied at once (Kale et "
        "al. 2025): the wait at a round boundary is only what the transfer takes beyond H inner steps. The "
        "shared outer state (theta_outer, momentum) still advances by the committed averages only and stays "
        "bit-identical across regions; a region's working model differs from it by its own fresh delta "
        "(outer_lr x (1 + outer_momentum) x its expected token weight). timeout_s then counts from the "
        "publish. Leaders hold 4 B/param more (the delta in flight). After the last step the trainer waits "
        "for the round in flight (DiLoCo.finish), so every region ends on the same parameters. streaming = "
        "Streaming DiLoCo (Douillard et al. 2025): the parameters are split into `fragments` fragments, each "
        "synchronised once every H steps at its own offset (fragment p at step c*H + floor(H*(p+1)/F)), so a "
        "round carries 1/F of the model; its exchange runs in the background for fragment_delay_steps inner "
        "steps and is then merged into the live parameters (fragment_alpha). Leaders hold 4 B/param more (the "
        "fragment in flight); every region ends on the shared outer state.",
    )
    fragments: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="overlap streaming: F, the number of fragments. Each round exchanges one fragment (about "
        "1/F of the parameters: whole transformer blocks, strided, when the model has at least F numbered "
        "layers, else single tensors, balanced by size), so the bytes in flight at once drop by about F. "
        "Rounds come every H/F steps; round k syncs fragment (k-1) mod F. Ignored unless overlap is streaming.",
    )
    fragment_delay_steps: int = Field(
        default=5,
        ge=0,
        le=1_000_000,
        description="overlap streaming: tau, the inner steps a fragment's exchange runs in the background "
        "before its result is merged (0: training waits for the exchange, as with overlap none but for 1/F "
        "of the bytes). Must be below H/F (the next fragment's round starts then). Ignored unless overlap is "
        "streaming.",
    )
    fragment_alpha: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="overlap streaming: the merge, tau steps after a fragment's round started: the "
        "fragment's live parameters become (1 - alpha) x the new shared outer state + alpha x the local "
        "parameters, which trained on for those tau steps. 0 drops the local steps (DiLoCo's replace); the "
        "paper merges with 0.5. Ignored unless overlap is streaming.",
    )
    transport: Transport = Field(
        default_factory=lambda: FsTransport(root="xr-mailbox"), description="Mailbox backend."
    )
    timeout_s: float = Field(
        default=1800,
        gt=0,
        le=86_400,
        description="Seconds a round may wait for a quorum (min_regions). Then the region checkpoints, names "
        "the missing regions in one line and exits with the requeue code.",
    )
    min_regions: Literal["all"] | Annotated[int, Field(ge=1, le=1000)] = Field(
        default="all",
        description="Regions a round needs before it may close without the others: 'all' = strict lock-step "
        "(every round waits for every region); N < len(regions) = elastic: once N regions have published, "
        "the round closes after grace_s, or at once when the others have announced a planned leave.",
    )
    grace_s: float = Field(
        default=60,
        ge=0,
        le=86_400,
        description="Elastic rounds: seconds the round still waits for the missing regions after min_regions "
        "have arrived; a region later than that has its delta dropped for the round. The bound on how long "
        "an absent region can idle the others per round (heartbeat_s shortens it for a region that crashed).",
    )
    heartbeat_s: Annotated[float, Field(ge=0.1, le=3600)] | None = Field(
        default=5.0,
        description="Elastic rounds: seconds between liveness heartbeats. A thread of each region's rank 0 "
        "overwrites <run>/_alive/<region>.json (an increasing counter) every heartbeat_s. A region waiting in a "
        "round treats a missing region whose heartbeat has not changed for 3 x heartbeat_s, measured on its OWN "
        "clock (it must have watched that long; observations carry over between rounds, and no clocks are "
        "compared across regions), as gone: the round closes without waiting out grace_s (min_regions still "
        "applies). So a crashed region (SIGKILL, node failure: nothing announces a leave) costs the others at "
        "most min(grace_s, 3 x heartbeat_s) once, then nothing per round until it beats again. A hung region "
        "whose heartbeat thread still beats is not detected: it still costs up to grace_s per round. Cost: "
        "3600 / heartbeat_s PUTs per hour and region (720 at the default 5 s: ~$0.004/h at S3 Standard's "
        "$0.005 per 1000 PUTs), plus, only while a round waits for a missing region, 2 GETs (its presence and its "
        "heartbeat) every min(1 s, grace_s / 4). null: no heartbeats (a crashed region costs grace_s in every round it misses). Ignored unless "
        "the run is elastic (min_regions below the number of regions).",
    )
    snapshot_every: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="Publish an outer snapshot (theta_outer + momentum, fp32) every this many rounds; a region "
        "that returns after the rounds it missed were cleaned up fast-forwards from the newest one.",
    )
    keep_rounds: int = Field(
        default=4,
        ge=1,
        le=1000,
        description="Rounds each region keeps in the mailbox behind the newest; older ones are deleted by their "
        "own region once an outer snapshot covers them.",
    )
    payload_dtype: Literal["bf16", "fp32", "int8", "fp8", "int4", "sparse"] = Field(
        default="bf16",
        description="Wire dtype of deltas/gradients; the outer state stays fp32. int8, fp8 (e4m3) and int4 carry "
        "one fp32 scale per 256 elements: int8/fp8 half of bf16's bytes plus 1.6%, int4 a quarter plus 3.1%; "
        "int8 rounds to 0.4% of each block's largest value, int4 to 7%, fp8 to 6% of each value (more far "
        "below the block's largest). Every region averages the same decoded values, so all stay "
        "bit-identical. The scaled dtypes need serialization raw. shard_mb counts wire bytes: at the same "
        "shard_mb an int8/fp8 shard holds twice bf16's elements (int4: four times), so a round has that many "
        "times fewer concurrent transfers; over a long-haul link, where each stream is window-bound, shrink "
        "shard_mb by as much to keep them. sparse (DiLoCo, any overlap): the SparseLoCo-style outer "
        "update of sparse_density, sparse_chunk and sparse_beta, with an error-feedback buffer per region "
        "(docs/cross-region.md, 'Sparse outer updates').",
    )
    sparse_density: float = Field(
        default=0.01,
        gt=0,
        le=0.5,
        description="payload_dtype sparse: the fraction of each chunk's elements a region sends per round "
        "(0.01 = 1%: with sparse_chunk 4096, 41 entries, 81 bytes per chunk: 1/101 of bf16's bytes; 0.03: "
        "1/37). At least one entry per chunk. Ignored for the other payload dtypes.",
    )
    sparse_chunk: int = Field(
        default=4096,
        ge=64,
        le=65536,
        description="payload_dtype sparse: elements per chunk (a power of two, 64..65536) of each shard; each "
        "chunk sends its top sparse_density share by magnitude, as log2(sparse_chunk)-bit indices and 2-bit "
        "values with two fp32 magnitudes per chunk (8 bytes). Ignored for the other payload dtypes.",
    )
    sparse_beta: float = Field(
        default=0.95,
        ge=0,
        le=1,
        description="payload_dtype sparse: the decay of the error-feedback buffer, e <- sparse_beta * e + "
        "delta before each round's selection (what was not sent, kept for later rounds; 0: nothing kept, "
        "plain top-k; with overlap streaming per fragment, at the fragment's rounds). The buffer is 4 B per parameter on the leaders, saved in checkpoints. Ignored for "
        "the other payload dtypes.",
    )
    shard_mb: float = Field(
        default=16.0, ge=0, le=4096, description="Target shard object size in MiB; 0 = one object per region."
    )
    threads: int = Field(default=16, ge=1, le=256, description="Concurrent uploads/downloads per process.")
    # Switches for benchmarks: each optimisation can be turned off on its own to measure it.
    node_leaders: bool = Field(
        default=True,
        description="Shards owned round-robin by node leaders (each node uploads its part, and each node leader "
        "holds the outer state); false: the region's rank 0 moves every shard and alone holds the outer state.",
    )
    serialization: Literal["raw", "torch_save"] = Field(
        default="raw", description="Shard object encoding: raw contiguous bytes, or torch.save (slower)."
    )
    outer_device: Literal["auto", "cpu"] = Field(
        default="auto",
        description="Where a region's leaders hold the outer state and take the outer step. Only the leaders "
        "(local rank 0 of each node; rank 0 alone with node_leaders: false) hold it; the other ranks hold none "
        "and get the new parameters (grad mode: gradients) from rank 0 by a broadcast inside the region. "
        "Flat fp32 buffers per parameter: DiLoCo leader 16 B (theta_outer, momentum, delta, average), grad-mode "
        "leader 8 B (gradient, average), every other rank 0 B. auto: on the training device while that state "
        "fits in outer_device_max_gib, else in host memory (pinned beside a GPU, except the momentum); cpu: "
        "always in host memory. Either way a leader's host memory also holds its transfer buffers: 2 B/param "
        "(bf16 payloads), 1 (int8/fp8, plus a scale per 256), 0.5 (int4, likewise) or 4 (fp32, when the state "
        "is on a GPU), while it uploads an outer snapshot 8 B more per parameter it uploads (a copy of the "
        "outer state), and the downloaded payloads of the other regions (up to their count x the wire size, "
        "split among the leaders; the scaled dtypes are decoded to fp32 one shard at a time). The placement "
        "never changes a bit of the result.",
    )
    outer_device_max_gib: float = Field(
        default=16.0,
        ge=0,
        le=1_000_000,
        description="outer_device auto: the most GiB of outer state a leader keeps on the training device "
        "(DiLoCo 16 B/param: the default holds about 1.07 billion parameters; grad mode 8 B/param). A larger "
        "state goes to host memory, where the blocked CPU kernels take the step (bounded by host memory "
        "bandwidth; it runs once a round). 0: always host memory.",
    )

    _numbers_not_booleans = field_validator(
        "inner_steps",
        "outer_lr",
        "outer_momentum",
        "fragments",
        "fragment_delay_steps",
        "fragment_alpha",
        "timeout_s",
        "min_regions",
        "grace_s",
        "heartbeat_s",
        "snapshot_every",
        "keep_rounds",
        "shard_mb",
        "threads",
        "outer_device_max_gib",
        "sparse_density",
        "sparse_chunk",
        "sparse_beta",
        mode="before",
    )(_no_bool)

    @field_validator("sparse_chunk")
    @classmethod
    def _chunk_is_a_power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two (64, 128, ..., 65536): indices are log2(chunk) bits")
        return v

    @check
    def _sparse_payloads(self) -> CrossRegion:
        if self.payload_dtype != "sparse":
            return self
        if self.serialization != "raw":
            raise FieldError(
                ("payload_dtype",),
                "payload_dtype sparse needs serialization: raw (torch_save carries bf16 and fp32 only)",
            )
        if self.sync != "diloco":
            raise FieldError(
                ("payload_dtype",),
                "payload_dtype sparse needs sync: diloco (its error-feedback buffer carries what a round did "
                "not send to later rounds; grad mode applies every step's gradient at once)",
            )
        return self

    @check
    def _scaled_payloads_are_raw(self) -> CrossRegion:
        if self.payload_dtype in ("int8", "fp8", "int4") and self.serialization != "raw":
            raise FieldError(
                ("payload_dtype",),
                f"payload_dtype {self.payload_dtype} needs serialization: raw (torch_save carries bf16 and fp32 only)",
            )
        return self

    @check
    def _overlap_is_diloco(self) -> CrossRegion:
        if self.overlap != "none" and self.sync != "diloco":
            raise FieldError(
                ("overlap",),
                f"overlap {self.overlap} needs sync: diloco (grad mode applies each step's average before the "
                "next step: there is nothing to overlap)",
            )
        return self

    @check
    def _streaming_schedule(self) -> CrossRegion:
        if self.overlap != "streaming":
            return self
        h, f, tau = self.inner_steps, self.fragments, self.fragment_delay_steps
        if f > h:
            raise FieldError(
                ("fragments",),
                f"fragments {f} is more than inner_steps {h}: each of the H steps of a cycle starts at most "
                "one fragment's round",
            )
        gap = h // f  # the fewest steps between two rounds (fragment offsets floor(H*(p+1)/F))
        if tau >= gap:
            raise FieldError(
                ("fragment_delay_steps",),
                f"fragment_delay_steps {tau} must be below inner_steps / fragments ({h} / {f}: rounds start "
                f"every {gap} step{'s' if gap > 1 else ''} or more): a fragment's exchange must be merged before the "
                "next round starts",
            )
        return self

    @check
    def _region_in_regions(self) -> CrossRegion:
        if len(set(self.regions)) != len(self.regions):
            raise ValueError(f"regions has duplicates: {self.regions}")
        if self.region not in self.regions:
            raise ValueError(f"region {self.region!r} is not in regions {self.regions}")
        if self.min_regions != "all":
            if self.min_regions > len(self.regions):
                raise ValueError(
                    f"min_regions ({self.min_regions}) is more than the {len(self.regions)} regions"
                )
            if self.elastic and self.sync == "grad":
                raise ValueError(
                    "min_regions below the number of regions needs sync: diloco (grad mode "
                    "averages every step and has no outer state a returning region could adopt)"
                )
        if self.elastic and self.grace_s >= self.timeout_s:
            raise ValueError(
                f"grace_s ({self.grace_s:g}) must be below timeout_s ({self.timeout_s:g}): a round "
                "that waits out its grace period must still close before the timeout"
            )
        return self

    @property
    def quorum(self) -> int:
        """How many regions a round needs (``min_regions`` resolved)."""
        return len(self.regions) if self.min_regions == "all" else int(self.min_regions)

    @property
    def fragment_count(self) -> int:
        """The fragments the parameters are split into: ``fragments`` with overlap streaming, else 1."""
        return self.fragments if self.overlap == "streaming" else 1

    @property
    def sparse_kept(self) -> int:
        """payload_dtype sparse: the entries each chunk sends (sparse_density of sparse_chunk, at least 1)."""
        return max(1, min(self.sparse_chunk, round(self.sparse_density * self.sparse_chunk)))

    @property
    def wire_dtype(self) -> str:
        """The dtype a payload's manifest names: payload_dtype, or for sparse ``sparse-c<chunk>-k<kept>``
        (regions that disagree on the chunk or the entries kept are refused by the manifest check)."""
        if self.payload_dtype == "sparse":
            return f"sparse-c{self.sparse_chunk}-k{self.sparse_kept}"
        return self.payload_dtype

    @property
    def elastic(self) -> bool:
        """Rounds may close without every region."""
        return self.quorum < len(self.regions)

    def shared_view(self) -> dict:
        """The fields every region of one run must agree on: everything but ``region``, ``enabled`` and how
        this region reaches the store (:data:`REGION_OWN_TRANSPORT_FIELDS`: its endpoint, addressing style,
        the bucket's region as its client names it, and its credentials), which may differ; the store
        itself (kind, bucket, prefix; the fs root) may not."""
        view = self.model_dump(mode="json", exclude={"region", "enabled"})
        if isinstance(self.transport, S3Transport):
            for name in REGION_OWN_TRANSPORT_FIELDS:
                view["transport"].pop(name, None)
        return view

    def round_settings(self) -> dict:
        """What the regions of a run must agree on at run time, for their rounds to line up and the shared
        outer state to stay bit-identical: each region's round claims (and theta0) carry it, and a region
        refuses a peer's that says otherwise (the trainer's one-line check of what ``validate`` checks on
        one checkout, :meth:`shared_view`). In the order a difference is reported: the averaging order
        (``regions``), the sync mode, the quorum (``min_regions`` resolved: a strict region writes its
        claims over any tombstone an elastic one would write), the wire (sparse: its chunk and density), then with DiLoCo the rounds' steps
        (H, and the fragments: 1 without streaming; they set the rounds' steps, order and contents) and the
        outer step. Left out, since regions may differ in them without harm: what is local to a region
        (its shape, threads, shards, the outer state's device), how long it waits (``timeout_s``,
        ``grace_s``), its housekeeping (``keep_rounds``, ``snapshot_every``), heartbeats (judged by the
        longer interval), ``overlap`` but for the fragments (an eager region and one without overlap apply
        the same committed rounds to the shared state, one boundary apart), and streaming's
        ``fragment_delay_steps`` and ``fragment_alpha``, which change only a region's own model between
        rounds, never the shared state."""
        out: dict = {
            "regions": list(self.regions),
            "sync": self.sync,
            "min_regions": self.quorum,
            "payload_dtype": self.payload_dtype,
            "serialization": self.serialization,
        }
        if self.payload_dtype == "sparse":  # the wire's chunks and entries (sparse_beta is a region's own)
            out.update(sparse_chunk=self.sparse_chunk, sparse_density=self.sparse_density)
        if self.sync == "diloco":
            out.update(
                inner_steps=self.inner_steps,
                fragments=self.fragment_count,
                outer_lr=self.outer_lr,
                outer_momentum=self.outer_momentum,
            )
        return out


def outer_step_warnings(xr: CrossRegion) -> list[tuple[str, str]]:
    """(field, message) for outer lr / momentum / H combinations (and, with overlap streaming, delays) that
    measured worse in bench/results/quality.md: H 10, 50 and 100 without overlap, H 50 and 100 with
    streaming; and sparse payloads as bench/results/sparse.md measured them (H 10, 50 and 100). Nothing
    outside those ranges: no evidence either way."""
    return _outer_step_warnings(xr) + _sparse_warnings(xr)


# Fields that only one payload dtype or overlap reads: set in a profile where the other holds, they are ignored
# (a typo in payload_dtype or overlap, or a leftover from an earlier setting)
_ONLY_WITH = {
    "sparse_density": ("payload_dtype", "sparse"),
    "sparse_chunk": ("payload_dtype", "sparse"),
    "sparse_beta": ("payload_dtype", "sparse"),
    "fragments": ("overlap", "streaming"),
    "fragment_delay_steps": ("overlap", "streaming"),
    "fragment_alpha": ("overlap", "streaming"),
}


def ignored_field_warnings(xr: CrossRegion) -> list[tuple[str, str]]:
    """(field, message) for a payload or streaming setting written in the profile where it is ignored
    (sparse_* without payload_dtype sparse, fragment_* without overlap streaming). The profile's only: the
    renders spell every flag out, so a trainer's options would always show them set."""
    if not xr.enabled:
        return []
    return [
        (
            name,
            f"cross_region.{name} is set, but {field} is {getattr(xr, field)}: it is read only with {field} "
            f"{value}, and ignored here",
        )
        for name, (field, value) in _ONLY_WITH.items()
        if name in xr.model_fields_set and getattr(xr, field) != value
    ]


def _sparse_warnings(xr: CrossRegion) -> list[tuple[str, str]]:
    """payload_dtype sparse, from bench/results/sparse.md (2026-12-07: H 10, 50 and 100; density 0.5%, 1% and
    3%; outer lr 1 and 2, sparse_beta 0.95) and the run before it (2026-12-06: H 10 and 50; density 1% and
    3%; outer lr 1, 2, 4; sparse_beta 0.95 and 1); all without overlap: with eager or streaming they are the
    only evidence there is, and the message says so."""
    if not xr.enabled or xr.sync != "diloco" or xr.payload_dtype != "sparse":
        return []
    out = []
    if xr.outer_momentum > 0:
        out.append(
            (
                "outer_momentum",
                f"cross_region.outer_momentum {xr.outer_momentum:g} with sparse payloads: not measured (bench "
                "sparse ran outer_momentum 0, as SparseLoCo does: the error feedback replaces the momentum). "
                "Use 0 unless you measured otherwise.",
            )
        )
    if not 10 <= xr.inner_steps <= 100:
        return out
    out += [
        (
            "payload_dtype",
            f"cross_region.payload_dtype sparse ({xr.sparse_density:.3g} of each chunk) with inner_steps "
            f"{xr.inner_steps}: bench/results/sparse.md measured held-out loss above dense bf16 DiLoCo at every "
            "point, each at its best outer setting: at H=10 +5.8% (0.5%), +1.3% (1%), +3.3% (3%); at H=50 "
            "+24% (0.5%), +16% (1%), +4.9% (3%); at H=100 +54% (0.5%), +32% (1%), +18.5% (3%) (a tiny model from "
            "scratch, 2000 steps"
            + ("" if xr.overlap == "none" else f"; without overlap: with overlap {xr.overlap} not measured")
            + "): the fewer the rounds, the worse; 0.5% was worse than 1% at every H. Its best outer_lr was 2 "
            "at 8 of the 9 points (1 at H=10, 3%). It saves bytes at a cost in the model: measure it on yours "
            "before relying on it.",
        )
    ]
    if xr.sparse_beta > 0.95:
        out.append(
            (
                "sparse_beta",
                f"cross_region.sparse_beta {xr.sparse_beta:g}: above 0.95, bench sparse's 2026-12-06 run "
                "measured worse held-out loss at 11 of 12 points of density x outer lr x H (H 10 and 50; "
                "sparse_beta 1: 1.1-14.6 points above 0.95; the exception -0.5). Use 0.95 unless you measured "
                "otherwise.",
            )
        )
    if xr.outer_lr > 2:
        out.append(
            (
                "outer_lr",
                f"cross_region.outer_lr {xr.outer_lr:g} with sparse payloads: outer lr 4 measured worse than the "
                "better of 1 and 2 at every density and H of bench sparse's 2026-12-06 run (H 10 and 50; +13% to "
                "+26% held-out over dense bf16 at sparse_beta 0.95). Use 1 or 2.",
            )
        )
    return out


def _outer_step_warnings(xr: CrossRegion) -> list[tuple[str, str]]:
    if not xr.enabled or xr.sync != "diloco":
        return []
    if xr.overlap == "streaming":
        return _streaming_warnings(xr)
    if xr.payload_dtype == "sparse":  # measured with dense payloads: _sparse_warnings has sparse's own
        return []
    if xr.inner_steps > 100:
        return []
    h, lr, mu = xr.inner_steps, xr.outer_lr, xr.outer_momentum
    if mu > 0 and h < 50:
        return [
            (
                "outer_momentum",
                f"cross_region.outer_momentum {mu:g} with inner_steps {h}: at H=10 every outer momentum in "
                "bench/results/quality.md ended 9.2-13% above plain averaging's held-out loss (outer_lr 1, "
                "outer_momentum 0). Use outer_momentum 0 below H=50 unless you measured otherwise.",
            )
        ]
    if lr / (1 - mu) > 2:
        return [
            (
                "outer_lr",
                f"cross_region.outer_lr {lr:g} with outer_momentum {mu:g} is an effective outer step "
                f"outer_lr / (1 - outer_momentum) of {lr / (1 - mu):.3g}: above 2, every setting in "
                "bench/results/quality.md ended 1.6-10.5% above plain averaging's held-out loss at H 10-100 "
                "(it overshoots in runs of few rounds). Try outer_lr 1 with outer_momentum 0, or 0.5 at "
                "H >= 50; with overlap streaming the opposite holds (0.7 with 0.9 measured best).",
            )
        ]
    return []


def _streaming_warnings(xr: CrossRegion) -> list[tuple[str, str]]:
    """overlap streaming, from bench/results/quality.md (H 50 and 100; F 2 and 4; tau 1, 5, H/F - 1; dense
    bf16 payloads). Its best outer setting is not advised for sparse payloads: their error feedback replaces
    the outer momentum (docs/cross-region.md), and sparse with streaming is not measured."""
    h, mu, tau = xr.inner_steps, xr.outer_momentum, xr.fragment_delay_steps
    if not 50 <= h <= 100:
        return []
    out = []
    if mu < 0.9 and xr.payload_dtype != "sparse":
        out.append(
            (
                "outer_momentum",
                f"cross_region.outer_momentum {mu:g} with overlap streaming: at H 50 and 100 (F 2 and 4, "
                "fragment_delay_steps 1 and 5) every other setting of bench/results/quality.md ended 0.6-5.5% "
                "above outer_lr 0.7 with outer_momentum 0.9, the best in each (plain averaging, the defaults: "
                "1.8-3.3%). Use outer_lr 0.7, outer_momentum 0.9 with streaming unless you measured otherwise.",
            )
        )
    gap = h // xr.fragments
    if tau > 5 and 2 * tau >= gap:
        out.append(
            (
                "fragment_delay_steps",
                f"cross_region.fragment_delay_steps {tau} is half or more of the {gap} steps between two "
                "rounds: at the longest delay (inner_steps / fragments - 1) bench/results/quality.md measured "
                "+1.25% (fragments 4) and +2.89% (fragments 2) held-out loss over no overlap at H=100, against "
                "-1.7% to +0.14% at delays 1 and 5. Use the shortest delay that hides the exchange.",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------------
# Trainer flags. Each field maps to --xr-<field-with-dashes>; nested transport fields are flattened.

_FLAT = {
    "run_id": "--xr-run-id",
    "region": "--xr-region",
    "regions": "--xr-regions",
    "sync": "--xr-sync",
    "inner_steps": "--xr-inner-steps",
    "outer_lr": "--xr-outer-lr",
    "outer_momentum": "--xr-outer-momentum",
    "overlap": "--xr-overlap",
    "fragments": "--xr-fragments",
    "fragment_delay_steps": "--xr-fragment-delay-steps",
    "fragment_alpha": "--xr-fragment-alpha",
    "timeout_s": "--xr-timeout-s",
    "min_regions": "--xr-min-regions",
    "grace_s": "--xr-grace-s",
    "heartbeat_s": "--xr-heartbeat-s",
    "snapshot_every": "--xr-snapshot-every",
    "keep_rounds": "--xr-keep-rounds",
    "payload_dtype": "--xr-payload-dtype",
    "sparse_density": "--xr-sparse-density",
    "sparse_chunk": "--xr-sparse-chunk",
    "sparse_beta": "--xr-sparse-beta",
    "shard_mb": "--xr-shard-mb",
    "threads": "--xr-threads",
    "node_leaders": "--xr-node-leaders",
    "serialization": "--xr-serialization",
    "outer_device": "--xr-outer-device",
    "outer_device_max_gib": "--xr-outer-device-max-gib",
}
_TRANSPORT = {
    "kind": "--xr-transport",
    "root": "--xr-root",
    "bucket": "--xr-bucket",
    "prefix": "--xr-prefix",
    "endpoint_url": "--xr-endpoint-url",
    "addressing_style": "--xr-addressing-style",
    "region_name": "--xr-s3-region",
}
_CREDS = {
    "profile": "--xr-aws-profile",
    "access_key_id_env": "--xr-access-key-id-env",
    "secret_access_key_env": "--xr-secret-access-key-env",
    "session_token_env": "--xr-session-token-env",
}


# spelled out only with payload_dtype sparse, which alone reads them (renders of the other payloads unchanged)
_SPARSE_FIELDS = frozenset({"sparse_density", "sparse_chunk", "sparse_beta"})
_VALUE_FLAGS = [*_FLAT.values(), *_TRANSPORT.values(), *_CREDS.values()]  # every flag that takes a value
_NULLABLE = {"heartbeat_s"}  # fields whose null is spelled "none" on the command line
_NONE = "none"


def _fmt(v: object) -> str:
    if v is None:
        return _NONE
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ",".join(v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _flag_values(xr: CrossRegion) -> list[tuple[str, str]]:
    """(flag, value) for every option of ``xr`` but --xr-enabled, in the order of the flags."""
    out = [
        (flag, _fmt(getattr(xr, field)))
        for field, flag in _FLAT.items()
        if field not in _SPARSE_FIELDS or xr.payload_dtype == "sparse"
    ]
    t = xr.transport
    for field, flag in _TRANSPORT.items():
        v = getattr(t, field, None)
        if v is not None:
            out.append((flag, _fmt(v)))
    if isinstance(t, S3Transport):
        for field, flag in _CREDS.items():
            v = getattr(t.credentials, field)
            if v is not None:
                out.append((flag, v))
    return out


def to_argv(xr: CrossRegion) -> list[str]:
    """Trainer flags for ``xr`` (empty when disabled). Every field is spelled out: a render never depends
    on the trainer's defaults."""
    if not xr.enabled:
        return []
    argv = ["--xr-enabled"]
    for flag, value in _flag_values(xr):
        argv += [flag, value]
    return argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the --xr-* flags on the trainer's parser (all optional; validated by from_namespace)."""
    g = parser.add_argument_group("cross-region sync")
    g.add_argument("--xr-enabled", action="store_true", help="synchronise with other regions")
    for flag in _VALUE_FLAGS:
        g.add_argument(flag, dest=_dest(flag), default=None)


def _dest(flag: str) -> str:
    return "xr_" + flag[len("--xr-") :].replace("-", "_")


def _model_data(enabled: bool, given: Mapping[str, str]) -> dict:
    """The CrossRegion input for ``enabled`` and the value flags that were given (flag -> its string, as
    :func:`to_argv` writes it): the one place flags become model fields, for flags and environment alike."""
    data: dict = {"enabled": enabled}
    for field, flag in _FLAT.items():
        if flag in given:
            v: object = given[flag]
            if field == "regions":
                v = [x for x in given[flag].split(",") if x]
            elif field in _NULLABLE and v == _NONE:
                v = None
            data[field] = v
    transport: dict = {field: given[flag] for field, flag in _TRANSPORT.items() if flag in given}
    creds = {field: given[flag] for field, flag in _CREDS.items() if flag in given}
    if creds:
        transport["credentials"] = creds
    if transport:
        transport.setdefault("kind", "fs")
        data["transport"] = transport
    return data


def from_namespace(ns: argparse.Namespace) -> CrossRegion:
    """Build a validated CrossRegion from parsed flags (raises pydantic.ValidationError)."""
    given = {flag: v for flag in _VALUE_FLAGS if (v := getattr(ns, _dest(flag))) is not None}
    return CrossRegion.model_validate(_model_data(bool(ns.xr_enabled), given))


def flag_names() -> list[str]:
    return ["--xr-enabled", *_VALUE_FLAGS]


def flag_of(loc: Sequence[str | int]) -> str | None:
    """The flag of the field at a pydantic error location of CrossRegion (``("transport", "fs", "root")``:
    ``--xr-root``); None for an error of the whole model (between fields)."""
    names = [x for x in loc if isinstance(x, str)]
    if not names:
        return None
    if names[0] == "enabled":
        return "--xr-enabled"
    if names[0] in _FLAT:
        return _FLAT[names[0]]
    if names[0] == "transport":
        rest = [x for x in names[1:] if x not in ("fs", "s3")]  # the union's tag
        if not rest:
            return _TRANSPORT["kind"]
        if rest[0] == "credentials":
            return _CREDS.get(rest[1]) if len(rest) > 1 else None
        return _TRANSPORT.get(rest[0])
    return None


# ---------------------------------------------------------------------------------------------------
# The same options as environment variables, for a trainer whose command line cannot take the flags (a
# profile whose trainer.args has no {xr_args}): --xr-foo-bar VALUE is SBATCH_GEN_XR_FOO_BAR=VALUE, and
# --xr-enabled is SBATCH_GEN_XR_ENABLED=1.

ENV_PREFIX = "SBATCH_GEN_XR_"
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no", "")


def env_name(flag: str) -> str:
    """The environment variable of a flag: ``--xr-inner-steps`` -> ``SBATCH_GEN_XR_INNER_STEPS``."""
    return ENV_PREFIX + flag[len("--xr-") :].replace("-", "_").upper()


def env_names() -> list[str]:
    """Every variable :func:`to_env` may set, in its order."""
    return [env_name(f) for f in flag_names()]


def to_env(xr: CrossRegion) -> dict[str, str]:
    """The environment that carries ``xr`` to a trainer (empty when disabled): what :func:`to_argv` says, in
    its order, each ``--xr-foo-bar VALUE`` as ``SBATCH_GEN_XR_FOO_BAR=VALUE``."""
    if not xr.enabled:
        return {}
    env = {env_name("--xr-enabled"): "1"}
    env.update((env_name(flag), value) for flag, value in _flag_values(xr))
    return env


def from_env(environ: Mapping[str, str]) -> CrossRegion:
    """Build a validated CrossRegion from the SBATCH_GEN_XR_* variables of ``environ`` (other names are
    ignored; none set: disabled). Raises ValueError for an unknown SBATCH_GEN_XR_* name or an
    SBATCH_GEN_XR_ENABLED that is not a boolean, pydantic.ValidationError for a bad value."""
    flags = {env_name(f): f for f in _VALUE_FLAGS}
    enabled_name = env_name("--xr-enabled")
    known = [enabled_name, *flags]
    given: dict[str, str] = {}
    enabled = False
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        if name == enabled_name:
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(
                    f"{name}: {value!r} is not a boolean (1, true or yes; 0, false, no or empty)"
                )
            enabled = value.lower() in _TRUE
        elif name in flags:
            given[flags[name]] = value
        else:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"{name}: unknown cross-region variable ({hint}known: {', '.join(known)})")
    return CrossRegion.model_validate(_model_data(enabled, given))
