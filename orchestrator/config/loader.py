"""Settings from a YAML file and command-line flags, validated by one pydantic model: every problem
is one line, ``file:line: field: message`` (or ``--flag: message``), all reported at once; the flags
come from the model's fields, so there is no second list of them to keep in step."""

from __future__ import annotations

import argparse
import difflib
import json
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import pydantic
import yaml
from pydantic.fields import FieldInfo

Loc = tuple[str | int, ...]
Model = TypeVar("Model", bound=pydantic.BaseModel)


class ConfigError(ValueError):
    """A config is invalid; the message lists every problem, one a line, with its line or flag."""


def _line_map(node: yaml.Node, path: Loc = (), out: dict | None = None, seen: set | None = None) -> dict[Loc, int]:
    """Where each key path starts in the file (1-based lines), for error messages.  An aliased node
    is walked once, so recursive or exponential aliases cannot hang the loader."""
    out = {} if out is None else out
    seen = set() if seen is None else seen
    out.setdefault(path, node.start_mark.line + 1)
    if id(node) in seen:
        return out
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            out[path + (key.value,)] = key.start_mark.line + 1
            _line_map(value, path + (key.value,), out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, path + (i,), out, seen)
    return out


MAX_EXPANDED_VALUES = 100_000  # a cluster YAML holds hundreds; aliases repeated within aliases hold billions


def _expanded_size(node: yaml.Node, memo: dict[int, int], open_: set[int]) -> int:
    """How many values the document holds once every alias is read as a copy (what pydantic and the
    providers' checks walk); raises ValueError for an alias inside itself or past the limit."""
    if id(node) in memo:
        return memo[id(node)]
    if id(node) in open_:
        raise ValueError("a value refers to itself (a recursive YAML alias)")
    open_.add(id(node))
    children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else
                node.value if isinstance(node, yaml.SequenceNode) else [])
    size = 1
    for child in children:
        size += _expanded_size(child, memo, open_)
        if size > MAX_EXPANDED_VALUES:
            raise ValueError(f"its aliases expand to more than {MAX_EXPANDED_VALUES:,} values (an alias "
                             "repeated inside aliases); write the values out")
    open_.discard(id(node))
    memo[id(node)] = size
    return size


def read_yaml(path: str | Path, what: str, empty_ok: bool = False) -> tuple[dict, dict[Loc, int]]:
    """A YAML file's mapping and the line of each key path; ConfigError if it is unreadable, not YAML
    or not a mapping (``what`` says what it should be; with ``empty_ok`` an empty file is {})."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        node = yaml.compose(text)
        if node is not None:
            _expanded_size(node, {}, set())  # before anything walks the values it would build
        data = yaml.safe_load(text)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    data = {} if data is None and empty_ok else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: {what}")
    return data, _line_map(node) if node is not None else {}


def at(loc: Loc, message: str, lines: Mapping[Loc, int], source: str | None) -> str:
    """``file:line: dotted.key: message``, the line of the nearest key of ``loc`` in the file;
    without a file, ``dotted.key: message``."""
    # a key with a line break or another control character would split the one-line message
    where = ".".join(str(p) if str(p).isprintable() else repr(p) for p in loc) or ("(top level)" if source else "")
    text = message if not where or message.startswith(f"{where} ") else f"{where}: {message}"
    if source is None:
        return text
    line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), "?")
    return f"{source}:{line}: {text}"


def _known_fields(model: type[pydantic.BaseModel], loc: Loc) -> list[str]:
    """The field names valid at ``loc`` (for did-you-mean on an unknown key)."""
    current: Any = model
    for part in loc[:-1]:
        if getattr(current, "__origin__", None) is dict:
            current = current.__args__[1]
        elif isinstance(current, type) and issubclass(current, pydantic.BaseModel) and part in current.model_fields:
            current = current.model_fields[str(part)].annotation
        else:
            return []
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, pydantic.BaseModel) else []


def did_you_mean(word: Any, choices: Iterable[str], *, fold: bool = False, cutoff: float = 0.6) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``word``, else ``""``: every unknown key and
    value in a config says it the same way.  ``fold``: case and underscores do not count
    (``instance_type`` finds ``InstanceType``)."""
    def key(text: str) -> str:
        return text.replace("_", "").casefold() if fold else text

    options = {key(c): c for c in choices}
    hint = difflib.get_close_matches(key(str(word)), list(options), n=1, cutoff=cutoff)
    return f"; did you mean {options[hint[0]]!r}?" if hint else ""


def describe(err: Any, model: type[pydantic.BaseModel], lines: Mapping[Loc, int], source: str | None,
             flags: Mapping[str, str] | None = None) -> str:
    """One pydantic error as one line: at its flag when ``flags`` (field -> flag) gave the field,
    else at its line in ``source``."""
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        message = "unknown key" + did_you_mean(loc[-1], _known_fields(model, loc))
    elif err["type"] == "missing":
        message = "required field is missing"
    else:
        message = err["msg"].removeprefix("Value error, ")
        if "input" in err and err["type"] not in ("value_error", "assertion_error"):
            message += f" (got {err['input']!r})"
    if flags and loc and loc[0] in flags:
        return f"{flags[loc[0]]}: {message}"
    return at(loc, message, lines, source)


def _argument(info: FieldInfo) -> dict[str, Any]:
    """``add_argument``'s keywords for a field: bool a switch, list one or more values, Literal choices."""
    kind = info.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None: the flag gives an X
        (kind,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if typing.get_origin(kind) is typing.Annotated:  # a checked type: the model checks the flag's value
        kind = typing.get_args(kind)[0]
    default = info.get_default(call_default_factory=True)
    shown = " ".join(map(str, default)) if isinstance(default, list) else default
    note = f" (default {shown})" if shown not in (None, "") and shown is not False else ""
    out: dict[str, Any] = {"help": (info.description or "") + note}
    if kind is bool:
        out.update(action="store_true", default=None)
    elif typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        out.update(type=item, nargs="*" if default == [] else "+")  # a bare flag says "none" where [] is allowed
    elif typing.get_origin(kind) is Literal:
        choices = list(typing.get_args(kind))
        out.update(type=type(choices[0]), choices=choices)
    elif kind in (str, int, float):
        out["type"] = kind
    elif typing.get_origin(kind) is dict:
        out.update(type=_json_object, metavar="JSON")
    else:
        raise TypeError(f"no command-line flag for a field of type {kind!r}")
    return out


def _json_object(text: str) -> dict:
    """argparse type of a mapping field: a JSON object, e.g. ``'{"layers": 1}'``."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give an object such as '{{\"layers\": 1}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"layers\": 1}}', got {text!r}")
    return value


@dataclass(frozen=True)
class ModelFlags(Generic[Model]):
    """A pydantic model as a YAML file plus one command-line flag per field (``--field-name``, or
    the spelling in ``spellings`` where the command line has always said it otherwise)."""

    model: type[Model]
    spellings: Mapping[str, str] = field(default_factory=dict)  # field -> flag

    def flag(self, name: str) -> str:
        return self.spellings.get(name) or "--" + name.replace("_", "-")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Every field as a flag; a flag not given is None (the file's value, else the model's default)."""
        for name, info in self.model.model_fields.items():
            parser.add_argument(self.flag(name), dest=name, **_argument(info))

    def load(self, path: str | Path | None, flags: Mapping[str, Any]) -> Model:
        """The YAML at ``path`` (if any) with the flags given over it, validated; every problem in
        one ConfigError.  ``flags`` is by field name (e.g. ``vars(args)``); None means not given."""
        data, lines = read_yaml(path, "expected a mapping of settings", empty_ok=True) if path else ({}, {})
        given = {name: value for name, value in flags.items() if name in self.model.model_fields and value is not None}
        try:
            return self.model.model_validate({**data, **given})
        except pydantic.ValidationError as e:
            used, source = {name: self.flag(name) for name in given}, str(path) if path else None
            raise ConfigError("\n".join(describe(err, self.model, lines, source, used) for err in e.errors())) from None
        except RecursionError:  # a YAML alias that contains itself
            raise ConfigError(f"{path}: a value refers to itself (a recursive YAML alias)") from None
