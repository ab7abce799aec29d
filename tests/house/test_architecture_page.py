"""docs/architecture.md, the maintainers' map, stays true: every module, package folder and test
file it names exists, and each of its three data paths is a numbered list whose every step
begins with the module it passes through."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
TEXT = PAGE.read_text()
# A backticked path: a module (x.py, a/b.py) or a folder of the package or the tests (a/b/).
PATH = re.compile(r"`((?:[a-z_]+/)*[a-z_]+\.py|(?:hpc_train|tests)/(?:[a-z_]+/)*)`")


def _where(name: str) -> Path:
    """A name as the page writes it, on disk: from the repository's root when it starts with a
    top folder, else inside the package (``login/hook.py``, ``rundir.py``)."""
    top = name.split("/", 1)[0]
    return ROOT / name if top in ("hpc_train", "tests", "benchmarks", "slurm") else ROOT / "hpc_train" / name


def _paths_section() -> dict[str, list[str]]:
    """Each data path's heading and its numbered steps, in order."""
    section = TEXT.split("## Three data paths", 1)[1].split("\n## ", 1)[0]
    paths = {}
    for block in section.split("\n### ")[1:]:
        title, _, body = block.partition("\n")
        paths[title.strip()] = [line for line in body.splitlines() if re.match(r"\d+\. ", line)]
    return paths


def test_every_named_module_and_folder_exists():
    names = sorted(set(PATH.findall(TEXT)))
    assert len(names) > 60
    missing = [n for n in names if not _where(n).exists()]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_the_check_sees_a_missing_module():
    assert "login/hook.py" in PATH.findall("see `login/hook.py` and `metrics.jsonl`")
    assert not _where("login/no_such_module.py").exists()


def test_the_three_data_paths_are_numbered_steps_through_existing_modules():
    paths = _paths_section()
    assert list(paths) == ["`submit` to a rank's first step", "A preemption signal to the requeue and the resume",
                           "A crash to the in-place restart from the node-local tier"]
    for title, steps in paths.items():
        assert len(steps) >= 8, title
        for i, step in enumerate(steps, 1):
            assert step.startswith(f"{i}. `"), f"{title}: step {i} must begin with its module: {step}"
            first = PATH.match(step[len(f"{i}. "):])
            assert first and _where(first.group(1)).is_file(), f"{title}: step {i} names no existing module: {step}"


@pytest.mark.parametrize("page", ["README.md", "docs/development.md", "docs/index.md"])
def test_the_page_is_linked(page):
    assert "architecture.md" in (ROOT / page).read_text()
