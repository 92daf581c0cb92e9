"""What every experiment shares: the setting (how long each arm trains), training one arm through the
ordinary training loop, reading its metrics back, the results file, tables and plots.

An *arm* is one model trained one way. Each arm is a normal run directory (`OUT/runs/ARM-seedS`), so any
of them can be inspected with `nanollama4 generate`, `eval` or `plot` afterwards.

Just over 400 lines: the arm runner and the results file are what every experiment module imports, and
they belong together.
"""

from __future__ import annotations

import json
import math
import textwrap
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from ..base.config import ModelConfig, TrainConfig
from ..base.errors import CheckpointError
from ..base.files import atomic_write, read_json
from ..interop.checkpoint import load_train_state, read_model_config, resolve_checkpoint
from ..model.memory import ParamCounts, param_counts
from ..model.tokenizer import CHAR_KIND
from ..reports.plots import read_metrics, save_png
from ..training.evaluation import full_validation_loss_of_run, read_full_validation, record_full_validation
from ..training.runs import fit_seq_len, is_run_dir, resume_config
from ..training.train import train
from .arms import arm_run_dir


@dataclass(frozen=True)
class Setting:
    """How big and how long: the same for every arm of an experiment, so that they compare."""

    steps: int | None = None  # optimizer steps per arm; None = the experiment's own STEPS
    batch_size: int = 16
    seq_len: int = 128
    eval_interval: int = 50  # validation points along the curve
    eval_batches: int = 8
    data: str | None = None  # corpus; None = Shakespeare's works
    seeds: tuple[int, ...] = (0, 1, 2)  # three seeds: the least that gives a paired interval of use
    tiny: bool = False  # a smoke-test scale (seconds), for the test suite: scores TINY_SCORE_TOKENS tokens

    @classmethod
    def chosen(cls, data: str | None = None, tiny: bool = False, steps: int | None = None,
               seeds: tuple[int, ...] | None = None) -> Setting:
        """The setting `nanollama4 experiment` asks for: full or tiny scale, with steps and seeds replaced
        where given (validation points no further apart than the run is long); no seeds given, () = the
        experiment file's own."""
        setting = cls.tiny_scale(data) if tiny else cls(data=data)
        if steps:
            setting = replace(setting, steps=steps, eval_interval=min(setting.eval_interval, steps))
        return replace(setting, seeds=seeds or ())

    @classmethod
    def tiny_scale(cls, data: str | None = None) -> Setting:
        """The smoke-test scale: seconds per experiment, numbers that mean nothing."""
        return cls(steps=3, batch_size=2, seq_len=16, eval_interval=3, eval_batches=1, data=data, tiny=True)

    @property
    def tokens_per_step(self) -> int:
        """Training characters (tokens) per optimizer step."""
        return self.batch_size * self.seq_len


def tiny_model(cfg: ModelConfig) -> ModelConfig:
    """The same layout at smoke-test size (the arm's routing and attention options kept)."""
    return cfg.replace(d_model=32, n_layers=min(cfg.n_layers, 4), head_dim=8,
                       ffn_dim=96, expert_dim=cfg.expert_dim * 48 // 192 or 16,
                       shared_expert_dim=cfg.shared_expert_dim and (cfg.shared_expert_dim * 48 // 192 or 16))


@dataclass
class ArmResult:
    """One trained arm: its curve (validation loss at each evaluation) and final numbers."""

    name: str
    seed: int
    run_dir: str
    params_total: int
    params_active: int
    steps: int
    seconds: float  # time in training steps only (the sum of the logged step times: no evaluations, no saving)
    tokens_per_s: float  # training tokens over `seconds`
    full_val_loss: float  # every validation token, in windows of the training length
    val_curve: list[dict[str, float]] = field(default_factory=list)  # {"step", "tokens", "time", "val_loss"}
    expert_load: list[list[list[float]]] = field(default_factory=list)  # per logged step: layers x experts

    @property
    def tokens(self) -> int:
        """Training tokens seen: what a time budget lets differ between arms (and the machine's load with it)."""
        return round(self.tokens_per_s * self.seconds)


TINY_SCORE_TOKENS = 4096  # validation tokens a --tiny arm is scored on (the full split takes minutes)


def train_run(name: str, cfg: ModelConfig, tc: TrainConfig, out: Path, progress: bool = True,
              data: str | None = None, max_tokens: int | None = None) -> ArmResult:
    """Train arm `name` with TrainConfig `tc` (its seed and budget, of steps or time, included) in
    OUT/runs/FOLDER-seedS (`arms.run_folder`) and read back what it logged, scored on `max_tokens` validation
    tokens (None: all). A run directory already there is continued: read back when its budget is spent,
    resumed exactly when it was interrupted. Sweeps and experiments train every arm through this.
    seq_len None is the model's context, as `train` reads it: resolved first, since the arm's tokens per step
    are counted here too."""
    tc = fit_seq_len(tc, cfg)
    run_dir = arm_run_dir(out, name, tc.seed)
    state = run_progress(run_dir)
    done = state is not None and bool((tc.max_steps and state["step"] >= tc.max_steps)
                                      or (tc.max_time and state["elapsed"] >= tc.max_time))
    if progress:
        note = "" if state is None else " (finished)" if done else f" (continuing from step {state['step']})"
        print(f"- {name} (seed {tc.seed}){note}", flush=True)
    if state is None:
        result = train(cfg, tc, run_dir, data=data, progress=progress)
    elif not done:  # an interrupted arm: its run resumes exactly where it stopped
        budget = {"max_steps": tc.max_steps} if tc.max_steps else {"max_time": tc.max_time}
        result = train(None, resume_config(run_dir, **budget), run_dir, data=data, resume=True, progress=progress)
    else:
        result = None
    if result is not None and result.interrupted:  # Ctrl-C or SIGTERM stops the whole experiment, not just this arm
        raise KeyboardInterrupt
    return read_arm(name, tc.seed, run_dir, tc.batch_size * tc.grad_accum * tc.seq_len, max_tokens=max_tokens)


def run_progress(run_dir: Path) -> dict[str, float] | None:
    """The step and elapsed seconds of a run directory's last checkpoint, or None when there is none (no
    run, or one that stopped before its first checkpoint, which starts afresh)."""
    if not is_run_dir(run_dir) or not (run_dir / "last").exists():
        return None
    state, _ = load_train_state(resolve_checkpoint(run_dir, prefer="last"))
    return {"step": int(state["step"]), "elapsed": float(state.get("elapsed", 0.0))}


def finished_steps(run_dir: Path) -> int | None:
    """The step of a run directory's last checkpoint, or None when there is none."""
    state = run_progress(run_dir)
    return None if state is None else int(state["step"])


def arm_names(doc: dict[str, Any]) -> list[str]:
    """The arms of a results.json in the order its sweep file lists them."""
    return [a["name"] for a in doc["sweep"]["arms"]]


def read_arm(name: str, seed: int, run_dir: Path, tokens_per_step: int, full_val_loss: float | None = None,
             max_tokens: int | None = None) -> ArmResult:
    """An ArmResult from a finished run directory (its metrics.jsonl and last checkpoint); the full
    validation loss is measured unless given (on the first `max_tokens` validation tokens when given).

    The clock is rebuilt from the steps' own logged times: the loop's clock also runs through every
    validation and checkpoint write, which take longer for a model with more parameters, and would
    charge that to the MoE arms whose speed is being measured.
    """
    if full_val_loss is None:
        loss = scored_loss(run_dir, max_tokens)
    else:
        loss = full_val_loss
    train_rows, val_rows = read_metrics(run_dir / "metrics.jsonl")
    clock, seconds = {}, 0.0  # step -> seconds spent in training steps up to and including it
    for row in train_rows:
        seconds += tokens_per_step / row["tokens_per_s"]
        clock[row["step"]] = seconds
    curve = [{"step": v["step"], "tokens": v["step"] * tokens_per_step, "time": clock.get(v["step"], 0.0),
              "val_loss": v["val_loss"]} for v in val_rows]
    load = [row["expert_load"] for row in train_rows if isinstance(row.get("expert_load"), list)]
    steps = train_rows[-1]["step"] if train_rows else 0
    counts = param_counts(read_model_config(resolve_checkpoint(run_dir)))  # with the tokenizer's vocabulary
    return ArmResult(name=name, seed=seed, run_dir=str(run_dir), params_total=counts.total,
                     params_active=counts.active, steps=steps, seconds=seconds,
                     tokens_per_s=steps * tokens_per_step / max(seconds, 1e-9), full_val_loss=loss, val_curve=curve,
                     expert_load=load)


def scored_loss(run_dir: Path, max_tokens: int | None) -> float:
    """The run's full validation loss at its last checkpoint: the one RUN/evaluation.json recorded for that
    checkpoint, else measured and recorded there (so that a rerun or `compare` need not measure it again).
    With `max_tokens` (score_tokens, a smoke test's sample) measured on that many tokens, and recorded as
    such: `compare` shows how many tokens it covers, and only the same sample is read back for it."""
    ckpt = resolve_checkpoint(run_dir, prefer="last")
    kept = read_full_validation(run_dir)
    if kept is not None and kept["checkpoint"] == ckpt.name and kept.get("max_tokens") == max_tokens:
        return float(kept["full_val_loss"])
    loss, n_tokens, window = full_validation_loss_of_run(run_dir, prefer="last", max_tokens=max_tokens)
    record_full_validation(run_dir, ckpt, loss, n_tokens, window, max_tokens=max_tokens)
    return loss


def spread(results: Sequence[ArmResult], name: str) -> float:
    """The seed-to-seed spread of arm `name`: the largest minus the smallest full validation loss over its
    seeds; nan with one seed (then nothing can be called better or worse). Differences between arms up to
    this are ties."""
    losses = [r.full_val_loss for r in results if r.name == name]
    return max(losses) - min(losses) if len(losses) > 1 else math.nan


def largest_spread(results: Sequence[ArmResult]) -> tuple[float, list[str]]:
    """The largest seed-to-seed spread over the arms trained with more than one seed (nan if none), and
    those arms' names: the tie threshold of a table."""
    names = list(dict.fromkeys(r.name for r in results))
    repeated = [n for n in names if len({r.seed for r in results if r.name == n}) > 1]
    return max((spread(results, n) for n in repeated), default=math.nan), repeated


def format_spread(tie: float) -> str:
    """The tie threshold as a table states it: a number, or why there is none (one seed: not measured)."""
    return "not measured (one seed, so no difference is called)" if math.isnan(tie) else f"{tie:.4f}"


def versus(diffs: Sequence[float]) -> str:
    """Per-seed differences as text ('-' for none)."""
    return ", ".join(f"{d:+.4f}" for d in diffs) if diffs else "-"


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def loss_at(curve: Sequence[dict[str, float]], key: str, x: float) -> float:
    """The validation loss of a curve at tokens or time `x` (key "tokens" or "time"), linearly between
    its evaluations; nan outside it."""
    for a, b in zip(curve, curve[1:], strict=False):
        if a[key] <= x <= b[key]:
            f = 0.0 if b[key] == a[key] else (x - a[key]) / (b[key] - a[key])
            return a["val_loss"] + f * (b["val_loss"] - a["val_loss"])
    return curve[-1]["val_loss"] if curve and math.isclose(curve[-1][key], x) else math.nan


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats with 4 decimals (thousands separated from 100 up)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def save(out: Path, experiment: str, setting: Setting, results: Sequence[ArmResult],
         extra: dict[str, Any] | None = None) -> Path:
    """OUT/results.json: the setting, every arm with its curve, and what else the experiment measured;
    `report` functions build the tables and plots from it alone, so that they can be redrawn."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"experiment": experiment, "date": time.strftime("%Y-%m-%d %H:%M"), "setting": asdict(setting),
           "arms": [asdict(r) for r in results], **(extra or {})}
    path = out / "results.json"
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1)))
    return path


def load_results(out: Path) -> tuple[dict[str, Any], list[ArmResult]]:
    """OUT/results.json, and its arms as ArmResults."""
    doc = read_json(out / "results.json")
    try:
        return doc, [ArmResult(**a) for a in doc["arms"]]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{out / 'results.json'} is not an experiment's results ({e}); run the experiment "
                              "again into a new folder") from None


def write_table(out: Path, table: str) -> Path:
    """OUT/table.md."""
    path = out / "table.md"
    atomic_write(path, lambda tmp: Path(tmp).write_text(table + "\n"))
    return path


def paired(results: Sequence[ArmResult], name: str, base: str) -> list[float]:
    """Arm `name` minus arm `base`, seed by seed (same seed: same initialisation and the same batches),
    over the seeds both have."""
    mine = {r.seed: r.full_val_loss for r in results if r.name == name}
    theirs = {r.seed: r.full_val_loss for r in results if r.name == base}
    return [mine[s] - theirs[s] for s in sorted(mine) if s in theirs]


EFFECT = 0.01  # nats per token: the smallest difference these experiments are sized to see (see PairedTest)
GATE = 3.0  # an arm skips the other seeds when its first seed's difference is GATE x the baseline's spread
# two-sided 95% quantiles of Student's t by degrees of freedom (n - 1 for n paired seeds)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclass(frozen=True)
class PairedTest:
    """An arm against its baseline, seed by seed: the differences (arm minus baseline, same seed: the same
    initialisation and the same batches, so most of the run-to-run noise cancels), their mean and its 95%
    t-interval, and what that allows one to say:

    - "better" / "worse": the interval excludes 0;
    - "tie (prints as zero)": it excludes 0 but its ends print as 0 at the table's precision (DIGITS):
      no direction is called on a difference nobody can see;
    - "tie": it straddles 0 and lies within +-EFFECT, so any difference is below what matters here;
    - "undecided": it straddles 0 but is wider than that: more seeds (or longer runs) are needed;
    - with fewer than 3 seeds no interval is drawn (with 2 the t quantile is 12.7: nothing is ever
      decided); a single seed is read only when the gate let it skip the others ("worse (one seed, ...)").
    """

    diffs: tuple[float, ...]
    mean: float
    low: float
    high: float
    reading: str

    @property
    def interval(self) -> str:
        """'mean [low, high]' or the mean alone when no interval was drawn."""
        if math.isnan(self.mean):
            return "-"
        return f"{self.mean:+.{DIGITS}f}" + ("" if math.isnan(self.low)
                                              else f" [{self.low:+.{DIGITS}f}, {self.high:+.{DIGITS}f}]")


DIGITS = 4  # decimals a loss difference is printed with
AS_ZERO = "tie (prints as zero)"  # the reading of an interval that excludes 0 but whose ends print as 0


def prints_as_zero(*values: float, digits: int = DIGITS) -> bool:
    """Whether every value prints as (+ or -) 0 with `digits` decimals, as the tables print it."""
    return all(float(f"{v:.{digits}f}") == 0 for v in values)


def paired_test(diffs: Sequence[float], effect: float = EFFECT, gated: float = math.nan,
                digits: int = DIGITS) -> PairedTest:
    """The paired reading of `diffs` (see PairedTest), printed with `digits` decimals: a direction is called
    only on a difference that prints as one. `gated`: the baseline spread against which a single-seed arm
    was let off the other seeds (nan if it was not)."""
    diffs = tuple(diffs)
    n = len(diffs)
    m = mean(diffs)
    if n < 3:
        gate_lets_off = n == 1 and not math.isnan(gated) and abs(diffs[0]) > GATE * gated
        if gate_lets_off and not prints_as_zero(m, digits=digits):
            side = "better" if diffs[0] < 0 else "worse"
            return PairedTest(diffs, m, math.nan, math.nan, f"{side} (one seed, over {GATE:g}x the spread)")
        return PairedTest(diffs, m, math.nan, math.nan, "-" if n == 0 else f"undecided ({n} seed{'s' * (n > 1)})")
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1))
    half = T95.get(n - 1, 1.96) * sd / math.sqrt(n)
    low, high = m - half, m + half
    if high < 0 or low > 0:
        reading = AS_ZERO if prints_as_zero(low, high, digits=digits) else "better" if high < 0 else "worse"
    else:
        reading = "tie" if max(-low, high) <= effect else "undecided"
    return PairedTest(diffs, m, low, high, reading)


def higher_or_lower(diffs: Sequence[float], effect: float, digits: int) -> str:
    """A paired difference of a quantity with no better side (accuracy points, bits): its mean and interval
    with `digits` decimals, read "higher", "lower", a tie within `effect`, or undecided ("-" where a seed has
    no value)."""
    if any(math.isnan(x) for x in diffs):
        return "-"
    test = paired_test(diffs, effect=effect, digits=digits)
    if math.isnan(test.low):  # too few seeds for an interval
        return f"{test.mean:+.{digits}f}"
    reading = {"better": "lower", "worse": "higher"}.get(test.reading, test.reading)
    return f"{test.mean:+.{digits}f} [{test.low:+.{digits}f}, {test.high:+.{digits}f}] {reading}"


def paired_reading(results: Sequence[ArmResult], name: str, base: str, effect: float = EFFECT) -> PairedTest:
    """`paired_test` of arm `name` against `base`, with the gate's spread for an arm left at one seed."""
    return paired_test(paired(results, name, base), effect, gated=spread(results, base))


def paired_cells(results: Sequence[ArmResult], name: str, base: str) -> list[str]:
    """An arm's three paired cells of a table row: its per-seed differences from `base`, their mean with
    the 95% interval, and the reading ("-", "-", "baseline" for the baseline itself)."""
    if name == base:
        return ["-", "-", "baseline"]
    test = paired_reading(results, name, base)
    return [versus(test.diffs), test.interval, test.reading]


def paired_note(first: int, base: str, effect: float = EFFECT) -> str:
    """The sentence under a table that says how its readings were made."""
    return (f"Readings are paired: each arm minus {base} on the same seed (same initialisation and batches), "
            "the mean difference and its 95% t-interval; better/worse when the interval excludes 0, a tie when "
            f"it lies within +-{effect} nats, undecided otherwise. Arms other than those trained on every seed "
            f"got the other seeds unless their seed-{first} difference exceeded {GATE:g}x {base}'s seed-to-seed "
            "spread over its first two seeds.")


def per_seed(results: Sequence[ArmResult], name: str) -> str:
    """Arm `name`'s full validation losses, seed by seed, as text."""
    return ", ".join(f"{r.full_val_loss:.4f}" for r in sorted(results, key=lambda r: r.seed) if r.name == name)


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.0) -> tuple[Figure, list[Any]]:
    """A figure of `ncols` side-by-side axes, drawn off-screen without pyplot (as plots.py draws), so that
    running an experiment never changes a caller's matplotlib backend."""
    fig = Figure(figsize=(width * ncols, height), layout="tight")
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def save_figure(fig: Figure, path: Path) -> Path:
    """Write the figure as a small PNG (80 dpi), atomically."""
    return save_png(fig, path, dpi=80)


def arm_counts(result: ArmResult) -> ParamCounts | int:
    """An arm's parameter counts by component, from its run's config; its active count alone where the run
    can no longer be read (a report redrawn from results.json elsewhere)."""
    try:
        return param_counts(read_model_config(resolve_checkpoint(Path(result.run_dir))))
    except (CheckpointError, OSError):
        return result.params_active


def loss_unit(results: Sequence[ArmResult]) -> str:
    """The validation loss's unit for a plot's axis: nats/char where every arm's run has a character tokenizer
    (the demo's), else nats/token (a BPE run's loss is per token; and a run that can no longer be read: a
    character is a token too, so that label is never wrong)."""
    for r in results:
        try:
            state = read_json(resolve_checkpoint(Path(r.run_dir)) / "tokenizer.json", limit=1 << 20)
        except (CheckpointError, OSError):
            return "nats/token"
        if state.get("kind") != CHAR_KIND:
            return "nats/token"
    return "nats/char"


def plot_curves(results: Sequence[ArmResult], path: Path, title: str) -> Path:
    """Validation loss against tokens seen and against time in training steps, one line per arm (its lowest
    seed solid, the others dotted in the same colour)."""
    fig, (by_tokens, by_time) = figure(2)
    colours: dict[str, Any] = {}
    for r in results:
        if not r.val_curve:
            continue
        style = "-" if r.seed == min(x.seed for x in results if x.name == r.name) else ":"
        xs_tok = [p["tokens"] for p in r.val_curve]
        xs_time = [p["time"] for p in r.val_curve]
        ys = [p["val_loss"] for p in r.val_curve]
        line, = by_tokens.plot(xs_tok, ys, style, marker=".", color=colours.get(r.name),
                               label=r.name if style == "-" else None)
        colours.setdefault(r.name, line.get_color())
        by_time.plot(xs_time, ys, style, marker=".", color=colours[r.name])
    later = [p["val_loss"] for r in results for p in r.val_curve[len(r.val_curve) // 4:]]
    quarter = [r.val_curve[len(r.val_curve) // 4]["val_loss"] for r in results if r.val_curve]
    if later:  # the later part of training, where the arms differ, fills the height
        for ax in (by_tokens, by_time):
            ax.set_ylim(min(later) - 0.03, max(max(quarter), min(later) + 0.1))
    # the title once over both panels: repeated on each, a long one ran into its neighbour
    fig.suptitle(textwrap.fill(title, 110))
    unit = loss_unit(results)
    by_tokens.set(xlabel="training tokens", ylabel=f"validation loss ({unit})", title="by tokens seen")
    by_time.set(xlabel="seconds in training steps", ylabel=f"validation loss ({unit})", title="by time")
    by_tokens.legend(fontsize=8)
    return save_figure(fig, path)
