"""Misuse of the Run API, one case per run (``python run_api_misuse.py CASE``): what a user's loop
might do by mistake. Each case prints what hpc_train did with it."""

import json
import sys

import torch

import hpc_train
from hpc_train.errors import UsageError

case = sys.argv[1]
run = hpc_train.init()
model = torch.nn.Linear(2, 1)
state = {"model": model, "step": 0}
run.restore(state)
if case == "log-values":
    run.log(1, loss=torch.tensor(1.5), acc=torch.tensor([0.25]), n=3)
    for bad in ({"note": "abc"}, {"loss": torch.ones(3)}, {"flag": True}):
        try:
            run.log(2, **bad)
        except UsageError as e:
            print("REFUSED", e)
elif case in ("negative", "backwards"):
    state["step"] = 5
    run.step_end(state)
    state["step"] = -3 if case == "negative" else 4
    try:
        run.step_end(state)
    except UsageError as e:
        print("REFUSED", e)
elif case == "finish-twice":
    state["step"] = 1
    run.step_end(state)
    first = run.finish({"loss": 1.0})
    path = run.run_dir / "result.json"
    before = (path.read_text(), path.stat().st_mtime_ns)
    second = run.finish({"loss": 2.0})
    print("SAME", second == first and (path.read_text(), path.stat().st_mtime_ns) == before, json.dumps(second))
