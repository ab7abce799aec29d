"""Arguments that no option of the command took: where they belong, in one line. Torch-free.

argparse alone says "unrecognized arguments: --nprocs 2". What the user meant is, in this order:

1. another command's option (``--nodes`` on ``run``: a ``submit``/``sbatch`` option);
2. a typo of one of this command's own options (``--nprocs``, or ``--np``, which argparse would
   have taken as an abbreviation of ``--nproc``: every parser here has ``allow_abbrev=False``,
   so a prefix is never silently taken for an option);
3. a script's own arguments typed without the ``--`` that separates them from hpc_train's.

A suggested command keeps what was typed after ``--``.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import shlex
from collections.abc import Mapping
from pathlib import Path

from hpc_train.errors import UsageError, show

# Commands whose options a user carries from one to another (run <-> submit/sbatch).
_LAUNCHERS = ("run", "submit", "sbatch")


def options(parser: argparse.ArgumentParser) -> list[str]:
    """A parser's long options (argparse keeps them in one table shared with its groups)."""
    return sorted(o for o in parser._option_string_actions if o.startswith("--"))


def _guess(flag: str, own: list[str]) -> str | None:
    """The own option ``flag`` was meant for: the only one it begins (an abbreviation), or one
    it is a close typo of, compared without the dashes ("nprocs" ~ "nproc")."""
    if len(flag) > 3:
        prefixed = [o for o in own if o.startswith(flag)]
        if len(prefixed) == 1:
            return prefixed[0]
    names = {o[2:]: o for o in own}
    match = difflib.get_close_matches(flag[2:], list(names), n=1, cutoff=0.8)
    return names[match[0]] if match else None


def _elsewhere(flag: str, command: str, commands: Mapping[str, argparse.ArgumentParser]) -> str | None:
    """One line for another launching command's option given to this one, else None."""
    if command not in _LAUNCHERS:
        return None
    owners = [name for name in _LAUNCHERS if name != command and flag in options(commands[name])]
    if not owners:
        return None
    line = f"{flag} is a {'/'.join(owners)} option"
    if command == "run" and owners == ["submit", "sbatch"]:   # a scheduler's resource (--nodes, --time, ...)
        return f"{line}; `run` trains on this machine with --nproc N"
    if flag == "--nproc":
        return f"{line}; a Slurm job's processes are --nodes x --tasks-per-node"
    return line


def refuse_stray(parser: argparse.ArgumentParser, commands: Mapping[str, argparse.ArgumentParser],
                 args: argparse.Namespace, extra: list[str], argv: list[str], rest: list[str]) -> None:
    """Raise :class:`UsageError` for ``extra``, the arguments no option took (as typed in
    ``argv``, before ``--``; ``rest``: after it). ``parser``: the command's own (a leaf of
    ``ckpt``/``sweep``); ``commands``: the top-level commands' parsers. With --script, a first
    stray argument may have been taken as the optional config file."""
    script = getattr(args, "script", None)
    if script and args.config is not None and not Path(args.config).exists():
        extra = [args.config, *extra]
    if not extra:
        return
    left, at = collections.Counter(extra), []
    for i, a in enumerate(argv):   # in the order typed (a first one may have been taken as the config)
        if left[a] > 0:
            left[a] -= 1
            at.append(i)
    stray = [argv[i] for i in at]
    command, where = args.command or "", parser.prog   # "python -m hpc_train ckpt export"
    for i in at:
        if not argv[i].startswith("--"):
            continue
        flag = argv[i].split("=", 1)[0]
        line = _elsewhere(flag, command, commands)
        if line:
            raise UsageError(f"{where}: {line}")
        guess = _guess(flag, options(parser))
        if guess:
            fixed = [*argv[:i], guess + argv[i][len(flag):], *argv[i + 1:]]
            typed = shlex.join(["python", "-m", "hpc_train", *fixed, *(["--", *rest] if rest else [])])
            shown = f" {typed}" if len(typed) <= 300 and typed.isprintable() else ""
            raise UsageError(f"{where}: unrecognized option {flag}; did you mean {guess}?{shown}")
    shown = shlex.join(stray)
    if len(shown) > 200 or not shown.isprintable():
        shown = show(stray)
    if script:
        after = f" {shlex.join(rest)}" if rest and len(shlex.join(rest)) <= 200 else " ..." if rest else ""
        raise UsageError(f"{where}: unrecognized arguments: {shown}; a script's arguments go after `--`: "
                         f"{where} ... --script {shlex.quote(script)} -- {shown}{after}")
    hint = " (a --script's own arguments go after `--`)" if command in _LAUNCHERS else ""
    raise UsageError(f"{where}: unrecognized arguments: {shown}{hint}")
