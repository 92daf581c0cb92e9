"""Checkpoint mechanics: complete step folders behind `last`/`best`, pruning, optimizer and tied-weight
round trips, clear errors, and no pickle anywhere."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanollama4.base.config import TrainConfig, preset
from nanollama4.interop.checkpoint import (
    CheckpointError,
    load_model,
    load_optimizer_state,
    load_run,
    load_train_state,
    model_tensors,
    read_json,
    read_safetensors,
    resolve_checkpoint,
    save_checkpoint,
)
from nanollama4.model.tokenizer import CharTokenizer, load_tokenizer
from nanollama4.model.transformer import Transformer
from nanollama4.ops import build_model
from nanollama4.training.optim import make_optimizer
from nanollama4.training.train import train
from tests.helpers import assert_cli_error, assert_refused, run_cli, run_cli_limited, snapshot, train_cli

SRC = Path(__file__).resolve().parents[1] / "src" / "nanollama4"
FILES = {"model.safetensors", "config.json", "tokenizer.json", "optimizer.safetensors", "optimizer.json",
         "train_config.json", "train_state.json"}


pytestmark = pytest.mark.usefixtures("one_thread")


def trained(cfg=None, steps: int = 2, seed: int = 0) -> tuple[Transformer, torch.optim.AdamW]:
    """A tiny model and its AdamW after a few steps on random tokens (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = build_model(cfg or preset("tiny", vocab_size=32))
    opt = make_optimizer(model, TrainConfig())
    for _ in range(steps):
        ids = torch.randint(0, model.cfg.vocab_size, (2, 17))
        model.loss(ids[:, :-1], ids[:, 1:]).total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def save(run: Path, step: int, model, opt, best: bool = False) -> Path:
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz .\n!?,"[: model.cfg.vocab_size])
    rng = {"torch": torch.get_rng_state(), "batches": torch.Generator().manual_seed(step).get_state()}
    return save_checkpoint(run, step, model, opt, tok.save, TrainConfig(max_steps=10).to_dict(),
                           {"data": None, "best_val_loss": 1.0, "val_loss": 1.0, "elapsed": 0.0}, rng, best=best)


def step_dirs(run: Path) -> set[str]:
    return {p.name for p in run.iterdir() if p.name.startswith("step-")}


def assert_complete(folder: Path) -> None:
    assert folder.is_dir() and not folder.is_symlink(), folder
    assert {p.name for p in folder.iterdir()} >= FILES, sorted(p.name for p in folder.iterdir())
    load_model(folder)
    load_tokenizer(folder / "tokenizer.json")
    load_train_state(folder)
    read_safetensors(folder / "optimizer.safetensors")
    read_json(folder / "optimizer.json")


def assert_links_and_pruning(run: Path) -> dict[str, str]:
    targets = {}
    for name in ("last", "best"):
        link = run / name
        if not link.is_symlink():
            assert not link.exists(), f"{name} exists but is not a symlink"
            continue
        target = os.readlink(link)
        assert "/" not in target and target.startswith("step-"), target  # a sibling, so the run dir can move
        assert_complete(run / target)
        targets[name] = target
    assert "last" in targets
    assert step_dirs(run) == set(targets.values())  # pruning keeps exactly what the links point at
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")], "temporary files left behind"
    return targets


def test_links_point_at_complete_folders_and_pruning_keeps_only_them(tmp_path):
    run = tmp_path / "run"
    model, opt = trained()
    save(run, 1, model, opt, best=True)
    assert assert_links_and_pruning(run) == {"last": "step-0000001", "best": "step-0000001"}
    save(run, 2, model, opt)
    assert assert_links_and_pruning(run) == {"last": "step-0000002", "best": "step-0000001"}
    save(run, 3, model, opt)
    assert assert_links_and_pruning(run) == {"last": "step-0000003", "best": "step-0000001"}
    save(run, 4, model, opt, best=True)
    assert assert_links_and_pruning(run) == {"last": "step-0000004", "best": "step-0000004"}
    assert resolve_checkpoint(run) == (run / "step-0000004").resolve()


def test_training_run_layout(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60)))
    run = tmp_path / "run"
    train(preset("tiny"), TrainConfig(seq_len=32, batch_size=4, eval_batches=2, eval_interval=2, max_steps=6,
                                      warmup_steps=1), run, data=str(corpus), progress=False,
          cache_dir=tmp_path / "cache")
    targets = assert_links_and_pruning(run)
    assert targets["last"] == "step-0000006"
    state, _ = load_train_state(run / "last")
    assert state["step"] == 6
    best_state, _ = load_train_state(run / targets["best"])
    assert best_state["val_loss"] == best_state["best_val_loss"] == state["best_val_loss"]


def test_optimizer_state_round_trips(tmp_path):
    model, opt = trained(steps=3)
    folder = save(tmp_path / "run", 3, model, opt)
    fresh_model = load_model(folder)
    fresh = make_optimizer(fresh_model, TrainConfig())
    load_optimizer_state(fresh, read_safetensors(folder / "optimizer.safetensors"),
                         read_json(folder / "optimizer.json"))
    want, got = opt.state_dict(), fresh.state_dict()
    assert want["state"].keys() == got["state"].keys() and len(want["state"]) == len(list(model.parameters()))
    for idx, state in want["state"].items():
        assert state.keys() == got["state"][idx].keys()
        for key, value in state.items():
            other = got["state"][idx][key]
            if torch.is_tensor(value):
                assert other.dtype == value.dtype and torch.equal(other, value), (idx, key)
            else:
                assert other == value, (idx, key)
    for gw, gg in zip(want["param_groups"], got["param_groups"], strict=True):
        assert {k: tuple(v) if isinstance(v, list) else v for k, v in gw.items()} == \
               {k: tuple(v) if isinstance(v, list) else v for k, v in gg.items()}
    # and the next step is the same with either optimizer
    ids = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(5))
    for m, o in ((model, opt), (fresh_model, fresh)):
        m.loss(ids[:, :-1], ids[:, 1:]).total.backward()
        o.step()
    for (name, a), b in zip(model.state_dict().items(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_optimizer_state_for_another_model_is_an_error(tmp_path):
    model, opt = trained()
    folder = save(tmp_path / "run", 1, model, opt)
    other = make_optimizer(build_model(preset("tiny", vocab_size=32, n_layers=2)), TrainConfig())
    with pytest.raises(CheckpointError) as info:
        load_optimizer_state(other, read_safetensors(folder / "optimizer.safetensors"),
                             read_json(folder / "optimizer.json"))
    assert "\n" not in str(info.value)


def test_tied_embeddings_round_trip(tmp_path):
    model, opt = trained(preset("tiny", vocab_size=32, tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    tensors = model_tensors(model)
    assert "lm_head.weight" not in tensors and "embed.weight" in tensors
    folder = save(tmp_path / "run", 1, model, opt)
    loaded = load_model(folder)
    assert loaded.cfg.tie_embeddings
    assert loaded.lm_head.weight is loaded.embed.weight
    assert loaded.lm_head.weight.data_ptr() == loaded.embed.weight.data_ptr()
    assert torch.equal(loaded.embed.weight, model.embed.weight)
    assert loaded.num_params() == model.num_params()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids = torch.randint(0, 32, (1, 12))
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    with torch.no_grad():  # still one tensor: changing the embedding changes the head
        loaded.embed.weight[0, 0] += 1.0
    assert loaded.lm_head.weight[0, 0] == loaded.embed.weight[0, 0]


def test_untied_model_keeps_its_head(tmp_path):
    model, opt = trained()
    assert "lm_head.weight" in model_tensors(model)
    loaded = load_model(save(tmp_path / "run", 1, model, opt))
    assert loaded.lm_head.weight is not loaded.embed.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_train_state_rng_round_trips(tmp_path):
    model, opt = trained()
    folder = save(tmp_path / "run", 7, model, opt)
    state, rng = load_train_state(folder)
    assert state["step"] == 7 and "rng" not in state
    assert torch.equal(rng["batches"], torch.Generator().manual_seed(7).get_state())
    g = torch.Generator()
    g.set_state(rng["batches"])
    assert torch.equal(torch.randint(0, 1000, (5,), generator=g),
                       torch.randint(0, 1000, (5,), generator=torch.Generator().manual_seed(7)))


def test_resolve_checkpoint_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a run")
    for path, words in ((tmp_path / "empty", "no checkpoint"), (tmp_path / "missing", "does not exist")):
        with pytest.raises(CheckpointError) as info:
            resolve_checkpoint(path)
        msg = str(info.value)
        assert words in msg and str(path) in msg and "\n" not in msg, msg
    assert isinstance(CheckpointError("x"), ValueError)


def test_dangling_last_link_is_an_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink("step-0000009", run / "last")
    with pytest.raises(CheckpointError):
        resolve_checkpoint(run)


@pytest.mark.parametrize("content", [b"", b"garbage" * 50, b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}"])
def test_read_safetensors_bad_file_is_checkpoint_error(tmp_path, content):
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        read_safetensors(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_read_json_bad_file_is_checkpoint_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"step": ')
    with pytest.raises(CheckpointError) as info:
        read_json(path)
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError):
        read_json(tmp_path / "missing.json")


def test_config_that_does_not_match_tensors_is_checkpoint_error(tmp_path):
    model, opt = trained()
    folder = save(tmp_path / "run", 1, model, opt)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "d_model": 32}))
    with pytest.raises(CheckpointError) as info:
        load_model(folder)
    assert "\n" not in str(info.value)


def test_no_pickle_or_torch_load_in_the_source():
    pattern = re.compile(r"\btorch\.load\b|\bimport\s+pickle\b|\bfrom\s+pickle\b|\bpickle\.(loads?|dumps?)\b|"
                         r"\bimport\s+(c|dill|cloud)pickle\b|weights_only")
    files = sorted(SRC.rglob("*.py"))
    assert len(files) >= 10, files
    offenders = [f"{f.name}:{i}: {line.strip()}" for f in files
                 for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


# ----------------------------------------------------------------------------- non-finite or incomplete checkpoints
def test_save_checkpoint_refuses_non_finite_tensors(tmp_path):
    model = build_model(preset("tiny"))
    optimizer = make_optimizer(model, TrainConfig())
    with torch.no_grad():
        model.blocks[1].attn.q_proj.weight[0, 0] = float("inf")
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 7, model, optimizer, tok.save, {}, {"data": None}, {"t": torch.zeros(1)})
    assert str(info.value) == (f"step 7 not saved: blocks.1.attn.q_proj.weight holds non-finite values; the last "
                               f"checkpoint in {tmp_path} is kept")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["generate", "eval", "resume"])
def test_loading_non_finite_weights_is_one_line_naming_the_file(command, run_copy, capsys):
    """A checkpoint written by an older version (or edited by hand) with NaN weights."""
    target = resolve_checkpoint(run_copy, prefer="last")
    tensors = load_file(target / "model.safetensors")
    tensors["norm.weight"] = tensors["norm.weight"] * float("nan")
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    (run_copy / "best").unlink()  # both links at the poisoned folder
    (run_copy / "best").symlink_to(target.name)
    before = snapshot(run_copy, lock=True)
    argv = {"generate": ["generate", str(run_copy), "--prompt", "the"], "eval": ["eval", str(run_copy)],
            "resume": ["train", "--resume", str(run_copy), "--max-steps", "8", "--quiet"]}[command]
    rc, _, err = run_cli(argv, capsys)
    line = assert_cli_error(rc, err, argv[0])
    assert line.endswith(f"{target / 'model.safetensors'} holds non-finite values (in norm.weight); the run "
                         "diverged before this was saved: use an earlier checkpoint"), line
    assert snapshot(run_copy) == {k: v for k, v in before.items() if k != "run.lock"}


def test_a_checkpoint_without_config_json_is_named(run_copy, capsys):
    """It used to say "no last/ or best/" although last/ was there."""
    target = resolve_checkpoint(run_copy, prefer="last")
    (target / "config.json").unlink()
    (run_copy / "best").unlink()
    (run_copy / "best").symlink_to(target.name)
    rc, _, err = run_cli(["generate", str(run_copy), "--prompt", "the"], capsys)
    assert assert_cli_error(rc, err, "generate") == (
        f"nanollama4 generate: error: {run_copy / 'best'} ({target.name}) has no config.json; the checkpoint is "
        "incomplete: restore the file or use another checkpoint")


# ---------------------------------------------------------------------------------------------- crafted checkpoints
def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("changes", "message"), [
    (dict(d_model=10**9), "d_model (1,000,000,000) is beyond what nanollama4 builds (at most 65,536)"),
    (dict(n_layers=10**8), "n_layers (100,000,000) is beyond what nanollama4 builds (at most 1,024)"),
    (dict(d_model=4096, n_layers=32, vocab_size=200_000), "model.safetensors does not match config.json: missing"),
    (dict(vocab_size=10**6), "wrong shapes: ['embed.weight (30, 64) (expected (1000000, 64))'"),
])
def test_a_crafted_config_is_refused_before_anything_is_allocated(changes, message, run_copy):
    """`d_model` 1e9 used to try to allocate 336 GB, `n_layers` 1e8 to grow past 5 GB and run on. Under a 4 GiB
    address-space limit and a minute, each is now one line (torch alone takes ~1.5 GiB of it)."""
    _edit_json(run_copy / "step-0000004" / "config.json", **changes)
    before = snapshot(run_copy)
    rc, out, err = run_cli_limited(["generate", str(run_copy), "--prompt", "the"], timeout=60)
    line = assert_cli_error(rc, err, "generate")
    assert message in line, line
    assert snapshot(run_copy) == before


@pytest.mark.parametrize(("changes", "message"), [
    (dict(step="x"), "train_state.json: step ('x') is not valid; the file is corrupt"),
    (dict(elapsed=[1]), "train_state.json: elapsed ('[1]') is not valid; the file is corrupt"),
    (dict(rng={"batches": "AAAA"}), "train_state.json: the batch sampler's state (rng) is missing or corrupt"),
    (dict(rng=[1, 2]), "train_state.json: the batch sampler's state (rng) is missing or corrupt"),
])
def test_a_corrupt_train_state_is_one_line_on_resume(changes, message, run_copy, capsys):
    _edit_json(run_copy / "step-0000004" / "train_state.json", **changes)
    assert message in assert_refused(capsys, ["train", "--resume", str(run_copy), "--max-steps", "8", "--quiet"],
                                     run_copy)


def test_non_finite_optimizer_state_is_refused_on_resume(run_copy, capsys):
    """The README said so; the run used to train on, then blame the learning rate."""
    path = run_copy / "step-0000004" / "optimizer.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * float("nan")
    save_file(tensors, path)
    line = assert_refused(capsys, ["train", "--resume", str(run_copy), "--max-steps", "8", "--quiet"], run_copy)
    assert line == (f"nanollama4 train: error: {path}: the optimizer state holds non-finite values (in {name}); the "
                    "run diverged before this was saved: use an earlier checkpoint")


def test_a_tokenizer_larger_than_the_model_is_refused_when_loaded(run_copy, capsys):
    """It used to load, then fail with an IndexError on the first prompt that used a token the model lacks."""
    ckpt = run_copy / "step-0000004"
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    CharTokenizer.from_text("".join(chr(0x400 + i) for i in range(vocab + 5))).save(ckpt / "tokenizer.json")
    for argv in (["generate", str(run_copy), "--prompt", chr(0x400)], ["eval", str(run_copy)]):
        rc, _, err = run_cli(argv, capsys)
        assert assert_cli_error(rc, err, argv[0]).endswith(
            f"{ckpt}: the tokenizer has {vocab + 5} tokens but the model only {vocab}; the tokenizer.json belongs to "
            "another model")


# ---------------------------------------------------------------------------------------------- a full disk
def _fill_disk_run(corpus: Path, run: Path, capsys) -> None:
    """Train into `run` until a save fails for want of space; check what a user is left with."""
    rc, _, err = train_cli(capsys, "--data", str(corpus), "--out", str(run), "--max-steps", "40",
                           "--set", "eval_interval=2")
    line = assert_cli_error(rc, err, "train")
    assert "not saved: cannot write it in" in line and "(no space left on the device); the last checkpoint there " \
        f"is kept: make room and continue with --resume {run}" in line, line
    last = resolve_checkpoint(run)
    assert last.name == "step-0000002"
    load_run(run, prefer="last")  # whole and loadable
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp")]  # no half-written folder


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint_injected(corpus, tmp_path, capsys, monkeypatch):
    """The second save meets ENOSPC (injected into the safetensors writer: see the tmpfs test for a real one)."""
    import nanollama4.interop.checkpoint as checkpoint

    real, calls = checkpoint.save_file, {"n": 0}

    def save_file_until_full(tensors, path, **kw):
        calls["n"] += 1
        if calls["n"] > 2:  # model and optimizer of the first checkpoint fit, nothing after
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(tensors, path, **kw)

    monkeypatch.setattr(checkpoint, "save_file", save_file_until_full)
    _fill_disk_run(corpus, tmp_path / "run", capsys)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root); the injected "
                                              "ENOSPC test above ran instead")
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint_on_a_real_tmpfs(corpus, tmp_path, capsys):
    """A 6 MiB tmpfs holds one checkpoint of the tiny model (3.6 MB) but not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"could not mount a tmpfs ({done.stderr.decode().strip()}); the injected ENOSPC test ran instead")
    try:
        _fill_disk_run(corpus, mount / "run", capsys)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_save_that_failed_after_its_rename_is_never_adopted_on_resume(run_copy, capsys, monkeypatch):
    """A save that fails between renaming step-N into place and moving `last` (a full disk, a kill) leaves
    step-N behind. The resumed run used to reach step N, find the folder and point `last` at it: its own
    training silently replaced by the old state."""
    import nanollama4.interop.checkpoint as checkpoint

    real_point = checkpoint._point

    def point_fails_for_last(link, target):
        if link.name == "last":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_point(link, target)

    monkeypatch.setattr(checkpoint, "_point", point_fails_for_last)
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "6", "--quiet"], capsys)
    assert "step 6 not saved" in assert_cli_error(rc, err, "train")
    orphan = run_copy / "step-0000006"
    assert orphan.is_dir() and os.readlink(run_copy / "last") == "step-0000004"  # the injected failure's leftover
    orphan_weights = load_file(orphan / "model.safetensors")
    monkeypatch.setattr(checkpoint, "_point", real_point)

    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "6", "--set", "lr=0.01", "--quiet"],
                         capsys)
    assert rc == 0, err
    last = resolve_checkpoint(run_copy)
    assert last.name == "step-0000006"
    assert json.loads((last / "train_config.json").read_text())["lr"] == 0.01  # this run's state, not the orphan's
    weights = load_file(last / "model.safetensors")
    assert any(not torch.equal(weights[k], orphan_weights[k]) for k in weights)
    assert not [p.name for p in run_copy.iterdir() if p.name.startswith(".tmp")]


def test_leftovers_of_a_killed_save_are_cleared_by_the_next_owner(run_copy, capsys):
    """SIGKILL mid-save leaves a .tmp-step-* folder (model and optimizer state) that nothing removed."""
    leftover = run_copy / ".tmp-step-0000005-abcdef"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "5", "--quiet"], capsys)
    assert rc == 0, err
    assert not leftover.exists()
    assert os.readlink(run_copy / "last") == "step-0000005"
    assert {p.name for p in run_copy.glob("step-*")} == {os.readlink(run_copy / n) for n in ("last", "best")}


def test_a_reader_retries_when_the_training_run_prunes_its_checkpoint_meanwhile(run_copy, monkeypatch):
    """generate/export/serve of a run that trains failed one time in nine with "model.safetensors is missing":
    the run saved a newer step and pruned the folder between our resolving `last` and reading it."""
    import shutil

    import nanollama4.interop.checkpoint as checkpoint

    real, calls = checkpoint.load_model, []

    def pruned_first(ckpt, **kw):
        calls.append(ckpt.name)
        if len(calls) == 1:  # the trainer saves step 5 and prunes step 4, just now
            shutil.copytree(run_copy / "step-0000004", run_copy / "step-0000005")
            for link in ("last", "best"):
                os.replace(run_copy / link, run_copy / f"{link}.old")
                os.symlink("step-0000005", run_copy / link)
                os.unlink(run_copy / f"{link}.old")
            shutil.rmtree(run_copy / "step-0000004")
        return real(ckpt, **kw)

    monkeypatch.setattr(checkpoint, "load_model", pruned_first)
    model, tokenizer, tc = load_run(run_copy, prefer="last")
    assert calls == ["step-0000004", "step-0000005"] and tc["max_steps"] == 4


# ---------------------------------------------------------------------------------------------- what is ours to remove
@pytest.mark.parametrize("spelling", ["step-0000004/", "./step-0000004", "absolute"])
def test_resume_keeps_the_checkpoint_however_the_links_spell_it(spelling, run_copy, capsys):
    """`last` -> `step-0000004/` (as tab completion writes it), `./step-0000004` or an absolute path: generate
    read the run, but resume compared the link's text with the folder's name, deleted the run's only
    checkpoint and then said the run held none."""
    target = str(run_copy / "step-0000004") if spelling == "absolute" else spelling
    for link in ("last", "best"):
        os.unlink(run_copy / link)
        os.symlink(target, run_copy / link)
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "5", "--quiet"], capsys)
    assert rc == 0, err
    last = resolve_checkpoint(run_copy)
    assert last.name == "step-0000005" and json.loads((last / "train_state.json").read_text())["step"] == 5


def test_folders_that_are_not_our_checkpoints_survive_a_resume(run_copy, capsys):
    """Every folder matching step-* used to be deleted on resume and after every save: a user's notes and a
    backup copy of a checkpoint vanished. Only real folders named step-NNNNNNN holding checkpoint files
    alone, and no link resolves to, are ours to remove."""
    notes = run_copy / "step-by-step-notes"
    notes.mkdir()
    (notes / "ideas.txt").write_text("mine")
    shutil.copytree(run_copy / "step-0000004", run_copy / "step-0000012.backup")
    annotated = run_copy / "step-0000002"  # our name, but it holds a file we never write
    shutil.copytree(run_copy / "step-0000004", annotated)
    (annotated / "README.txt").write_text("kept on purpose")
    elsewhere = run_copy.parent / "elsewhere"
    shutil.copytree(run_copy / "step-0000004", elsewhere)
    os.symlink(elsewhere, run_copy / "step-0000003")  # a link, not a folder of ours
    foreign = [notes, run_copy / "step-0000012.backup", annotated, run_copy / "step-0000003", elsewhere]
    before = {p: snapshot(p) for p in foreign}
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "6", "--set", "eval_interval=1",
                          "--quiet"], capsys)
    assert rc == 0, err
    assert {p: snapshot(p) for p in foreign} == before
    assert (run_copy / "step-0000003").is_symlink()
    ours = {p.name for p in run_copy.glob("step-*") if p not in foreign}
    assert ours == {os.path.basename(os.readlink(run_copy / n)) for n in ("last", "best")}


def test_a_folder_of_someone_elses_where_a_checkpoint_goes_is_kept_and_the_save_refused(run_copy, capsys):
    """A save used to move any step-N folder aside and delete it; one that is not ours is left alone."""
    theirs = run_copy / "step-0000005"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    rc, _, err = run_cli(["train", "--resume", str(run_copy), "--max-steps", "5", "--quiet"], capsys)
    line = assert_cli_error(rc, err, "train")
    assert f"step 5 not saved: {theirs} exists and is not a checkpoint nanollama4 wrote" in line, line
    assert (theirs / "notes.txt").read_text() == "mine" and [p.name for p in theirs.iterdir()] == ["notes.txt"]
    assert os.readlink(run_copy / "last") == "step-0000004"


@pytest.mark.parametrize(("file", "key", "text"), [
    ("train_state.json", "best_val_loss", "NaN"),
    ("train_state.json", "val_loss", "-Infinity"),
    ("train_config.json", "lr", "1e999"),
])
def test_a_non_finite_number_in_a_state_file_is_refused_in_one_line(file, key, text, run_copy, capsys):
    """best_val_loss NaN used to be accepted: every later comparison with it is false, so `best` never moved
    again and generate, eval, serve and export read a stale step."""
    path = run_copy / "step-0000004" / file
    doc = json.loads(path.read_text())
    doc[key] = "PLACEHOLDER"
    path.write_text(json.dumps(doc).replace('"PLACEHOLDER"', text))
    line = assert_refused(capsys, ["train", "--resume", str(run_copy), "--max-steps", "8", "--quiet"], run_copy)
    assert f"{path} holds a non-finite number ({text}), which no file of ours holds" in line, line


def test_code_a_checkpoint_names_is_shown_escaped_and_said_to_come_from_it(run_copy, capsys):
    """Issue 55: a crafted config.json's `imports` reached the terminal raw (an escape sequence, a forged
    second line), and the message advised --import of a path the downloaded folder chose without saying so."""
    path = run_copy / "step-0000004" / "config.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "router": "theirs", "imports": "/tmp/evil.py\x1b[2J\nnanollama4: all fine"}))
    rc, _, err = run_cli(["generate", str(run_copy), "--prompt", "the", "--max-new-tokens", "2"], capsys)
    line = assert_cli_error(rc, err, "generate")
    assert "\x1b" not in line
    assert (f"router 'theirs' is defined by code that the checkpoint {run_copy / 'step-0000004'} names (/tmp/evil.py"
            "\\x1b[2J\\nnanollama4: all fine, in its config.json), which is not imported: pass --import "
            "/tmp/evil.py\\x1b[2J\\nnanollama4: all fine if you trust that code") in line, line
