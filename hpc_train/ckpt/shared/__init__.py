"""The shared tier: sharded checkpoints on the shared file system through torch.distributed.checkpoint.

:mod:`~hpc_train.ckpt.shared.save` (the asynchronous, atomic save), :mod:`~hpc_train.ckpt.shared.crc`
(DCP's writer, checksumming as it writes), :mod:`~hpc_train.ckpt.shared.export` (a step's model as
one plain file). Loading either tier's item is :mod:`hpc_train.ckpt.load`; which step a restart
loads is :mod:`hpc_train.ckpt.tiers`.
"""
