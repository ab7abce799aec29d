"""Reading a config's YAML: files and ``--set`` values, safely and as written.

How a value is read (files and ``--set`` alike): YAML gives the structure, but a plain scalar
stays the text as written (only ``null``/``~``/empty is special) and the field's type decides
what the text means. PyYAML implements YAML 1.1, whose implicit types silently rewrite values
that are strings to Slurm: ``time: 30:00`` became the base-60 int 1800, ``account: 0123`` the
octal 83, ``progress: off`` the bool False. Per field type:

* str: the text, unchanged (``30:00``, ``0123``, ``off``, ``1.50``);
* int: ASCII decimal digits with an optional sign, no leading zeros, no ``_`` (``1_000``,
  ``0x10``, ``1:30``, ``1e3`` and ``2.0`` are errors naming the field: each has a reading under
  which it is not the number it looks like, so the user writes ``1000``);
* float: a decimal or exponent number (``1e-3``, ``.5``); ``.nan``/``.inf`` are errors;
* bool: ``true``/``false``, also ``yes``/``no``/``on``/``off`` (any case) as YAML 1.1 had them.

Anchors may be defined but aliases (``*name``) are refused: a few lines of nested aliases
expand to billions of nodes ("billion laughs"), and a config has no use for them. Duplicate
keys are refused too (YAML 1.1 let the last one win silently).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from hpc_train.errors import UsageError, closest, show


class _RefusedYAML(yaml.MarkedYAMLError):
    """Valid YAML that a config file may not use (aliases, duplicate keys, deep nesting)."""


class _Bounded(yaml.SafeLoader):
    """PyYAML's safe loader with nesting bounded: the composer recurses once per level, so a
    file of ``[`` x 10^5 would otherwise end in a RecursionError. Typed as ``safe_load`` types
    (a run directory's config.yaml, which hpc_train wrote, is read back with it)."""

    MAX_DEPTH = 20                       # a config is 3 deep; recursion fails near 1000
    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > self.MAX_DEPTH:
                raise _RefusedYAML(None, None, f"nested deeper than {self.MAX_DEPTH} levels; a config is "
                                   f"sections of keys", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Loader(_Bounded):
    """The bounded loader, with plain scalars kept as text and aliases and duplicate keys refused
    (see the module docstring for why). Pure Python, not the C loader: the overrides below live
    in the composer and constructor, which the C loader replaces; config files are a few
    kilobytes, so speed does not matter."""

    yaml_implicit_resolvers: dict = {}   # own table, filled below: only null is implicit

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _RefusedYAML(None, None, f"found the alias *{event.anchor}; aliases are not allowed in config "
                               f"files (write the value out)", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node)
            try:
                seen = key in first
            except TypeError:   # unhashable: the base class refuses it, with its line
                continue
            if seen:
                raise _RefusedYAML(None, None, f"duplicate key {show(key)} (first at line {first[key] + 1}); "
                                   f"each key may appear once per mapping", key_node.start_mark)
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                              ["~", "n", "N", ""])


def _yaml_problem(e: yaml.YAMLError, text: str) -> tuple[str, str]:
    """(where, what) of a YAML error, each on one line."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = e.problem or e.context or "malformed"
    elif isinstance(e, yaml.reader.ReaderError):   # a character YAML does not allow, e.g. a NUL
        where = f"line {text.count(chr(10), 0, e.position) + 1}"
        what = f"the control character U+{e.character:04X} is not allowed in YAML"
    else:
        where, what = "", str(e)
    return where, " ".join(str(what).split())


def _parse(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (_Loader is a SafeLoader)


def parse_value(raw: str, field: str) -> Any:
    """A ``--set`` value as YAML (plain scalars stay text); not YAML at all: the text itself."""
    try:
        return _parse(raw) if raw.strip() else ""
    except _RefusedYAML as e:
        raise UsageError(f"{field}: {_yaml_problem(e, raw)[1]}") from None
    except yaml.YAMLError:
        return raw   # e.g. 'a: b: c' or '*x': not YAML, so the text itself


_MAX_FILE_BYTES = 1 << 20


def read_file(path: str | os.PathLike[str]) -> Any:
    """A config file's YAML, or a :class:`UsageError` naming the file and what is wrong."""
    p = Path(path)
    name = str(p) if len(str(p)) <= 200 else f"{str(p)[:120]}...{str(p)[-40:]} ({len(str(p))} characters)"
    try:
        if p.is_dir():
            raise UsageError(f"config: {name} is a directory; give a YAML file (e.g. jobs/digits.yaml)")
        if not p.is_file():
            raise UsageError(f"config file not found: {name} (example configs are in jobs/, e.g. jobs/digits.yaml)")
        size = p.stat().st_size
        if size > _MAX_FILE_BYTES:
            # Parsing is pure Python (see _Loader): a wrong file of gigabytes would take minutes.
            raise UsageError(f"config: {name} is {size} bytes; a job config is a few kilobytes "
                             f"(the limit is {_MAX_FILE_BYTES} bytes): is this the right file?")
        raw = p.read_bytes()
    except OSError as e:
        raise UsageError(f"config: cannot read {name}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")   # a BOM from Windows editors is fine
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UsageError(f"config: {name} is not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}); "
                         f"save it as UTF-8") from None
    try:
        return _parse(text)
    except yaml.YAMLError as e:
        where, what = _yaml_problem(e, text)
        if isinstance(e, _RefusedYAML):
            raise UsageError(f"config: {name}{', ' + where if where else ''}: {what}") from None
        raise UsageError(f"config: {name} is not valid YAML{' at ' + where if where else ''}: {what}") from None


def parse_mapping(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """Text that should be a config's YAML, whatever it holds, typed as ``yaml.safe_load`` types:
    (mapping, None), or (None, what is wrong). Never raises: the loader bounds nesting, and any
    YAML error is one answer."""
    try:
        value = yaml.load(text, Loader=_Bounded)  # noqa: S506 (_Bounded is a SafeLoader)
    except (yaml.YAMLError, RecursionError, ValueError):
        return None, "is not valid YAML"
    if value is None:
        return {}, None
    if not isinstance(value, dict):
        return None, "is not a mapping of sections"
    return value, None


def section(saved: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """One section of a :func:`parse_mapping` mapping: {} when it is missing or not a mapping."""
    value = (saved or {}).get(name)
    return value if isinstance(value, dict) else {}


IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_INT_TEXT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")                 # ASCII only: int() also takes '١٢' and '1_0'
_FLOAT_TEXT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_NONFINITE_TEXT = re.compile(r"[-+]?\.?(?:inf|infinity|nan)", re.I)    # YAML's .inf/.nan, Python's inf/nan
_BOOL_TEXT = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
# Ints end up in torch, numpy and Slurm as 64-bit integers; fields without a max still stop here.
_INT_MAX = 2**63 - 1


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _printable(value: str) -> bool:
    # Values end up on #SBATCH lines and in shell scripts, where a newline starts a command; a NUL
    # cannot pass through argv or the environment, and a lone surrogate (an undecodable byte of a
    # command-line argument) cannot be written as UTF-8. Tabs are harmless.
    return not any((ord(c) < 32 and c != "\t") or c == "\x7f" or 0xD800 <= ord(c) <= 0xDFFF for c in value)


def coerce(path: str, f: dataclasses.Field, value: Any) -> Any:
    """Check ``value`` against the field's type and rules; return it in the field's type.

    ``value`` is text from YAML or ``--set`` (see the module docstring) or an already typed
    value (``config.from_dict``, command-line flags); both go through the same checks. The
    field's metadata (``min``, ``max``, ``choices``, ``importable``) comes from ``config._f``.
    """
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    m = f.metadata
    lo, hi = m.get("min"), m.get("max")
    given = value   # messages quote what the user wrote ('1e15'), not what it became
    if kind == "bool":
        if isinstance(value, str) and value.lower() in _BOOL_TEXT:
            value = _BOOL_TEXT[value.lower()]
        if not isinstance(value, bool):
            raise UsageError(f"config: {path} must be true or false, got {show(given)}")
    elif kind == "int":
        if isinstance(value, str) and _INT_TEXT.fullmatch(value):
            if len(value) > 30:   # int() refuses over 4300 digits; anything this long is out of range
                raise UsageError(f"config: {path} must be <= {_num(hi if hi is not None else _INT_MAX)}, "
                                 f"got {show(given)}")
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"config: {path} must be an integer (decimal digits, e.g. 1000), got {show(given)}")
        hi = _INT_MAX if hi is None else hi
    elif kind == "float":
        if isinstance(value, str):
            if _NONFINITE_TEXT.fullmatch(value):
                raise UsageError(f"config: {path} must be a finite number, got {show(given)}")
            if _FLOAT_TEXT.fullmatch(value):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"config: {path} must be a number (e.g. 0.5 or 1e-3), got {show(given)}")
        try:
            value = float(value)
        except OverflowError:   # an int beyond float's range
            value = math.inf
        if not math.isfinite(value):
            raise UsageError(f"config: {path} must be a finite number, got {show(given)}")
    elif kind == "str":
        if value is None:
            raise UsageError(f"config: {path} must be a string, got an empty value (null); write '' for an "
                             f"empty string")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise UsageError(f"config: {path} must be a string, got {show(given)}")
        value = str(value)
        if not _printable(value):
            raise UsageError(f"config: {path} must be a single line of printable text, got {show(given)}")
    elif kind == "list":
        if not isinstance(value, list) or not all(isinstance(v, str) and _printable(v) for v in value):
            raise UsageError(f"config: {path} must be a list of single-line strings, got {show(given)}")
    if lo is not None and value < lo or hi is not None and value > hi:
        low = f">= {_num(lo)}" if lo is not None else ""
        high = f"<= {_num(hi)}" if hi is not None else ""
        valid = f"{low} and {high}" if lo is not None and m.get("max") is not None else (
            low if lo is not None and value < lo else high)
        raise UsageError(f"config: {path} must be {valid}, got {show(given)}")
    if m.get("choices") and value not in m["choices"]:
        if not (m.get("importable") and IMPORT_RE.match(value)):
            extra = " or an import path 'package.module:function'" if m.get("importable") else ""
            raise UsageError(f"config: {path} must be one of {', '.join(m['choices'])}{extra}; "
                             f"got {show(given)}{closest(value[:200], m['choices'])}")
    if m.get("importable") and not m.get("choices") and value and not IMPORT_RE.match(value):
        raise UsageError(f"config: {path} must be an import path 'package.module:function', got {show(given)}")
    return value
