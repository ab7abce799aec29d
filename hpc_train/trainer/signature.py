"""The built-in trainer's model signature (torch-free): what its checkpoints record, so that a
resume with another model config is refused before any worker starts, not with a shape error
deep inside a load. The login side computes it for ``submit`` as the CLI does for ``run``."""

from __future__ import annotations

from typing import Any

from hpc_train.config import Config, ModelSection


def model_signature(model: ModelSection) -> dict[str, Any]:
    return {"name": model.name, "hidden": model.hidden}


def expected(cfg: Config) -> dict[str, Any] | None:
    """The signature a run of ``cfg`` records, or None where the user's code (a script, a
    callable) trains: hpc_train then knows nothing of its model."""
    if cfg.train.script or cfg.train.fn:
        return None
    return model_signature(cfg.model)
