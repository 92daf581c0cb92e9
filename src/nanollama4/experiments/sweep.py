"""Sweeps: your own comparison, as a file. Arms x seeds, each arm a normal run, read with paired statistics.

A sweep file is a config file (`configfile`: `data`, `[model]`, `[train]`: what every arm starts from)
with a `[sweep]` table and the arms:

    [model]
    preset = "experiments"

    [train]
    batch_size = 16
    seq_len = 128

    [sweep]
    title = "4 against 8 experts"
    seeds = [0, 1, 2]
    max_steps = 800                  # each arm's budget: max_steps, or max_time ("5m" or seconds)
    grid = { n_experts = [4, 8] }    # arms from every combination of these fields (model or train)
    pairs = [["n_experts=8", "n_experts=4"]]   # named pairs read (default: each arm against the first)
    # cross = { lr = [1e-3, 2e-3] }  # fields tuned per arm: every arm at each value, read at its best

A grid value may be a table of fields set together, so that a grid over layouts keeps what must stay tied
(the active size): `grid = { layout = [{ n_experts = 8, experts_per_token = 1 }, { n_experts = 16,
experts_per_token = 2, expert_dim = 192 }] }` makes two arms, named by their fields. `cross` trains every arm
(grid or [[arm]]) at each of its values, and the report reads each arm at its best value, chosen on the
same validation loss (with the choice's own noise: the best against the next), and the named pairs, which
may then name the arms as the file defines them, at each one's best.

    [[arm]]                          # and/or arms named by hand, each with its own fields
    name = "dense"
    n_experts = 0

`nanollama4 sweep FILE` trains the arms seed by seed, each seed's arms one after the other (so a slow
stretch of the machine falls on every arm alike), into OUT/runs/ARM-seedS (`arms`: one rule from a name to
its folder). Run again into the same folder, it continues: a finished arm is read back, an interrupted one
resumes exactly. Everything about the arms and their folders is checked before anything trains (`Sweep.check`,
`check_runs`): a mistake found after hours of training costs those hours. Each arm is scored by its full
validation loss (every validation token); the report (`sweep_report`) is a table per arm and, per named
pair, the per-seed differences, their mean with a 95% t-interval and the reading (better / worse / tie /
undecided: `experiments.common.PairedTest`).

The experiments of docs/experiments.md are sweep files in this package (experiments/NAME.toml) run by the
same machinery; the file's `experiment` names the module that measures more and writes their tables.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.config import ModelConfig, TrainConfig, config_of, parse_duration, preset, split_overrides
from ..base.configfile import TABLES, VOCAB_NOTE, ConfigFile, _toml_value, check_value, flat_table, read_config_file
from ..base.errors import ConfigError, Nanollama4Error, TrainingError
from ..base.files import atomic_write, read_json
from ..base.parts import declared_hint
from ..training.runs import fit_seq_len
from . import arms as folders
from . import common
from .common import TINY_SCORE_TOKENS
from .sweep_report import report

DEFAULT_PRESET = "shakespeare-char"  # as `nanollama4 train`'s
EXPERIMENT_MODULES = sorted(p.stem for p in Path(__file__).parent.glob("*.toml"))  # each has its NAME.py
SWEEP_KEYS = {"title", "seeds", "max_steps", "max_time", "grid", "cross", "pairs", "baseline", "gate", "always",
              "experiment", "score_tokens", "tiny", "time_steps"}
TIME_ROUNDS = 5  # [sweep] time_steps: each arm timed this many turns, the arms in turn (A B C A B C ...)
MAX_RUNS = 1_000  # arms x seeds: counted before a grid is expanded, so a typo of 10^9 combinations is one line


@dataclass(frozen=True)
class Arm:
    """One way of training: its name and the fields it changes over the file's [model] and [train]."""

    name: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    base: str = ""  # with [sweep] cross: the arm as the file defines it, which this one trains at `crossed`
    crossed: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The arm as results.json and the started-sweep record hold it (base and crossed only when crossed)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v or k in ("name", "model", "train")}


@dataclass
class Sweep:
    """A sweep file, checked: the base settings, the arms, the seeds and budget, and how to read them."""

    path: Path
    title: str
    base: ConfigFile
    arms: list[Arm]
    seeds: tuple[int, ...]
    max_steps: int | None
    max_time: float | None
    pairs: list[tuple[str, str]]  # (arm, against): arm minus against, seed by seed
    gate: float | None = None  # arms not in `always` get the later seeds only when within gate x the spread
    always: tuple[str, ...] = ()
    experiment: str | None = None  # a module of nanollama4.experiments that measures more and reports
    score_tokens: int | None = None  # score each arm on the first this many validation tokens (None: all)
    time_steps: int | None = None  # after training, time each arm's step interleaved, this many steps a turn
    tiny_fields: Arm = field(default_factory=lambda: Arm("--tiny"))  # [sweep] tiny: what --tiny sets, where set

    @property
    def baseline(self) -> str:
        return self.pairs[0][1] if self.pairs else self.arms[0].name

    def configs(self, arm: Arm, tiny: bool = False) -> tuple[ModelConfig, TrainConfig]:
        """The arm's ModelConfig and TrainConfig (without seed and budget), seq_len resolved as `train` resolves
        it (none: the model's max_seq_len), so that what counts the arm's tokens never meets a None.

        `tiny`: the smoke-test scale. A file that leaves seq_len to the model keeps it so, the tiny model's
        context being TINY_TRAIN's window: --tiny then takes the path the full sweep takes. The file's [sweep]
        tiny (`tiny_fields`) replaces, at that scale, each of its fields wherever it is set (by [model], [train],
        the arm or TINY_TRAIN): `tiny = { seq_len = 32, attention_chunk_size = 8 }` keeps chunks shorter than the
        window on the arms that chunk, and leaves an arm that does not unchunked."""
        train = {**self.base.train, **arm.train}
        fields = {**self.base.model, **arm.model}
        window = train.get("seq_len")
        if tiny:
            train.update({k: v for k, v in TINY_TRAIN.items() if k != "seq_len" or window is not None})
            train.update({k: v for k, v in self.tiny_fields.train.items() if k in train})
            fields.update({k: v for k, v in self.tiny_fields.model.items() if k in fields})
        try:
            model = preset(self.base.preset or DEFAULT_PRESET, **fields)
            if tiny:
                model = common.tiny_model(model)
                model = model if window is not None else model.replace(max_seq_len=TINY_TRAIN["seq_len"])
            tc = fit_seq_len(TrainConfig.from_dict(train), model)
        except (ConfigError, TrainingError) as e:
            raise ConfigError(f"{self.path}: arm {folders.shown(arm.name)}: {e}") from None
        return model, tc

    def run_configs(self, arm: Arm, seed: int, tiny: bool = False) -> tuple[ModelConfig, TrainConfig]:
        """The configs `arm` trains with on `seed`: its own, with the seed and the sweep's budget."""
        model, tc = self.configs(arm, tiny)
        tc = tc.replace(seed=seed, max_steps=self.max_steps, max_time=self.max_time)
        if self.max_steps:
            tc = tc.replace(warmup_steps=min(tc.warmup_steps, self.max_steps))
        return model, tc

    def check(self, tiny: bool = False) -> None:
        """What the arms and their folders must be with these seeds, before anything trains: at most MAX_RUNS
        runs, names that map to folders of their own (`arms.check_names`), every arm's configs valid (at the
        smoke-test scale with `tiny`)."""
        check_size(self.path, len(self.arms), len(self.seeds))
        folders.check_names(str(self.path), [a.name for a in self.arms], self.seeds)
        for arm in self.arms:
            self.configs(arm, tiny)

    def to_dict(self) -> dict[str, Any]:
        """What a rerun into the same folder must match to continue it (JSON)."""
        return json.loads(json.dumps({"path": str(self.path.resolve()), "title": self.title, "preset": self.base.preset,
                                      "model": self.base.model, "train": self.base.train, "data": self.base.data,
                                      "arms": [a.to_dict() for a in self.arms], "seeds": self.seeds,
                                      "max_steps": self.max_steps, "max_time": self.max_time, "pairs": self.pairs,
                                      "gate": self.gate, "always": self.always, "experiment": self.experiment,
                                      **({"tiny": dataclasses.asdict(self.tiny_fields)}
                                         if self.tiny_fields.model or self.tiny_fields.train else {}),
                                      **({"time_steps": self.time_steps} if self.time_steps else {})}))


# the smoke-test scale of `--tiny`: a few steps of tiny windows, one validation; numbers that mean nothing
TINY_TRAIN = dict(batch_size=2, seq_len=16, eval_interval=3, eval_batches=1, warmup_steps=1)
TINY_STEPS = 3


# ---------------------------------------------------------------------------------------------- reading
def read_sweep(path: str | Path) -> Sweep:
    """The sweep file at `path`, every key checked; one ConfigError line naming the file and key otherwise."""
    base = read_config_file(path, extra=("sweep", "arm"), homes={key: "sweep" for key in SWEEP_KEYS})
    path = base.path
    table = base.extra.get("sweep")
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: a sweep file needs a [sweep] table (seeds, a budget, the grid or [[arm]]s)")
    unknown = sorted(set(table) - SWEEP_KEYS)
    if unknown:
        raise ConfigError(f"{path}: [sweep] has no key {unknown[0]!r}; it takes {', '.join(sorted(SWEEP_KEYS))}")
    seeds = table.get("seeds", [0, 1, 2])
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                      for s in seeds) and len(set(seeds)) == len(seeds)):
        raise ConfigError(f"{path}: [sweep] seeds = {_toml_value(seeds)} takes a list of distinct whole numbers")
    arms = _arms(path, base.extra.get("arm", []), table.get("grid", {}), len(seeds))
    bases = [a.name for a in arms]
    cross = table.get("cross", {})
    if cross:
        if table.get("gate") is not None:
            raise ConfigError(f"{path}: [sweep] gate and cross do not go together (an arm's first seed at one value "
                              "cannot gate its others); leave one out")
        arms = _crossed(path, arms, cross, len(seeds))
    names = [a.name for a in arms]
    known = names + (bases if cross else [])  # with cross, pairs may name the file's arms (read at their best)
    max_steps, max_time = table.get("max_steps"), table.get("max_time")
    if (max_steps is None) == (max_time is None):
        raise ConfigError(f"{path}: [sweep] takes one budget per arm: max_steps = N or max_time = \"5m\"")
    if max_steps is not None and not (isinstance(max_steps, int) and not isinstance(max_steps, bool)
                                      and max_steps > 0):
        raise ConfigError(f"{path}: [sweep] max_steps = {_toml_value(max_steps)} takes a positive whole number")
    if max_time is not None:
        try:
            max_time = parse_duration(str(max_time)) if not isinstance(max_time, bool) else math.nan
        except ConfigError as e:
            raise ConfigError(f"{path}: [sweep] max_time: {e}") from None
    pairs = table.get("pairs")
    if pairs is None:
        listed = bases if cross else names
        first = table.get("baseline", listed[0])
        pairs = [[n, first] for n in listed if n != first]
    if not (isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 for p in pairs)):
        raise ConfigError(f"{path}: [sweep] pairs = {_toml_value(pairs)} takes a list of [arm, against] pairs")
    for name in [n for p in pairs for n in p] + list(table.get("always", [])) + [table.get("baseline", known[0])]:
        if name not in known:
            raise ConfigError(f"{path}: [sweep] names the arm {name!r}, which the file does not define; its arms "
                              f"are: {', '.join(known)}")
    gate = table.get("gate")
    if gate is not None and not (isinstance(gate, (int, float)) and not isinstance(gate, bool) and gate > 0):
        raise ConfigError(f"{path}: [sweep] gate = {_toml_value(gate)} takes a positive number")
    score_tokens = table.get("score_tokens")
    if score_tokens is not None and not (isinstance(score_tokens, int) and not isinstance(score_tokens, bool)
                                         and score_tokens > 0):
        raise ConfigError(f"{path}: [sweep] score_tokens = {_toml_value(score_tokens)} takes a positive whole number "
                          "(validation tokens each arm is scored on; leave it out for all of them)")
    time_steps = table.get("time_steps")
    if time_steps is not None and not (isinstance(time_steps, int) and not isinstance(time_steps, bool)
                                       and 0 < time_steps <= 1000):
        raise ConfigError(f"{path}: [sweep] time_steps = {_toml_value(time_steps)} takes a whole number of steps, 1 to "
                          "1,000 (each arm's training step timed that many steps a turn, the arms in turn)")
    tiny = table.get("tiny", {})
    if not isinstance(tiny, dict):
        raise ConfigError(f"{path}: [sweep] tiny = {_toml_value(tiny)} takes a table of [model] or [train] fields "
                          "that --tiny sets where the file sets them, e.g. tiny = { seq_len = 32 }")
    title = table.get("title", path.stem)
    experiment = table.get("experiment")
    if experiment is not None and experiment not in EXPERIMENT_MODULES:
        raise ConfigError(f"{path}: [sweep] experiment = {_toml_value(experiment)} takes one of "
                          f"{', '.join(EXPERIMENT_MODULES)} (the experiments' modules)")
    sweep = Sweep(path=path, title=str(title), base=base, arms=arms, seeds=tuple(seeds), max_steps=max_steps,
                  max_time=max_time, pairs=[(a, b) for a, b in pairs], gate=gate,
                  always=tuple(table.get("always", ())), experiment=experiment,
                  score_tokens=score_tokens, time_steps=time_steps,
                  tiny_fields=_arm(path, "--tiny", tiny, "[sweep] tiny"))
    sweep.check()  # a bad arm or folder fails now, not after the first arms have trained
    return sweep


def check_size(path: Path, n_arms: int, n_seeds: int) -> None:
    """Refuse a sweep of more than MAX_RUNS runs, naming their number."""
    if n_arms * n_seeds > MAX_RUNS:
        raise ConfigError(f"{path}: the sweep makes {n_arms:,} arms x {n_seeds} seed{'s' * (n_seeds > 1)} = "
                          f"{n_arms * n_seeds:,} runs; a sweep takes at most {MAX_RUNS:,}: shorten the grid's lists "
                          "or split the sweep")


def _arms(path: Path, listed: Any, grid: Any, n_seeds: int) -> list[Arm]:
    """The [[arm]] tables, then the grid's combinations (named "key=value key=value"), counted before they are
    made (`check_size`)."""
    if not isinstance(listed, list) or not all(isinstance(a, dict) for a in listed):
        raise ConfigError(f"{path}: arms are tables: [[arm]] with a name and the fields it changes")
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError(f"{path}: [sweep] grid takes lists of values, e.g. grid = {{ n_experts = [4, 8] }}, or of "
                          "tables of fields set together")
    check_size(path, len(listed) + (math.prod(len(v) for v in grid.values()) if grid else 0), n_seeds)
    arms = []
    for i, table in enumerate(listed):
        table = dict(table)
        name = table.pop("name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{path}: [[arm]] number {i + 1} needs a name = \"...\"")
        arms.append(_arm(path, name, table))
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)) if keys else ():
        fields: dict[str, Any] = {}
        for key, value in zip(keys, values, strict=True):  # a table: fields set together (the key only labels it)
            for k, v in (value.items() if isinstance(value, dict) else [(key, value)]):
                if k in fields:
                    raise ConfigError(f"{path}: [sweep] grid sets {k!r} twice in one arm; set each field once")
                fields[k] = v
        arms.append(_arm(path, " ".join(f"{k}={_plain(v)}" for k, v in fields.items()), fields))
    if not arms:
        raise ConfigError(f"{path}: the sweep has no arms; add [[arm]] tables or a [sweep] grid")
    names = [a.name for a in arms]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ConfigError(f"{path}: two arms are named {folders.shown(twice)}; give each arm its own name")
    return arms


def _crossed(path: Path, arms: list[Arm], cross: Any, n_seeds: int) -> list[Arm]:
    """Every arm at every combination of [sweep] cross's values ("ARM lr=0.002"), counted first."""
    if not isinstance(cross, dict) or not all(isinstance(v, list) and v for v in cross.values()):
        raise ConfigError(f"{path}: [sweep] cross takes lists of values, e.g. cross = {{ lr = [1e-3, 2e-3, 4e-3] }}")
    check_size(path, len(arms) * math.prod(len(v) for v in cross.values()), n_seeds)
    keys, out = list(cross), []
    for arm in arms:
        both = [k for k in keys if k in arm.model or k in arm.train]
        if both:
            raise ConfigError(f"{path}: arm {folders.shown(arm.name)} sets {both[0]!r}, which [sweep] cross varies; "
                              "leave it to cross")
        for values in itertools.product(*(cross[k] for k in keys)):
            fields = dict(zip(keys, values, strict=True))
            tuned = _arm(path, arm.name, fields, "[sweep] cross")
            name = f"{arm.name} " + " ".join(f"{k}={_plain(v)}" for k, v in fields.items())
            out.append(Arm(name, {**arm.model, **tuned.model}, {**arm.train, **tuned.train}, base=arm.name,
                           crossed=fields))
    return out


def _plain(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


NOT_PER_ARM = {"seed": "the seeds are [sweep] seeds (or --seeds)", "vocab_size": VOCAB_NOTE,
               "max_steps": "the budget is [sweep]'s", "max_time": "the budget is [sweep]'s"}


def _arm(path: Path, name: str, values: dict[str, Any], what: str | None = None) -> Arm:
    """An arm's fields, each put in the table it belongs to and checked against its declaration (`what`: the
    table's name in errors, if not "arm NAME")."""
    model, train = {}, {}
    where = f"{path}: {what or f'arm {folders.shown(name)}'}"
    for key, value in flat_table(values):  # a kind's own settings as "muon.lr" (TOML: muon.lr = 0.01)
        owner = config_of(key)
        table = next((t for t, cls in TABLES.items() if cls is owner), None)
        if table is None or key in NOT_PER_ARM:
            why = NOT_PER_ARM.get(key, "no such field in [model] or [train]")
            raise ConfigError(f"{where} sets {key!r}: {why}")
        try:
            hint = declared_hint(TABLES[table], key)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        checked = check_value(where, key, value, hint)
        (model if table == "model" else train)[key] = checked
    return Arm(name, model, train)


# ---------------------------------------------------------------------------------------------- running
def run_sweep(sweep: Sweep, out: str | Path, progress: bool = True, tiny: bool = False,
              seeds: tuple[int, ...] | None = None, max_steps: int | None = None) -> list[Path]:
    """Train the sweep's arms into folder `out` (new, empty, or an unfinished run of the same sweep), then
    write results.json, table.md and the plot (an experiment's own, when the file names one). Returns the
    paths written. `tiny`, `seeds` and `max_steps` replace the file's (the smoke-test scale; fewer seeds)."""
    if seeds:
        sweep = dataclasses.replace(sweep, seeds=tuple(seeds))
    if tiny:
        sweep = dataclasses.replace(sweep, max_steps=TINY_STEPS, max_time=None, score_tokens=TINY_SCORE_TOKENS)
    elif max_steps:
        sweep = dataclasses.replace(sweep, max_steps=max_steps, max_time=None)
    sweep.check(tiny)  # other seeds: other folder names and another count of runs
    out = Path(out)
    start_folder(out, {"sweep": sweep.to_dict(), "tiny": tiny})
    check_runs(sweep, out, tiny)
    if progress:
        print(f"{sweep.title}: {len(sweep.arms)} arms x {len(sweep.seeds)} seeds = "
              f"{len(sweep.arms) * len(sweep.seeds)} runs, in {out / 'runs'}", flush=True)
    if sweep.experiment is not None:
        from importlib import import_module

        module = import_module(f".{sweep.experiment}", __package__)
        return module.run(out, sweep, train_arms(sweep, out, progress, tiny), progress, tiny)
    results = train_arms(sweep, out, progress, tiny)
    timed = {"timed": time_arms(sweep, out, tiny, progress)} if sweep.time_steps else {}
    return [common.save(out, "sweep", setting_of(sweep, tiny), results, {"sweep": sweep.to_dict(), **timed}),
            *report(out)]


def time_arms(sweep: Sweep, out: Path, tiny: bool = False, progress: bool = True) -> dict[str, list[float]]:
    """Each arm's training tokens/s, timed as benchmarks/moe_compute.py times models: every arm built once (seed
    0, its own configs), warmed up, then TIME_ROUNDS turns of `time_steps` steps each, the arms in turn (A B C
    A B C ...), so that a slow minute of the machine falls on every arm alike. {arm: tokens/s per turn}.

    The training runs' own tokens/s (the table's) were each measured in its own minutes: on a shared machine
    the same arm read 2,303 and 3,501 tokens/s on two seeds."""
    import tempfile
    import time as clock

    from ..training.runsetup import start_run
    from ..training.train import read_step, train_step

    runs = {}
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        for arm in sweep.arms:
            model, tc = sweep.run_configs(arm, sweep.seeds[0], tiny)
            run = start_run(model, tc, Path(scratch) / folders.folder_name(arm.name), data_path(sweep), None)
            read_step(run, train_step(run, 1.0))  # first-call allocations and kernel builds: not timed
            runs[arm.name] = run
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for turn in range(TIME_ROUNDS):
            for name, run in runs.items():
                start = clock.perf_counter()
                for _ in range(sweep.time_steps):
                    read_step(run, train_step(run, 1.0))
                rates[name].append(sweep.time_steps * run.tc.batch_size * run.tc.seq_len * run.tc.grad_accum
                                   / (clock.perf_counter() - start))
            if progress:
                print(f"timing the arms in turn: {turn + 1} of {TIME_ROUNDS} turns", flush=True)
    return rates


def train_arms(sweep: Sweep, out: Path, progress: bool = True, tiny: bool = False) -> list[Any]:
    """Every arm with every seed, seed by seed (each seed's arms one after the other), as `ArmResult`s.

    With a gate, the first seed trains every arm; later seeds train the baseline and the `always` arms, and
    the others only when their first-seed difference from the baseline is within gate x the baseline's
    seed-to-seed spread over the first two seeds (the baseline trains first in each seed): a difference far
    past the noise needs no interval to be read."""
    results: list[common.ArmResult] = []
    base, gated_out = sweep.baseline, set()
    order = sorted(sweep.arms, key=lambda a: a.name != base)  # the baseline first: its spread gates the others
    for i, seed in enumerate(sweep.seeds):
        for arm in order:
            if i == 1 and sweep.gate and arm.name != base and arm.name not in sweep.always:
                diff, tie = common.paired(results, arm.name, base), common.spread(results, base)
                if diff and not math.isnan(tie) and abs(diff[0]) > sweep.gate * tie:
                    gated_out.add(arm.name)
            if arm.name in gated_out:
                continue
            model, tc = sweep.run_configs(arm, seed, tiny)
            results.append(common.train_run(arm.name, model, tc, out, progress, data_path(sweep),
                                            sweep.score_tokens))
    return results


def check_runs(sweep: Sweep, out: Path, tiny: bool = False) -> None:
    """Every arm's run folder, before anything trains: empty, or the arm's own run (`arms.check_run`)."""
    for seed in sweep.seeds:
        for arm in sweep.arms:
            model, tc = sweep.run_configs(arm, seed, tiny)
            folders.check_run(out, arm.name, model, tc, arm.train)


def with_command_line(sweep: Sweep, data: str | None = None, sets: Sequence[str] = ()) -> Sweep:
    """The sweep with --data and --set KEY=VALUE over the file's data, [model] and [train], as `train
    --config` takes them (command line > file > preset > defaults), every arm checked again. Refused: a field
    an arm sets (the command line changes what every arm starts from; over an arm's own value it would make
    the arms that differ in it alike), the seed, the budget and vocab_size (as in an arm)."""
    model_over, train_over = split_overrides(list(sets))
    for key in [*model_over, *train_over]:
        if key in NOT_PER_ARM:
            raise ConfigError(f"--set {key}: {NOT_PER_ARM[key]}")
        setter = next((a for a in sweep.arms if key in a.model or key in a.train), None)
        if setter is not None:
            raise ConfigError(f"--set {key}: arm {folders.shown(setter.name)} of {sweep.path} sets {key} itself, and "
                              "a --set changes what every arm starts from; change the arms in the file")
    base = dataclasses.replace(sweep.base, model={**sweep.base.model, **model_over},
                               train={**sweep.base.train, **train_over},
                               data=sweep.base.data if data is None else str(Path(data).expanduser().absolute()))
    sweep = dataclasses.replace(sweep, base=base)
    sweep.check()
    return sweep


def data_path(sweep: Sweep) -> str | None:
    """The corpus, a path in the file taken relative to the file."""
    return sweep.base.corpus()


def setting_of(sweep: Sweep, tiny: bool = False) -> Any:
    """The sweep as an experiment's `Setting` (what results.json records and the reports read)."""
    _, tc = sweep.configs(Arm("base"), tiny)
    return common.Setting(steps=sweep.max_steps, batch_size=tc.batch_size, seq_len=tc.seq_len,
                   eval_interval=tc.eval_interval, eval_batches=tc.eval_batches, data=data_path(sweep),
                   seeds=sweep.seeds, tiny=tiny)


def start_folder(out: Path, started: dict) -> None:
    """Make `out` the folder of a sweep or experiment: new or empty (then `started` is written there), or the
    folder of an unfinished run of the same one (`started` equal to what it holds); refused otherwise."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a new or empty folder")
    started = json.loads(json.dumps(started))
    if out.is_dir() and any(out.iterdir()):
        if (out / "results.json").exists():
            raise ConfigError(f"{out} already holds results; pass a new or empty --out (experiments and sweeps "
                              "never overwrite)")
        if not (out / STARTED).exists() or _started(out) != started:
            raise ConfigError(f"{out} is not empty and not an unfinished run of this experiment or sweep with these "
                              "options; pass a new or empty --out (or the same options as the interrupted run)")
    else:  # what a rerun into this folder must match to continue it
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / STARTED, lambda tmp: Path(tmp).write_text(json.dumps(started, indent=1) + "\n"))


STARTED = "sweep.json"  # written when a sweep starts: the sweep and its options


def _started(out: Path) -> dict | None:
    try:
        return read_json(out / STARTED)
    except Nanollama4Error:
        return None
