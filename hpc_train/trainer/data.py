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
    it, without importing scikit-learn (seconds of CPU per rank at every start and restart; the
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
