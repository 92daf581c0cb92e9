"""Declared fields: a settings dataclass says once what each field takes, and every door reads it from there.

A settings class (`ModelConfig`, `TrainConfig`, `Sampling`) is a dataclass whose field lines carry all
there is to know about a field: its type (a `Literal` lists the choices), its limits as `Rule`s inside
`Annotated[...]`, its default, and its meaning as the comment at the end of its line. From that one line:

- `check(obj)` judges a built object, field by field, and raises one line naming the field and the rule
  ("top_p (0.0) must be a number in (0, 1]"): the Python API, a config file, `--set`, the command line's
  flags and the HTTP bodies all end up here, so a value is refused in the same words at every door;
- `read_text` reads a command-line or `--set` string as the field's type (a typo fails naming the field);
- `add_arguments` / `arguments_of` make and read argparse flags for a class's fields (`generate`'s sampling
  flags), their help the field's comment (`field_help`), which `nanollama4 config` prints too.

Torch-free on purpose: the command line builds its parser from these declarations before it needs torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import math
import re
import tokenize
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from .errors import ConfigError

__all__ = ["Rule", "Limit", "Annotated", "check", "problem", "shown", "field_help", "hints", "read_text",
           "add_arguments", "arguments_of", "flag_type", "split", "number", "integer", "size", "Seed", "SEED_LIMIT",
           "POSITIVE", "WHOLE", "NON_NEGATIVE", "POSITIVE_NUMBER", "at_least", "above", "at_most", "options_of", "OWN",
           "plain_fields"]


@dataclass(frozen=True)
class Rule:
    """A value's limit beyond its type: `ok(value)` must hold, else "NAME (VALUE) must be WORDS".

    `words` also stands in for the type's own words when the type is wrong, so they should say both
    ("a positive integer", "a number in (0, 1]"). A rule without `ok` only words the type's refusal.
    """

    words: str
    ok: Callable[[Any], bool] | None = None

    def message(self, name: str, value: Any) -> str:
        return f"{name} ({shown(value)}) must be {self.words}"


@dataclass(frozen=True)
class Limit(Rule):
    """A size past what the project builds: a crafted file, not a choice (refused before memory is asked for)."""

    def message(self, name: str, value: Any) -> str:
        return f"{name} ({value:,}) is beyond what nanollama4 builds (at most {self.words}); the config is wrong or " \
               "not ours"


SEED_LIMIT = 2**63  # seeds are 0 .. 2^63 - 1: what torch's generators take, with room for derived seeds


def shown(value: Any, limit: int = 80) -> str:
    """`value` as a message quotes it: its repr, cut to `limit` characters (a 4,000-digit seed stays one line)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"<an integer of about {value.bit_length() * 0.30103:,.0f} digits>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def number(v: Any) -> bool:
    """A finite int or float (not a bool, not an int too large for a float)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def at_least(low: float, words: str) -> Rule:
    return Rule(words, lambda v: v >= low)


def above(low: float, words: str) -> Rule:
    return Rule(words, lambda v: v > low)


POSITIVE = above(0, "a positive integer")
WHOLE = at_least(0, "a whole number >= 0")
NON_NEGATIVE = at_least(0, "a non-negative number")
POSITIVE_NUMBER = above(0, "a positive number")
Seed = Annotated[int, Rule("an integer from 0 to 2^63 - 1", lambda v: 0 <= v < SEED_LIMIT)]


def at_most(limit: int) -> Limit:
    """The largest size the project builds: past it, a crafted file (`Limit`'s words)."""
    return Limit(f"{limit:,}", lambda v: v <= limit)


def size(limit: int = 2**27) -> Any:
    """A positive integer of at most `limit`."""
    return Annotated[int, POSITIVE, at_most(limit)]


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """Each field's resolved annotation, `Annotated` rules included."""
    return typing.get_type_hints(cls, include_extras=True)


def split(hint: Any) -> tuple[Any, tuple[Rule, ...]]:
    """(the bare type, the rules) of an annotation; `Rule | None` is `Optional[Annotated[...]]`, so the
    members of a union are unwrapped too."""
    rules: list[Rule] = []

    def bare(h: Any) -> Any:
        if typing.get_origin(h) is Annotated:
            base, *extras = typing.get_args(h)
            rules.extend(e for e in extras if isinstance(e, Rule))
            return bare(base)
        return h

    hint = bare(hint)
    if _is_union(hint):
        members = tuple(bare(h) for h in typing.get_args(hint))
        hint = functools.reduce(lambda a, b: a | b, members) if all(isinstance(m, type) for m in members) \
            else typing.Union[members]  # noqa: UP007 (Literal members cannot be joined with |)
    return hint, tuple(rules)


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def _options(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if _is_union(hint) else (hint,)


def options_of(hint: Any) -> tuple[Any, ...]:
    """The bare types an annotation allows (`int | None` -> int, NoneType), rules and Annotated stripped."""
    return _options(split(hint)[0])


def _fits(value: Any, option: Any) -> bool:
    if option is type(None):
        return value is None
    if option is bool:
        return isinstance(value, bool)
    if option is int:
        return integer(value)
    if option is float:
        return number(value)
    if option is str:
        return isinstance(value, str)
    if typing.get_origin(option) is Literal:
        return isinstance(value, str) and value in typing.get_args(option)
    if typing.get_origin(option) is tuple:
        item = typing.get_args(option)[0]
        return isinstance(value, tuple) and all(_fits(v, split(item)[0]) for v in value)
    raise TypeError(f"fields: no check for the annotation {option!r}")


def type_words(hint: Any) -> str:
    """What an annotation takes, in words ("true or false", "'char' or 'bpe'", "a number or None")."""
    words = []
    for option in _options(split(hint)[0]):
        if option is type(None):
            continue
        if typing.get_origin(option) is Literal:
            choices = [repr(c) for c in typing.get_args(option)]
            words.append(", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0])
        elif typing.get_origin(option) is tuple:
            words.append("a list of " + type_words(typing.get_args(option)[0]).removeprefix("a "))
        else:
            words.append({bool: "true or false", int: "an integer", float: "a number", str: "a string"}[option])
    if type(None) in _options(split(hint)[0]):
        words.append("None")
    return " or ".join(words)


OWN = {"own": True}  # a field's metadata: it holds the kinds' own settings tables (parts.py), not a value of its own


def plain_fields(cls: Any) -> tuple[dataclasses.Field, ...]:
    """The fields of dataclass `cls` that hold a value each (not the kinds' tables, `OWN`)."""
    return tuple(f for f in dataclasses.fields(cls) if not f.metadata.get("own"))


def check(obj: Any, error: Callable[[str, str], Exception] | None = None, prefix: str = "") -> None:
    """Raise one line naming the first field of dataclass `obj` whose value is not of its declared type or
    breaks one of its rules (named `prefix` + its name: "muon.lr"). `error(field, message)` makes the
    exception (default: ConfigError(message))."""
    declared = hints(type(obj))
    for f in plain_fields(obj):
        name, hint = prefix + f.name, declared[f.name]
        message = problem(name, getattr(obj, f.name), hint)
        if message is not None:
            raise (error(name, message) if error else ConfigError(message))


def problem(name: str, value: Any, hint: Any) -> str | None:
    """What is wrong with `value` for the field `name` declared as `hint`, in one line; None if nothing."""
    base, rules = split(hint)
    options = _options(base)
    if value is None and type(None) in options:
        return None
    if not any(_fits(value, option) for option in options):
        words = rules[0].words if rules and not isinstance(rules[0], Limit) else type_words(hint)
        return f"{name} ({shown(value)}) must be {words}"
    for rule in rules:
        if rule.ok is not None and not rule.ok(value):
            return rule.message(name, value)
    return None


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Each field's one-line meaning: the comment at the end of its line in the class's source (its
    declaration, read with Python's own tokenizer so that a `#` inside a string is not taken for one)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            row = token.start[0] - 1
            m = re.match(r"\s+(\w+): ", lines[row])
            if m and m.group(1) in {f.name for f in dataclasses.fields(cls)} and token.start[1] > m.end():
                out[m.group(1)] = token.string.lstrip("#").strip()
    return out


_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def read_text(key: str, raw: str, hint: Any) -> Any:
    """`raw` (a command line's or `--set`'s text) read as the type `hint` declares: None for an optional
    field, a bool word ("auto" too for `bool | str`), an int or a float; text and Literal fields stay text,
    for `check` to judge."""
    options = set(_options(split(hint)[0]))
    optional = type(None) in options
    if optional and raw.lower() in ("none", "null"):
        return None
    if bool in options:
        if raw.lower() in _WORDS:
            return _WORDS[raw.lower()]
        if str in options and raw.lower() == "auto":  # bf16=auto
            return "auto"
        expected = "true, false or auto" if str in options else "bool"
    elif options & {int, float}:
        kind = int if int in options else float
        try:
            return kind(raw)
        except ValueError:
            expected = kind.__name__
    else:
        return raw
    raise ConfigError(f"{key}={raw!r}: expected {expected}{' or None' if optional else ''}")


def _argument_type(hint: Any) -> Callable[[str], Any]:
    """An argparse type for one field: the text read as the field's type ("none" for an optional one, a
    true/false word for a bool, a whole or finite number); its limits are `check`'s."""
    options = set(_options(split(hint)[0]))

    def read(text: str) -> Any:
        if type(None) in options and text.lower() in ("none", "null"):
            return None
        if bool in options:
            if text.lower() not in _WORDS:
                raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
            return _WORDS[text.lower()]
        if int in options:
            try:
                return int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if float in options:
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
            return value
        if not text:
            raise argparse.ArgumentTypeError("must not be empty")
        return text

    return read


def flag_type(name: str, hint: Any) -> Callable[[str], Any]:
    """An argparse type for a flag that sets a declared field: the text read as the field's type, then
    judged by its rules (`problem`), so the flag refuses a value in the declaration's own words."""
    read = _argument_type(hint)

    def judged(text: str) -> Any:
        value = read(text)
        message = problem(name, value, hint)
        if message is not None:
            raise argparse.ArgumentTypeError(message)
        return value

    return judged


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                  defaults: dict[str, Any] | None = None) -> None:
    """One `--field-name` flag per field of `cls` (but `skip`): typed as the field, its help the field's
    comment, its default the field's (or `defaults`'); a tuple field is a repeatable flag, a bool field takes a
    true/false word or none (`--ignore-eos` alone is `--ignore-eos true`)."""
    helps, defaults = field_help(cls), defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = hints(cls)[f.name]
        base = next(o for o in _options(split(hint)[0]) if o is not type(None))
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        flag = "--" + f.name.replace("_", "-")
        if typing.get_origin(base) is tuple:
            parser.add_argument(flag, dest=f.name, action="append", type=_argument_type(typing.get_args(base)[0]),
                                metavar="TEXT", help=helps.get(f.name, "") + " (repeatable)")
        elif base is bool:
            parser.add_argument(flag, dest=f.name, type=_argument_type(hint), nargs="?", const=True, default=default,
                                metavar="true|false", help=helps.get(f.name, ""))
        else:
            shown = f" (default {default})" if f.name in defaults else ""
            parser.add_argument(flag, dest=f.name, type=_argument_type(hint), default=default,
                                help=helps.get(f.name, "") + shown)


def arguments_of(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The values `add_arguments`' flags parsed, as keywords for `cls` (a repeatable flag not given: ())."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in skip and hasattr(args, f.name):
            value = getattr(args, f.name)
            out[f.name] = tuple(value or ()) if typing.get_origin(
                next(o for o in _options(split(hints(cls)[f.name])[0]) if o is not type(None))) is tuple else value
    return out
