"""Slurm's compressed node lists (``gpu[001-004,010],login-a``), expanded in one place. No torch.

Used on the node side (ranks and the rendezvous host from ``SLURM_JOB_NODELIST``) and on the
login side (the allocation the requeue hook chooses nodes from).
"""

from __future__ import annotations

from hpc_train.errors import UsageError, show


def expand(nodelist: str) -> list[str]:
    """The names of a Slurm node list, in order. Raises :class:`UsageError` naming the list when
    it does not parse or names no host."""
    import hostlist  # python-hostlist: pure Python, handles several bracket groups and padding

    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise UsageError(f"environment: cannot parse the Slurm node list {show(nodelist)}: {e}") from None
    if not hosts:   # ',' expands to nothing, and hosts[0] is the rendezvous address
        raise UsageError(f"environment: the Slurm node list {show(nodelist)} names no host; Slurm writes e.g. "
                         f"node[1-4],gpu01")
    return hosts
