"""The run directory's records, each a type with one owner. No torch here.

Every record a run directory holds about a run's fate has one module here that defines it as a
type, reads it (validating types, ranges and finiteness: a damaged record or entry is named and
set aside, never a traceback, a negative budget or a NaN) and writes it (atomically, never
through a link). Every other module goes through them; none parses or edits their JSON.

======================  ==========================================  ============================
file                    what                                        owner
======================  ==========================================  ============================
``result.json``         a finished run (it never trains again)      :mod:`.result`
``stopped.json``        the last stop: step, signal, checkpoint,    :mod:`.stop`
                        rank 0's request for the batch shell
``requeue.json``        requeues and in-place restarts, per cause   :mod:`.requeue`
``requeue.pending``     an earlier version's request, still read    :mod:`.requeue`
``logs/.heartbeat/*``   each rank's record of its start and end     :mod:`.ranks`
``job.json``            the Slurm jobs submitted for the run        :mod:`.jobs`
``goodput.json``        where the wall time went                    :mod:`hpc_train.goodput`
======================  ==========================================  ============================
"""
