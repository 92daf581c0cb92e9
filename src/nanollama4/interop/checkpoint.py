"""Training checkpoints: safetensors and JSON only, written atomically, resumed exactly.

A run directory looks like
    RUN_DIR/metrics.jsonl, plots/, step-0000500/, step-0001000/, last -> step-0001000, best -> step-0000500,
    run.lock (locked by the process training there; it also marks the folder as a run of ours)
Each step-* folder is complete on its own (model, config, tokenizer, optimizer, train state). It is
written under a temporary name, fsynced and renamed into place; `last` and `best` are symlinks swapped
with an atomic rename. A crash at any moment therefore leaves the previous checkpoint intact.

What in a run folder is ours to remove is decided in one place (`is_our_step`, `linked_steps`): a real
folder named `step-` + 7 digits that holds only checkpoint files, and that neither link resolves to
(however the link is spelled); our own temporary folders (`.tmp-step-NNNNNNN-*`). Nothing else there is
ever touched.

Over 400 lines on purpose: writing, resolving, validating and pruning checkpoints share the rules of what
a checkpoint folder is and what is ours to remove; one file keeps those rules in one place.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..base.config import ModelConfig
from ..base.errors import CheckpointError, MissingImport
from ..base.files import read_json, read_safetensors, safetensors_shapes, write_cause
from ..model.lora import ADAPTERS_FILE, load_adapters, save_adapters, split_state
from ..model.tokenizer import Tokenizer, load_tokenizer
from ..model.transformer import Transformer
from ..ops import install

LOCK_NAME = "run.lock"  # in every run directory: held by the process training there, names it
LINKS = ("last", "best")  # the run's symlinks to its checkpoints
STEP_NAME = re.compile(r"step-\d{7}")  # a checkpoint folder's name: f"step-{step:07d}"
TMP_NAME = re.compile(r"\.tmp-step-\d{7}-.+")  # what `_write_checkpoint`'s mkdtemp names
CHECKPOINT_FILES = frozenset({"model.safetensors", "config.json", "tokenizer.json", "optimizer.safetensors",
                              "optimizer.json", "train_config.json", "train_state.json",
                              ADAPTERS_FILE})
TensorOf = Callable[[torch.nn.Parameter, torch.Tensor], torch.Tensor]  # (parameter, its tensor) -> a tensor


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding a NaN or an infinity, else None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


# ---------------------------------------------------------------------------------------------- model + optimizer
def model_tensors(model: Transformer, whole: TensorOf | None = None) -> dict[str, torch.Tensor]:
    """The state dict without the tied LM head (safetensors stores each tensor once).

    `whole` (parameter, tensor) -> tensor gathers a parameter spread over ranks (see `optimizer_tensors`)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue
        if whole is not None and name in params:
            t = whole(params[name], t)
        tensors[name] = t.detach().contiguous()
    return tensors


def read_model_config(ckpt: Path) -> ModelConfig:
    """A checkpoint's config.json, as a validated ModelConfig (CheckpointError naming the file otherwise)."""
    try:
        return ModelConfig.from_dict(read_json(ckpt / "config.json"))
    except MissingImport as e:  # the folder, maybe downloaded, chose the name: say so
        raise CheckpointError(e.message(f"the checkpoint {ckpt}", "its config.json")) from None
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{ckpt / 'config.json'} describes an invalid model: {e}") from None


# Names that earlier versions wrote, and today's: the router's noise and balancing bias once sat on the MoE.
_RENAMED = [(re.compile(r"\.ffn\.noise\.weight$"), ".ffn.router.noise.weight"),
            (re.compile(r"\.ffn\.router_bias$"), ".ffn.router.expert_bias")]


def renamed(tensors: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's tensors (or shapes) under today's names, so that runs saved before a rename still load."""
    out = {}
    for name, value in tensors.items():
        for old, new in _RENAMED:
            name = old.sub(new, name)
        out[name] = value
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` holds, with its shape, from a model built on the meta device
    (no memory, no initialisation)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (name == "lm_head.weight" and cfg.tie_embeddings)}


def check_shapes(file: Path, found: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]],
                 against: str = "config.json") -> None:
    """Refuse a weights file whose tensor names or shapes (read from its header) differ from what the
    config builds: checked before any tensor is read, so a crafted file cannot make us allocate."""
    missing, unexpected = sorted(set(wanted) - set(found)), sorted(set(found) - set(wanted))
    wrong = [f"{n} {found[n]} (expected {wanted[n]})" for n in sorted(set(found) & set(wanted))
             if found[n] != wanted[n]]
    if missing or unexpected or wrong:
        parts = [f"{label} {names[:3]}{' ...' if len(names) > 3 else ''}" for label, names in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shapes:", wrong)) if names]
        raise CheckpointError(f"{file} does not match {against}: {'; '.join(parts)}")


def load_model(ckpt: Path, dtype: torch.dtype | None = None, fast: bool = True, merged: bool = True) -> Transformer:
    """Our Transformer from a checkpoint folder (config.json + model.safetensors), with the fast modules
    installed (`ops.install`) unless fast=False. The file's shapes are checked against the config before
    anything is allocated. A LoRA run's checkpoint (adapters.safetensors beside the frozen model) gives the
    model with its adapters merged in, or with `merged=False` attached and training (a resume)."""
    cfg = read_model_config(ckpt)
    check_shapes(ckpt / "model.safetensors", renamed(safetensors_shapes(ckpt / "model.safetensors")),
                 expected_shapes(cfg))
    tensors = renamed(read_safetensors(ckpt / "model.safetensors"))
    bad = non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"{ckpt / 'model.safetensors'} holds non-finite values (in {bad}); the run diverged "
                              "before this was saved: use an earlier checkpoint")
    model = Transformer(cfg)
    if cfg.tie_embeddings:
        tensors["lm_head.weight"] = tensors.get("embed.weight", torch.empty(0))
    try:
        model.load_state_dict(tensors)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{ckpt / 'model.safetensors'} does not match config.json: {detail}") from None
    if fast:
        install(model)
    if (ckpt / ADAPTERS_FILE).exists():
        load_adapters(model, ckpt / ADAPTERS_FILE, merged=merged)
    return model.to(dtype) if dtype is not None else model


def _params_by_index(opt: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters in the order `opt.state_dict()` numbers them."""
    return [p for group in opt.param_groups for p in group["params"]]


def optimizer_tensors(opt: torch.optim.Optimizer, whole: TensorOf | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state as flat tensors plus JSON-able metadata (param groups and scalar state).

    `whole` turns a parameter's state tensor that lives spread over ranks into the whole tensor (see
    `distributed`); every rank must call it, in the same order."""
    sd = opt.state_dict()
    params = _params_by_index(opt)
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                if whole is not None and value.dim() > 0:
                    value = whole(params[idx], value)
                tensors[f"state.{idx}.{key}"] = value.contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                         part: TensorOf | None = None) -> None:
    """The inverse of `optimizer_tensors`; `part` cuts a whole state tensor down to this rank's part.
    State that is not finite, or does not fit the model, is a CheckpointError."""
    bad = non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"the optimizer state holds non-finite values (in {bad}); the run diverged before "
                              "this was saved: use an earlier checkpoint")
    state: dict[int, dict[str, Any]] = {}
    params = _params_by_index(opt)
    try:
        for name, value in tensors.items():
            _, idx, key = name.split(".", 2)
            if not 0 <= int(idx) < len(params):
                raise CheckpointError(f"optimizer state names parameter {idx}, but the model has {len(params)}")
            if part is not None and value.dim() > 0:
                value = part(params[int(idx)], value)
            state.setdefault(int(idx), {})[key] = value
        for name, value in meta.get("scalars", {}).items():
            idx, key = name.split(".", 1)
            state.setdefault(int(idx), {})[key] = value
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError, IndexError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"optimizer state does not match the model: {str(e)[:200]}") from None


# ---------------------------------------------------------------------------------------------- whole checkpoints
def save_checkpoint(run_dir: Path, step: int, model: Transformer, optimizer: torch.optim.Optimizer,
                    tokenizer_save: Callable[[Path], Any], train_config: dict[str, Any],
                    train_state: dict[str, Any], rng: dict[str, torch.Tensor], best: bool = False, *,
                    tensors: dict[str, torch.Tensor] | None = None,
                    optimizer_state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None) -> Path:
    """Write RUN_DIR/step-N atomically and point `last` (and `best` if asked) at it. Returns the folder.

    `tensors` and `optimizer_state` replace `model_tensors(model)` and `optimizer_tensors(optimizer)`
    where those live spread over ranks (`distributed` gathers them whole, so a checkpoint is the same
    whatever the world size). Refuses (CheckpointError) weights or optimizer state that are not finite:
    a checkpoint is only ever something a run can continue from.
    """
    final = run_dir / f"step-{step:07d}"
    tensors = model_tensors(model) if tensors is None else tensors
    opt_tensors, opt_meta = optimizer_tensors(optimizer) if optimizer_state is None else optimizer_state
    bad = non_finite(tensors) or non_finite(opt_tensors)
    if bad is not None:
        raise CheckpointError(f"step {step} not saved: {bad} holds non-finite values; the last checkpoint in "
                              f"{run_dir} is kept")
    try:
        _write_checkpoint(run_dir, final, step, model, tokenizer_save, tensors, opt_tensors, opt_meta,
                          train_config, train_state, rng)
        _point(run_dir / "last", final.name)
        if best:
            _point(run_dir / "best", final.name)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"step {step} not saved: cannot write it in {run_dir} ({write_cause(e)}); the last "
                              f"checkpoint there is kept: make room and continue with --resume {run_dir}") from None
    _prune(run_dir)
    return final


def _write_checkpoint(run_dir: Path, final: Path, step: int, model: Transformer, tokenizer_save: Callable[[Path], Any],
                      tensors: dict[str, torch.Tensor], opt_tensors: dict[str, torch.Tensor], opt_meta: dict[str, Any],
                      train_config: dict[str, Any], train_state: dict[str, Any], rng: dict[str, torch.Tensor]) -> None:
    """Every file of a checkpoint into a temporary folder, fsynced, renamed to `final` (removed on failure).

    A `final` already there is never adopted: it is a leftover of a save that failed after its rename and
    before `last` moved (a full disk, a kill), holding an older run's state; it is moved aside and replaced.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".tmp-step-{step:07d}-"))
    tmp.chmod(0o755)
    stale = None
    try:
        base, adapters = split_state(tensors)  # a LoRA run: the frozen model, and its adapters apart
        save_file(base, tmp / "model.safetensors", metadata={"format": "pt"})
        if adapters:
            save_adapters(model, tmp / ADAPTERS_FILE, adapters)
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
        tokenizer_save(tmp / "tokenizer.json")
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        (tmp / "optimizer.json").write_text(json.dumps(opt_meta) + "\n")
        (tmp / "train_config.json").write_text(json.dumps(train_config, indent=2) + "\n")
        state = {**train_state, "step": step, "rng": {k: _b64(v) for k, v in rng.items()}}
        (tmp / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if (final.exists() or final.is_symlink()) and not is_our_step(final):
            raise CheckpointError(f"step {step} not saved: {final} exists and is not a checkpoint nanollama4 wrote "
                                  f"(it is left as it is); move it out of {run_dir} and continue with --resume "
                                  f"{run_dir}")
        if final.exists():
            stale = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".tmp-step-{step:07d}-stale-"))
            os.replace(final, stale / final.name)
        os.rename(tmp, final)
    finally:
        for leftover in (tmp, stale):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


def clear_leftovers(run_dir: Path) -> None:
    """Remove what interrupted saves left in a run: our temporary folders, and checkpoint folders that
    neither `last` nor `best` points at (a save that failed after its rename). Called by the run's owner,
    under its lock."""
    for tmp in run_dir.glob(".tmp-step-*"):
        if TMP_NAME.fullmatch(tmp.name) and tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(run_dir)


def _point(link: Path, target: str) -> None:
    """Atomically make `link` a symlink to `target` (a sibling folder name)."""
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def is_our_step(path: Path) -> bool:
    """Whether `path` is a checkpoint folder as `save_checkpoint` writes it: a real folder (not a link) named
    step-NNNNNNN holding checkpoint files and nothing else. Anything else, a user's `step-notes/` or a
    `step-0000012.backup/` copy, is not ours to remove."""
    if not STEP_NAME.fullmatch(path.name) or path.is_symlink() or not path.is_dir():
        return False
    try:
        names = {entry.name for entry in path.iterdir()}
    except OSError:
        return False
    return bool(names) and names <= CHECKPOINT_FILES


def step_folders(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders (`is_our_step`), in step order."""
    return sorted(d for d in run_dir.glob("step-*") if is_our_step(d))


def linked_steps(run_dir: Path) -> dict[str, Path]:
    """Each of `last` and `best` that resolves to a checkpoint folder of this run, with that folder's
    resolved path. Resolved, not read as text: `step-0000020/`, `./step-0000020` and an absolute path all
    name the same folder."""
    out = {}
    home = Path(os.path.realpath(run_dir))
    for name in LINKS:
        link = run_dir / name
        if not link.is_symlink():
            continue
        target = Path(os.path.realpath(link))
        if target.parent == home and is_our_step(target):
            out[name] = target
    return out


def _prune(run_dir: Path) -> None:
    """Delete the checkpoint folders that neither `last` nor `best` resolves to. Nothing is deleted while
    `last` resolves to no checkpoint of this run: which folder is current is then unknown."""
    keep = linked_steps(run_dir)
    if "last" not in keep:
        return
    for d in step_folders(run_dir):
        if Path(os.path.realpath(d)) not in keep.values():
            shutil.rmtree(d, ignore_errors=True)


def resolve_checkpoint(path: str | os.PathLike[str], prefer: str = "last") -> Path:
    """A checkpoint folder from a run directory (its `last` or `best`) or a step folder given directly."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a run directory such as runs/NAME")
    if (path / "config.json").exists():
        return path
    for name in (prefer, "last", "best"):
        if (path / name / "config.json").exists():
            return (path / name).resolve()
    for name in (prefer, "last", "best"):
        if (path / name).is_dir():
            raise CheckpointError(f"{path / name} ({(path / name).resolve().name}) has no config.json; the "
                                  "checkpoint is incomplete: restore the file or use another checkpoint")
    raise CheckpointError(f"{path} holds no checkpoint (no config.json, no last/ or best/); "
                          "is it a training run directory?")


def load_train_state(ckpt: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """train_state.json, with its RNG states decoded back to tensors; every field the loop reads is checked
    here, so a corrupt file is one error naming it rather than a failure later in the loop."""
    path = ckpt / "train_state.json"
    state = read_json(path)
    number = (int, float)
    checks = {"step": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "elapsed": lambda v: isinstance(v, number) and math.isfinite(v) and v >= 0,
              "best_val_loss": lambda v: v is None or isinstance(v, number) and math.isfinite(v),
              "val_loss": lambda v: v is None or isinstance(v, number) and math.isfinite(v),
              "world_size": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 2**20,
              "data": lambda v: v is None or isinstance(v, str)}
    for key, ok in checks.items():
        if (key == "step" or key in state) and not ok(state.get(key)):
            raise CheckpointError(f"{path}: {key} ({str(state.get(key))[:40]!r}) is not valid; the file is corrupt")
    try:
        rng = {k: _unb64(v) for k, v in state.pop("rng").items()}
        torch.Generator().set_state(rng["batches"])  # the bytes must be a generator's state
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{path}: the batch sampler's state (rng) is missing or corrupt ({type(e).__name__})"
                              ) from None
    return state, rng


def check_vocab(tokenizer: Tokenizer, cfg: ModelConfig, where: Path) -> None:
    """A tokenizer with ids the model has no embedding row for would fail on the first prompt that uses one
    (an IndexError deep in torch): refuse the pair when it is loaded."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{cfg.vocab_size}; the tokenizer.json belongs to another model")


# ---------------------------------------------------------------------------------------------- loading runs
def load_run(path: str | Path, prefer: str = "best", fast: bool = True
             ) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """Model, tokenizer and train config of a run directory (its best checkpoint by default); the model as
    `load_model` gives it.

    A run that is training meanwhile may prune the checkpoint between finding it and reading it (a newer
    one took its place): then the newer one is read, a few times over at most."""
    for attempt in range(READ_ATTEMPTS):
        ckpt = resolve_checkpoint(path, prefer=prefer)
        try:
            try:
                tc = read_json(ckpt / "train_config.json")
            except CheckpointError:
                tc = {}
            model, tokenizer = load_model(ckpt, fast=fast), load_tokenizer(ckpt / "tokenizer.json")
        except (CheckpointError, OSError):
            if ckpt.exists() or attempt == READ_ATTEMPTS - 1:
                raise
            continue  # pruned under us: resolve the run's link again
        check_vocab(tokenizer, model.cfg, ckpt)
        return model, tokenizer, tc
    raise AssertionError("unreachable")


READ_ATTEMPTS = 5
