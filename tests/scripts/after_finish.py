"""A user's program that goes on after training (an evaluation, an upload), around the README's loop
(own_loop.main); for tests/node/test_stop_handlers.py. It says on stderr which handler each stop signal
has after finish() (or after close(), when the run stopped). Knobs, from the environment:

``AFTER_HANDLERS=1``
    its own SIGTERM and SIGUSR2 handlers, installed before init(); each says "user handler: SIGx"
``AFTER_WORK_S``
    after finish(), an "evaluation" of that many seconds, then a second one: a KeyboardInterrupt in
    the first is caught and said, as a program that lets Ctrl-C skip a step would
``AFTER_STEPS``, ``AFTER_SLEEP``
    own_loop's steps, and its sleep after each
``HPC_TEST_MARK_DIR`` with ``HPC_TEST_EXIT_S``
    the process's exit writes ``exiting-rank<R>`` there and lasts that long (see :class:`SlowTeardown`)
"""

import atexit
import os
import signal
import sys
import time

import hpc_train

try:
    import own_loop                          # python after_finish.py: its directory is on sys.path
except ImportError:
    from tests.scripts import own_loop       # run --fn tests.scripts.after_finish:fn


def mine(signum, frame):
    os.write(2, f"user handler: {signal.Signals(signum).name}\n".encode())


def handlers() -> str:
    def name(h) -> str:
        if h is mine:
            return "mine"
        if h is signal.default_int_handler:
            return "default_int_handler"
        if isinstance(h, int):
            return signal.Handlers(h).name
        return type(getattr(h, "__self__", h)).__name__   # hpc_train's: StopRequest
    return " ".join(f"{s}={name(signal.getsignal(getattr(signal, 'SIG' + s)))}" for s in ("TERM", "INT", "USR2"))


def say(*what) -> None:
    print(*what, file=sys.stderr, flush=True)


class SlowTeardown:
    """Stands in for torch's part of the interpreter's teardown (a second or more, after every exit
    handler, where Python runs no signal handler any more): held by a module global, it is deleted
    while the interpreter destroys its modules; it marks that moment and makes it last, so a test
    can send its signal there and not a moment earlier or later."""

    def __init__(self, mark: str, seconds: float) -> None:
        self.mark, self.seconds = mark, seconds

    def __del__(self, _open=os.open, _close=os.close, _sleep=time.sleep) -> None:
        # Module globals may already be gone here: everything it uses is bound above.
        _close(_open(self.mark, os.O_CREAT | os.O_WRONLY, 0o644))
        _sleep(self.seconds)


def _exit_mark() -> str | None:
    d = os.environ.get("HPC_TEST_MARK_DIR")
    return os.path.join(d, f"exiting-rank{os.environ.get('RANK', '0')}") if d else None


def slow_exit_handler() -> None:
    """An exit handler that takes HPC_TEST_EXIT_S (a logger's upload at exit), marking its start."""
    mark, seconds = _exit_mark(), float(os.environ.get("HPC_TEST_EXIT_S", "0"))
    if mark:
        def upload() -> None:
            open(mark, "w").close()
            time.sleep(seconds)
        atexit.register(upload)


def slow_exit_model(cfg):
    """A user's model plug-in (the built-in trainer's path) whose exit handler takes a while."""
    from tests.plugins_for_tests import tiny_model
    slow_exit_handler()
    return tiny_model(cfg)


def main() -> dict:
    if os.environ.get("AFTER_HANDLERS"):
        signal.signal(signal.SIGTERM, mine)
        signal.signal(signal.SIGUSR2, mine)
    try:
        result = own_loop.main(int(os.environ.get("AFTER_STEPS", "10")), float(os.environ.get("AFTER_SLEEP", "0")))
    except SystemExit:   # own_loop leaves this way after a stop
        run = hpc_train.init()   # the same Run
        run.close()
        say("handlers after close:", handlers())
        raise
    say("handlers after finish:", handlers())
    work = float(os.environ.get("AFTER_WORK_S", "0"))
    if work:
        say("evaluating")
        try:
            time.sleep(work)
        except KeyboardInterrupt:
            say("KeyboardInterrupt during the evaluation")
        say("evaluating again")
        time.sleep(work)
    return result


def fn() -> dict:
    """``run --fn tests.scripts.after_finish:fn``: the same program as a callable."""
    slow_exit_handler()
    return main()


if __name__ == "__main__":
    mark = _exit_mark()
    if mark:
        teardown = SlowTeardown(mark, float(os.environ.get("HPC_TEST_EXIT_S", "0")))
    main()
