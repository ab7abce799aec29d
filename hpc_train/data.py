"""Datasets: real digits offline, MNIST from local IDX files, synthetic, or the user's own.

Every builder returns ``(train, test)`` map-style datasets of ``(image, label)`` with images
shaped ``1x28x28``, so the tutorial models apply to each unchanged. Loaders are torchdata's
``StatefulDataLoader``: its state (position in the epoch, worker RNG) is what makes a resume
continue with the exact next batch.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from hpc_train.config import DataSection
from hpc_train.errors import UsageError
from hpc_train.plugins import resolve

# MNIST's own statistics; applied to every image source so the models see the same scale.
_MEAN, _STD = 0.1307, 0.3081


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return (x - _MEAN) / _STD


def digits(cfg: DataSection, seed: int) -> tuple[Dataset, Dataset]:
    """scikit-learn's 1797 real handwritten digits (UCI), 8x8 upscaled to 28x28.

    The split is stratified and fixed by ``seed``, so every rank and every resume sees the same.
    """
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    # Pad 8->10 then resize to 28: MNIST digits sit in a 20x20 box centred in 28x28.
    x = torch.nn.functional.pad(x, (1, 1, 1, 1))
    x = torch.nn.functional.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    y = torch.tensor(target, dtype=torch.long)
    rng = np.random.default_rng(seed)
    test_idx: list[int] = []
    for label in range(10):
        idx = np.flatnonzero(target == label)
        rng.shuffle(idx)
        test_idx += idx[: round(len(idx) * cfg.test_fraction)].tolist()
    is_test = torch.zeros(len(y), dtype=torch.bool)
    is_test[test_idx] = True
    x = _normalize(x)
    return TensorDataset(x[~is_test], y[~is_test]), TensorDataset(x[is_test], y[is_test])


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images 1797x8x8, targets): scikit-learn's ``digits.csv.gz`` read as ``load_digits`` reads
    it, without importing scikit-learn (1.3 s of CPU per rank at every start and restart; the
    file is all it needs). Falls back to ``load_digits`` if the file is not where it was."""
    import importlib.util
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise UsageError("data: data.name=digits needs scikit-learn (pip install scikit-learn)")
    path = Path(next(iter(spec.submodule_search_locations or [""]))) / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        import gzip
        with gzip.open(path, mode="rt", encoding="utf-8") as f:
            data = np.loadtxt(f, delimiter=",")
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)
    from sklearn.datasets import load_digits
    bunch = load_digits()
    return bunch.images, bunch.target


def _read_idx(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    if len(raw) < 4:
        raise UsageError(f"data: {path} is not an IDX file (too short)")
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise UsageError(f"data: {path} is not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", raw[4: 4 + 4 * ndim])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise UsageError(f"data: {path} is truncated: header says {dims}, body has {body.size} bytes")
    return body.reshape(dims)


def mnist(cfg: DataSection, seed: int) -> tuple[Dataset, Dataset]:
    """MNIST from the user's uncompressed IDX files, the layout torchvision uses."""
    raw = Path(cfg.root) / "MNIST" / "raw"
    out = []
    for split in ("train", "t10k"):
        imgs, labels = raw / f"{split}-images-idx3-ubyte", raw / f"{split}-labels-idx1-ubyte"
        for p in (imgs, labels):
            if not p.is_file():
                raise UsageError(f"data: MNIST file {p} not found; data.root must hold MNIST/raw/"
                                 f"{{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte (uncompressed)")
        x = torch.from_numpy(_read_idx(imgs).copy()).float().unsqueeze(1) / 255.0
        y = torch.from_numpy(_read_idx(labels).astype(np.int64))
        out.append(TensorDataset(_normalize(x), y))
    return out[0], out[1]


def synthetic(cfg: DataSection, seed: int) -> tuple[Dataset, Dataset]:
    """Random images with random labels: for benchmarks, where only the shapes matter."""
    g = torch.Generator().manual_seed(seed)
    n_test = max(1, cfg.synthetic_size // 8)
    x = torch.randn(cfg.synthetic_size + n_test, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (cfg.synthetic_size + n_test,), generator=g)
    n = cfg.synthetic_size
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])


BUILTIN = {"digits": digits, "mnist": mnist, "synthetic": synthetic}


def build(cfg: DataSection, seed: int) -> tuple[Dataset, Dataset]:
    fn = BUILTIN.get(cfg.name) or resolve(cfg.name, "data.name")
    result: Any = fn(cfg, seed)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise UsageError(f"data: {cfg.name} must return (train_dataset, test_dataset), got {type(result).__name__}")
    return result


def _ignore_stop_signals(worker_id: int) -> None:
    """Data-loader processes leave stop signals to the trainer process.

    Slurm signals every process of a step, and a worker killed by SIGTERM/USR2 takes the
    training process down with "DataLoader worker is killed by signal" before it can save.
    Workers exit by themselves when their parent goes away.
    """
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def loader(ds: Dataset, sampler: Any, batch_size: int, num_workers: int, seed: int, drop_last: bool):
    """A ``StatefulDataLoader`` with its own generator, so worker seeds do not depend on when
    the global RNG was last touched (one of the conditions for a bitwise resume)."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader
    # torchdata 0.11 calls a deprecated torch API on every iterator; the warning is noise.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

    return StatefulDataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                              drop_last=drop_last, generator=torch.Generator().manual_seed(seed),
                              persistent_workers=False, pin_memory=torch.cuda.is_available(),
                              worker_init_fn=_ignore_stop_signals if num_workers else None)


class ShardedLoader:
    """A rank's shard of a map-style dataset, resumable mid-epoch: what ``run.loader()`` returns.

    Wraps a ``DistributedSampler`` and a ``StatefulDataLoader``. Each ``iter()`` is one epoch;
    the epoch number, the sampler's epoch and the loader's seed advance by themselves, so a loop
    needs no ``set_epoch``. Its ``state_dict`` is the epoch and, mid-epoch, the loader's
    position; after a restore the next ``iter()`` yields exactly the batches a straight run
    would have yielded. Seeds depend on (seed, rank, epoch) only, never on how many epochs this
    process has run, so a resumed run draws the same ones as a straight run.
    """

    hpc_train_per_rank = True   # its state differs per rank (hpc_train.state)

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, num_workers: int = 0,
                 max_batches: int | None = None, reshard_multiple: int = 1) -> None:
        from torch.utils.data import DistributedSampler
        self.rank, self.world, self.seed = rank, world_size, seed
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
        self.loader = loader(dataset, self.sampler, batch_size, num_workers, seed + rank, drop_last=drop_last)
        full = len(self.loader)
        self.batches_per_epoch = min(full, max_batches) if max_batches is not None else full
        self.reshard_multiple = reshard_multiple
        self.epoch = 0
        self.batches = 0           # yielded in the current epoch
        self._skip = 0

    def __len__(self) -> int:
        return self.batches_per_epoch

    @property
    def epochs_done(self) -> int:
        """Complete epochs (one whose last batch was taken counts, before its iterator ends)."""
        return self.epoch + (self.batches >= self.batches_per_epoch)

    def __iter__(self):
        if self.batches < self.batches_per_epoch:   # else restored just after the epoch's last batch
            self.sampler.set_epoch(self.epoch)
            self.loader.generator.manual_seed(self.seed + 7919 * self.rank + 104729 * self.epoch)
            it = iter(self.loader)
            for _ in range(self._skip):
                next(it)
            self._skip = 0
            while self.batches < self.batches_per_epoch:
                batch = next(it)
                self.batches += 1
                yield batch
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        # The loader's own state only mid-epoch: restoring an exhausted StatefulDataLoader can
        # drop the next epoch (meta-pytorch/data #1437); "all batches taken" needs no state.
        mid = 0 < self.batches < self.batches_per_epoch
        return {"epoch": self.epoch, "batches": self.batches, "loader": self.loader.state_dict() if mid else None}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.batches = int(sd["epoch"]), int(sd["batches"])
        if sd.get("loader") is not None:
            self.loader.load_state_dict(sd["loader"])

    def close(self) -> None:
        """Stop the loader's worker processes. A StatefulDataLoader keeps its last iterator (to
        report its position), and with it the workers, which would otherwise block the
        interpreter's exit (multiprocessing joins them at exit, and they wait for the parent)."""
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.loader._iterator = None

    def load_resharded(self, sd: dict[str, Any], saved_world: int) -> None:
        """Continue a checkpoint saved at another world size after the same number of samples.

        DistributedSampler hands rank r the permutation's elements r, r+W, ...; after b batches
        per rank at world W the first b*B*W samples are consumed, at any W. So skipping
        b*W/W' batches at the new world W' continues with exactly the unseen samples.
        """
        per_rank = int(sd["batches"]) * saved_world // self.world
        per_rank -= per_rank % self.reshard_multiple
        self.epoch, self.batches = int(sd["epoch"]), min(per_rank, self.batches_per_epoch)
        self._skip = self.batches
