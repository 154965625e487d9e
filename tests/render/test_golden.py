"""out/ is committed: a fresh render must equal it, and drift is reported as a unified diff."""

import shutil

from .conftest import REPO, sg, sg_proc


def test_committed_renders_are_current():
    r = sg_proc("check", cwd=REPO)
    assert r.code == 0, r.out + r.err
    assert "up to date" in r.out


def test_validate_passes_on_the_repo_sites():
    r = sg_proc("validate", cwd=REPO)
    assert r.code == 0, r.err
    assert "cross-region run 'llm-xr-1': eu, us agree" in r.out


def test_check_reports_drift_as_a_diff(work):
    shutil.copytree(REPO / "out", work / "out")
    target = work / "out" / "eu.sbatch"
    text = target.read_text()
    target.write_text(text.replace("#SBATCH --partition=h200", "#SBATCH --partition=hand-edited"))
    (work / "out" / "gone.sbatch").write_text("#!/bin/bash\n")
    r = sg("check")
    assert r.code == 1
    assert "--- a/out/eu.sbatch" in r.out and "+++ b/out/eu.sbatch" in r.out
    assert "-#SBATCH --partition=hand-edited" in r.out
    assert "+#SBATCH --partition=h200" in r.out
    assert "out/gone.sbatch: no site renders this file" in r.out
    assert "differ from a fresh render" in r.err


def test_diff_one_site_and_render_fixes_it(work):
    r = sg("render", "--site", "us")
    assert r.code == 0, r.err
    assert (work / "out" / "us.sbatch").stat().st_mode & 0o777 == 0o755
    assert (work / "out" / "us.setup.sbatch").is_file()
    assert sg("diff", "--site", "us").code == 0
    sites = work / "sites" / "us.yaml"
    sites.write_text(sites.read_text().replace("cpus_per_task: 72", "cpus_per_task: 64"))
    r = sg("diff", "--site", "us")
    assert r.code == 1
    assert "-#SBATCH --cpus-per-task=72" in r.out and "+#SBATCH --cpus-per-task=64" in r.out
    assert sg("render", "--site", "us").code == 0
    assert sg("diff", "--site", "us").code == 0


def test_render_all_writes_every_site_and_nothing_else(work):
    r = sg("render", "--all", "--out", "rendered")
    assert r.code == 0, r.err
    names = {p.name for p in (work / "rendered").iterdir()}
    ours = {f"{s}{suffix}" for s in ("eu", "us", "local") for suffix in (".sbatch", ".setup.sbatch")}
    assert ours <= names
    assert not any(n.startswith(("_", ".")) for n in names)
    for name in ours:
        assert (work / "rendered" / name).read_text() == (REPO / "out" / name).read_text()


def test_sites_lists_only_real_sites(work):
    r = sg("sites")
    assert r.code == 0
    names = [line.split()[0] for line in r.out.splitlines()]
    assert {"eu", "local", "us"} <= set(names)
    assert names == sorted(names)
    assert "_base" not in r.out and "llm-xr-1" not in names


def test_show_and_schema(work):
    r = sg("show", "--site", "us")
    assert r.code == 0, r.err
    assert "# site us: resolved from sites/_base/llm-xr-1.yaml, sites/us.yaml" in r.out
    assert "inner_steps: 500" in r.out  # from the shared base
    assert "region: us" in r.out
    r = sg("schema")
    assert r.code == 0
    assert '"extends"' in r.out and '"cross_region"' in r.out and '"lead_time_s"' in r.out


def test_render_with_overrides_and_sites_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    r = sg(
        "render",
        "--site",
        "local",
        "--sites-dir",
        "sites",
        "--out",
        str(tmp_path),
        "--set",
        "paths.run_dir=runs/t1",
        "--set",
        "torchrun.rdzv_port=29611",
        "--set",
        "cross_region={enabled: true, region: a, regions: [a, b]}",
    )
    assert r.code == 0, r.err
    text = (tmp_path / "local.sbatch").read_text()
    assert "RUN_DIR=runs/t1  # paths.run_dir" in text
    assert "MASTER_PORT=29611" in text
    assert "--xr-regions 'a,b'" in text
    assert "#   override: --set torchrun.rdzv_port=29611" in text


def test_the_node_program_is_written_once_beside_the_renders_and_checked_like_them(work):
    """`render` writes sbatch-gen-node.py (the preflight's checks, run-trainer) once for every render that runs it, and
    `check` fails on a stale or missing one as on a stale render: the renders pin its sha256."""
    r = sg("render", "--all")
    assert r.code == 0, r.err
    assert r.out.count("out/sbatch-gen-node.py") == 1, r.out
    node = work / "out" / "sbatch-gen-node.py"
    assert node.read_bytes() == (REPO / "out" / "sbatch-gen-node.py").read_bytes()
    assert sg("check").code == 0
    node.write_text(node.read_text().replace("preflight ok on", "preflight fine on"))
    r = sg("check")
    assert r.code == 1 and "--- a/out/sbatch-gen-node.py" in r.out, r.out
    assert '-    print(f"preflight fine on' in r.out and '+    print(f"preflight ok on' in r.out, r.out
    node.unlink()
    r = sg("check")
    assert r.code == 1 and "out/sbatch-gen-node.py" in r.out, r.out
    # every Slurm render writes it, pinned by the job library its script sources, and stages it: the batch
    # shell's OMP_NUM_THREADS is its (use_allocated_cpus), whatever else the render runs it for (the preflight,
    # a pinned environment, a training step that run-trainer supervises). A run that pins its code with none of
    # those (python_env none) prunes the staged copies of older submissions too.
    sg("render", "--all")
    alone = ["--site", "local", "--set", "preflight.enabled=false", "--set", "python_env={kind: none}"]
    r = sg("render", *alone, "--set", "trainer.stop_protocol=signal", "--out", "alone")
    assert r.code == 0 and (work / "alone" / "sbatch-gen-node.py").exists(), r.out
    text = (work / "alone" / "local.sbatch").read_text()
    assert '\n  stage_node_program || die 1 "$NODE_ERROR"  # sbatch-gen-node.py: OMP_NUM_THREADS\n' in text
    assert "\n  pin_code " in text and "node_py --exec" not in text  # the training step runs torchrun itself
