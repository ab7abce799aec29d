"""The node-local tier: each rank's whole state, often, in its own node's memory, with copies on a peer node.

:mod:`~hpc_train.ckpt.local.tier` (:class:`~hpc_train.ckpt.local.tier.LocalTier`: save, prune, the
restore's choice), :mod:`~hpc_train.ckpt.local.flat` (an item's tensors as one raw file per dtype),
:mod:`~hpc_train.ckpt.local.peer` (the copies on the buddy node and the fetch from them) and
:mod:`~hpc_train.ckpt.local.wire` (one item, rank to rank). Which step a restart loads is
:mod:`hpc_train.ckpt.tiers`; where the tier lives is :mod:`hpc_train.config_local`.
"""
