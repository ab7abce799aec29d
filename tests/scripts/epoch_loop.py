"""docs/own-code.md's epoch-based loop: a schedule stepped and a line printed at each epoch's end,
the epoch taken from ``loader.epoch``, never from the step.

``python epoch_loop.py``: 3 epochs of 96 samples in batches of 4. ``STOP_AT=N`` asks for a stop
at step N (``run.request_stop``: it lands within a step), so that a test can resume the run at
another world size.
"""

import os
import sys

import torch

import hpc_train

EPOCHS = 3

run = hpc_train.init()
torch.manual_seed(0)
model = run.wrap(torch.nn.Linear(8, 2))
optim = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)   # stepped once per epoch
g = torch.Generator().manual_seed(1)
data = [(torch.randn(8, generator=g), i % 2) for i in range(96)]
loader = run.loader(data, batch_size=4)
state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "step": 0}
run.restore(state)
stop_at = int(os.environ.get("STOP_AT", "0"))
while loader.epoch < EPOCHS:
    epoch = loader.epoch
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x.to(run.device)), y.to(run.device))
        optim.zero_grad()
        loss.backward()
        optim.step()
        state["step"] += 1
        if state["step"] == stop_at:
            run.request_stop()
        if run.step_end(state):
            sys.exit(run.exit_code)
    sched.step()
    if run.is_main:
        print(f"epoch {epoch} ended at step {state['step']}, lr {sched.get_last_lr()[0]:g}", flush=True)
run.finish({"epochs": loader.epochs_done, "steps": state["step"]})
