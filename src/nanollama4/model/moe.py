"""Feed-forward layers: the SwiGLU MLP and the mixture of experts built from it.

Reading map. `MoE.forward` is the whole story, in order:
  1. route      the router (router.py): logits -> (noise, choice bias) -> top-k, or capacity with
                overflow to each token's next-best expert -> the weights its kind computes
  2. assign     `Routing.assignments`: the (token, expert, weight) triples that found room
  3. experts    `Experts.forward`: sort the rows by expert -> one SwiGLU product per expert -> add back
  4. shared     the always-on shared expert, on every token
  5. losses     the router's `auxiliary_loss` (Switch load balancing + router z-loss), and the counts
                its auxiliary-loss-free choice bias learns from (`Router.update_bias`)
`moe_reference` computes the same layer plainly (every expert on every token) for the tests.

Only the chosen experts run, so compute grows with k, not N. This file is the plain math: how fast the
grouped rows are multiplied (our CPU kernel, grouped_mm, padding, a few-row decode path) is
`ops.experts.FastExperts`, which `ops.install` swaps in for `Experts` from outside.

Shape suffixes: T tokens (batch x sequence, flattened), D model width, H expert hidden width (the shared
expert has a width of its own, `ModelConfig.shared_dim`), E experts,
K experts per token (top-k), A assignments (kept (token, expert) pairs, at most T x K). So x_TD is the
tokens' input, experts_TK each token's chosen experts, counts_E the rows per expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..base.config import ModelConfig
from .router import Routing, router_class


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the dense FFN and the shared expert. With `std`, the matrices
    start as the model starts them (Normal(0, std), `down` at out_std); else as nn.Linear does."""

    def __init__(self, d_model: int, hidden: int, std: float | None = None, out_std: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)
        if std is not None:
            for linear in (self.gate_proj, self.up_proj):
                nn.init.normal_(linear.weight, std=std)
            nn.init.normal_(self.down_proj.weight, std=std if out_std is None else out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------- the layer
@dataclass
class LastPass:
    """What `counts` and `stats` read of the last forward pass (tensors: reading them is the caller's sync)."""

    expert_A: torch.Tensor  # each kept assignment's expert
    slots: int  # tokens x top-k: the assignments there would be with every slot kept
    rerouted: torch.Tensor | None = None  # training only: assignments past a token's top-k (capacity)
    dropped: torch.Tensor | None = None  # training only: slots that found no room
    logits_TE: torch.Tensor | None = None  # training only: the router logits, for the entropy


class MoE(nn.Module):
    """Router + routed experts + shared expert, on flattened tokens.

    The router (`router.Router`, the kind the config names) decides each token's experts and weights, and
    whether a weight scales the expert's input (Llama 4's sigmoid router) or its output (the tutorial's
    softmax). After each forward pass, `aux_loss` holds the weighted load-balancing + z-loss (a zero
    tensor when both coefficients are 0 or in eval mode), and `counts`/`stats` describe the routing
    (tensors, no host sync).
    """

    aux_loss: torch.Tensor  # this pass's auxiliary loss, which `Transformer.loss` adds to the LM loss
    last: LastPass | None  # the last forward pass's routing, for `counts` and `stats`

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        # each part starts as `Transformer.reset_parameters` starts it, so that an MoE(cfg) swapped into a
        # built model trains like one built with it (the outputs into the residual stream shrunk alike)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.router = router_class(cfg.router)(cfg)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.expert_dim, cfg.init_std, out_std)
        self.shared_expert = SwiGLU(cfg.d_model, cfg.shared_dim, cfg.init_std, out_std) if cfg.shared_expert else None
        self.last, self._counts = None, None
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x_TD = x.reshape(B * T, d)
        r = self.route(x_TD)
        token_A, expert_A, weight_A = r.assignments()
        y_TD = self.experts(x_TD, token_A, expert_A, weight_A, self.router.scales_input)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        self._remember(r, expert_A, B * T)
        self.aux_loss = self.router.auxiliary_loss(r, self.counts, B * T * self.top_k) if self.training \
            else r.logits_TE.new_zeros(())
        if self.training:
            self.router.note_load(self.counts)
        return y_TD.view(B, T, d)

    def route(self, x_TD: torch.Tensor) -> Routing:
        """The router's decision for these tokens (observers wrap this method to keep it)."""
        return self.router(x_TD)

    # ------------------------------------------------------------------------------------------ statistics
    def _remember(self, r: Routing, expert_A: torch.Tensor, n_tokens: int) -> None:
        """Keep what `counts` and `stats` read. What the step itself does not use (counts without balancing,
        the fractions, the entropy) is derived when they are read, so decoding does not pay for it."""
        self.last = LastPass(expert_A, n_tokens * self.top_k)
        if self.training:
            self.last.rerouted, self.last.dropped, self.last.logits_TE = r.rerouted, r.dropped, r.logits_TE.detach()
        self._counts = None

    @property
    def counts(self) -> torch.Tensor | None:
        """Assignments per expert in the last forward pass (E,), or None before the first; counted once per
        pass, and the same tensor for every caller."""
        if self.last is None:
            return None
        if self._counts is None:
            self._counts = count_per_expert(self.last.expert_A, self.n_experts)
        return self._counts

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """The last forward pass's routing, as tensors (reading them is the caller's sync): assignments per
        expert (`counts`), the most and least loaded expert over a uniform share, and every declared
        `ROUTING_STATISTICS` entry that has a value now (the per-step ones after a training pass: the
        rerouted and dropped shares, the router entropy, the balancing loss and z-loss without their
        coefficients, whether or not the run trains on them); {} before the first pass."""
        counts_E = self.counts
        if counts_E is None:
            return {}
        mean_load = self.last.slots / self.n_experts
        out = {"counts": counts_E, "max_load": counts_E.max().float() / mean_load,
               "min_load": counts_E.min().float() / mean_load}
        for stat in ROUTING_STATISTICS:
            value = stat.read(self)
            if value is not None:
                out[stat.name] = value
        return out


# ---------------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class RoutingStatistic:
    """One routing statistic, declared once beside what it reads: metrics.jsonl's routing block, TensorBoard
    (routing/layerN/NAME), `plot`'s and `compare`'s routing panels all take it from `ROUTING_STATISTICS`."""

    name: str  # its key in the validation line's "routing" block and in `MoE.stats`
    meaning: str  # the title of its plot panel
    unit: str  # the panel's y label
    read: Callable[[MoE], torch.Tensor | None]  # its value for one MoE layer now (None: none now)
    pooled: Literal["mean", "now"] = "mean"  # each training step's value averaged between validations, or
    # the value read at the validation itself
    factor: float = 1.0  # shown at this factor (a share as a percentage: 100)
    panel: str | None = None  # drawn in the panel of this other statistic (a range's low and high)


def _in_training(read: Callable[[LastPass], torch.Tensor]) -> Callable[[MoE], torch.Tensor | None]:
    """A statistic of the last pass when it was a training pass (rerouting, drops and the logits are kept then)."""
    return lambda moe: read(moe.last) if moe.last is not None and moe.last.logits_TE is not None else None


def _probs(last: LastPass) -> torch.Tensor:
    return last.logits_TE.softmax(-1)


def _entropy(last: LastPass) -> torch.Tensor:
    """The router's mean entropy over the tokens, in nats."""
    probs_TE = _probs(last)
    return -(probs_TE * probs_TE.clamp_min(1e-12).log()).sum(-1).mean()


def _balance(moe: MoE) -> torch.Tensor | None:
    """N · Σ_e f_e · p_e of the last training pass (`Router.auxiliary_loss`'s balancing term)."""
    last = moe.last
    if last is None or last.logits_TE is None:
        return None
    return moe.n_experts * (moe.counts.float() / last.slots * _probs(last).mean(0)).sum()


ROUTING_STATISTICS: list[RoutingStatistic] = [
    RoutingStatistic("rerouted", "Rerouted: slots sent to the next-best expert", "% of top-k slots",
                     _in_training(lambda last: last.rerouted.float() / last.slots), factor=100.0),
    RoutingStatistic("dropped", "Dropped: slots no expert had room for", "% of top-k slots",
                     _in_training(lambda last: last.dropped.float() / last.slots), factor=100.0),
    RoutingStatistic("entropy", "Router entropy (dashed: the maximum, ln E)", "nats", _in_training(_entropy)),
    RoutingStatistic("bias_min", "Balancing bias: lowest and highest (router.expert_bias)", "bias",
                     lambda moe: moe.router.expert_bias.min().float(), pooled="now"),
    RoutingStatistic("bias_max", "", "", lambda moe: moe.router.expert_bias.max().float(), pooled="now",
                     panel="bias_min"),
    RoutingStatistic("balance_loss", "Balance loss N·Σ f·p (1 = balanced)", "without its coefficient",
                     _balance),
    RoutingStatistic("z_loss", "Router z-loss: mean squared log-sum-exp", "without its coefficient",
                     _in_training(lambda last: torch.logsumexp(last.logits_TE, dim=-1).pow(2).mean())),
]


def routing_statistic(stat: RoutingStatistic) -> RoutingStatistic:
    """Declare a routing statistic (or replace the one of its name): from then on it is logged, sent to
    TensorBoard, plotted and compared with the others. Returns it."""
    ROUTING_STATISTICS[:] = [s for s in ROUTING_STATISTICS if s.name != stat.name] + [stat]
    return stat


# ---------------------------------------------------------------------------------------------- 3. experts
class Experts(nn.Module):
    """N SwiGLU experts with fused weights, stored (in, out) as the reference checkpoints store them.

    gate_up (E, D, 2H) holds each expert's gate and up matrices side by side; down is (E, H, D).
    `forward` sorts the assignments' rows by expert, runs `products` (here one plain product pair per
    expert) and adds each result back into its token's row. `ops.experts.FastExperts` replaces
    `products` with faster ones and adds a few-row path for decoding; expert parallelism
    (`distributed.experts`) moves the sorted rows to the rank holding their expert and back, around
    this module.
    """

    def __init__(self, n_experts: int, d_model: int, hidden: int, std: float = 0.02, out_std: float | None = None
                 ) -> None:
        super().__init__()
        self.n_experts, self.hidden = n_experts, hidden
        out_std = std if out_std is None else out_std
        self.gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * hidden).normal_(std=std))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, d_model).normal_(std=out_std))

    def forward(self, x_TD: torch.Tensor, token_A: torch.Tensor, expert_A: torch.Tensor, weight_A: torch.Tensor,
                scale_input: bool) -> torch.Tensor:
        """Sum over assignments a of weight_a-scaled SwiGLU_{expert_a}(x[token_a]), per token. Returns (T, D).

        Assignments are (token, expert, weight) triples, any order; weights scale the expert's input
        (Llama 4) or its output (tutorial).
        """
        rows = sort_by_expert(x_TD, token_A, expert_A, weight_A, self.n_experts, scale_input)
        return combine(self.products(rows.x_AD, rows.counts_E), rows, x_TD, scale_input)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, d_model={self.gate_up.shape[-2]}, hidden={self.hidden}"

    def products(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """SwiGLU_e(x_a) for rows sorted by expert, counts_E rows each. Returns (A, D)."""
        return per_expert_products(x_AD, *self.weights(), counts_E)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up and down as tensors to multiply by. (Expert parallelism under FSDP2 holds this rank's
        experts as DTensor shards, whose local part is what this rank multiplies.)"""
        return _local(self.gate_up), _local(self.down)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


@dataclass
class ExpertRows:
    """Assignments sorted by expert: each one's row of x (already scaled when the weight scales the input),
    the rows per expert, and what `combine` needs to add results back."""

    x_AD: torch.Tensor  # the rows, grouped by expert
    counts_E: torch.Tensor  # rows per expert
    token_A: torch.Tensor  # each row's token
    weight_A1: torch.Tensor  # each row's weight, (A, 1) in x's dtype


def sort_by_expert(x_TD: torch.Tensor, token_A: torch.Tensor, expert_A: torch.Tensor, weight_A: torch.Tensor,
                   n_experts: int, scale_input: bool) -> ExpertRows:
    """Gather the assignments' rows in expert order, so that each expert multiplies one contiguous block."""
    expert_A, order_A = torch.sort(expert_A, stable=True)
    token_A, weight_A1 = token_A[order_A], weight_A[order_A].unsqueeze(1).to(x_TD.dtype)
    x_AD = x_TD.index_select(0, token_A)  # backward: index_add_ (x_TD[token_A] would use index_put_)
    if scale_input:
        x_AD = x_AD * weight_A1
    return ExpertRows(x_AD, count_per_expert(expert_A, n_experts), token_A, weight_A1)


def combine(y_AD: torch.Tensor, rows: ExpertRows, x_TD: torch.Tensor, scale_input: bool) -> torch.Tensor:
    """Add each row's expert output (scaled when the weight scales the output) into its token's row: (T, D)."""
    if not scale_input:
        y_AD = y_AD * rows.weight_A1
    return torch.zeros_like(x_TD).index_add_(0, rows.token_A, y_AD.to(x_TD.dtype))


def per_expert_products(x_AD: torch.Tensor, gate_up_EDH: torch.Tensor, down_EHD: torch.Tensor,
                        counts_E: torch.Tensor) -> torch.Tensor:
    """One expert at a time: SwiGLU_e on its block of counts_E[e] rows. split/unbind make one backward node
    each; indexing gate_up[e] per expert would instead build a full-size zero gradient for every expert."""
    outs = []
    for x_e, w1, w2 in zip(x_AD.split(counts_E.tolist()), gate_up_EDH.unbind(0), down_EHD.unbind(0), strict=True):
        gate, up = (x_e @ w1).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w2)
    return torch.cat(outs) if outs else x_AD.new_zeros(0, down_EHD.shape[-1])


def count_per_expert(expert_A: torch.Tensor, n_experts: int) -> torch.Tensor:
    """bincount(expert_A, minlength=n_experts), in a form whose output shape torch.compile knows ahead."""
    zeros_E = torch.zeros(n_experts, dtype=torch.long, device=expert_A.device)
    return zeros_E.index_add_(0, expert_A, torch.ones_like(expert_A))


# ---------------------------------------------------------------------------------------------- reference
def moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same MoE computed plainly: every expert on every token, weight 0 for the ones not chosen.

    Slow (cost grows with N) and obvious; tests check the sparse dispatch against it. Routing is shared
    with the fast path (call it with the same RNG state when noise is on).
    """
    B, T, d = x.shape
    x_TD = x.reshape(B * T, d)
    r = moe.route(x_TD)
    weights_TK = r.weights_TK if r.valid_TK is None else r.weights_TK * r.valid_TK
    dense_TE = torch.zeros(B * T, moe.n_experts, dtype=torch.float32, device=x.device)
    dense_TE.scatter_add_(1, r.experts_TK, weights_TK)
    dense_TE = dense_TE.to(x.dtype)
    y_TD = torch.zeros_like(x_TD)
    for e in range(moe.n_experts):
        w_T1 = dense_TE[:, e:e + 1]
        inp = x_TD * w_T1 if moe.router.scales_input else x_TD
        gate, up = (inp @ moe.experts.gate_up[e]).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ moe.experts.down[e]
        y_TD = y_TD + (out if moe.router.scales_input else out * w_T1)
    if moe.shared_expert is not None:
        y_TD = y_TD + moe.shared_expert(x_TD)
    return y_TD.view(B, T, d)
