"""Profiles and their extends: bases live in the sites directory; rendered headers name them relative to
it, so a render is the same bytes wherever the sites directory is and wherever sbatch-gen runs from.
(Bases outside the directory are refused: see test_bad_input.py.)"""

import os
import shutil

from .conftest import REPO, sg


def test_header_names_profiles_inside_the_sites_directory(tmp_path, monkeypatch):
    shutil.copytree(REPO / "sites", tmp_path / "elsewhere" / "sites")
    monkeypatch.chdir(REPO)
    a = sg("render", "--site", "us", "--out", str(tmp_path / "a"))
    assert a.code == 0, a.err
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # the sites directory is not below the current directory
    b = sg(
        "render",
        "--site",
        "us",
        "--sites-dir",
        str(tmp_path / "elsewhere" / "sites"),
        "--templates-dir",
        str(REPO / "templates"),
        "--out",
        str(tmp_path / "b"),
    )
    assert b.code == 0, b.err
    for name in ("us.sbatch", "us.setup.sbatch"):
        text = (tmp_path / "b" / name).read_text()
        assert "#   profile: sites/us.yaml\n#   extends: sites/_base/llm-xr-1.yaml\n" in text
        assert str(tmp_path) not in text
        assert text == (tmp_path / "a" / name).read_text()


def test_a_symlink_inside_the_sites_directory_is_fine(work):
    os.symlink("llm-xr-1.yaml", work / "sites" / "_base" / "alias.yaml")
    us = work / "sites" / "us.yaml"
    us.write_text(
        us.read_text().replace("extends: _base/llm-xr-1.yaml", "extends: _base/../_base/alias.yaml")
    )
    r = sg("render", "--site", "us", "--out", "out")
    assert r.code == 0, r.err
    assert "#   extends: sites/_base/alias.yaml\n" in (work / "out" / "us.sbatch").read_text()
