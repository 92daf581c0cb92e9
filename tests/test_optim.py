"""optim.py: Muon (each routed expert's matrices orthogonalised on their own, equal to torch.optim.Muon on
that matrix; the parameter split, Muon for hidden matrices and AdamW for the rest; AdamW's part equal to
torch's), and the optimizer kinds: what each one answers (own settings, groups' peak learning rates,
refusals, state size), and that a new optimizer is one registration: SGD with a momentum setting of its
own, defined here, trains, saves its setting and resumes like the built-in ones (from a file with
--import: test_registries_cli.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from nanollama4.base.config import Decay, TrainConfig, preset
from nanollama4.base.errors import ConfigError
from nanollama4.base.parts import OPTIMIZERS, own_fields
from nanollama4.model.memory import param_counts, training_memory
from nanollama4.model.moe import Experts
from nanollama4.ops import build_model
from nanollama4.training.distributed import World, check
from nanollama4.training.optim import (
    MuonAdamW,
    OptimizerKind,
    make_optimizer,
    optimizer_kind,
    orthogonalize,
    trainable_parameters,
)
from nanollama4.training.runs import resume_config
from nanollama4.training.schedule import logged_lr, lr_scale, peak_lrs, set_lr
from nanollama4.training.train import train

STEPS = 4


def _grads(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(STEPS)]


def test_orthogonalize_brings_singular_values_near_one():
    g = torch.randn(3, 48, 96) * 5
    s = torch.linalg.svdvals(orthogonalize(g).float())
    assert s.shape == (3, 48) and s.min() > 0.5 and s.max() < 1.3  # Keller's quintic: roughly [0.7, 1.2]
    tall = orthogonalize(g.mT).float()
    assert torch.allclose(tall, orthogonalize(g).float().mT)  # transposition commutes with it


def test_muon_on_each_expert_equals_torch_muon_on_that_matrix():
    """Our batched step over a stack of 3 experts against torch.optim.Muon stepping each expert's gate,
    up and down matrices as 2-D nn.Linear-style (out, in) parameters, over several steps with momentum,
    Nesterov, weight decay and torch's default ("original") shape scaling."""
    n, d, h, lr, wd = 3, 32, 48, 0.02, 0.1
    torch.manual_seed(0)
    experts = Experts(n, d, h)
    torch.nn.init.normal_(experts.gate_up, std=0.02)
    torch.nn.init.normal_(experts.down, std=0.02)
    start = experts.down.detach().clone()
    start_gate_up = experts.gate_up.detach().clone()
    ours = MuonAdamW([
        {"params": [experts.gate_up], "muon": True, "layout": "experts", "blocks": 2, "lr": lr, "weight_decay": wd},
        {"params": [experts.down], "muon": True, "layout": "experts", "blocks": 1, "lr": lr, "weight_decay": wd}])
    # torch's reference: one 2-D (out, in) parameter per expert matrix
    ref = {}
    for e in range(n):
        ref[e, "gate"] = torch.nn.Parameter(experts.gate_up[e, :, :h].detach().T.clone())
        ref[e, "up"] = torch.nn.Parameter(experts.gate_up[e, :, h:].detach().T.clone())
        ref[e, "down"] = torch.nn.Parameter(experts.down[e].detach().T.clone())
    theirs = torch.optim.Muon(list(ref.values()), lr=lr, weight_decay=wd, momentum=0.95, nesterov=True)
    for g_gu, g_dn in zip(_grads((n, d, 2 * h), 1), _grads((n, h, d), 2), strict=True):
        experts.gate_up.grad, experts.down.grad = g_gu.clone(), g_dn.clone()
        for e in range(n):
            ref[e, "gate"].grad = g_gu[e, :, :h].T.clone()
            ref[e, "up"].grad = g_gu[e, :, h:].T.clone()
            ref[e, "down"].grad = g_dn[e].T.clone()
        ours.step()
        theirs.step()
    # Two code paths: our batched products of all experts at once against torch's one matrix at a time. Their
    # Newton-Schulz products run in bf16, where another kernel's rounding (another CPU's, another batch's)
    # moves an update by about bf16's 2^-8 of itself; 1/32 of the largest movement of the four steps is 8x that.
    moved = max((experts.down - start).abs().max().item(), (experts.gate_up - start_gate_up).abs().max().item())
    for e in range(n):
        for name, got in (("gate", experts.gate_up[e, :, :h].T), ("up", experts.gate_up[e, :, h:].T),
                          ("down", experts.down[e].T)):
            torch.testing.assert_close(got.detach(), ref[e, name].detach(), atol=moved / 32, rtol=0)
    assert (experts.down.detach() - start).abs().mean() > 0.005  # four steps moved the weights by ~0.01 each


def test_adamw_part_equals_torch_adamw():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    w2 = torch.nn.Parameter(w.detach().clone())
    ours = MuonAdamW([{"params": [w], "lr": 1e-2, "weight_decay": 0.1}], betas=(0.9, 0.99))
    theirs = torch.optim.AdamW([w2], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    for g in _grads((16, 8), 3):
        w.grad, w2.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(w.detach(), w2.detach())


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = build_model(preset("tutorial", vocab_size=64))  # learned router noise: a second router matrix
    opt = make_optimizer(model, TrainConfig(optimizer="muon"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert len(muon) + len(adamw) == len(names) and not muon & adamw
    assert {"embed.weight", "lm_head.weight", "norm.weight", "blocks.0.ffn.router.weight",
            "blocks.0.ffn.router.noise.weight", "blocks.0.attn_norm.weight"} <= adamw
    assert {"blocks.0.attn.q_proj.weight", "blocks.0.attn.o_proj.weight", "blocks.0.ffn.experts.gate_up",
            "blocks.0.ffn.experts.down", "blocks.0.ffn.shared_expert.up_proj.weight"} <= muon
    assert all(p.dim() >= 2 for g in opt.param_groups if g["muon"] for p in g["params"])


def test_muon_experts_false_hands_the_routed_experts_to_adamw_with_decay():
    """The option behind a Muon step that does not grow with N: the experts' 3-D matrices leave Muon."""
    model = build_model(preset("tutorial", vocab_size=64))
    opt = make_optimizer(model, TrainConfig(optimizer="muon", weight_decay=0.1, settings={"muon": {"experts": False}}))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    decayed = {names[id(p)] for g in opt.param_groups if not g["muon"] and g["weight_decay"] == 0.1
               for p in g["params"]}
    assert not any(".experts." in n for n in muon)
    assert {"blocks.0.ffn.experts.gate_up", "blocks.0.ffn.experts.down"} <= decayed
    assert {"blocks.0.attn.q_proj.weight", "blocks.0.ffn.shared_expert.up_proj.weight"} <= muon


def test_experts_in_turn_refresh_n_experts_a_step_and_reuse_the_rest():
    """muon.experts_per_step: step 1 orthogonalises every expert (the same as plain Muon); from then on
    experts (t·n .. t·n + n - 1) mod N get a fresh orthogonalised update at turn t, and every other expert
    steps along the one it got last, so each step's Newton-Schulz work is n experts' whatever N is."""
    n_exp, d, h, lr, n = 4, 32, 48, 0.02, 3
    torch.manual_seed(0)
    turned, plain = Experts(n_exp, d, h), Experts(n_exp, d, h)
    for p in (*turned.parameters(), *plain.parameters()):
        torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
    ours = MuonAdamW([{"params": [turned.down], "muon": True, "layout": "experts", "blocks": 1, "lr": lr,
                       "ns_experts": n}])
    ref = MuonAdamW([{"params": [plain.down], "muon": True, "layout": "experts", "blocks": 1, "lr": lr}])
    scale = max(1.0, d / h) ** 0.5
    last = None
    for step, grad in enumerate(_grads(turned.down.shape, 7)):
        before = turned.down.detach().clone()
        turned.down.grad, plain.down.grad = grad.clone(), grad.clone()
        plain_before = plain.down.detach().clone()
        ours.step()
        ref.step()
        taken = (before - turned.down.detach()) / (lr * scale)  # the orthogonalised update each expert took
        fresh = (plain_before - plain.down.detach()) / (lr * scale)  # what plain Muon took (same momentum)
        refreshed = set(range(n_exp)) if step == 0 else {e % n_exp for e in range((step - 1) * n, step * n)}
        for e in range(n_exp):
            want = fresh[e] if e in refreshed else last[e]
            torch.testing.assert_close(taken[e], want, atol=1e-6, rtol=1e-5, msg=f"step {step}, expert {e}")
        assert step == 0 or not torch.allclose(taken, fresh, atol=1e-4)  # some experts really reused
        last = taken
        turned.down.data.copy_(plain.down)  # the same weights again, so that only the update is compared


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_training_step_lowers_the_loss(optimizer):
    torch.manual_seed(0)
    model = build_model(preset("tiny"))
    opt = make_optimizer(model, TrainConfig(optimizer=optimizer, lr=3e-3))
    x = torch.randint(0, 64, (4, 32))
    first = None
    for _ in range(5):
        loss = model.loss(x[:, :-1], x[:, 1:]).total
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert model.loss(x[:, :-1], x[:, 1:]).total.item() < first - 0.1


def test_one_newton_schulz_loop_per_shape_steps_as_one_per_parameter(monkeypatch):
    """The step stacks the matrices of one shape across parameters (every layer's query projections, every
    layer's experts whose turn it is) into one orthogonalisation: the weights it gives equal those of one
    orthogonalisation per parameter (the step before it), experts in turn included, over a few steps."""
    import nanollama4.training.optim as optim

    cfg = preset("tiny")
    tc = TrainConfig(optimizer="muon", settings={"muon": {"experts_per_step": 1}})
    models, optimizers = [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model(cfg))
        optimizers.append(make_optimizer(models[-1], tc))
    start = [p.detach().clone() for p in models[0].parameters()]
    calls = []
    real = optim.orthogonalize

    def counted(g, *a, **k):
        calls.append(g.shape)
        return real(g, *a, **k)

    monkeypatch.setattr(optim, "orthogonalize", counted)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in models[0].parameters()]
        for model in models:
            for p, grad in zip(model.parameters(), grads, strict=True):
                p.grad = grad.clone()
        calls.clear()
        optimizers[0].step()  # batched by shape
        batched = len(calls)
        with monkeypatch.context() as m:  # one orthogonalisation per parameter, as before
            m.setattr(optim, "orthogonalize_all", lambda batches: [real(b) for b in batches])
            optimizers[1].step()
        assert batched < sum(1 for g in optimizers[0].param_groups if g["muon"] for _ in g["params"])
        # Two code paths (one bmm over a stack against one mm per matrix): the bf16 Newton-Schulz products may
        # round apart on another CPU, moving an update by about 2^-8 of itself; 1/32 of the steps' movement.
        for a, b, a0 in zip(models[0].parameters(), models[1].parameters(), start, strict=True):
            torch.testing.assert_close(a, b, atol=max((a - a0).abs().max().item() / 32, 1e-7), rtol=0)


# ---------------------------------------------------------------------------------------------- the kinds
SGD_NAME = "sgd-momentum"


@pytest.fixture
def sgd() -> Iterator[type[OptimizerKind]]:
    """SGD with momentum 0.9, registered for one test (a module passed to --import registers for good)."""

    @dataclasses.dataclass
    class SGDSettings:
        momentum: Decay = 0.9  # the momentum of every weight

    class SGD(OptimizerKind, name=SGD_NAME, about="SGD with momentum"):
        Settings = SGDSettings

        @classmethod
        def build(cls, model, tc):
            return torch.optim.SGD(trainable_parameters(model), lr=tc.lr, momentum=cls.settings(tc).momentum)

        @classmethod
        def state_count(cls, counts):
            return counts.total  # one momentum per weight

    yield SGD
    OPTIMIZERS.remove(SGD_NAME)


def settings(**changes) -> SimpleNamespace:
    """TrainConfig's fields with some changed and not validated: what a kind is asked about, whether or not the
    config would let those settings through (it refuses LoRA without --init-from, say)."""
    tc = TrainConfig()
    return SimpleNamespace(**{**{f.name: getattr(tc, f.name) for f in dataclasses.fields(tc)}, **changes})


def test_the_built_in_kinds_and_what_they_read():
    assert own_fields(OPTIMIZERS["adamw"]) == ()
    assert [f.name for f in own_fields(OPTIMIZERS["muon"])] == ["lr", "momentum", "weight_decay", "experts",
                                                               "experts_per_step"]
    for kind in OPTIMIZERS.values():
        assert set(kind.keeps) <= {f.name for f in own_fields(kind)}, kind.name
    assert optimizer_kind("muon") is OPTIMIZERS["muon"]


def test_old_runs_flat_keys_load_as_the_kinds_own():
    """train_config.json of runs saved before Muon owned its settings: muon_lr and the rest at the top."""
    old = {"optimizer": "muon", "muon_lr": 0.05, "muon_momentum": 0.9, "muon_weight_decay": 0.01,
           "muon_experts": False, "muon_experts_per_step": 2}
    tc = TrainConfig.from_dict(old)
    assert dataclasses.asdict(tc.settings["muon"]) == {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01,
                                                       "experts": False, "experts_per_step": 2}
    assert "muon_lr" not in tc.to_dict() and tc.to_dict()["muon.lr"] == 0.05
    assert TrainConfig.from_dict({**old, "muon.lr": 0.07}).settings["muon"].lr == 0.07  # today's key wins
    with pytest.raises(ConfigError, match=r"muon.momentum \(1.5\) must be in \[0, 1\)"):
        TrainConfig.from_dict({**old, "muon_momentum": 1.5})


def test_an_unknown_optimizer_names_the_kinds_there_are():
    with pytest.raises(ConfigError) as info:
        optimizer_kind("lion")
    assert str(info.value).startswith("optimizer ('lion') must be one of: 'adamw' (AdamW on every parameter), "
                                      "'muon' (Muon for the hidden matrices, AdamW for the rest)")
    assert "--import MODULE" in str(info.value)


def test_the_schedule_scales_each_group_s_own_peak():
    """Muon's groups peak at muon.lr, AdamW's at lr, both at the schedule's one share of it."""
    model = build_model(preset("tiny", vocab_size=64))
    tc = TrainConfig(optimizer="muon", lr=3e-3, min_lr=3e-4, max_steps=20, warmup_steps=4,
                     settings={"muon": {"lr": 0.05}})
    opt = make_optimizer(model, tc)
    peaks = peak_lrs(opt, tc)
    assert peaks == [0.05 if g.get("muon") else 3e-3 for g in opt.param_groups] and 0.05 in peaks and 3e-3 in peaks
    assert [g["lr"] for g in opt.param_groups] == peaks  # built at the peaks
    scale = lr_scale(tc, 1, 0.0)
    set_lr(opt, tc, scale)
    assert scale == 0.5 and [g["lr"] for g in opt.param_groups] == [scale * p for p in peaks]
    assert logged_lr(tc, scale) == scale * 3e-3  # what metrics.jsonl logs: AdamW's lr


def test_muon_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="optimizer=muon with parallel=fsdp is not supported"):
        OPTIMIZERS["muon"].check(TrainConfig(optimizer="muon", parallel="fsdp"))
    with pytest.raises(ConfigError, match="optimizer=muon with parallel=fsdp is not supported"):
        check(World(), TrainConfig(optimizer="muon", parallel="fsdp"), preset("tiny"))  # before any spread
    with pytest.raises(ConfigError, match="lora_rank trains with optimizer=adamw, not 'muon'"):
        OPTIMIZERS["muon"].check(settings(lora_rank=4, optimizer="muon"))
    OPTIMIZERS["adamw"].check(settings(parallel="fsdp", lora_rank=4))


def test_a_registered_optimizer_answers_every_question(sgd):
    """Build, peaks, refusals and state size come from the one class: nothing else names it."""
    assert optimizer_kind(SGD_NAME) is sgd
    with pytest.raises(ConfigError, match="'sgd-momentum' \\(SGD with momentum\\)"):
        optimizer_kind("x")
    tc = TrainConfig(optimizer=SGD_NAME, lr=0.1, max_steps=10, warmup_steps=0)
    model = build_model(preset("tiny", vocab_size=64))
    opt = make_optimizer(model, tc)
    assert isinstance(opt, torch.optim.SGD)
    set_lr(opt, tc, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.05]
    sgd.check(settings(optimizer=SGD_NAME, parallel="fsdp"))  # nothing refused
    cfg = preset("tiny", vocab_size=64)
    adamw, mine = (training_memory(cfg, 4, 32, name).state for name in ("adamw", SGD_NAME))
    assert adamw - mine == 4 * param_counts(cfg).total  # one moment per weight fewer, 4 bytes each
    assert sgd.describe(tc, 0) == "sgd-momentum at 0.1"


def test_a_registered_optimizer_trains_and_resumes_through_train(sgd, corpus, tmp_path, capsys):
    """The thought experiment: a user's optimizer, named in a TrainConfig, trains a few steps, saves its
    state with the checkpoint and resumes from it, as AdamW and Muon do."""
    settings = dict(seq_len=32, batch_size=4, eval_batches=2, eval_interval=2, warmup_steps=1, lr=0.05,
                    min_lr=0.005, max_steps=3)
    tc = TrainConfig(optimizer=SGD_NAME, **settings, settings={SGD_NAME: {"momentum": 0.5}})  # asks the registry
    run = tmp_path / "run"
    result = train(preset("tiny"), tc, run, data=str(corpus), progress=False, summary=True)
    assert result.step == 3 and math.isfinite(result.val_loss)
    assert "sgd-momentum at 0.05" in capsys.readouterr().out  # the summary asks the kind
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "lm_loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3] and steps[0]["lr"] == pytest.approx(0.05)  # warmup: 1 step
    saved = json.loads((run / "last" / "train_config.json").read_text())
    assert saved["optimizer"] == SGD_NAME and saved[f"{SGD_NAME}.momentum"] == 0.5
    assert f"[train.{SGD_NAME}]" in (run / "config.toml").read_text()
    assert any(k.endswith(".momentum_buffer") for k in load_file(run / "last" / "optimizer.safetensors"))
    resumed = train(None, resume_config(run, max_steps=5), run, resume=True, progress=False)
    assert resumed.step == 5 and math.isfinite(resumed.val_loss)



def test_newton_schulz_iterates_in_float32_where_the_cpu_emulates_bf16(monkeypatch):
    """On an AVX2-only CPU torch emulates bf16 products (24x float32's time on a Zen 3: the GPU check's dry run
    took over 15 minutes in Muon's step); with AMX or AVX512_BF16, and on a GPU, bf16 as torch's Muon."""
    import nanollama4.training.optim as optim
    from nanollama4.base.runtime import cpu_flags

    for flags, want in (("fpu avx2 fma", torch.float32), ("avx2 avx512f avx512_bf16", torch.bfloat16),
                        ("avx2 amx_bf16", torch.bfloat16)):
        monkeypatch.setattr(optim, "cpu_flags", lambda f=flags: cpu_flags(f"flags\t: {f}\n"))
        optim._cpu_iterates_in_float32.cache_clear()
        assert optim.newton_schulz_dtype(torch.device("cpu")) == want, flags
        assert optim.newton_schulz_dtype(torch.device("cuda")) == torch.bfloat16
        assert orthogonalize(torch.randn(2, 8, 12)).dtype == want, flags  # the dtype it iterated in
    optim._cpu_iterates_in_float32.cache_clear()
