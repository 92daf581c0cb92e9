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
- `MARK` and `code_of`: `plugins.load` marks each module it imports with what `--import` took, and a run
  records it for the parts it uses (`ModelConfig.imports`, `TrainConfig.optimizer_imports`).

Torch-free, so that the command line can read configs before it needs torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from .errors import ConfigError

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
        """Register `part` as `name`, replacing one of that name (a module imported again)."""
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


ROUTERS: Registry[Any] = Registry("router", "a kind", "nanollama4.router")
OPTIMIZERS: Registry[Any] = Registry("optimizer", "an optimizer", "nanollama4.optim")
