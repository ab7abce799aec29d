"""A user's own loop through ``hpc_train.init()``, as the README shows it: the lifecycle tests run
it under every path (``run --script``, ``run --fn``, ``python``, ``torchrun``, Slurm).

``python own_loop.py [STEPS] [SLEEP_S]``: STEPS optimizer steps of a tiny model, sleeping SLEEP_S
after each so that a test can stop it mid-run from outside with a real signal.
``HPC_TEST_CRASH_RANK=R``: rank R raises at its first step (a bug in the user's code).
"""

import os
import sys
import time

import torch

import hpc_train


def main(steps: int = 30, sleep_s: float = 0.0) -> dict:
    run = hpc_train.init()
    torch.manual_seed(0)
    model = run.wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.tensor(i % 2)) for i in range(256)]
    loader = run.loader(data, batch_size=4)
    state = {"model": model, "optim": optim, "loader": loader, "step": 0}
    run.restore(state)
    loss = torch.zeros(())
    crash = os.environ.get("HPC_TEST_CRASH_RANK") == str(run.rank)
    while state["step"] < steps:
        for x, y in loader:
            if crash:
                raise RuntimeError(f"own_loop: rank {run.rank} crashes, as the test asked")
            loss = torch.nn.functional.cross_entropy(model(x.to(run.device)), y.to(run.device))
            optim.zero_grad()
            loss.backward()
            optim.step()
            state["step"] += 1
            run.log(state["step"], loss=loss.item())
            time.sleep(sleep_s)
            if run.step_end(state):
                sys.exit(run.exit_code)
            if state["step"] >= steps:
                break
    return run.finish({"loss": loss.item()})


def fn() -> dict:
    """``run --fn tests.scripts.own_loop:fn``: the same loop as a callable (STEPS/SLEEP from the environment)."""
    return main(int(os.environ.get("OWN_LOOP_STEPS", "30")), float(os.environ.get("OWN_LOOP_SLEEP", "0")))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30, float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
