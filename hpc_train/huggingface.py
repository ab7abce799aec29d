"""Hugging Face ``Trainer`` scripts, first-class: two lines (docs/huggingface.md)::

    trainer = Trainer(..., callbacks=[hpc_train.huggingface.Callback()])
    trainer.train(resume_from_checkpoint=hpc_train.huggingface.checkpoint_to_resume(args))

With them every rank agrees on a stop at each step, as in any loop on :class:`hpc_train.run.Run`;
the Trainer saves its own checkpoint **at that step** and ends, and the process exits with the
stop's code; a rerun (the same command, a requeue, an in-place restart) resumes from the
Trainer's newest complete checkpoint; a finished run is recorded as finished.

The Trainer's checkpoint is the run's only one: hpc_train saves none of its own for it (no tier
could then hold a step ahead of the Trainer's, which its resume would go back below), and
records the Trainer's ``output_dir`` (:mod:`hpc_train.records.keeper`) so that ``status`` and
``ckpt list`` name the step the rerun really resumes from.

transformers is imported here, and only here: hpc_train imports this module only when a script
does (``pip install 'hpc_train[huggingface]'``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from hpc_train import rundir
from hpc_train.errors import UsageError
from hpc_train.records import keeper as keeper_record
from hpc_train.records.keeper import Keeper

try:
    from transformers import TrainerCallback
except ImportError as e:   # pragma: no cover - the extra is missing
    raise ImportError("hpc_train.huggingface needs transformers: pip install 'hpc_train[huggingface]'") from e

log = logging.getLogger("hpc_train")
_asked: set[Path] = set()   # output_dirs that checkpoint_to_resume was asked about, in this process

__all__ = ["Callback", "checkpoint_to_resume"]


def _keeper(args: Any) -> Keeper:
    if not getattr(args, "output_dir", None):
        raise UsageError("hpc_train.huggingface: the TrainingArguments have no output_dir, where the Trainer "
                         "keeps the checkpoints a rerun resumes from")
    return Keeper(keeper_record.TRAINER, Path(args.output_dir).absolute(), max(1, int(args.world_size)),
                  bool(getattr(args, "save_only_model", False)))


def _starting_over(run: Any) -> bool:
    """``--resume none`` (``HPC_TRAIN_RESUME=none``) at the run's first start; a requeue or an
    in-place restart of it resumes (its launcher passes ``latest`` then)."""
    return os.environ.get(rundir.RESUME_ENV, "latest") == "none" and run.env.restart_count == 0


def checkpoint_to_resume(args: Any) -> str | None:
    """What to pass to ``trainer.train(resume_from_checkpoint=...)``: the newest complete
    ``checkpoint-N`` in ``args.output_dir`` (one a kill left half-written is skipped, which the
    Trainer's own ``get_last_checkpoint`` would take), or None on a fresh run and under
    ``--resume none``. ``--resume PATH`` naming a ``checkpoint-N`` directory gives that one.
    Brings up the process's Run (:func:`hpc_train.init`): a finished run exits 0 here."""
    from hpc_train import lifecycle
    run = lifecycle.init()
    keeper = _keeper(args)
    _asked.add(keeper.directory)
    if _starting_over(run):
        return None
    saved, _problem = keeper_record.read(run.run_dir)
    if saved is not None and saved.directory == keeper.directory:
        keeper = saved   # judged for the world size that saved them (this run's may differ)
    spec = os.environ.get(rundir.RESUME_ENV, "latest")
    if spec not in ("latest", "none"):
        named = Path(spec)
        if rundir.name_number(named.name, keeper_record.PREFIX) is not None and named.is_dir():
            return str(named)
    newest = keeper_record.newest_complete(keeper)
    if newest is not None and run.is_main:
        log.info("resuming from the Trainer's %s (step %d)", newest.path, newest.step)
    return str(newest.path) if newest is not None else None


class Callback(TrainerCallback):
    """``Trainer(..., callbacks=[hpc_train.huggingface.Callback()])``: a stop (Ctrl-C under
    ``run``, SIGTERM, the job's signal, ``run.request_stop()``) reaches every rank at the same
    step, where the Trainer saves ``checkpoint-N`` and ends; the process then exits with the
    stop's code (``run.exit_code``), so the job is requeued once and a rerun resumes there. The
    Trainer's logged values go to ``metrics.jsonl`` (and TensorBoard, ``log.tensorboard``)."""

    def __init__(self) -> None:
        self.run: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from hpc_train import lifecycle
        run = lifecycle.init()
        keeper = _keeper(args)
        if self.run is None:
            run.checkpoints_kept_by(keeper)
        self.run = run
        run.total_steps = state.max_steps or None
        if state.global_step == 0 and run.is_main:
            if _starting_over(run):
                _move_aside(keeper)
            else:
                _tell_once(keeper)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run.step_end({"step": state.global_step}):
            control.should_save = True           # the Trainer's checkpoint, at this very step
            control.should_training_stop = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        values = {k: v for k, v in (logs or {}).items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if values and self.run is not None:
            self.run.log(state.global_step, console=False, **values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.run
        if run.stopped:
            # After the Trainer's save: the stop's exit code, so the launcher, the job and a
            # shell see a run that did not finish (code after trainer.train() does not run).
            raise SystemExit(run.exit_code)
        if not run.finished:
            run.finish({"steps": state.global_step})


def _tell_once(keeper: Keeper) -> None:
    """A rerun that starts over although the Trainer's checkpoints are there: say what to add."""
    if keeper.directory in _asked:
        return
    newest = keeper_record.newest_complete(keeper)
    if newest is not None:
        log.warning("trainer.train() starts at step 0, but %s holds the Trainer's checkpoint of step %d: to resume "
                    "from it, call trainer.train(resume_from_checkpoint=hpc_train.huggingface.checkpoint_to_resume("
                    "args)) (docs/huggingface.md)", keeper.directory, newest.step)


def _move_aside(keeper: Keeper) -> None:
    """``--resume none``: the old run's ``checkpoint-N`` directories go to ``old-<time>/`` in the
    output_dir (the Trainer would write over them, and its rotation delete them), not deleted."""
    kept = keeper_record.trainer_checkpoints(keeper)
    if not kept:
        return
    aside = keeper.directory / time.strftime("old-%Y%m%d-%H%M%S")
    aside.mkdir(exist_ok=True)
    for k in kept:
        os.rename(k.path, aside / k.path.name)
    log.info("--resume none: moved the Trainer's %d checkpoint(s) aside to %s", len(kept), aside)
