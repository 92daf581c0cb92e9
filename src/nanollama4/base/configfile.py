"""Config files: a run's settings as TOML, read and written from the config dataclasses' own declarations.

A file holds up to three things: `data` (the corpus: a text file or a folder), a `[model]` table (`preset`,
a preset's name, plus any `ModelConfig` fields) and a `[train]` table (any `TrainConfig` fields), each
with a table per kind that has settings of its own (`[train.muon]`, `[model.softmax]`; parts.py):

    data = "corpus/"

    [model]
    preset = "shakespeare-char"
    n_experts = 16

    [train]
    optimizer = "muon"
    max_time = 300.0

    [train.muon]
    lr = 0.02

`nanollama4 train --config FILE` resolves a field by the first of: the command line (`--set`, `--preset`,
`--max-steps`/`--max-time`, `--data`), the file, the preset, the dataclass's default. Every run writes its
resolved file, every field filled in, as `config.toml` at its root, and `train --config RUN/config.toml
--out NEW` trains the same run again. `nanollama4 config [--preset P]` prints the full default file.

There is no second list of fields: the names, types and defaults are the dataclasses' (`config.py`), and
each field's one-line meaning is the comment on its line there (`fields.field_help`). TOML has no null, so a
field that may be None takes the string "none".
"""

from __future__ import annotations

import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .config import ModelConfig, TrainConfig, config_of, preset
from .errors import ConfigError
from .fields import field_help, options_of, plain_fields
from .files import read_bytes
from .parts import declared_hint, own_fields, renamed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (Python 3.10)
    import tomli as tomllib

TABLES = {"model": ModelConfig, "train": TrainConfig}
CONFIG_LIMIT = 2**20  # bytes: a config or sweep file of every field, with dozens of arms, is a few kB
VOCAB_NOTE = "vocab_size is the tokenizer's (char: the corpus's characters; bpe: set bpe_vocab_size)"


@dataclass
class ConfigFile:
    """What a config file set: the preset named, the [model] and [train] fields, the corpus."""

    path: Path
    preset: str | None = None
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    data: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the top-level keys a caller allowed (a sweep's)

    def corpus(self) -> str | None:
        """`data` as a path to read: one written relative is relative to the file's folder."""
        if self.data is None:
            return None
        return self.data if Path(self.data).expanduser().is_absolute() else str(self.path.parent / self.data)


# ---------------------------------------------------------------------------------------------- the declarations
def _expected(hint: Any) -> str:
    """What a field takes, in words, from its resolved annotation."""
    options = options_of(hint)
    words = []
    for option in options:
        if option is type(None):
            words.append('"none"')
        elif typing.get_origin(option) is Literal:
            words.append(" or ".join(json.dumps(v) for v in typing.get_args(option)))
        elif option is str:
            words.append('"auto"' if bool in options else "a string")
        else:
            words.append({bool: "true or false", int: "a whole number", float: "a number"}[option])
    return " or ".join(words)


def check_value(where: str, key: str, value: Any, hint: Any) -> Any:
    """`value` as read from TOML, if its JSON type is one the field declares (ints where floats go are
    widened); else a ConfigError naming where, the key and what it takes. The field's choices and limits are
    judged where the config is built, by its one declaration (`fields.check`), as for every other door."""
    options = options_of(hint)
    if type(None) in options and value == "none":
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str) and (bool not in options or value == "auto"):
            return value
        if typing.get_origin(option) is Literal and isinstance(value, str):
            return value
    raise ConfigError(f"{where}: {key} = {_toml_value(value)} takes {_expected(hint)}")


# ---------------------------------------------------------------------------------------------- reading
def read_config_file(path: str | Path, extra: tuple[str, ...] = (), homes: dict[str, str] | None = None
                     ) -> ConfigFile:
    """The file at `path`, every key checked against the declarations; one ConfigError line otherwise. The
    top-level keys in `extra` (a sweep file's) are kept unchecked in `ConfigFile.extra`, for the caller;
    `homes` names the extra table a key of theirs belongs in, for the error when it is written under
    [model] or [train] (score_tokens: "sweep")."""
    path = Path(path)
    try:
        exists = path.exists()
    except OSError as e:  # a folder on the way that may not be read
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    if not exists:
        raise ConfigError(f"{path}: no such config file (`nanollama4 config > {path.name}` writes one)")
    try:  # bounded: a FIFO would block forever, /dev/zero never ends (a file we are handed, maybe downloaded)
        text = read_bytes(path, CONFIG_LIMIT, "a config file", ConfigError).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.__class__.__name__}: {e})") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nests its arrays or tables too deeply to be a config file") from None
    except ValueError as e:  # a whole number past Python's 4,300 digits
        raise ConfigError(f"{path}: holds a value no config takes ({str(e).split(':')[0]})") from None
    out = ConfigFile(path)
    for key, value in raw.items():
        if key == "data":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{path}: data = {_toml_value(value)} takes a path (a text file or a folder)")
            out.data = value
        elif key in TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: {key} must be a table, [{key}]")
            getattr(out, key).update(_read_table(path, key, value, out, homes or {}))
        elif key in extra:
            out.extra[key] = value
        else:
            holds = ", ".join(["data", "[model]", "[train]", *(f"[{k}]" for k in extra)])
            raise ConfigError(f"{path}: unknown key {key!r}; a{' sweep' if extra else ''} config file holds {holds}")
    return out


def _read_table(path: Path, table: str, values: dict[str, Any], out: ConfigFile, homes: dict[str, str]
                ) -> dict[str, Any]:
    """The [model] or [train] table's values by key, a kind's own table ([train.muon]) as "muon.KEY" keys."""
    cls = TABLES[table]
    known = {f.name for f in plain_fields(cls)}
    checked = {}
    for key, value in flat_table(values):
        where = f"{path}: [{table}]"
        if table == "model" and key == "preset":
            if not isinstance(value, str):
                raise ConfigError(f"{where} preset = {_toml_value(value)} takes a preset's name")
            try:
                preset(value)  # an unknown name fails here, listing the presets
            except ConfigError as e:
                raise ConfigError(f"{where} preset: {e}") from None
            out.preset = value
            continue
        if table == "model" and key == "vocab_size":
            raise ConfigError(f"{where} vocab_size cannot be set: {VOCAB_NOTE}")
        owner = config_of(key)
        if owner is not cls:
            other = next((t for t, c in TABLES.items() if c is owner), None)
            moved = next(((t, new) for t, c in TABLES.items() if (new := renamed(c, key))), None)
            if other is None and moved is not None:  # a key older runs took: where it is written now
                (home, (new_key, whose)) = moved
                kind, _, name = new_key.partition(".")
                raise ConfigError(f"{where} has no key {key!r}: it is {new_key} now ({whose}); write {name} = "
                                  f"{_toml_value(value)} under [{home}.{kind}]")
            if other is None and key in homes:
                raise ConfigError(f"{where} has no key {key!r}; it belongs in [{homes[key]}]")
            if other is None and "." not in key:
                raise ConfigError(f"{where} has no key {key!r}; valid keys: {', '.join(sorted(known))}")
            if other is not None:
                raise ConfigError(f"{where} has no key {key!r}; it belongs in [{other}]")
        try:
            hint = declared_hint(cls, key)
        except ConfigError as e:
            raise ConfigError(f"{where} {e}") from None
        checked[key] = check_value(where, key, value, hint)
    return checked


def flat_table(values: dict[str, Any]) -> list[tuple[str, Any]]:
    """A table's keys, a sub-table's ([train.muon]) as "muon.KEY"."""
    return [(f"{key}.{k}", v) for key, value in values.items() if isinstance(value, dict) for k, v in value.items()] \
        + [(key, value) for key, value in values.items() if not isinstance(value, dict)]


def resolve(file: ConfigFile | None, cli_preset: str | None, model_over: dict[str, Any], train_over: dict[str, Any],
            default_preset: str) -> tuple[str, ModelConfig, TrainConfig]:
    """The preset's name, the ModelConfig and the TrainConfig of a new run: command line > file > preset >
    defaults. A budget given on the command line replaces the file's (of either kind)."""
    file = file or ConfigFile(Path("-"))
    name = cli_preset or file.preset or default_preset
    train_values = dict(file.train)
    if "max_steps" in train_over or "max_time" in train_over:
        train_values.pop("max_steps", None)
        train_values.pop("max_time", None)
    try:
        model_cfg = preset(name, **{**file.model, **model_over})
        tc = TrainConfig.from_dict({**train_values, **train_over})
    except ConfigError as e:
        if file.path.name == "-":  # no file: the command line alone
            raise
        raise ConfigError(f"{e} (from {file.path} and the command line)") from None
    return name, model_cfg, tc


# ---------------------------------------------------------------------------------------------- writing
def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    return json.dumps(value, default=str)


def _table(cfg: Any, skip: tuple[str, ...] = ()) -> list[str]:
    helps = field_help(type(cfg))
    lines = []
    for f in plain_fields(cfg):
        if f.name in skip:
            continue
        entry = f"{f.name} = {_toml_value(getattr(cfg, f.name))}"
        lines.append(f"{entry:<40}  # {helps[f.name]}" if f.name in helps else entry)
    return lines


def _kind_tables(table: str, cfg: Any) -> list[str]:
    """[table.kind] for each kind whose settings cfg holds, with the kind in a comment."""
    lines = []
    for kind_name, values in cfg.settings.items():
        registry = next(r for r in cfg.KINDS.values() if kind_name in r)
        kind = registry[kind_name]
        used = any(getattr(cfg, f) == kind_name for f in cfg.KINDS)
        lines += ["", f"[{table}.{kind_name}]  # the {kind_name} {registry.field}'s own settings"
                  + ("" if used else f" (when {registry.field} = {_toml_value(kind_name)})")]
        helps = field_help(kind.Settings)
        for f in own_fields(kind):
            entry = f"{f.name} = {_toml_value(getattr(values, f.name))}"
            lines.append(f"{entry:<40}  # {helps[f.name]}" if f.name in helps else entry)
    return lines


def config_toml(model_cfg: ModelConfig, tc: TrainConfig, data: str | None = None, header: str = "",
                preset_name: str | None = None) -> str:
    """A complete config file: every field of both tables, each with its meaning."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    if lines:
        lines.append("")
    if data is not None:
        lines += [f"data = {_toml_value(data)}", ""]
    lines.append("[model]")
    if preset_name is not None:
        lines.append(f"{'preset = ' + _toml_value(preset_name):<40}  # the preset the fields below start from")
    lines += _table(model_cfg, skip=("vocab_size",))
    lines.append(f"# vocab_size = {model_cfg.vocab_size}  ({VOCAB_NOTE})")
    lines += _kind_tables("model", model_cfg)
    lines += ["", "[train]"] + _table(tc) + _kind_tables("train", tc)
    return "\n".join(lines) + "\n"


def run_config_toml(model_cfg: ModelConfig, tc: TrainConfig, data: str | None) -> str:
    """A run's resolved config.toml: `train --config` on it trains the same run again."""
    return config_toml(model_cfg, tc, data, header=(
        "nanollama4: this run's settings, every field resolved. Train it again with\n"
        "  nanollama4 train --config config.toml --out NEW_RUN\n"
        "(the command line wins over this file: --set KEY=VALUE, --max-steps, --max-time, --data)"))


def defaults_toml(preset_name: str, model_over: dict[str, Any] | None = None,
                  train_over: dict[str, Any] | None = None) -> str:
    """`nanollama4 config --preset P [--set ...]`: the full default file for a preset, with any changes."""
    return config_toml(preset(preset_name, **(model_over or {})), TrainConfig.from_dict(train_over or {}), header=(
        f"nanollama4 config file: the preset {preset_name!r} and the training defaults, every field.\n"
        "Keep the lines you change; train with: nanollama4 train --config FILE --max-time 5m\n"
        "Precedence: command line (--set, --preset, --max-steps/--max-time, --data) > this file > preset > "
        "defaults.\n"
        'A field that may be None takes "none". data = "PATH" (a text file or folder) picks the corpus.'),
        preset_name=preset_name)
