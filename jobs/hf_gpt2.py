"""A tiny GPT-2 trained by the Hugging Face Trainer on the repo's text, made first-class by two lines.

The model is built from its config (no download), over the bytes of jobs/data/corpus.txt. The
two lines marked "hpc_train" give it a stop that every rank agrees on at a step, where the
Trainer saves its own checkpoint, and a rerun (the same command, a requeue) that resumes there,
bitwise (docs/huggingface.md):

    python -m hpc_train run    --script jobs/hf_gpt2.py --nproc 2 -- --output-dir runs/gpt2-out
    python -m hpc_train submit --script jobs/hf_gpt2.py --nodes 2 -- --output-dir runs/gpt2-out
    torchrun --nproc-per-node 2 jobs/hf_gpt2.py --output-dir runs/gpt2-out

``--unmodified`` runs it as a script that knows nothing of hpc_train (it finds its own last
checkpoint with transformers' ``get_last_checkpoint``); ``--plain-train`` keeps the callback but
calls plain ``trainer.train()``. ``--pace S`` sleeps S seconds after each step and prints
``step N``, to watch a stop land.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

TEXT = Path(__file__).resolve().parent / "data" / "corpus.txt"


class Blocks(torch.utils.data.Dataset):
    """Consecutive blocks of ``size`` bytes of the text; the model predicts each next byte."""

    def __init__(self, path: Path, size: int) -> None:
        data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        self.blocks = data[: len(data) // size * size].view(-1, size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class Pace(TrainerCallback):
    """``--pace``: a slower step, and a line per step (for watching a stop; tests use it)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs) -> None:
        print(f"step {state.global_step}", flush=True)
        time.sleep(self.seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", required=True, help="the Trainer's checkpoints (checkpoint-N)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-steps", type=int, default=1000, help="the Trainer's periodic checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", help="rank 0 saves the final weights here (torch.save)")
    ap.add_argument("--pace", type=float, default=0.0)
    ap.add_argument("--unmodified", action="store_true", help="no hpc_train: its own get_last_checkpoint")
    ap.add_argument("--plain-train", action="store_true", help="the callback, but plain trainer.train()")
    args = ap.parse_args()

    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
                              learning_rate=1e-3, save_strategy="steps", save_steps=args.save_steps,
                              logging_steps=10, report_to="none", seed=args.seed, disable_tqdm=True,
                              use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
                              ddp_find_unused_parameters=False)
    set_seed(args.seed)   # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=None, eos_token_id=None))
    callbacks = [Pace(args.pace)] if args.pace else []
    if args.unmodified:
        from transformers.trainer_utils import get_last_checkpoint
        resume = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    else:
        import hpc_train.huggingface
        callbacks.append(hpc_train.huggingface.Callback())                           # hpc_train
        resume = None if args.plain_train else hpc_train.huggingface.checkpoint_to_resume(targs)   # hpc_train
    trainer = Trainer(model=model, args=targs, train_dataset=Blocks(TEXT, 33), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    if args.weights and targs.process_index == 0:
        torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}, args.weights)


if __name__ == "__main__":
    main()
