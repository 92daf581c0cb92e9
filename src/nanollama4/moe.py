"""Feed-forward layers: the SwiGLU MLP and the mixture of experts built from it.

Reading map. `MoE.forward` is the whole story, in order:
  1. route      `MoE.route`: router logits -> (noise, choice bias) -> top-k, or `assign_with_capacity`
                when an expert capacity applies (full experts overflow to each token's next-best one)
  2. assign     `Routing.assignments`: the (token, expert, weight) triples that found room
  3. experts    `Experts.forward`: sort the rows by expert -> one SwiGLU product per expert -> add back
  4. shared     the always-on shared expert, on every token
  5. losses     `MoE.auxiliary_loss` (Switch load balancing + router z-loss), and the counts that the
                auxiliary-loss-free choice bias learns from (`MoE.update_bias`)
`moe_reference` computes the same layer plainly (every expert on every token) for the tests.

Only the chosen experts run, so compute grows with k, not N. This file is the plain math: how fast the
grouped rows are multiplied (our CPU kernel, grouped_mm, padding, a few-row decode path) is
`ops.experts.FastExperts`, which `ops.install` swaps in for `Experts` from outside.

Shape suffixes: T tokens (batch x sequence, flattened), D model width, H expert hidden width, E experts,
K experts per token (top-k), A assignments (kept (token, expert) pairs, at most T x K). So x_TD is the
tokens' input, experts_TK each token's chosen experts, counts_E the rows per expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the dense FFN and the shared expert."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------- the layer
class MoE(nn.Module):
    """Router + routed experts + shared expert, on flattened tokens.

    `sigmoid` router (Llama 4): top-k of the router logits, sigmoid of each chosen logit, and that score
    multiplies the expert's *input*. `softmax` router (the tutorial): the non-chosen logits are set to
    -inf before a softmax, and the weights multiply the experts' *outputs*.

    After each forward pass, `aux_loss` holds the weighted load-balancing + z-loss (a zero tensor when
    both coefficients are 0 or in eval mode), and `counts`/`stats` describe the routing (tensors, no host
    sync).
    """

    aux_loss: torch.Tensor  # this pass's auxiliary loss, which `Transformer.loss` adds to the LM loss
    _assigned: tuple[torch.Tensor, int] | None  # the last pass's expert ids and slot count
    _counts: torch.Tensor | None  # counted from _assigned when first needed
    _training: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rerouted, dropped, logits (training)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.kind = cfg.n_experts, cfg.experts_per_token, cfg.router
        self.noise_kind, self.noise_std = cfg.router_noise, cfg.router_noise_std
        self.capacity_factor, self.capacity_in_eval = cfg.capacity_factor, cfg.capacity_in_eval
        self.overflow, self.softmax_over = cfg.capacity_overflow == "next", cfg.softmax_over
        self.aux_coef, self.z_coef, self.bias_rate = cfg.aux_loss_coef, cfg.z_loss_coef, cfg.bias_balance_rate
        self.router = Float32Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.noise = Float32Linear(cfg.d_model, cfg.n_experts, bias=False) if cfg.router_noise == "learned" else None
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.expert_dim)
        self.shared_expert = SwiGLU(cfg.d_model, cfg.expert_dim) if cfg.shared_expert else None
        # Auxiliary-loss-free balancing: added to the scores for the top-k choice only, never to weights.
        self.register_buffer("router_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("pending_counts", torch.zeros(cfg.n_experts), persistent=False)
        self._assigned = self._counts = self._training = None
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x_TD = x.reshape(B * T, d)
        r = self.route(x_TD)
        token_A, expert_A, weight_A = r.assignments()
        y_TD = self.experts(x_TD, token_A, expert_A, weight_A, self.kind == "sigmoid")
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        self._remember(r, expert_A, B * T)
        self.aux_loss = self.auxiliary_loss(r) if self.training else r.logits_TE.new_zeros(())
        if self.training and self.bias_rate:
            self.pending_counts += self.counts.float()
        return y_TD.view(B, T, d)

    # ------------------------------------------------------------------------------------------ 1. routing
    def capacity(self, n_tokens: int) -> int | None:
        """Slots per expert for this batch, or None when routing is dropless."""
        applies = self.capacity_factor is not None and (self.training or self.capacity_in_eval)
        if not applies:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def route(self, x_TD: torch.Tensor) -> Routing:
        """Decide experts and weights for each token; router math in float32 whatever the model dtype."""
        logits_TE = self.router(x_TD)
        scores_TE = logits_TE
        if self.training and self.noise_kind != "none":
            std = F.softplus(self.noise(x_TD)) if self.noise is not None \
                else self.noise_std
            scores_TE = logits_TE + torch.randn_like(logits_TE) * std
        choice_TE = scores_TE + self.router_bias
        cap = self.capacity(x_TD.shape[0])
        zero = torch.zeros((), dtype=torch.long, device=x_TD.device)
        if cap is None:  # (for the top-1, max is the quicker of the two: benchmarks/RESULTS.md)
            experts_TK = choice_TE.max(dim=-1, keepdim=True).indices if self.top_k == 1 \
                else choice_TE.topk(self.top_k, dim=-1).indices
            valid_TK, rerouted = None, zero
        else:
            experts_TK, valid_TK, rerouted = assign_with_capacity(choice_TE, self.top_k, cap, self.overflow)
        chosen_TK = scores_TE.gather(1, experts_TK)
        if valid_TK is not None:
            chosen_TK = chosen_TK.masked_fill(~valid_TK, float("-inf"))
        if self.kind == "sigmoid":
            weights_TK = torch.sigmoid(chosen_TK)  # sigmoid(-inf) = 0 for empty slots
        elif self.softmax_over == "all":  # every expert's probability; the chosen ones' are kept as they are
            weights_TK = torch.softmax(scores_TE, dim=-1).gather(1, experts_TK)
            if valid_TK is not None:
                weights_TK = weights_TK * valid_TK
        else:  # softmax over the chosen logits = -inf everywhere else, then softmax over all experts
            weights_TK = torch.softmax(chosen_TK, dim=-1).nan_to_num(0.0)  # a token with no slot: all 0
        dropped = zero if valid_TK is None else (~valid_TK).sum()
        return Routing(logits_TE, experts_TK, weights_TK, valid_TK, rerouted, dropped, scores_TE, choice_TE)

    # ------------------------------------------------------------------------------------------ 5. losses
    def auxiliary_loss(self, r: Routing) -> torch.Tensor:
        """The Switch load-balancing loss and the router z-loss of routing `r`, with their coefficients.

        Balancing: N * sum_e f_e * p_e, f_e the share of assignments expert e got (counted, so not
        differentiable) and p_e its mean router probability (differentiable): smallest when both are
        uniform. z-loss: the mean squared log-sum-exp of the logits, which keeps them from growing.
        """
        aux = r.logits_TE.new_zeros(())
        if self.aux_coef:
            frac_E = self.counts.float() / self._assigned[1]
            aux = aux + self.aux_coef * self.n_experts * (frac_E * r.logits_TE.softmax(-1).mean(0)).sum()
        if self.z_coef:
            aux = aux + self.z_coef * torch.logsumexp(r.logits_TE, dim=-1).pow(2).mean()
        return aux

    @torch.no_grad()
    def update_bias(self) -> None:
        """Nudge each expert's choice bias toward uniform load: up if under-loaded, down if over-loaded.

        Uses the assignments counted since the last update (one optimizer step's worth), then resets them.
        """
        if not self.bias_rate or self.pending_counts.sum() == 0:
            return
        load_E = self.pending_counts
        self.router_bias += self.bias_rate * torch.sign(load_E.mean() - load_E)
        self.pending_counts.zero_()

    # ------------------------------------------------------------------------------------------ statistics
    def _remember(self, r: Routing, expert_A: torch.Tensor, n_tokens: int) -> None:
        """Keep what `counts` and `stats` read. What the step itself does not use (counts without balancing,
        the fractions, the entropy) is derived when they are read, so decoding does not pay for it."""
        self._assigned = (expert_A, n_tokens * self.top_k)
        self._counts = None
        self._training = (r.rerouted, r.dropped, r.logits_TE.detach()) if self.training else None

    @property
    def counts(self) -> torch.Tensor | None:
        """Assignments per expert in the last forward pass (E,), or None before the first; counted once per
        pass, and the same tensor for every caller."""
        if self._assigned is None:
            return None
        if self._counts is None:
            self._counts = count_per_expert(self._assigned[0], self.n_experts)
        return self._counts

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """The last forward pass's routing, as tensors (reading them is the caller's sync): assignments per
        expert (`counts`), the most and least loaded expert over a uniform share, and in training also the
        rerouted and dropped fractions and the router entropy; {} before the first pass."""
        counts_E = self.counts
        if counts_E is None:
            return {}
        slots = self._assigned[1]
        extra: dict[str, torch.Tensor] = {}
        if self._training is not None:
            rerouted, dropped, logits_TE = self._training
            probs_TE = logits_TE.softmax(-1)
            extra = {"rerouted_frac": rerouted.float() / slots, "dropped_frac": dropped.float() / slots,
                     "entropy": -(probs_TE * probs_TE.clamp_min(1e-12).log()).sum(-1).mean()}
        mean_load = slots / self.n_experts
        return {"counts": counts_E, **extra, "max_load": counts_E.max().float() / mean_load,
                "min_load": counts_E.min().float() / mean_load}


# ---------------------------------------------------------------------------------------------- 1-2. routing
class Float32Linear(nn.Linear):
    """x @ W.T on float32 copies of x and W, whatever the model's dtype: the router's logits decide the
    top-k, and bf16 rounding of them would flip near-ties. (Under autocast the product itself follows
    autocast, like every linear.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


@dataclass
class Routing:
    """One routing decision for T tokens: which experts, with what weight, and what got in the way."""

    logits_TE: torch.Tensor  # raw router logits, float32 (no noise, no bias)
    experts_TK: torch.Tensor  # chosen experts per slot
    weights_TK: torch.Tensor  # float32; 0 for slots that found no room
    valid_TK: torch.Tensor | None  # False where capacity left a slot empty; None = every slot valid
    rerouted: torch.Tensor  # assignments that went past the token's top-k because an expert was full
    dropped: torch.Tensor  # slots that found no expert with room
    scores_TE: torch.Tensor  # the logits plus the noise (training only): what the weights are computed from
    choice_TE: torch.Tensor  # the scores plus the balancing bias: what the top-k (and capacity) is taken on

    def assignments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_A, expert_A, weight_A: one triple per slot that found room, in token order."""
        T, k = self.experts_TK.shape
        token_A = torch.arange(T * k, device=self.experts_TK.device).div_(k, rounding_mode="floor")  # 0,0,1,1,..
        expert_A, weight_A = self.experts_TK.reshape(-1), self.weights_TK.reshape(-1)
        if self.valid_TK is not None:  # capacity path: drop empty slots (one host sync, training only)
            keep_A = self.valid_TK.reshape(-1).nonzero().squeeze(1)
            token_A, expert_A, weight_A = token_A[keep_A], expert_A[keep_A], weight_A[keep_A]
        return token_A, expert_A, weight_A


def assign_with_capacity(choice_TE: torch.Tensor, k: int, capacity: int, overflow: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each token k experts, at most `capacity` tokens per expert, best choices first.

    Tokens claim slots in order of their best choice score (a confident token should not lose its
    expert to an unsure one that merely came earlier in the batch). In round r every token still short
    of k experts proposes its r-th ranked expert; each expert accepts proposals in priority order while
    it has room. A token whose choice is full thus moves on to its next-best expert with room, and one
    that finds none keeps fewer than k (possibly zero: then only the shared expert and the residual).
    With overflow=False only the k rounds of each token's own top-k run: a full choice is dropped.
    Returns experts_TK, valid_TK and the number of assignments made beyond each token's top-k.
    """
    T, E = choice_TE.shape
    dev = choice_TE.device
    ranking_TE = choice_TE.argsort(dim=1, descending=True, stable=True)
    order_T = choice_TE.max(dim=1).values.argsort(descending=True, stable=True)
    priority_T = torch.empty_like(order_T)
    priority_T[order_T] = torch.arange(T, device=dev)
    free_E = torch.full((E,), capacity, dtype=torch.long, device=dev)
    experts_TK = torch.zeros(T, k, dtype=torch.long, device=dev)
    filled_T = torch.zeros(T, dtype=torch.long, device=dev)
    rerouted = torch.zeros((), dtype=torch.long, device=dev)
    for r in range(E if overflow else k):
        need_T = filled_T < k
        if not bool(need_T.any()):  # one host sync per round; most batches settle in k or k+1 rounds
            break
        cand_T = ranking_TE[:, r]
        # Sort proposals by (expert, priority); tokens not proposing sort after every real expert.
        key_T = torch.where(need_T, cand_T, E) * T + priority_T
        sorted_T = key_T.argsort()
        cand_S, need_S = cand_T[sorted_T], need_T[sorted_T]
        counts_E = torch.bincount(cand_T[need_T], minlength=E)
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        pos_S = torch.arange(T, device=dev) - starts_E[cand_S.clamp(max=E - 1)]
        accept_S = need_S & (pos_S < free_E[cand_S.clamp(max=E - 1)])
        tok = sorted_T[accept_S]
        experts_TK[tok, filled_T[tok]] = cand_T[tok]
        filled_T[tok] += 1
        free_E -= torch.bincount(cand_T[tok], minlength=E)
        if r >= k:
            rerouted = rerouted + tok.numel()
    valid_TK = torch.arange(k, device=dev)[None, :] < filled_T[:, None]
    return experts_TK, valid_TK, rerouted


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

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.n_experts, self.hidden = n_experts, hidden
        self.gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, d_model))

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
        inp = x_TD * w_T1 if moe.kind == "sigmoid" else x_TD
        gate, up = (inp @ moe.experts.gate_up[e]).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ moe.experts.down[e]
        y_TD = y_TD + (out if moe.kind == "sigmoid" else out * w_T1)
    if moe.shared_expert is not None:
        y_TD = y_TD + moe.shared_expert(x_TD)
    return y_TD.view(B, T, d)
