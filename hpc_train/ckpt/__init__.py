"""Checkpoints: two tiers over one torch-free store, and one answer to "which step, from where".

``shared/``: DCP on the shared file system; ``local/``: each rank's whole state in its node's
memory, with copies on a peer node. Both write the store's step directories and commit records
(:mod:`~hpc_train.ckpt.store`), load through :mod:`~hpc_train.ckpt.load`, and are chosen between
by :mod:`~hpc_train.ckpt.tiers` (the restore, ``status``, ``ckpt list|verify`` and the hook).
"""
