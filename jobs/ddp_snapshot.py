"""A torchrun-style DDP script that knows nothing of hpc_train (after pytorch/examples'
ddp-tutorial-series/multinode.py): its own init_process_group, LOCAL_RANK from the environment,
and its own snapshot every few epochs, loaded when it starts.

    torchrun --nproc-per-node 2 jobs/ddp_snapshot.py --snapshot /tmp/snap.pt
    python -m hpc_train run --script jobs/ddp_snapshot.py --nproc 2 -- --snapshot /tmp/snap.pt
    python -m hpc_train submit --script jobs/ddp_snapshot.py --nodes 2 -- --snapshot $PWD/snap.pt

Under hpc_train it runs unmodified: a preemption stops it (SIGTERM, as torchrun would send),
the job is requeued, and the next run resumes from its snapshot.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def regression_data(n: int = 4096, dim: int = 20) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def image_data(n: int = 2048) -> TensorDataset:
    """MNIST-shaped images and labels (the tutorials' ConvNet input), made up."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def convnet() -> torch.nn.Module:
    """pytorch/examples' MNIST ConvNet: where a CPU's threads per process start to matter."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(9216, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=1)
    ap.add_argument("--snapshot", default="snapshot.pt")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epoch-sleep", type=float, default=0.0, help="seconds to idle after each epoch")
    ap.add_argument("--model", choices=("mlp", "conv"), default="mlp", help="mlp: regression; conv: MNIST ConvNet")
    args = ap.parse_args()

    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    print("torchrun variables: " + " ".join(f"{k}={os.environ[k]}" for k in names), flush=True)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    if args.model == "conv":
        model, data, loss_fn = convnet().to(device), image_data(), F.cross_entropy
    else:
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
        data, loss_fn = regression_data(), F.mse_loss
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first_epoch = 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, map_location=device, weights_only=True)
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        first_epoch = snap["epochs_run"]
        print(f"rank {rank}: resuming training from snapshot at epoch {first_epoch}", flush=True)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    started = time.perf_counter()
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
            if (epoch + 1) % args.save_every == 0:
                tmp = args.snapshot + ".tmp"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epochs_run": epoch + 1}, tmp)
                os.replace(tmp, args.snapshot)
        time.sleep(args.epoch_sleep)
    dist.barrier()
    if rank == 0:
        print(f"trained epochs {first_epoch}-{args.epochs - 1} in {time.perf_counter() - started:.3f} s", flush=True)
    # The DDP wrapper goes before its process group: its reducer holds the group, and a gloo
    # group freed after destroy_process_group(), at interpreter exit, can hang or abort the process.
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
