"""A character-level language model on a text file, in your own training loop, with hpc_train.

The loop is plain PyTorch; a few lines (marked "hpc_train") give it sharded checkpoints, a stop
that every rank agrees on at a step boundary, a requeue on Slurm, and a bitwise-exact resume.
The same file runs everywhere:

    python jobs/charlm.py                                            # one process
    python -m hpc_train run --script jobs/charlm.py --nproc 2 -- --steps 400
    torchrun --nproc-per-node 2 jobs/charlm.py
    python -m hpc_train submit --script jobs/charlm.py --nodes 2 -- --steps 4000

Stop it (Ctrl-C on `run`, SIGTERM, the job's signal) and run the same command again: it
continues from the step it saved, with the same weights a run that never stopped would have.
Hyperparameters not given on the command line come from the hpc_train config (`--set
optim.lr=0.01`, sweeps), which `run.config` exposes.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

import hpc_train

TEXT = Path(__file__).resolve().parent / "data" / "corpus.txt"


class CharWindows(torch.utils.data.Dataset):
    """(context of `context` characters, the character after it), at every position of the text."""

    def __init__(self, text: str, context: int) -> None:
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.context = context

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, i: int):
        return self.ids[i:i + self.context], self.ids[i + self.context]


class CharMLP(nn.Module):
    """Bengio et al.'s neural language model: embed the context, one hidden layer, next character."""

    def __init__(self, vocab: int, context: int, embed: int = 24, hidden: int = 256, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(context * embed, hidden), nn.Tanh(), nn.Dropout(dropout),
                                 nn.Linear(hidden, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(x))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: train.max_steps, else 400)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: optim.lr)")
    ap.add_argument("--batch-size", type=int, default=None, help="per rank (default: data.batch_size)")
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--text", default=str(TEXT))
    args = ap.parse_args(argv)

    run = hpc_train.init()                                               # hpc_train
    cfg = run.config
    steps = args.steps or cfg.train.max_steps or 400
    lr = args.lr or cfg.optim.lr
    torch.manual_seed(cfg.seed)                  # the same initial weights on every rank
    data = CharWindows(Path(args.text).read_text(), args.context)
    net = CharMLP(len(data.chars), args.context)
    model = run.wrap(net, stages=[net.embed, net.net])                  # hpc_train: dist.strategy (split: these stages)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps)))))
    loader = run.loader(data, args.batch_size or cfg.data.batch_size, shuffle=True)   # hpc_train: sharded, resumable
    torch.manual_seed(cfg.seed + 1 + run.rank)   # each rank's own dropout stream (restore brings back its state)
    # The unwrapped model: its checkpoint keys are the plain model's under every strategy.
    state = {"model": net, "optim": optim, "sched": sched, "loader": loader, "step": 0}
    if run.scaler.is_enabled():                                          # hpc_train: train.precision=fp16
        state["scaler"] = run.scaler
    run.restore(state)                                                   # hpc_train: no-op on a fresh run
    loss_fn = nn.CrossEntropyLoss()
    loss = torch.tensor(float("nan"))
    while state["step"] < steps:
        for x, y in loader:                      # one epoch; continues mid-epoch after a restore
            x, y = x.to(run.device), y.to(run.device)
            with run.autocast():                                         # hpc_train: train.precision
                loss = loss_fn(model(x), y)
            optim.zero_grad(set_to_none=True)
            run.scaler.scale(loss).backward()    # fp16: loss scaling; otherwise these three are
            run.scaler.step(optim)               # loss.backward() and optim.step()
            run.scaler.update()
            sched.step()
            state["step"] += 1
            run.log(state["step"], loss=loss.item(), lr=sched.get_last_lr()[0])
            if run.step_end(state):                                      # hpc_train: stop agreed, saved
                return {"stopped_at": state["step"]}
            if state["step"] >= steps:
                break
    return run.finish({"loss": loss.item(), "steps": state["step"], "bits_per_char": loss.item() / math.log(2)})


if __name__ == "__main__":
    main()
