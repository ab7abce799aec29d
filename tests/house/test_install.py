"""What the project's own set-up (``make venv``: the install line in the Makefile) gives a user's
script. Issue 51: a script beside the clone, whose folder ``git clone`` names ``hpc_train``,
imported that folder as an empty namespace package (``module 'hpc_train' has no attribute
'init'``): the editable install's finder ran after the script's own folder was searched."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_script_beside_a_folder_named_hpc_train_imports_the_package(tmp_path):
    (tmp_path / "hpc_train").mkdir()     # the clone's folder (it holds no __init__.py)
    (tmp_path / "hpc_train" / "README.md").write_text("the clone\n")
    script = tmp_path / "train.py"
    script.write_text("import hpc_train\nprint(callable(hpc_train.init), hpc_train.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # as a user runs it
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("True "), p.stdout + p.stderr
