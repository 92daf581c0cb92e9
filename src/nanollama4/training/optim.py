"""Optimizers: AdamW for everything, or Muon for the hidden matrices and AdamW for the rest.

Muon (Keller Jordan, 2024) replaces each hidden matrix's update by the nearest semi-orthogonal matrix to its
(Nesterov) momentum, found by a few Newton–Schulz iterations: every direction of the matrix moves by about
the same amount, where Adam's update is dominated by a few. It is meant for matrices that map one hidden
space to another, so the embedding, the LM head, the norms' gains and the router (whose rows are per-expert
scores, not a map) stay on AdamW, as in the speedruns that made Muon known.

torch.optim.Muon takes 2-D parameters only, one at a time. The routed experts are one 3-D parameter per
layer, (experts, in, out); `MuonAdamW` orthogonalises each expert's matrices on their own, and gate and up
(stored side by side as one (in, 2 x hidden) matrix per expert) each on their own, as the shared expert's
separate gate and up projections are: all of a layer's expert matrices in one batched product. Both kinds
of parameter live in one optimizer, so a checkpoint saves one state and a resume restores it whole.

Newton–Schulz on every expert costs in proportion to N, the total parameters, which an MoE is meant not to
pay. With `ns_experts` = n > 0 on a group of expert matrices, each step re-orthogonalises n experts of
each layer in turn (experts (t·n) mod N … (t·n + n − 1) mod N at that parameter's t-th step) and every
other expert steps along the orthogonalised update it got last (kept as `ortho`, in the parameter's
dtype, saved with the momentum): Muon's momentum moves slowly (0.95 keeps ~20 steps), so a direction a few steps old
is close to today's, and the cost per step is n experts' whatever N is. The first step orthogonalises all.

Which optimizer a run uses is a name in its config (`optimizer`), looked up in `parts.OPTIMIZERS`. A kind
is one subclass of `OptimizerKind` with `name=` (`parts.Kind`), and answers everything the rest of the
package asks about an optimizer: its own settings (a `Settings` dataclass: `[train.muon]` in a config file,
`--set muon.lr=0.01`), how it is built, each param group's peak learning rate (the schedule scales it),
what it refuses, its state's size (the memory check) and a line for the run's summary. So adding one is
one subclass, here or in a module of your own loaded with --import:

    @dataclass
    class SGDSettings:
        momentum: float = 0.9  # the momentum of every weight

    class SGD(OptimizerKind, name="sgd", about="SGD with momentum"):
        Settings = SGDSettings

        @classmethod
        def build(cls, model, tc):
            own = cls.settings(tc)
            return torch.optim.SGD(trainable_parameters(model), lr=tc.lr, momentum=own.momentum)

        @classmethod
        def state_count(cls, counts):
            return counts.total  # one momentum per weight
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.optim.adamw import adamw

from ..base.config import Decay, NonNegative, TrainConfig, Turns
from ..base.errors import ConfigError
from ..base.parts import OPTIMIZERS, Kind
from ..base.runtime import cpu_flags, native_bf16

# The quintic Newton-Schulz coefficients of Keller Jordan's Muon (those torch.optim.Muon uses): chosen for
# the steepest slope at zero, so that 5 iterations push every singular value into roughly [0.7, 1.2].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
STACK_ELEMENTS = 1 << 21  # `orthogonalize_all` stacks matrices of one shape up to about this many values a call


@functools.cache
def _cpu_iterates_in_float32() -> bool:
    """Whether this CPU lacks bf16 product instructions (its x86 flags list neither AMX nor AVX512_BF16)."""
    flags = cpu_flags()
    return flags is not None and native_bf16(flags) is None


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16, as torch.optim.Muon iterates, where its products are native (a GPU; a CPU with AMX or
    AVX512_BF16); float32 on a CPU where torch emulates bf16 (most laptops, AVX2-only): there bf16
    products are many times slower than float32's and the optimizer step dwarfed the model's (RESULTS.md,
    "An optimizer step"). float32 iterates at least as accurately; the update differs by bf16's rounding."""
    return torch.float32 if device.type == "cpu" and _cpu_iterates_in_float32() else torch.bfloat16


def orthogonalize(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """An approximately semi-orthogonal matrix near each matrix of g (..., rows, cols): U V^T of its SVD,
    its singular values brought near 1 by Newton-Schulz iterations in bf16 (as torch.optim.Muon does), or
    float32 where the CPU has no bf16 products (`newton_schulz_dtype`)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(newton_schulz_dtype(g.device)).reshape(-1, *g.shape[-2:])
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):  # x <- a x + (b G + c G^2) x with G = x x^T, each product fused with its sum
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x if wide else x.mT).reshape(g.shape)


def orthogonalize_all(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """`orthogonalize` of each (k, rows, cols) batch in `batches`, the batches of one shape stacked, up to
    STACK_ELEMENTS values, and done in one call: an optimizer step then runs one Newton-Schulz loop for the
    4 layers' query projections, or every layer's experts whose turn it is, not one per parameter. Small
    matrices gain most (a loop's ten products are each too small to fill the cores); a stack of large ones
    only adds its copy, hence the cap (benchmarks/optimizer_step.py --before). Each matrix's iteration is its
    own whatever it is stacked with: the norm and the products are per matrix."""
    stacks: dict[tuple[int, int], list[list[int]]] = {}
    for i, b in enumerate(batches):
        runs = stacks.setdefault(tuple(b.shape[-2:]), [[]])
        if runs[-1] and sum(batches[j].numel() for j in runs[-1]) + b.numel() > STACK_ELEMENTS:
            runs.append([])
        runs[-1].append(i)
    out: list[torch.Tensor] = [batches[0]] * len(batches)
    for members in (run for runs in stacks.values() for run in runs):
        done = orthogonalize(torch.cat([batches[i] for i in members]) if len(members) > 1 else batches[members[0]])
        for i, part in zip(members, done.split([batches[i].shape[0] for i in members]), strict=True):
            out[i] = part
    return out


def _as_matrices(t: torch.Tensor, layout: str, blocks: int) -> torch.Tensor:
    """t as a batch of (fan_out, fan_in) matrices. "linear": nn.Linear's (out, in); "experts": a stack of
    (in, out) expert matrices whose out holds `blocks` equal matrices side by side (gate and up)."""
    if layout == "linear":
        return t.unsqueeze(0)
    e, d_in, d_out = t.shape
    return t.view(e, d_in, blocks, d_out // blocks).permute(0, 2, 3, 1).reshape(e * blocks, d_out // blocks, d_in)


def _from_matrices(m: torch.Tensor, like: torch.Tensor, layout: str, blocks: int) -> torch.Tensor:
    """The inverse of `_as_matrices`."""
    if layout == "linear":
        return m.squeeze(0)
    e, d_in, d_out = like.shape
    return m.view(e, blocks, d_out // blocks, d_in).permute(0, 3, 1, 2).reshape(e, d_in, d_out)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups marked {"muon": True, "layout": ..., "blocks": ...}, AdamW on the others.

    Muon's step, per matrix W with gradient G: B <- momentum·B + (1 - momentum)·G; with Nesterov
    U = (1 - momentum)·G + momentum·B; W <- (1 - lr·wd)·W - lr·sqrt(max(1, fan_out/fan_in))·NS(U). That is
    torch.optim.Muon's step with its default ("original") scaling, which `tests/test_optim.py` checks on
    one expert's matrices. AdamW's is torch's fused one.
    """

    def __init__(self, groups: list[dict[str, Any]], betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8,
                 momentum: float = 0.95, nesterov: bool = True) -> None:
        super().__init__(groups, dict(betas=betas, eps=eps, momentum=momentum, nesterov=nesterov, muon=False,
                                      layout="linear", blocks=1, weight_decay=0.0, ns_experts=0))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(group, params)
        return loss

    def _muon(self, group: dict[str, Any], params: list[nn.Parameter]) -> None:
        """Momentum per matrix, then every matrix of the group orthogonalised in one Newton-Schulz loop per
        shape (`orthogonalize_all`), then the updates."""
        lr, wd, m = group["lr"], group["weight_decay"], group["momentum"]
        layout, blocks, n = group["layout"], group["blocks"], group["ns_experts"]
        updates, asked = [], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - m)
            update = p.grad.lerp(buf, m) if group["nesterov"] else buf
            updates.append(update)
            asked.append(_as_matrices(self._due(state, update, layout, n), layout, blocks))
        for p, update, done in zip(params, updates, orthogonalize_all(asked), strict=True):
            ortho = self._placed(self.state[p], update, done, layout, blocks, n)
            fan_out, fan_in = p.shape if layout == "linear" else (p.shape[2] // blocks, p.shape[1])
            p.mul_(1 - lr * wd)
            p.add_(ortho.to(p.dtype), alpha=-lr * math.sqrt(max(1.0, fan_out / fan_in)))

    @staticmethod
    def _in_turn(layout: str, n: int, update: torch.Tensor) -> bool:
        return layout == "experts" and 0 < n < update.shape[0]

    def _due(self, state: dict[str, Any], update: torch.Tensor, layout: str, n: int) -> torch.Tensor:
        """What this step orthogonalises of `update`: all of it, or with experts in turn the n experts whose
        turn it is (all of them at the first step)."""
        if not self._in_turn(layout, n, update) or "ortho" not in state:
            return update
        return update.index_select(0, self._chosen(state, update, n))

    @staticmethod
    def _chosen(state: dict[str, Any], update: torch.Tensor, n: int) -> torch.Tensor:
        turn, experts = state["ns_turn"], update.shape[0]
        return torch.arange(turn * n, turn * n + n, device=update.device) % experts

    def _placed(self, state: dict[str, Any], update: torch.Tensor, done: torch.Tensor, layout: str, blocks: int,
                n: int) -> torch.Tensor:
        """The orthogonalised update of the whole parameter from what `_due` asked for: with experts in turn,
        the fresh experts written into the ones kept from earlier steps, and the turn moved on."""
        if not self._in_turn(layout, n, update):
            return _from_matrices(done, update, layout, blocks)
        if "ortho" not in state:
            state["ortho"] = _from_matrices(done, update, layout, blocks).to(update.dtype)
            state["ns_turn"] = 0
            return state["ortho"]
        chosen = self._chosen(state, update, n)
        fresh = _from_matrices(done, update[:n], layout, blocks)  # (the slice gives only its shape)
        state["ortho"].index_copy_(0, chosen, fresh.to(update.dtype))
        state["ns_turn"] = (state["ns_turn"] + 1) % update.shape[0]
        return state["ortho"]

    def _adamw(self, group: dict[str, Any], params: list[nn.Parameter]) -> None:
        avgs, sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], avgs, sqs, [], steps, fused=True, amsgrad=False,
                beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False)


def _is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """Hidden matrices: the attention projections, the dense SwiGLU, the shared and the routed experts."""
    if p.dim() < 2 or name.startswith(("embed.", "lm_head.")):
        return False
    return ".attn." in name or (".ffn." in name and ".router." not in name)


# ---------------------------------------------------------------------------------------------- the kinds
def optimizer_kind(name: str) -> type[OptimizerKind]:
    """The kind a config's `optimizer` names, or a ConfigError naming the kinds there are."""
    return OPTIMIZERS.find(name)


def make_optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer tc names, over the parameters of `model` that train (`OptimizerKind.build`)."""
    return optimizer_kind(tc.optimizer).build(model, tc)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of `model` that trains: frozen ones (a LoRA run's base) are left out."""
    return [p for _, p in _named_trainable(model)]


def _named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class Counts(Protocol):
    """The parameter counts `state_count` reads (`memory.ParamCounts`)."""

    total: int
    embedding: int
    lm_head: int
    norms: int


class OptimizerKind(Kind):
    """One optimizer a config can name. A subclass registers itself with `name=` (and `about=`, a few words
    for error messages), may declare its own settings (`Settings`, read with `cls.settings(tc)`), and names
    in `keeps` those of them a resume cannot change, each with why (the end of a sentence "RUN was trained
    with KIND.FIELD=VALUE"). It is never instantiated: each method is asked of the class."""

    registry = OPTIMIZERS
    keeps: ClassVar[dict[str, str]] = {}

    @classmethod
    def build(cls, model: nn.Module, tc: TrainConfig) -> torch.optim.Optimizer:
        """The optimizer over `model`'s trainable parameters (`trainable_parameters`), each group at its
        peak learning rate. The loop sets every group's lr from the schedule before each step."""
        raise NotImplementedError

    @classmethod
    def peak_lr(cls, group: dict[str, Any], tc: TrainConfig) -> float:
        """The peak learning rate of one of the optimizer's param groups, which the schedule scales
        (`schedule.set_lr`). Read from tc, not from the group, so that a resume may change it."""
        return tc.lr

    @classmethod
    def check(cls, tc: TrainConfig) -> None:
        """Refuse, with a ConfigError saying why and what to do instead, settings this optimizer cannot
        train with (a spread over ranks, LoRA); before anything is created."""

    @classmethod
    def state_count(cls, counts: Counts) -> int:
        """The numbers the optimizer keeps per model of these parameter counts (`memory.training_memory`;
        it errs low): two moments per weight, as AdamW, unless a kind says otherwise."""
        return 2 * counts.total

    @classmethod
    def describe(cls, tc: TrainConfig, n_experts: int) -> str:
        """The optimizer in a few words for the run's summary (`train.run_summary`), its peak lr included."""
        return f"{cls.name} at {tc.lr:g}"


class AdamW(OptimizerKind, name="adamw", about="AdamW on every parameter"):
    """torch's fused AdamW on every trainable parameter; weight decay on the matrices only, since decaying
    the norms' gains toward 0 would fight the norm."""

    @classmethod
    def build(cls, model: nn.Module, tc: TrainConfig) -> torch.optim.Optimizer:
        named = _named_trainable(model)
        groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": tc.weight_decay},
                  {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
        # fused: one pass over each tensor instead of a kernel per operation
        return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=True)

    @classmethod
    def describe(cls, tc: TrainConfig, n_experts: int) -> str:
        return f"AdamW at {tc.lr:g}"


@dataclass
class MuonSettings:
    """Muon's own settings ([train.muon]; `--set muon.lr=0.01`): those of the hidden matrices. The rest of
    the parameters take AdamW's (TrainConfig's lr, weight_decay, beta1, beta2)."""

    lr: NonNegative = 0.02  # peak learning rate of the hidden matrices (scaled per shape)
    momentum: Decay = 0.95  # momentum of the hidden matrices (Nesterov)
    weight_decay: NonNegative = 0.0  # decoupled decay of the hidden matrices (per step: lr x this)
    experts: bool = True  # Muon for the routed experts too (False: AdamW for them)
    experts_per_step: Turns = 0  # experts per layer re-orthogonalised each step, in turn (0 = all)


class Muon(OptimizerKind, name="muon", about="Muon for the hidden matrices, AdamW for the rest"):
    """`MuonAdamW`: Muon on the hidden matrices, AdamW on the rest. With experts False the routed experts'
    matrices go to AdamW as well: Newton-Schulz on every expert costs in proportion to N, the total
    parameters, which an MoE is meant not to pay for; AdamW's step is elementwise. experts_per_step > 0
    keeps Muon for them but orthogonalises only that many of each layer's experts per step, in turn
    (`MuonAdamW._in_turn`)."""

    Settings = MuonSettings
    formerly = {f"muon_{name}": name for name in ("lr", "momentum", "weight_decay", "experts", "experts_per_step")}
    keeps = {"experts": ", whose expert state the other optimizer cannot take over",
             "experts_per_step": "; a resume keeps it (its experts' saved updates follow that turn)"}

    @classmethod
    def build(cls, model: nn.Module, tc: TrainConfig) -> torch.optim.Optimizer:
        named, own = _named_trainable(model), cls.settings(tc)
        hidden = [(n, p) for n, p in named if _is_hidden_matrix(n, p) and (own.experts or p.dim() != 3)]
        linear = [p for n, p in hidden if p.dim() == 2]
        gate_up = [p for n, p in hidden if p.dim() == 3 and n.endswith("gate_up")]
        down = [p for n, p in hidden if p.dim() == 3 and not n.endswith("gate_up")]
        taken = {id(p) for _, p in hidden}
        rest = [(n, p) for n, p in named if id(p) not in taken]
        muon = dict(muon=True, lr=0.0, weight_decay=own.weight_decay)  # lr below (keys in the saved order)
        experts = dict(muon, layout="experts", ns_experts=own.experts_per_step)
        groups = [{**muon, "params": linear, "layout": "linear", "blocks": 1},
                  {**experts, "params": gate_up, "blocks": 2},
                  {**experts, "params": down, "blocks": 1},
                  {"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": tc.weight_decay},
                  {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        for g in groups:
            g["lr"] = cls.peak_lr(g, tc)
        return MuonAdamW(groups, betas=(tc.beta1, tc.beta2), momentum=own.momentum)

    @classmethod
    def peak_lr(cls, group: dict[str, Any], tc: TrainConfig) -> float:
        return cls.settings(tc).lr if group.get("muon") else tc.lr

    @classmethod
    def check(cls, tc: TrainConfig) -> None:
        if tc.parallel == "fsdp":
            raise ConfigError("optimizer=muon with parallel=fsdp is not supported: Muon orthogonalises whole "
                              "matrices and FSDP2 gives each rank a slice of them; use parallel=ddp "
                              "(expert_parallel works with it) or optimizer=adamw")
        if tc.lora_rank:
            raise ConfigError("lora_rank trains with optimizer=adamw, not 'muon' (Muon orthogonalises whole "
                              "matrices; an adapter is two thin factors)")

    @classmethod
    def state_count(cls, counts: Counts) -> int:
        rest = counts.embedding + counts.lm_head + counts.norms  # on AdamW: two moments each
        return (counts.total - rest) + 2 * rest  # one momentum for each hidden matrix's weight

    @classmethod
    def describe(cls, tc: TrainConfig, n_experts: int) -> str:
        own, experts = cls.settings(tc), ""
        if n_experts:
            experts = ("; routed experts on AdamW" if not own.experts else
                       f"; {own.experts_per_step} of {n_experts} experts a layer orthogonalised per step"
                       if 0 < own.experts_per_step < n_experts else "; every expert every step")
        return f"Muon at {own.lr:g} on the hidden matrices{experts}, AdamW at {tc.lr:g} for the rest"
