"""The parts a config names by kind: router kinds, optimizer kinds and expert products, each in one `Registry`.

A config field such as `router = "softmax"` or `optimizer = "muon"` names a part; the part registers itself
where it is defined (router.py, optim.py, ops/experts.py, or a module of yours passed with `--import`), and
the config looks the name up here. One helper for all three:

- `Registry`: name -> part, with the refusal that lists every name there is and says how to bring one of
  your own. A registry knows the package module its built-in parts live in (`home`) and imports it on the
  first question, so the config can ask it without importing torch-heavy code itself: config.py stays
  below router.py and optim.py in the import order, and they may use its field declarations.
- `Kind`: the base of a class part (a router kind, an optimizer kind). A subclass registers itself with
  `name=` (and `about=`, a few words for error messages), and may declare its own settings: a dataclass
  `Settings` of fields written as the config's are (type, limits, default, meaning in the comment). The
  config holds one table of them per kind (`[train.muon]` in a config file, `--set muon.lr=0.01`,
  "muon.lr" in train_config.json), so a kind brought with --import has settings of its own without a
  line changed in config.py. `formerly` maps the flat keys older runs saved (`muon_lr`) to them.
- `Composed`: the base of `ModelConfig` and `TrainConfig`, which keeps those tables (`settings`) and reads
  and writes them in the configs' dict form ("muon.lr"); `declared_hint` finds any key's declared type.
- `MARK` and `code_of`: `plugins.load` marks each module it imports with what `--import` took, and a run
  records it for the parts it uses (`ModelConfig.imports`, `TrainConfig.optimizer_imports`).

Torch-free, so that the command line can read configs before it needs torch.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from .errors import ConfigError
from .fields import check, hints, plain_fields

T = TypeVar("T")
MARK = "__nanollama4_import__"  # set on each module `plugins.load` imports: what --import it takes (a name or a path)


class Registry(Generic[T]):
    """Parts by name. `field` is the config field (or option) that names one, `yours` how the refusal calls
    one of your own, `home` the package module that registers the built-in ones, `changed` a callback after
    each change (the products' derived tables)."""

    def __init__(self, field: str, yours: str, home: str, changed: Callable[[], None] | None = None) -> None:
        self.field, self.yours, self.home, self.changed = field, yours, home, changed
        self._parts: dict[str, T] = {}
        self._loaded = False

    def _load(self) -> dict[str, T]:
        if not self._loaded:
            self._loaded = True  # first: the home module registers into this registry as it is imported
            importlib.import_module(self.home)
        return self._parts

    def add(self, name: str, part: T) -> None:
        """Register `part` as `name`, replacing one of that name (a module imported again). A name is what a
        config writes and the first half of its settings' keys ("muon.lr"): no dots, spaces or '='."""
        if not isinstance(name, str) or not name or any(c in name for c in ".= \t\n"):
            raise ConfigError(f"a {self.field}'s name must be a word (letters, digits, '-' or '_'), not {name!r}")
        self._parts[name] = part
        if self.changed is not None:
            self.changed()

    def remove(self, name: str) -> None:
        """Forget `name` (a test's part); a name not there is ignored."""
        self._parts.pop(name, None)
        if self.changed is not None:
            self.changed()

    def find(self, name: Any) -> T:
        """The part called `name`, else a ConfigError listing every registered name with its `about` and
        saying how to bring one of your own (--import)."""
        parts = self._load()
        if not isinstance(name, str) or name not in parts:
            known = ", ".join(f"'{k}' ({getattr(c, 'about', '')})" for k, c in parts.items())
            raise ConfigError(f"{self.field} ({name!r}) must be one of: {known}; {self.yours} of your own: define "
                              "it in a module and pass --import MODULE")
        return parts[name]

    def __contains__(self, name: object) -> bool:
        return name in self._load()

    def __getitem__(self, name: str) -> T:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._load()))

    def __len__(self) -> int:
        return len(self._load())

    def items(self) -> list[tuple[str, T]]:
        return list(self._load().items())

    def values(self) -> list[T]:
        return list(self._load().values())


@dataclass
class NoSettings:
    """The settings of a kind that has none of its own."""


class Kind:
    """A class part: subclasses register themselves in the class's `registry` with `name=`; see the module
    docstring. Never instantiated by the registry: the config asks the class."""

    registry: ClassVar[Registry[Any]]
    name: ClassVar[str]
    about: ClassVar[str] = ""
    Settings: ClassVar[type] = NoSettings  # a dataclass of this kind's own fields, or NoSettings
    formerly: ClassVar[dict[str, str]] = {}  # flat config keys older runs saved -> fields of Settings

    def __init_subclass__(cls, name: str | None = None, about: str = "", **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if name is not None:
            cls.name, cls.about = name, about or name
            cls.registry.add(name, cls)

    @classmethod
    def settings(cls, cfg: Any) -> Any:
        """This kind's settings as config `cfg` holds them (its table, `own_fields`)."""
        return cfg.settings[cls.name]


def own_fields(kind: type) -> tuple[dataclasses.Field, ...]:
    """The fields a kind declares of its own (none for a function part or a kind without Settings)."""
    settings = getattr(kind, "Settings", NoSettings)
    return dataclasses.fields(settings) if dataclasses.is_dataclass(settings) else ()


def code_of(cls: type) -> str | None:
    """What `--import` takes for class `cls` to exist (`plugins.load` marks each module it imports with it: a
    file's path, or the module's name); None for nanollama4's own classes."""
    module = cls.__module__
    if module.split(".")[0] == "nanollama4":
        return None
    return getattr(sys.modules.get(module), MARK, module)


# ---------------------------------------------------------------------------------------------- configs of kinds
class Composed:
    """The base of the config dataclasses (`config.ModelConfig`, `config.TrainConfig`): their dict form (what
    config.json and train_config.json hold), and the tables of the kinds they name (`Kind.Settings`).

    A config field that names a kind (`KINDS`: ModelConfig's `router`, TrainConfig's `optimizer`) brings
    that kind's own settings, kept in the `settings` field as one dataclass per kind. In the dict form they
    are flat keys "kind.field" ("muon.lr"), as `--set` and sweeps write them; a nested table (a config file's
    [train.muon]) and the flat keys older runs saved (`Kind.formerly`: "muon_lr") are read as well.
    """

    KINDS: ClassVar[dict[str, Registry[Any]]] = {}
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in plain_fields(self)}
        for kind, values in self.settings.items():
            out.update((f"{kind}.{name}", value) for name, value in dataclasses.asdict(values).items())
        return out

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.to_dict() == other.to_dict()  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """Build from a dict, rejecting unknown keys (a typo must not silently fall back to a default)."""
        plain = {f.name for f in plain_fields(cls)}
        formerly = {old: (kind.name, new) for registry in cls.KINDS.values() for kind in registry.values()
                    for old, new in getattr(kind, "formerly", {}).items()}
        values: dict[str, Any] = {}
        tables: dict[str, dict[str, Any]] = {}
        unknown = []
        for key, value in data.items():
            if key in plain:
                values[key] = value
            elif key == "settings" and isinstance(value, dict):  # the Python form: {kind: table or Settings}
                for kind, table in value.items():
                    table = dataclasses.asdict(table) if dataclasses.is_dataclass(table) else table
                    if isinstance(table, dict):
                        tables.setdefault(kind, {}).update(table)
                    else:  # refused, naming the kind, where the tables are settled
                        tables[kind] = table
            elif isinstance(key, str) and "." in key:
                kind, _, name = key.partition(".")
                tables.setdefault(kind, {})[name] = value
            elif isinstance(value, dict) and isinstance(key, str):
                tables.setdefault(key, {}).update(value)
            elif key not in formerly:
                unknown.append(key)
        for key, (kind, name) in formerly.items():  # an old run's flat key, unless the new one is given too
            if key in data:
                tables.setdefault(kind, {}).setdefault(name, data[key])
        if unknown:
            raise ConfigError(f"unknown {cls.__name__} keys {sorted(map(str, unknown))}; valid keys: "
                              f"{sorted(plain)} and each kind's own as KIND.KEY (`nanollama4 config` lists them)")
        return cls(**values, settings=tables)

    def _settle_kinds(self) -> None:
        """Each table in `settings` made its kind's Settings, checked field by field; the built-in kinds' and
        the named kind's tables filled in with their defaults (a config file lists them all)."""
        named = {getattr(self, field): registry for field, registry in self.KINDS.items()}
        given, self.settings = self.settings, {}
        for kind_name, table in given.items():
            registry = next((r for r in self.KINDS.values() if kind_name in r), None)
            if registry is None:
                kinds = ", ".join(k for r in self.KINDS.values() for k, c in r.items() if own_fields(c))
                raise ConfigError(f"{kind_name!r} names no kind with settings of its own (those with some: "
                                  f"{kinds}); write KIND.KEY, as muon.lr")
            kind = registry[kind_name]
            if isinstance(table, kind.Settings):
                values = table
            else:
                if not isinstance(table, dict):
                    raise ConfigError(f"{kind_name}'s settings must be a table of key = value, not {table!r}")
                extra = sorted(set(table) - {f.name for f in own_fields(kind)})
                if extra:
                    raise not_a_setting(registry, kind, extra[0])
                values = kind.Settings(**table)
            check(values, prefix=f"{kind_name}.")
            self.settings[kind_name] = values
        for name, registry in [*named.items(), *((None, r) for r in self.KINDS.values())]:
            for kind_name, kind in registry.items():
                if (kind_name == name or (name is None and code_of(kind) is None)) and own_fields(kind):
                    self.settings.setdefault(kind_name, kind.Settings())


def not_a_setting(registry: Registry[Any], kind: Any, name: str) -> ConfigError:
    """The refusal of "kind.name" where the kind declares no setting `name`, in the same words at every door."""
    known = ", ".join(f.name for f in own_fields(kind)) or "none"
    return ConfigError(f"{kind.name}.{name} is not a setting of the {kind.name} {registry.field}; its settings: "
                       f"{known}")


def kind_of_key(cls: Any, key: str) -> tuple[Registry[Any], Any] | None:
    """(registry, kind) when `key` is "kind.name" for a kind that config class `cls` can name; else None."""
    kind_name, dot, _ = key.partition(".")
    registry = next((r for r in cls.KINDS.values() if dot and kind_name in r), None)
    return None if registry is None else (registry, registry[kind_name])


def renamed(cls: Any, key: str) -> tuple[str, str] | None:
    """Where a flat key that older runs saved (`Kind.formerly`: "router_noise") is set now, as (its KIND.KEY,
    words naming whose setting it is): ("softmax.noise", "the softmax router's own setting"); None for any
    other key. A run's files still load with the old key; a key a person types is refused, naming the new one
    instead of only saying "unknown key"."""
    for registry in cls.KINDS.values():
        for kind in registry.values():
            name = getattr(kind, "formerly", {}).get(key)
            if name is not None:
                return f"{kind.name}.{name}", f"the {kind.name} {registry.field}'s own setting"
    return None


def renamed_words(key: str, new: tuple[str, str], value: str = "...") -> str:
    """The refusal of `key`, which is `new` (`renamed`) now, with the --set that sets it."""
    return f"unknown key {key!r}: it is {new[0]} now ({new[1]}); --set {new[0]}={value}"


def declared_hint(cls: Any, key: str) -> Any:
    """The declared type of `key` in config class `cls`: one of its fields, or "kind.key" of a kind it names;
    else a ConfigError listing what there is."""
    plain = {f.name for f in plain_fields(cls)}
    if key in plain:
        return hints(cls)[key]
    found = kind_of_key(cls, key)
    if found is None:
        new = renamed(cls, key)
        if new is not None:
            raise ConfigError(renamed_words(key, new))
        raise ConfigError(f"unknown key {key!r}; valid keys: {', '.join(sorted(plain | set(own_keys(cls))))}")
    registry, kind = found
    name = key.partition(".")[2]
    if name not in {f.name for f in own_fields(kind)}:
        raise not_a_setting(registry, kind, name)
    return hints(kind.Settings)[name]


def own_keys(cls: Any) -> list[str]:
    """Every "kind.key" the kinds that config class `cls` names declare (those registered now)."""
    return [f"{kind_name}.{f.name}" for registry in cls.KINDS.values() for kind_name, kind in registry.items()
            for f in own_fields(kind)]


ROUTERS: Registry[Any] = Registry("router", "a kind", "nanollama4.model.router")
OPTIMIZERS: Registry[Any] = Registry("optimizer", "an optimizer", "nanollama4.training.optim")
