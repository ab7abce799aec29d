"""The suite's own harness: under ``make test``'s pytest-xdist workers, a test marked ``quiet``
(it compares ranks' speeds, so another file's load beside it could fail it) runs while no other
test does (``tests/conftest.py``). Checked with real workers on a small suite of its own, which
uses this conftest: each test writes when it starts and ends."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]   # tests/

SUITE = {
    "test_long.py": """
import pytest
from stamp import stamp
@pytest.mark.parametrize("i", range(6))
def test_long(i):
    stamp(f"long{i}", 0.4)
""",
    "test_mixed.py": """
import pytest
from stamp import stamp
@pytest.mark.parametrize("i", range(3))
def test_before(i):
    stamp(f"before{i}", 0.2)
@pytest.mark.quiet
def test_alone():
    stamp("QUIET", 1.0)
@pytest.mark.parametrize("i", range(3))
def test_after(i):
    stamp(f"after{i}", 0.2)
""",
    "stamp.py": """
import os, time
def stamp(name, seconds):
    with open(os.environ["STAMPS"], "a") as f:
        f.write(f"{name} {time.time()!r}\\n")
        f.flush()
        time.sleep(seconds)
        f.write(f"{name} {time.time()!r}\\n")
""",
}


def test_a_quiet_test_runs_while_no_other_test_does(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(HERE / "conftest.py", tests / "conftest.py")
    for name, text in SUITE.items():
        (tests / name).write_text(text)
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nmarkers = ["quiet: alone"]\n')
    stamps = tmp_path / "stamps"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:randomly",
                        "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "STAMPS": str(stamps)})
    assert p.returncode == 0 and "13 passed" in p.stdout, p.stdout + p.stderr
    spans: dict[str, list[float]] = {}
    for line in stamps.read_text().splitlines():
        name, t = line.split()
        spans.setdefault(name, []).append(float(t))
    q0, q1 = spans.pop("QUIET")
    assert len(spans) == 12 and all(len(s) == 2 for s in spans.values()), spans
    overlapping = [n for n, (a, b) in spans.items() if a < q1 and b > q0]
    assert not overlapping, (overlapping, spans, (q0, q1))
    # The two files did run side by side otherwise: the harness costs the quiet test's turn, not the workers.
    assert any(a < spans["long0"][1] and b > spans["long0"][0] for n, (a, b) in spans.items() if not n.startswith("long"))
