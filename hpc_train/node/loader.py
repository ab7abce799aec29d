"""A rank's shard of a map-style dataset, resumable mid-epoch: what ``run.loader()`` returns.

Loaders are torchdata's ``StatefulDataLoader``: its state (position in the epoch, worker RNG)
is what makes a resume continue with the exact next batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from hpc_train.errors import UsageError


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

    Wraps a ``DistributedSampler`` and a ``StatefulDataLoader``. Each ``iter()`` is one epoch
    (or its rest): the epoch number, the sampler's epoch and the loader's seed advance when the
    epoch's iteration ends, so a loop needs no ``set_epoch``. Its ``state_dict`` is the epoch
    and, mid-epoch, the loader's position; after a restore the next ``iter()`` yields exactly
    the batches a straight run would have yielded. Seeds depend on (seed, rank, epoch) only,
    never on how many epochs this process has run, so a resumed run draws the same ones as a
    straight run.

    A batch counts as taken once the loop asks for the next one, or once a checkpoint
    (``state_dict``) is taken while the loop holds it. An iterator given up with its last batch
    in neither case, as in the tutorials' peek ``len(next(iter(loader))[0])``, gives that batch
    back: the next ``iter()`` starts from the same position, and no epoch loses a batch.
    """

    hpc_train_per_rank = True   # its state differs per rank (hpc_train.ckpt.state)

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, num_workers: int = 0,
                 max_batches: int | None = None, reshard_multiple: int = 1) -> None:
        from torch.utils.data import DistributedSampler, IterableDataset
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise UsageError(
                f"run.loader needs a map-style dataset (with __len__ and __getitem__), and "
                f"{type(dataset).__name__} is iterable: it cannot be sharded or resumed by index. To checkpoint "
                f"an iterable dataset, shard it yourself and put a torchdata StatefulDataLoader over it in "
                f"state (state['loader'] = StatefulDataLoader(dataset, batch_size=...)): its position is saved "
                f"per rank")
        self.rank, self.world, self.seed = rank, world_size, seed
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
        self.loader = loader(dataset, self.sampler, batch_size, num_workers, seed + rank, drop_last=drop_last)
        full = len(self.loader)
        if full == 0:
            # An empty epoch never reaches run.step_end: a loop over it would spin for ever.
            raise UsageError(
                f"run.loader: {len(dataset)} samples make no batch for rank {rank}: batch size {batch_size} at "
                f"world size {world_size} needs at least {batch_size * world_size} samples"
                f"{' (drop_last=True)' if drop_last else ''}; use a smaller batch size, fewer ranks or more data")
        self.batches_per_epoch = min(full, max_batches) if max_batches is not None else full
        self.reshard_multiple = reshard_multiple
        self.epoch = 0
        self.batches = 0           # yielded in the current epoch
        # The last batch yielded is "out" until the loop asks for the next one or a checkpoint
        # reads the state; an iterator abandoned while one is out (a peek: next(iter(loader)))
        # gives it back to the next iter().
        self._out = False
        self._loaded = False       # the StatefulDataLoader resumes from a loaded position at its next iter()

    def __len__(self) -> int:
        return self.batches_per_epoch

    @property
    def epochs_done(self) -> int:
        """Complete epochs (one whose last batch was taken counts, before its iterator ends)."""
        return self.epoch + (self.batches >= self.batches_per_epoch)

    def __iter__(self):
        """One epoch, or the rest of it: the epoch advances when its iteration ends, never when
        ``iter()`` is called, and an iterator given up early (a peek) counts for nothing."""
        if self._out:   # the last iterator was abandoned with a batch nobody used: give it back
            self._out = False
            self.batches -= 1
        if self.batches < self.batches_per_epoch:   # else restored just after the epoch's last batch
            self.sampler.set_epoch(self.epoch)
            self.loader.generator.manual_seed(self.seed + 7919 * self.rank + 104729 * self.epoch)
            # After load_state_dict the StatefulDataLoader continues where the checkpoint was taken;
            # otherwise its iterator starts the epoch afresh and the batches already taken are skipped.
            skip, self._loaded = (0 if self._loaded else self.batches), False
            it = iter(self.loader)
            for _ in range(skip):
                next(it)
            while self.batches < self.batches_per_epoch:
                batch = next(it)
                self.batches += 1
                self._out = True
                yield batch         # abandoned here (GeneratorExit): _out stays set
                self._out = False
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        # A checkpoint taken while a batch is out counts it as used (the step trained on it).
        self._out = False
        # The loader's own state only mid-epoch: restoring an exhausted StatefulDataLoader can
        # drop the next epoch (meta-pytorch/data #1437); "all batches taken" needs no state.
        mid = 0 < self.batches < self.batches_per_epoch
        return {"epoch": self.epoch, "batches": self.batches, "loader": self.loader.state_dict() if mid else None}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.batches, self._out = int(sd["epoch"]), int(sd["batches"]), False
        self._loaded = sd.get("loader") is not None
        if self._loaded:
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
        self._out = self._loaded = False   # a fresh iterator skips the batches taken
