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

import re
from pathlib import Path
from typing import Any

import yaml

from hpc_train.errors import UsageError, show


class _RefusedYAML(yaml.MarkedYAMLError):
    """Valid YAML that a config file may not use (aliases, duplicate keys, deep nesting)."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, with plain scalars kept as text and aliases, duplicate keys and deep
    nesting refused (see the module docstring for why). Pure Python, not the C loader: the
    overrides below live in the composer and constructor, which the C loader replaces; config
    files are a few kilobytes, so speed does not matter."""

    yaml_implicit_resolvers: dict = {}   # own table, filled below: only null is implicit
    MAX_DEPTH = 20                       # a config is 3 deep; recursion fails near 1000
    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _RefusedYAML(None, None, f"found the alias *{event.anchor}; aliases are not allowed in config "
                               f"files (write the value out)", event.start_mark)
        self._depth += 1
        try:
            if self._depth > self.MAX_DEPTH:
                raise _RefusedYAML(None, None, f"nested deeper than {self.MAX_DEPTH} levels; a config is "
                                   f"sections of keys", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

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


def read_file(path: str | Path) -> Any:
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


