"""Same inputs, same bytes: across runs, hash seeds and checkout locations. A one-field change to a
profile changes only the lines that depend on that field (plus the inputs hash in the header)."""

import difflib
import os
import shutil

import pytest

from .conftest import REPO, edit_site, sg, sg_proc

SITES = ("eu", "us", "local")


def _render_in(base, *extra_env):
    """Copy sites/ and templates/ to `base`, render there in a separate process."""
    shutil.copytree(REPO / "sites", base / "sites")
    shutil.copytree(REPO / "templates", base / "templates")
    env = dict(os.environ, **dict(extra_env))
    args = ["render", "--out", "out", "--templates-dir", "templates"]
    for s in SITES:
        args += ["--site", s]
    r = sg_proc(*args, cwd=base, env=env)
    assert r.code == 0, r.err
    return {p.name: p.read_bytes() for p in sorted((base / "out").iterdir())}


def test_byte_identical_across_runs_hash_seeds_and_locations(tmp_path):
    a = _render_in(tmp_path / "a", ("PYTHONHASHSEED", "1"))
    b = _render_in(tmp_path / "some" / "other" / "checkout", ("PYTHONHASHSEED", "2"))
    assert a == b
    for name, data in a.items():
        assert data == (REPO / "out" / name).read_bytes(), name
        text = data.decode()
        assert str(tmp_path) not in text and str(REPO) not in text


def test_no_volatile_content_in_renders():
    import sbatch_gen

    for name in ("eu.sbatch", "us.sbatch", "local.sbatch", "eu.setup.sbatch"):
        text = (REPO / "out" / name).read_text()
        header = text.split("\n#SBATCH", 1)[0]
        assert sbatch_gen.__version__ not in header
        assert "2026" not in text and "2025" not in text  # no render date anywhere
        assert "/work/" not in text


def _changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    removed, added = [], []
    for line in difflib.ndiff(before.splitlines(), after.splitlines()):
        if line.startswith("- "):
            removed.append(line[2:])
        elif line.startswith("+ "):
            added.append(line[2:])
    return removed, added


@pytest.mark.parametrize(
    "site, field, value, expected_added",
    [
        ("eu", "slurm.partition", "h200-long", ["#SBATCH --partition=h200-long"]),
        ("eu", "nccl.debug", "INFO", ['export NCCL_DEBUG="${NCCL_DEBUG-INFO}"']),
        ("eu", "trainer.config", "configs/other.yaml", ["TRAIN_CONFIG=configs/other.yaml  # trainer.config"]),
        ("us", "torchrun.rdzv_port", 29555, ["MASTER_PORT=29555  # torchrun.rdzv_port"]),
        (
            "local",
            "preemption.max_requeues_without_progress",
            7,
            ["MAX_NO_PROGRESS=7  # preemption.max_requeues_without_progress"],
        ),
        ("local", "slurm.time", "01:00:00", ["#SBATCH --time=01:00:00"]),
    ],
)
def test_one_field_changes_only_its_lines(work, site, field, value, expected_added):
    assert sg("render", "--site", site, "--out", "before").code == 0
    edit_site(work / "sites" / f"{site}.yaml", **{field: value})
    r = sg("render", "--site", site, "--out", "after")
    assert r.code == 0, r.err
    before = (work / "before" / f"{site}.sbatch").read_text()
    after = (work / "after" / f"{site}.sbatch").read_text()
    removed, added = _changed_lines(before, after)
    sha = [line for line in added if line.startswith("#   inputs sha256: ")]
    assert len(sha) == 1
    assert [line for line in added if line not in sha] == expected_added
    assert len(removed) == len(added)


def test_each_render_keeps_its_own_render_state(tmp_path):
    """shq notes a literal $ in single quotes in the state of its own render (a fresh RenderState in the
    render's context), not in the cached Jinja environment: a render that runs while another one is under
    way (here: called from inside it) does not reset or set the other's."""
    from sbatch_gen.loader import load_site
    from sbatch_gen.render import _SC2016, _cached_env, render_site

    tdir = tmp_path / "templates"
    shutil.copytree(REPO / "templates", tdir)
    main = tdir / "slurm.sbatch.j2"
    main.write_text(main.read_text() + "{{ render_another() }}\n")
    dollar = load_site(REPO / "sites", "local", ["trainer.extra_args=[--note, $HOME]"])
    plain = load_site(REPO / "sites", "local")
    inner: list[str] = []

    def render_another() -> str:  # renders `plain` once, in the middle of the outer render
        if not inner:
            inner.append("")
            inner.append(render_site(plain, tdir)[0].text)
        return ""

    env = _cached_env(str(tdir.resolve()))
    env.globals["render_another"] = render_another
    outer = render_site(dollar, tdir)[0].text
    assert _SC2016 in outer  # the inner render did not reset it
    assert _SC2016 not in inner[1]  # nor did the outer one's $ leak into it
    assert not [k for k, v in env.globals.items() if isinstance(v, list | set)], env.globals.keys()
