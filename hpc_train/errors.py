"""The one exception type the CLI turns into a clean usage error.

Anything raised as :class:`UsageError` reaches the user as a single line on stderr and exit
code 2, with no traceback. Everything else is a bug or a runtime failure and keeps its
traceback. Keep this module free of heavy imports: the CLI imports it before anything else.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

EXIT_USAGE = 2
# Stopped before the end (a preemption, a signal, request_stop) and not requeued: the exit of a
# process that called init() after a stop, and of a batch script whose run stopped.
EXIT_STOPPED = 3


class UsageError(Exception):
    """Bad input from the user: a config key, a value, a flag, a path, an environment variable."""


class RunDirBusy(UsageError):
    """The run directory is held by another run (its lock): what was refused writes nothing there,
    neither an error file nor a record, since every file in it is the holder's."""


class RunFailure(RuntimeError):
    """A failure whose message names the cause and the fix: reported as one line, no traceback."""


class CheckpointError(RunFailure):
    """A checkpoint that cannot be loaded; the message names it and says why."""


class RendezvousError(RunFailure):
    """The ranks could not find each other or the first collective failed."""


class NonFiniteError(RunFailure):
    """Training diverged: a value summed with the step, or a weight about to be saved, is NaN or
    infinite. Nothing is saved for that step; the last checkpoint stays the newest."""


class WatchdogError(RunFailure):
    """A rank stopped making progress and the watchdog ended it."""


class ScriptFailed(RunFailure):
    """The script exited non-zero; the message names the rank, the host and its last lines."""


def closest(word: str, choices: Iterable[str]) -> str:
    """A ``; did you mean 'x'?`` suffix for ``word`` among ``choices``, or ``""``."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def show(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a message quotes what it refuses, and what it
    refuses may be a megabyte pasted into ``--set`` or an environment variable. ``repr`` also
    escapes newlines, which keeps the message to one line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} characters)"


def os_error_line(e: OSError) -> str:
    """One line for a filesystem failure: what, where, and the likely way out."""
    import errno
    where = f" {e.filename}" if e.filename else ""
    hint = {errno.ENOSPC: "; free some space or use another --run-dir",
            errno.EROFS: "; use a writable --run-dir",
            errno.EACCES: "; check the permissions, or use another --run-dir",
            errno.EDQUOT: "; your disk quota is spent"}.get(e.errno or 0, "")
    return f"cannot use{where}: {e.strerror or e}{hint}"


# How gloo and the TCP store word a collective that failed because a peer went away (it died,
# was stopped, or froze past the timeout): a rank whose error says so is a victim, not the cause.
PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
             "timed out waiting")


def says_peer_lost(text: str) -> bool:
    low = text.lower()
    return any(s in low for s in PEER_LOST)


def signal_name(signum: int) -> str:
    """``SIGKILL``, or ``signal 41`` for one without a name (a real-time signal: hpc_train's stack
    dump is one, and a process that does not handle it dies of it)."""
    import signal
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
