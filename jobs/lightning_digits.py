"""A plain PyTorch Lightning script that knows nothing of hpc_train: a small classifier of
scikit-learn's handwritten digits (8x8, offline), DDP on CPU, Lightning's own checkpoints.

    python jobs/lightning_digits.py --devices 1 --strategy auto      # Lightning alone, one process
    python -m hpc_train run --script jobs/lightning_digits.py --nproc 2 -- --root /tmp/ld
    python -m hpc_train submit --script jobs/lightning_digits.py --nodes 2 -- --devices 1 --num-nodes 2 --root $PWD/ld

`devices` is the number of ranks per node hpc_train starts (``--nproc`` under ``run``, the tasks
per node under ``submit``) and `num_nodes` its nodes: Lightning then starts no process of its own
and takes its ranks from the variables hpc_train sets (docs/lightning.md).

A stop reaches it as SIGTERM: Lightning ends ``fit`` at its next check, OnExceptionCheckpoint
saves there, and the same command resumes from the newest checkpoint (``ckpt_path="last"``).
Seeded: two uninterrupted runs end with the same weights, bit for bit, and so does a run stopped
and resumed at an epoch boundary (dropout is reseeded from the step and the rank; Lightning saves
no RNG state). A stop inside an epoch resumes too, but not bitwise: Lightning starts that epoch's
data again from its beginning (it warns that the loader is not resumable). Under DDP, Lightning's
own SIGTERM path can hang when the stop reaches the ranks at different points of a step;
``--stop-together`` adds StopTogether, which makes every rank stop at the same step.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


def digits() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    n = len(x) // 64 * 64            # whole batches on every rank, every epoch (1792 of 1797)
    return TensorDataset(torch.tensor(x[:n] / 16.0, dtype=torch.float32), torch.tensor(y[:n]))


class DigitsMLP(L.LightningModule):
    def __init__(self, seed: int, lr: float, pause_file: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(64, 10))

    def on_fit_start(self) -> None:
        env = getattr(self.trainer.strategy, "cluster_environment", None)
        print(f"rank {self.global_rank} of {self.trainer.world_size} ({type(env).__name__})", flush=True)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        # Dropout's masks depend only on the seed, the step and the rank, so a resumed run draws
        # what an uninterrupted one draws: Lightning saves no RNG state, and each epoch's
        # iter(loader) takes a draw from the global RNG at a point that differs after a resume.
        torch.manual_seed(self.hparams.seed * 1_000_003 + self.global_step * 1009 + self.global_rank)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=False)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            print(f"epoch {self.current_epoch} ended at step {self.global_step}", flush=True)
        # The tests' hold: every rank waits at an epoch's end while this file exists, until a stop
        # comes, so that the stop lands on an epoch boundary whenever it comes.
        pause = self.hparams.pause_file
        while pause and os.path.exists(pause) and not self.trainer.received_sigterm:
            time.sleep(0.1)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


class StopTogether(Callback):
    """SIGTERM for DDP, taken by every rank at the same step (``--stop-together``).

    Lightning's own SIGTERM handler runs a collective (a broadcast) inside the handler, and each
    rank also checks its own flag at the end of a step: when the signal reaches the ranks at
    different points of a step, they wait in different collectives and the job hangs
    (Lightning #20806). Here the handler only sets a flag; at each step's end every rank learns
    of it through one all-reduce, and all raise Lightning's SIGTERMException there, so that
    OnExceptionCheckpoint saves with every rank present.
    """

    def __init__(self) -> None:
        self.stop = False

    def on_train_start(self, trainer, pl_module) -> None:
        # Replaces the handler the Trainer registered just before; it puts back the one it found
        # when fit ends.
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, signum, frame) -> None:
        self.stop = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.strategy.reduce_boolean_decision(self.stop, all=False):
            raise SIGTERMException()


def devices(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=devices, default=2, help="processes per node (an int, or auto)")
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--every-n-steps", type=int, default=10, help="ModelCheckpoint(every_n_train_steps=)")
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pause-file", help="at each epoch end, wait while this file exists (until a stop)")
    ap.add_argument("--root", default="lightning_digits", help="Lightning's default_root_dir (checkpoints/ in it)")
    ap.add_argument("--weights", help="rank 0 saves the final state_dict here")
    ap.add_argument("--stop-together", action="store_true", help="SIGTERM through StopTogether (see there)")
    ap.add_argument("--lightning-requeue", action="store_true",
                    help="Lightning's own requeue on SIGUSR2 (needs train.script_signal=passthrough): not "
                         "what the docs advise; hpc_train counts such a requeue afterwards, from sacct")
    args = ap.parse_args()

    # One thread per rank: the ranks of a node share its cores.
    torch.set_num_threads(1)
    L.seed_everything(args.seed, workers=True)
    model = DigitsMLP(args.seed, args.lr, args.pause_file)
    loader = DataLoader(digits(), batch_size=args.batch_size, shuffle=True)
    ckpt_dir = os.path.join(args.root, "checkpoints")
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy,
        max_epochs=args.epochs, default_root_dir=args.root, logger=False, deterministic=True,
        enable_progress_bar=False, enable_model_summary=False,
        # hpc_train requeues the job: Lightning's own requeue (scontrol on its signal) stays off.
        plugins=[SLURMEnvironment(auto_requeue=args.lightning_requeue, requeue_signal=signal.SIGUSR2)]
        if SLURMEnvironment.detect() else [],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.every_n_steps, save_last=True),
                   # Saves when fit ends by an exception, Lightning's SIGTERM included (the stop).
                   OnExceptionCheckpoint(dirpath=ckpt_dir), *([StopTogether()] if args.stop_together else [])],
    )
    trainer.fit(model, loader, ckpt_path="last")
    if trainer.is_global_zero and args.weights:
        torch.save(model.state_dict(), args.weights)
        print(f"final weights saved to {args.weights} at step {trainer.global_step}", flush=True)
    # Lightning leaves its process group up after fit. Ending the process with it still up
    # sometimes aborts at interpreter exit ("terminate called without an active exception": a
    # gloo thread still joinable), which reads as a failed rank; the tutorials' cleanup() avoids it.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
