"""Repetitions that may fail, for the benchmarks: one failed repetition is reported and the
benchmark goes on.

A benchmark runs each repetition through :meth:`Reps.run`. A repetition that raises (a subprocess
that exited non-zero or was killed by a signal: :class:`RepFailed`, from :func:`run_checked`; or
any other exception while reading its results) is recorded and reported at once: which variant,
which repetition, its exit code or signal, and the last lines of its stderr. The summary then
gives every figure with the number of repetitions it rests on ("median of 4 (1 failed)"), a
variant with no successful repetition says so instead of a number, and :meth:`Reps.finish`
prints one line and returns the exit status (1 if any repetition failed).

Only ``Exception`` is caught: Ctrl-C (KeyboardInterrupt) still stops the benchmark.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, TextIO, TypeVar

T = TypeVar("T")
TAIL_LINES = 8


def describe_exit(code: int | None) -> str:
    """A return code in words: negative is Python's "killed by signal N"; 128+N is how a shell
    (or a launcher that mirrors it) reports a child killed by signal N."""
    if code is None:
        return "no exit code"
    if code < 0:
        return f"killed by {_signame(-code)}"
    if code > 128 and _signame(code - 128, None):
        return f"exit {code} (128+{_signame(code - 128)})"
    return f"exit {code}"


def _signame(num: int, default: str | None = "") -> str | None:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}" if default == "" else default


def tail(text: str | bytes | None, lines: int = TAIL_LINES) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


class RepFailed(RuntimeError):
    """A repetition's process failed: its exit code (or signal) and the tail of its stderr."""

    def __init__(self, what: str, returncode: int | None, stderr: str | bytes | None = "") -> None:
        self.what, self.returncode, self.stderr_tail = what, returncode, tail(stderr)
        super().__init__(f"{what}: {describe_exit(returncode)}")


def check(r: subprocess.CompletedProcess, what: str = "") -> subprocess.CompletedProcess:
    """``r`` if it exited 0, else :class:`RepFailed` with its code and stderr's tail."""
    if r.returncode != 0:
        name = what or " ".join(map(str, r.args[:4] if isinstance(r.args, list) else [r.args]))
        raise RepFailed(name, r.returncode, r.stderr)
    return r


def run_checked(argv: list[str], what: str = "", **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, **kw)`` with stderr captured (text) unless the caller routes it,
    raising :class:`RepFailed` on a non-zero exit."""
    kw.setdefault("text", True)
    if "capture_output" not in kw:
        kw.setdefault("stderr", subprocess.PIPE)
    return check(subprocess.run(argv, **kw), what)


@dataclass
class Failure:
    variant: str
    rep: int
    reason: str           # one line: the exit code or signal, or the exception
    stderr_tail: str      # the last lines of the failed process's stderr (or the traceback's)


class Reps:
    """The outcome of every repetition of every variant (repetitions numbered from 1)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out
        self.results: dict[str, dict[int, Any]] = {}
        self.failures: list[Failure] = []

    def _print(self, text: str) -> None:
        print(text, file=self.out or sys.stdout, flush=True)

    def run(self, variant: str, rep: int, fn: Callable[[], T]) -> T | None:
        """``fn()``'s value, kept as this repetition's result; None (reported) if it raised."""
        self.results.setdefault(variant, {})
        try:
            value = fn()
        except RepFailed as e:
            self.fail(variant, rep, str(e), e.stderr_tail)
            return None
        except Exception as e:     # reading a run's results failed, or a section raised
            self.fail(variant, rep, f"{type(e).__name__}: {e}".splitlines()[0],
                      tail("".join(traceback.format_exception(e))))
            return None
        self.results[variant][rep] = value
        return value

    def fail(self, variant: str, rep: int, reason: str, stderr_tail: str = "") -> None:
        """Record (and report) a failed repetition the caller detected itself."""
        self.results.setdefault(variant, {})
        self.failures.append(Failure(variant, rep, reason, stderr_tail))
        self._print(f"  rep {rep}: {variant} FAILED: {reason}")
        for line in stderr_tail.splitlines():
            self._print(f"      | {line}")

    def get(self, variant: str, rep: int) -> Any:
        return self.results.get(variant, {}).get(rep)

    def values(self, variant: str, pick: Callable[[Any], float] | None = None) -> list[float]:
        """The successful repetitions' results (or ``pick`` of each), in repetition order."""
        got = self.results.get(variant, {})
        return [pick(got[r]) if pick else got[r] for r in sorted(got)]

    def n_ok(self, variant: str) -> int:
        return len(self.results.get(variant, {}))

    def n_failed(self, variant: str) -> int:
        return sum(f.variant == variant for f in self.failures)

    def basis(self, variant: str, stat: str = "median") -> str:
        """What a figure rests on: "median of 4 (1 failed)", or "no successful repetition (5 failed)"."""
        n, f = self.n_ok(variant), self.n_failed(variant)
        if n == 0:
            return f"no successful repetition ({f} failed)"
        return f"{stat} of {n}" + (f" ({f} failed)" if f else "")

    def median(self, variant: str, pick: Callable[[Any], float] | None = None) -> float | None:
        vals = self.values(variant, pick)
        return statistics.median(vals) if vals else None

    def figure(self, variant: str, pick: Callable[[Any], float] | None = None, fmt: str = "{:.1f}",
               unit: str = "") -> str:
        """``"1234.5 samples/s (median of 4, 1 failed)"``, or the no-success sentence."""
        med = self.median(variant, pick)
        if med is None:
            return self.basis(variant)
        n, f = self.n_ok(variant), self.n_failed(variant)
        return f"{fmt.format(med)}{unit} (median of {n}" + (f", {f} failed)" if f else ")")

    def summary(self) -> str:
        """One line: every repetition succeeded, or which failed and how."""
        total = sum(len(v) for v in self.results.values()) + len(self.failures)
        if not self.failures:
            return f"all {total} repetitions succeeded"
        what = "; ".join(f"{f.variant} rep {f.rep} ({f.reason})" for f in self.failures)
        return f"{len(self.failures)} of {total} repetitions FAILED: {what}"

    def finish(self) -> int:
        """Print the one-line summary; the exit status: 1 if any repetition failed, else 0."""
        self._print(self.summary())
        return 1 if self.failures else 0


def ratio(a: float | None, b: float | None, fmt: str = "{:.3f}") -> str:
    """``a / b`` formatted, or "n/a" where either side has no figure."""
    return fmt.format(a / b) if a is not None and b else "n/a"
