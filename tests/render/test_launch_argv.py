"""The command line on the nodes is built once (sbatch_gen/launch.py) for both kinds: a Slurm profile and an
SSH profile with the same paths, trainer and cross_region start the trainer with the same arguments, and
torchrun with the same flags where they mean the same thing. Checked on the lists both templates render
from and on the rendered scripts themselves (their arrays expanded by bash), for the fixed flags and for a
command line of the profile's own (trainer.args, whose run-time placeholders are each launcher's variables)."""

from __future__ import annotations

import subprocess

import pytest

from sbatch_gen.launch import SLURM, SSH, Concat, Option, Var, Word, torchrun_argv, trainer_argv
from sbatch_gen.loader import load_site
from sbatch_gen.render import RENDER_STATE, RenderState, make_env, render_site, shell_quote

from .conftest import REPO
from .script_parts import flat

XR = "cross_region={enabled: true, region: eu, regions: [eu, us], transport: {kind: fs, root: /mnt/xr mail}}"
SHARED = [
    "paths.run_dir=runs/same",
    "trainer.config=configs/tiny.yaml",
    "trainer.resume=auto",
    "torchrun.procs_per_node=2",
    "torchrun.rdzv_timeout_s=300",
    "torchrun.max_restarts=1",
    "torchrun.rdzv_port=29555",
]
VARIANTS = {
    "plain": [],
    "data": ["paths.data=data/shards"],
    "max-steps": ["trainer.max_steps=7"],
    "extra-args": ["trainer.extra_args=[--note, it's $HOME `x`, '', --flag=a b]"],
    "cross-region": [XR],
    "everything": ["paths.data=data/shards", "trainer.max_steps=7", "trainer.extra_args=[--note, x y]", XR],
    # trainer.args: every placeholder but {site} (the two sites' names differ), alone and inside words
    "custom-args": [
        "paths.data=data/shards",
        "trainer.max_steps=7",
        "trainer.args=[--job.config_file, '{config}', '--job.dump_folder={run_dir}/dump', --resume, '{resume}',"
        " '--data={data_path}', --steps, '{max_steps}', '{xr_args}', --world, '{nnodes}x{nproc_per_node}',"
        " 'it''s $HOME `x` \\ \"q\" {{literal}}', '', '--mix=$RUN_DIR {run_dir} ${{HOME}}']",
        XR,
    ],
    "script": [
        "trainer={script: bin/my train.py, config: configs/tiny.yaml, args: ['--cfg={config}', '{nnodes}']}",
    ],
}
FIXED_FLAGS = [v for v in VARIANTS if v not in ("custom-args", "script")]
# What the custom-args variant's trainer gets, with RUNTIME's values (the XR flags in between).
CUSTOM_HEAD = [
    "--job.config_file",
    "configs/tiny.yaml",
    "--job.dump_folder=runs/same/dump",
    "--resume",
    "auto",
    "--data=data/shards",
    "--steps",
    "7",
]
CUSTOM_TAIL = ["--world", "2x2", 'it\'s $HOME `x` \\ "q" {literal}', "", "--mix=$RUN_DIR runs/same ${HOME}"]


def _profiles(variant: str):
    sets = SHARED + VARIANTS[variant]
    return (load_site(REPO / "sites", "local", sets), load_site(REPO / "sites", "ssh-local", sets))


def _as_ssh(w: Word) -> Word:
    """A Slurm word with the SSH launcher's name for the node count (the one variable they name apart)."""
    if w == SLURM.nnodes:
        return SSH.nnodes
    if isinstance(w, Concat):
        return Concat(tuple(SSH.nnodes if p == SLURM.nnodes else p for p in w.parts))
    return w


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_kinds_build_the_same_trainer_argv(variant):
    slurm, ssh = _profiles(variant)
    a = trainer_argv(slurm.profile, SLURM, "same")
    b = trainer_argv(ssh.profile, SSH, "same")
    assert [Option(tuple(_as_ssh(w) for w in o.words), o.key) for o in a] == b
    if variant == "custom-args":
        assert any(SLURM.nnodes in w.parts for o in a for w in o.words if isinstance(w, Concat))


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_kinds_build_the_same_torchrun_flags_where_they_mean_the_same(variant):
    slurm, ssh = _profiles(variant)
    a = {o.words[0]: o for o in torchrun_argv(slurm.profile, SLURM)}
    b = {o.words[0]: o for o in torchrun_argv(ssh.profile, SSH)}
    # The node count and the run id are each launcher's own variables; SSH also names node 0 the store's
    # host (is_host) and binds every node to the pinned interface's address (--local-addr).
    for flag in ("--nproc-per-node", "--rdzv-backend=c10d", "--max-restarts"):
        assert a[flag] == b[flag], flag
    endpoint = [
        w for w in (o.words[0] for o in a.values()) if isinstance(w, Concat) and "--rdzv-endpoint=" in w.parts
    ]
    assert endpoint and endpoint == [
        w for w in (o.words[0] for o in b.values()) if isinstance(w, Concat) and "--rdzv-endpoint=" in w.parts
    ]
    conf_a = next(o for o in a.values() if o.key == "torchrun.rdzv_timeout_s").words[0]
    conf_b = next(o for o in b.values() if o.key == "torchrun.rdzv_timeout_s").words[0]
    assert conf_a == "--rdzv-conf=join_timeout=300"
    assert conf_b == Concat(("--rdzv-conf=", "join_timeout=300,is_host=", Var("IS_HOST")))
    assert a["--nnodes"].words[1] == Var("SLURM_NNODES") and b["--nnodes"].words[1] == Var("NNODES")


# ---- the rendered scripts ------------------------------------------------------------------------------

# The run-time values, the same for both launchers (each under its own variable name where they differ).
RUNTIME = {
    "NPROC_PER_NODE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29555",
    "SLURM_NNODES": "2",
    "NNODES": "2",
    "SLURM_JOB_ID": "77",
    "TAG": "sbg-x-29555-1",
    "ATTEMPT": "1",
    "IS_HOST": "1",
    "NODE_ADDR": "10.0.0.1",
    "RESUME": "auto",
}


def _block(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i : text.index(end, i) + len(end)]


def _expand(code: str, arrays: list[str]) -> dict[str, list[str]]:
    """Run code under bash and print each array NUL-separated."""
    sets = "".join(f"{k}={shell_quote(v)}\n" for k, v in RUNTIME.items())
    prints = "".join(f"printf '%s\\0' \"${{{a}[@]}}\"; printf '\\1\\0'\n" for a in arrays)
    r = subprocess.run(
        ["bash", "-c", "set -eu\n" + sets + code + "\n" + prints], capture_output=True, timeout=30
    )
    assert r.returncode == 0, r.stderr.decode()
    words = r.stdout.decode().split("\0")[:-1]
    out, cur = {}, []
    names = iter(arrays)
    for w in words:
        if w == "\1":
            out[next(names)] = cur
            cur = []
        else:
            cur.append(w)
    return out


def _rendered_argv(variant: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    slurm, ssh = _profiles(variant)
    sb = flat(render_site(slurm)[0].text)
    sh = render_site(ssh)[0].text
    s_settings = _block(sb, "# ---- settings from the profile", "# ---- environment of every job step")
    s_arrays = _block(sb, "\nTORCHRUN_ARGS=(\n", "\n)\n") + _block(sb, "\nTRAINER_ARGS=(\n", "\n)\n")
    h_settings = _block(sh, "\nHOSTS=(", "\nSITE=")
    # the two arrays of node_main: the first "  )" line closes the second (the first ends in ") trainer_args=(")
    h_arrays = _block(sh, "  local -a torchrun_args=(\n", "\n  )\n").replace("local -a ", "declare -a ")
    # the words between torchrun's arguments and the trainer's: the entry point (-m MODULE, or SCRIPT)
    s_entry = _block(sb, 'torchrun "${TORCHRUN_ARGS[@]}" ', ' "${TRAINER_ARGS[@]}"')
    h_entry = _block(sh, 'torchrun "${torchrun_args[@]}" ', ' "${trainer_args[@]}"')
    s_entry = (
        "\nENTRY=(" + s_entry[len('torchrun "${TORCHRUN_ARGS[@]}" ') : -len(' "${TRAINER_ARGS[@]}"')] + ")"
    )
    h_entry = (
        "\nENTRY=(" + h_entry[len('torchrun "${torchrun_args[@]}" ') : -len(' "${trainer_args[@]}"')] + ")"
    )
    a = _expand(s_settings + s_arrays + s_entry, ["TORCHRUN_ARGS", "TRAINER_ARGS", "ENTRY"])
    b = _expand(h_settings + h_arrays + h_entry, ["torchrun_args", "trainer_args", "ENTRY"])
    return (
        {"torchrun": a["TORCHRUN_ARGS"], "trainer": a["TRAINER_ARGS"], "entry": a["ENTRY"]},
        {"torchrun": b["torchrun_args"], "trainer": b["trainer_args"], "entry": b["ENTRY"]},
    )


@pytest.mark.parametrize("variant", FIXED_FLAGS)
def test_the_rendered_scripts_start_the_trainer_with_the_same_arguments(variant):
    slurm, ssh = _rendered_argv(variant)
    assert slurm["trainer"] == ssh["trainer"]
    assert slurm["entry"] == ssh["entry"] == ["-m", "sbatch_gen.train"]
    assert slurm["trainer"][:6] == [
        "--config",
        "configs/tiny.yaml",
        "--run-dir",
        "runs/same",
        "--resume",
        "auto",
    ]
    if variant == "extra-args":
        assert slurm["trainer"][-4:] == ["--note", "it's $HOME `x`", "", "--flag=a b"]
    if variant == "everything":
        assert ["--data-path", "data/shards", "--max-steps", "7"] == slurm["trainer"][6:10]
        assert "/mnt/xr mail" in slurm["trainer"] and slurm["trainer"][-2:] == ["--note", "x y"]


@pytest.mark.parametrize("variant", ["custom-args", "script"])
def test_the_rendered_scripts_start_a_custom_command_line_with_the_same_arguments(variant):
    slurm, ssh = _rendered_argv(variant)
    assert slurm["trainer"] == ssh["trainer"]
    if variant == "script":
        assert slurm["entry"] == ssh["entry"] == ["bin/my train.py"]
        assert slurm["trainer"] == ["--cfg=configs/tiny.yaml", "2"]
        return
    assert slurm["entry"] == ssh["entry"] == ["-m", "sbatch_gen.train"]
    got = slurm["trainer"]
    assert got[: len(CUSTOM_HEAD)] == CUSTOM_HEAD
    assert got[-len(CUSTOM_TAIL) :] == CUSTOM_TAIL
    xr = got[len(CUSTOM_HEAD) : -len(CUSTOM_TAIL)]
    assert xr[0] == "--xr-enabled" and xr[xr.index("--xr-root") + 1] == "/mnt/xr mail"


@pytest.mark.parametrize("variant", ["plain", "everything"])
def test_the_rendered_torchrun_flags_agree(variant):
    slurm, ssh = _rendered_argv(variant)
    assert slurm["torchrun"] == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend=c10d",
        "--rdzv-id=77",
        "--rdzv-endpoint=10.0.0.1:29555",
        "--rdzv-conf=join_timeout=300",
        "--max-restarts",
        "1",
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",  # not SIGTERM: the workers' stop request (run-trainer)
        "--shutdown-timeout=30",  # preemption.checkpoint_s + margin_s: torchrun's own 30 s by chance
    ]
    assert ssh["torchrun"] == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend=c10d",
        "--rdzv-id=sbg-x-29555-1.1",
        "--rdzv-endpoint=10.0.0.1:29555",
        "--rdzv-conf=join_timeout=300,is_host=1",
        "--local-addr=10.0.0.1",
        "--max-restarts",
        "1",
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
        "--shutdown-timeout=10",  # launch.kill_grace_s
    ]


def test_run_time_values_render_as_quoted_expansions():
    assert shell_quote(Var("RUN_DIR")) == '"$RUN_DIR"'
    assert shell_quote(Concat(("--rdzv-id=", Var("TAG"), ".", Var("ATTEMPT")))) == '--rdzv-id="$TAG.$ATTEMPT"'
    assert shell_quote(Concat((Var("A"), '_b $`"\\'))) == '"${A}_b \\$\\`\\"\\\\"'
    with pytest.raises(ValueError):
        Var("not a name")
    with pytest.raises(ValueError):
        Concat(("no variable",))
    assert Option(("--max-steps", "7"), "trainer.max_steps").key == "trainer.max_steps"


# ---- how an argument list is laid out in a render (render.packed_options) ----------------------------


def _packed(options) -> list[str]:
    env = make_env(REPO / "templates")
    return (
        env.from_string("{% for x in o | packed_options %}{{ x }}\n{% endfor %}")
        .render({"o": options, RENDER_STATE: RenderState()})
        .splitlines()
    )


def test_keyed_options_get_a_line_of_their_own_and_the_others_pack_by_family():
    opts = [
        Option(("--config", "a b")),
        Option(("--run-dir", "r")),
        Option(("--max-restarts", "1"), "torchrun.max_restarts"),
        *[Option((f"--xr-flag-{i}", str(i))) for i in range(12)],
        Option(("--metrics-sinks", "tensorboard")),
        Option(("--xr-late", "$(rm -rf /)")),
    ]
    lines = _packed(opts)
    assert lines[0] == "--config 'a b' --run-dir r"  # packed outside a family too, up to a keyed option
    assert lines[1] == "--max-restarts 1  # torchrun.max_restarts"
    assert (
        lines[2] == "# cross_region: the trainer's --xr-* flags, from its fields"
    )  # the family's profile section
    xr = [x for x in lines if x.startswith("--xr-flag-")]
    assert [len(x.split()) for x in xr] == [6, 6, 6, 6]  # three options to a line, whatever their width
    assert " ".join(xr).split() == [w for i in range(12) for w in (f"--xr-flag-{i}", str(i))]
    assert lines[-4:] == [
        "# metrics: the trainer's --metrics-* flags, from its fields",
        "--metrics-sinks tensorboard",
        "# cross_region: the trainer's --xr-* flags, from its fields",
        "--xr-late '$(rm -rf /)'",
    ]
    # a longer value changes its own line only
    opts[4] = Option(("--xr-flag-1", "a-much-longer-value-than-before" * 3))
    again = _packed(opts)
    assert [i for i, (x, y) in enumerate(zip(lines, again, strict=True)) if x != y] == [3]


def test_rank_logs_give_torchrun_a_log_dir_per_attempt_and_tee_on_both_launchers():
    """torchrun.rank_logs: --log-dir (Slurm: the attempt's folder beside its node logs, which the node program
    splits per node; SSH: per node already) and --tee=3; off by default."""
    for site, launcher, log_dir in (
        ("local", SLURM, "$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID.attempt-$ATTEMPT.ranks"),
        ("ssh-local", SSH, "$LOGS/attempt-$ATTEMPT.node-$rank.ranks"),
    ):
        plain = _shell_words(torchrun_argv(load_site(REPO / "sites", site, []).profile, launcher))
        assert not [w for w in plain if w.startswith(("--log-dir", "--tee"))], plain
        profile = load_site(REPO / "sites", site, ["torchrun.rank_logs=true"]).profile
        words = _shell_words(torchrun_argv(profile, launcher))
        assert words[words.index("--tee=3") - 1] == f'--log-dir="{log_dir}"', words


def _shell_words(options: list[Option]) -> list[str]:
    return [w if isinstance(w, str) else w.shell() for o in options for w in o.words]
