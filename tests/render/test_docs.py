"""The docs stay true to the repository: every relative link of README.md and docs/*.md reaches a file (and
a heading, for a #anchor into a Markdown page), every block that docs/own-trainer.md quotes from a file is
still in that file, and its contract table names every placeholder, exported variable, stop protocol and
library name the code has."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from sbatch_gen import contract, launch, xr_options
from sbatch_gen.profiles import base, environment
from sbatch_gen.train import api

from .conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OWN_TRAINER = REPO / "docs" / "own-trainer.md"

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_QUOTE = re.compile(r"^<!-- quote: (\S+) -->\n```[a-z]*\n(.*?)^```[ \t]*$", re.M | re.S)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def relative_links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_the_pages_exist():
    assert OWN_TRAINER in PAGES
    assert (REPO / "README.md") in PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_reach_a_file_and_a_heading(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Some `code`: here\n\n[x](a.md#some-code-here) [y](b.md)\n")
    assert anchors(tmp_path / "a.md") == {"top", "some-code-here"}
    assert relative_links(tmp_path / "a.md") == ["a.md#some-code-here", "b.md"]


CODE_DIRS = ("sbatch_gen", "templates", "examples", "scripts", "sites", "tests")


def test_docs_pages_named_in_code_and_profiles_exist():
    """Messages, docstrings and comments point at docs/<page>.md: every such page exists."""
    named: dict[str, set[str]] = {}
    for top in CODE_DIRS:
        for f in (REPO / top).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".j2", ".yaml", ".sh"):
                for page in re.findall(r"\bdocs/[\w-]+\.md\b", f.read_text(errors="replace")):
                    named.setdefault(page, set()).add(f.relative_to(REPO).as_posix())
    assert "sbatch_gen/train/api.py" in named.get("docs/own-trainer.md", set())
    assert {page: sorted(where) for page, where in named.items() if not (REPO / page).exists()} == {}


def test_the_readme_and_the_trainer_page_link_to_the_own_trainer_page():
    assert "docs/own-trainer.md" in relative_links(REPO / "README.md")
    assert any(t.startswith("own-trainer.md") for t in relative_links(REPO / "docs" / "trainer.md"))


def quoted_blocks(page: Path) -> list[tuple[str, list[str]]]:
    return [(m.group(1), m.group(2).splitlines()) for m in _QUOTE.finditer(page.read_text())]


def missing_lines(quoted: list[str], source: list[str]) -> list[str]:
    """The quoted lines that are not lines of the source, in order ("..." alone on a line skips some)."""
    missing, at = [], 0
    for line in quoted:
        if line.strip() == "...":
            continue
        try:
            at = source.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


def test_quoted_blocks_are_in_their_files_verbatim():
    blocks = quoted_blocks(OWN_TRAINER)
    assert {"examples/sites/titan.yaml", "examples/out/titan.sbatch"} <= {f for f, _ in blocks}
    for name, lines in blocks:
        source = (REPO / name).read_text().splitlines()
        assert not missing_lines(lines, source), (
            f"{name}: not there (in this order): {missing_lines(lines, source)}"
        )


def test_the_quote_check_sees_a_changed_line():
    source = ["a", "  b", "c"]
    assert missing_lines(["a", "...", "c"], source) == []
    assert missing_lines(["b"], source) == ["b"]  # indentation counts
    assert missing_lines(["c", "a"], source) == ["a"]  # so does the order


def test_the_contract_table_names_every_placeholder_variable_protocol_and_exit_code():
    text = OWN_TRAINER.read_text()
    contract_part = text[text.index("## The contract") : text.index("## The library")]
    names = [f"`{{{p}}}`" for p in launch.PLACEHOLDERS]
    names += [f"`{v}`" for v in sorted(environment.RESERVED_ENV) if not v.startswith(xr_options.ENV_PREFIX)]
    names += [
        f"`{xr_options.ENV_PREFIX}*`",
        f"`{contract.EXIT_REQUEUE}`",
        f"`<stop file>{contract.ACK_SUFFIX}`",
    ]
    names += [f"`{p}`" for p in typing.get_args(base.StopProtocol)]
    assert [n for n in names if n not in contract_part] == []


def test_the_library_section_names_the_whole_public_api():
    text = OWN_TRAINER.read_text()
    library = text[text.index("## The library") : text.index("## Example")]
    public = [n for n in api.__all__ if n not in ("CrossRegion", "ENV_STOP_FILE")]  # named in the contract
    assert [n for n in public if f"`{n}" not in library] == []


def test_the_commands_table_names_every_command_and_option_of_sbatch_gen():
    """docs/profiles.md's table of commands has a row for each command and each option of `sbatch-gen`
    itself (--version: the renders carry none, and the row says where that is answered)."""
    from sbatch_gen.cli import cli

    text = (REPO / "docs" / "profiles.md").read_text()
    rows = [
        line for line in text[text.index("| command | what it does |") :].splitlines() if line.startswith("|")
    ]
    names = [*cli.commands, *(o for p in cli.params for o in p.opts if o.startswith("--") and o != "--help")]
    assert [n for n in names if not any(row.startswith(f"| `{n}") for row in rows)] == []
    version_row = next(row for row in rows if row.startswith("| `--version`"))
    assert "cross-region.md#which-version-a-region-runs" in version_row


def test_the_readme_and_the_quickstart_say_how_to_get_a_local_cluster():
    """A new user without a cluster learns from the README and the quickstart how to start the local one
    and point sbatch at it."""
    for page in (REPO / "README.md", REPO / "docs" / "quickstart.md"):
        text = page.read_text()
        assert "scripts/local-slurm.sh start" in text, page
        assert "scripts/local-slurm.sh env" in text, page
        assert any(t.split("#")[0].endswith("local-slurm.md") for t in relative_links(page)), page
