"""Your code reaches every command: a router kind of one's own, in a file of one's own, trains, generates,
evaluates, explains and serves through `--import`; a command without it names the module to import; and a
mixture-of-experts layer built alone starts from sensible weights, so swapping one into a model trains."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
import torch

from nanollama4.base.config import preset
from nanollama4.base.parts import ROUTERS
from nanollama4.cli import main
from nanollama4.model.moe import MoE
from nanollama4.ops import build_model
from tests.helpers import TINY, assert_cli_error, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

KIND = "sigmoid-halved"
USER_CODE = textwrap.dedent(f'''
    """An engineer's own router: Llama 4's sigmoid weights, halved."""
    import torch

    from nanollama4.model.router import Router, chosen_scores


    class Halved(Router, name="{KIND}", scales_input=True, about="a user's"):
        def weigh(self, scores_TE, experts_TK, valid_TK):
            return 0.5 * torch.sigmoid(chosen_scores(scores_TE, experts_TK, valid_TK))
''')


@pytest.fixture(scope="module")
def user_run(tmp_path_factory, corpus):
    """A run trained with the user's router, through the CLI as a user trains it (`main(argv)` here)."""
    root = tmp_path_factory.mktemp("plugins")
    code = root / "my_router.py"
    code.write_text(USER_CODE)
    run = root / "run"
    argv = ["train", *TINY, "--import", str(code), "--set", f"router={KIND}", "--data", str(corpus), "--out", str(run),
            "--max-steps", "4", "--set", "eval_interval=2"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    yield {"code": code, "run": run, "corpus": corpus, "printed": printed.getvalue()}
    forget()


def forget() -> None:
    """This process as a fresh interpreter finds it: the user's kind neither registered nor imported."""
    ROUTERS.remove(KIND)
    sys.modules.pop("my_router", None)


def test_the_run_trained_with_the_users_router_and_recorded_it(user_run):
    run, code = user_run["run"], user_run["code"]
    saved = json.loads((run / "last" / "config.json").read_text())
    assert saved["router"] == KIND and saved["imports"] == str(code.resolve())
    assert f'imports = "{code.resolve()}"' in (run / "config.toml").read_text()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r.get("loss", r.get("val_loss"))) for r in rows)


def test_the_closing_next_line_runs_when_pasted(user_run, capsys):
    """The run's last line said `--prompt "ROMEO:"` for any corpus (this one has no capitals) and left out the
    --import the run needs, so pasted it failed. It now names the import, and a prompt from the start of a line
    of the run's own validation text; both of its commands run as printed."""
    line = next(x for x in user_run["printed"].splitlines() if x.startswith("next: "))
    generate, evaluate = (shlex.split(part) for part in line.removeprefix("next: ").split("   |   "))
    assert generate[:2] == ["nanollama4", "generate"] and evaluate[:2] == ["nanollama4", "eval"]
    for command in (generate, evaluate):
        assert command[2] == str(user_run["run"]) and command[3:5] == ["--import", str(user_run["code"])]
    prompt = generate[generate.index("--prompt") + 1]
    text = user_run["corpus"].read_text()
    assert "ROMEO" not in line and 0 < len(prompt) <= 24 and f"\n{prompt}" in text[int(len(text) * 0.9):]
    rc, out, err = run_cli(generate[1:] + ["--max-new-tokens", "5"], capsys)
    assert rc == 0 and out.startswith(prompt), err
    rc, out, err = run_cli(evaluate[1:], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("command", [["generate", "RUN", "--prompt", "the cat", "--max-new-tokens", "5"],
                                     ["eval", "RUN"], ["explain", "RUN", "--prompt", "the cat"],
                                     ["export", "RUN", "OUT"], ["serve", "RUN", "--port", "0"],
                                     ["train", "--resume", "RUN", "--max-steps", "6"]])
def test_a_command_without_the_import_names_the_module(user_run, command, tmp_path, capsys):
    """As in a fresh interpreter (the kind is not registered): one line that says which --import to pass."""
    forget()
    argv = [{"RUN": str(user_run["run"]), "OUT": str(tmp_path / "out")}.get(a, a) for a in command]
    rc, _, err = run_cli(argv, capsys)
    err = assert_cli_error(rc, err, command[0])
    assert f"--import {user_run['code'].resolve()}" in err and KIND in err


def test_with_the_import_every_command_runs(user_run, capsys, tmp_path):
    """generate, eval and explain in this process with --import; export refuses in one line, because the
    reference format has only Llama 4's router (a custom kind has no transformers equivalent)."""
    run, code = str(user_run["run"]), str(user_run["code"])
    rc, out, err = run_cli(["generate", run, "--import", code, "--prompt", "the cat", "--max-new-tokens", "5",
                            "--greedy"], capsys)
    assert rc == 0 and out.startswith("the cat") and len(out.rstrip("\n")) == len("the cat") + 5, err  # 5 chars
    rc, out, err = run_cli(["eval", run, "--import", code], capsys)
    assert rc == 0 and re.search(r"full validation loss: \d+\.\d+", out), err
    rc, out, err = run_cli(["explain", run, "--import", code, "--prompt", "the cat"], capsys)
    assert rc == 0 and "expert" in out, err
    rc, out, err = run_cli(["export", run, str(tmp_path / "hf"), "--import", code], capsys)
    assert "only the Llama 4 MoE" in assert_cli_error(rc, err, "export")
    rc, out, err = run_cli(["train", "--resume", run, "--import", code, "--max-steps", "6", "--quiet"], capsys)
    assert rc == 0 and "step 6" in out, err


def test_the_server_serves_the_users_router(user_run):
    """`nanollama4 serve RUN --import FILE`, asked by the official openai client."""
    openai = pytest.importorskip("openai")
    proc = subprocess.Popen([sys.executable, "-m", "nanollama4", "serve", str(user_run["run"]), "--port", "0",
                             "--import", str(user_run["code"])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        answer = client.completions.create(model=user_run["run"].name, prompt="the cat", max_tokens=5, temperature=0)
        assert answer.choices[0].text and answer.usage.completion_tokens == 5
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_import_that_fails_is_one_line(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('half written')\n")
    rc, _, err = run_cli(["config", "--import", str(broken)], capsys)
    assert "RuntimeError: half written" in assert_cli_error(rc, err, "config")
    rc, _, err = run_cli(["config", "--import", "no_such_module_here"], capsys)
    assert "no module named 'no_such_module_here'" in assert_cli_error(rc, err, "config")
    rc, _, err = run_cli(["config", "--import", str(tmp_path / "missing.py")], capsys)
    assert "no such file" in assert_cli_error(rc, err, "config")
    rc, _, err = run_cli(["config", "--set", "router=nobodys"], capsys)
    assert "--import MODULE" in assert_cli_error(rc, err, "config")


def test_a_moe_swapped_into_a_model_trains(corpus):
    """MoE(cfg) built alone starts as a built model's does (no uninitialised memory): swapped into a dense
    model, the loss is finite from the first step and falls."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    model = build_model(cfg.replace(n_experts=0))
    for block in model.blocks:
        block.ffn = MoE(cfg)
    moe = model.blocks[0].ffn
    assert moe.experts.gate_up.std().item() == pytest.approx(cfg.init_std, rel=0.1)
    assert moe.experts.down.std().item() == pytest.approx(cfg.init_std / math.sqrt(2 * cfg.n_layers), rel=0.1)
    assert moe.router.weight.std().item() == pytest.approx(cfg.init_std, rel=0.2)
    ids = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model.loss(ids[:, :-1], ids[:, 1:]).total
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(cfg.vocab_size), abs=0.3)  # starts where an untrained model does
    assert losses[-1] < losses[0] - 0.5, losses
