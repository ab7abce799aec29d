"""An accelerate training loop on hpc_train's Run: stopped and resumed, bitwise (docs/huggingface.md).

accelerate prepares the model (DDP), the optimizer and the scheduler; the Run holds them in
``state`` and checkpoints them, with every rank's RNG states and the loader's position, so a
stop saves at its step and the same command resumes there with the weights a run that never
stopped would have. accelerate's own ``save_state``/``load_state`` restore the objects it
registered, but not where the loop was in its data unless the loop skips there itself
(``skip_first_batches``), and a loop that calls them needs its own stop handling.

    python -m hpc_train run --script jobs/accelerate_loop.py --nproc 2 -- --steps 60
    torchrun --nproc-per-node 2 jobs/accelerate_loop.py --steps 60
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import hpc_train

TEXT = Path(__file__).resolve().parent / "data" / "corpus.txt"


class Windows(torch.utils.data.Dataset):
    """(16 bytes of the text, the byte after them), at every position."""

    def __init__(self, path: Path, context: int = 16) -> None:
        self.ids = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        self.context = context

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, i: int):
        return self.ids[i:i + self.context], self.ids[i + self.context]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--weights", help="rank 0 saves the final weights here (torch.save)")
    ap.add_argument("--pace", type=float, default=0.0, help="sleep after each step (to watch a stop land)")
    args = ap.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    run = hpc_train.init()                                   # hpc_train: the group accelerate set up
    torch.manual_seed(0)                                     # the same initial weights on every rank
    net = nn.Sequential(nn.Embedding(256, 16), nn.Flatten(), nn.Linear(16 * 16, 128), nn.Tanh(),
                        nn.Dropout(0.1), nn.Linear(128, 256))
    optim = torch.optim.AdamW(net.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 - s / (args.steps + 1))
    model, optim, sched = accelerator.prepare(net, optim, sched)
    loader = run.loader(Windows(TEXT), batch_size=32)       # hpc_train: this rank's shard, resumable
    torch.manual_seed(1 + run.rank)                          # each rank's own dropout stream
    state = {"model": accelerator.unwrap_model(model), "optim": optim, "sched": sched, "loader": loader, "step": 0}
    run.restore(state)                                       # hpc_train: no-op on a fresh run
    loss_fn = nn.CrossEntropyLoss()
    while state["step"] < args.steps:
        for x, y in loader:
            loss = loss_fn(model(x.to(accelerator.device)), y.to(accelerator.device))
            optim.zero_grad()
            accelerator.backward(loss)
            optim.step()
            sched.step()
            state["step"] += 1
            run.log(state["step"], loss=loss.item())
            time.sleep(args.pace)
            if run.step_end(state):                          # hpc_train: every rank stops here, saved
                return
            if state["step"] >= args.steps:
                break
    if args.weights and run.is_main:
        torch.save({k: v.detach().cpu() for k, v in state["model"].state_dict().items()}, args.weights)
    run.finish({"loss": loss.item()})


if __name__ == "__main__":
    main()
