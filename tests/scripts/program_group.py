"""A program on init() that finishes, with the process group its own (``program``: made before
init(), as a Trainer or accelerate makes it) or hpc_train's (``hpc``). An exit handler registered
before init() (so it runs after hpc_train's) writes whether a process group was still up then.

Usage: python program_group.py OUT.json program|hpc
"""

import atexit
import json
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps({"initialized": dist.is_initialized()})))
if sys.argv[2] == "program":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

import hpc_train  # noqa: E402

run = hpc_train.init()
state = {"model": torch.nn.Linear(2, 2), "step": 0}
run.restore(state)
for step in range(1, 3):
    state["step"] = step
    run.step_end(state)
run.finish()
