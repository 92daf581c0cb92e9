"""Routers: which experts each token goes to, and with what weight.

One class owns the whole decision, in order:
  1. logits     the router's product, in float32 whatever the model's dtype (bf16 rounding would flip
                near-ties in the top-k)
  2. noise      in training, noise on the logits (fixed or learned scale: noisy top-k gating); they are
                now the *scores* the weights are computed from
  3. bias       the auxiliary-loss-free balancing bias, added for the choice only (never to the weights)
  4. choice     the top-k of those choice scores, or `assign_with_capacity` when an expert capacity
                applies (a full expert's overflow goes to each token's next-best expert with room)
  5. weights    `weigh`, the one thing a router kind defines, and `scales_input`: whether the weight
                multiplies the expert's input (Llama 4) or its output (the tutorial)
It also keeps what balances the load: the Switch loss and z-loss (`auxiliary_loss`), and the counts the
bias learns from (`note_load`, `update_bias`).

Adding a router kind is one subclass here (or anywhere: a test module does it, a module of yours comes with
`--import`); it registers itself by its `name=` (`parts.Kind`), and the config finds it there. A kind may
declare settings of its own, a `Settings` dataclass written as the config's fields are (the softmax
router's noise below: `[model.softmax]` in a config file, `--set softmax.noise=learned`):

    class NormalisedSigmoid(Router, name="sigmoid-normalised", scales_input=True):
        def weigh(self, scores_TE, experts_TK, valid_TK):
            w_TK = torch.sigmoid(chosen_scores(scores_TE, experts_TK, valid_TK))
            return w_TK / w_TK.sum(-1, keepdim=True).clamp_min(1e-9)

Shape suffixes as in moe.py: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..base.config import ModelConfig, NonNegative, RouterNoise, SoftmaxOver
from ..base.parts import ROUTERS, Kind


def router_class(kind: str) -> type[Router]:
    """The router class of a kind (config's `router`), or a ConfigError naming the kinds there are."""
    return ROUTERS.find(kind)


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


class Float32Linear(nn.Linear):
    """x @ W.T on float32 copies of x and W, whatever the model's dtype (the learned noise's scale)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class Router(nn.Module, Kind):
    """Scores, noise, balancing bias, top-k and capacity, shared by every kind; `weigh` is the kind's.

    The parameter is `weight` (E, D), the reference checkpoints' `router.weight`; `noise` is the learned
    noise scale's linear (the softmax router's noise="learned"), `expert_bias` the balancing bias (a buffer:
    it is nudged, not trained) and `pending_counts` the assignments it has not yet learned from.
    """

    registry = ROUTERS
    scales_input: ClassVar[bool]  # the weight multiplies the expert's input (True) or its output (False)

    def __init_subclass__(cls, scales_input: bool | None = None, **kw) -> None:
        super().__init_subclass__(**kw)
        if scales_input is not None:
            cls.scales_input = scales_input

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.capacity_factor, self.capacity_in_eval = cfg.capacity_factor, cfg.capacity_in_eval
        self.overflow = cfg.capacity_overflow == "next"
        self.aux_coef, self.z_coef, self.bias_rate = cfg.aux_loss_coef, cfg.z_loss_coef, cfg.bias_balance_rate
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model).normal_(std=cfg.init_std))
        self.noise_kind, self.noise_std, self.noise = "none", 0.0, None  # a kind that has noise sets them
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("pending_counts", torch.zeros(cfg.n_experts), persistent=False)

    def extra_repr(self) -> str:
        return f"kind={self.name!r}, n_experts={self.n_experts}, top_k={self.top_k}"

    @classmethod
    def extra_parameters(cls, cfg: ModelConfig) -> int:
        """The weights a layer's router of this kind holds beyond `weight` (E, D): what `memory.param_counts`
        adds per MoE layer without building the model. A kind with trained weights of its own says how many."""
        return 0

    # ------------------------------------------------------------------------------------------ the decision
    def forward(self, x_TD: torch.Tensor) -> Routing:
        """Decide experts and weights for each token."""
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = logits_TE
        if self.training and self.noise_kind != "none":
            std = F.softplus(self.noise(x_TD)) if self.noise is not None else self.noise_std
            scores_TE = logits_TE + torch.randn_like(logits_TE) * std
        choice_TE = scores_TE + self.expert_bias
        cap = self.capacity(x_TD.shape[0])
        zero = torch.zeros((), dtype=torch.long, device=x_TD.device)
        if cap is None:  # (for the top-1, max is the quicker: 2026-12-01, git history of benchmarks/RESULTS.md)
            experts_TK = choice_TE.max(dim=-1, keepdim=True).indices if self.top_k == 1 \
                else choice_TE.topk(self.top_k, dim=-1).indices
            valid_TK, rerouted = None, zero
        else:
            experts_TK, valid_TK, rerouted = assign_with_capacity(choice_TE, self.top_k, cap, self.overflow)
        weights_TK = self.weigh(scores_TE, experts_TK, valid_TK)
        dropped = zero if valid_TK is None else (~valid_TK).sum()
        return Routing(logits_TE, experts_TK, weights_TK, valid_TK, rerouted, dropped, scores_TE, choice_TE)

    def weigh(self, scores_TE: torch.Tensor, experts_TK: torch.Tensor, valid_TK: torch.Tensor | None
              ) -> torch.Tensor:
        """Each slot's weight (T, K), float32, from the scores (logits + noise) and the experts chosen;
        0 for a slot that found no room (valid_TK False)."""
        raise NotImplementedError

    def capacity(self, n_tokens: int) -> int | None:
        """Slots per expert for a batch of n_tokens in the current mode, or None when routing is dropless."""
        applies = self.capacity_factor is not None and (self.training or self.capacity_in_eval)
        return self.slots_per_expert(n_tokens) if applies else None

    def slots_per_expert(self, n_tokens: int) -> int:
        """ceil(capacity_factor * T * k / N): what capacity gives each expert when it acts."""
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    # ------------------------------------------------------------------------------------------ balance
    def auxiliary_loss(self, r: Routing, counts_E: torch.Tensor, slots: int) -> torch.Tensor:
        """The Switch load-balancing loss and the router z-loss of routing `r`, with their coefficients.

        Balancing: N * sum_e f_e * p_e, f_e the share of the `slots` assignments expert e got (counted, so
        not differentiable) and p_e its mean router probability (differentiable): smallest when both are
        uniform. z-loss: the mean squared log-sum-exp of the logits, which keeps them from growing.
        """
        aux = r.logits_TE.new_zeros(())
        if self.aux_coef:
            frac_E = counts_E.float() / slots
            aux = aux + self.aux_coef * self.n_experts * (frac_E * r.logits_TE.softmax(-1).mean(0)).sum()
        if self.z_coef:
            aux = aux + self.z_coef * torch.logsumexp(r.logits_TE, dim=-1).pow(2).mean()
        return aux

    def note_load(self, counts_E: torch.Tensor) -> None:
        """Count a training pass's assignments toward the next bias update (when balancing by bias)."""
        if self.bias_rate:
            self.pending_counts += counts_E.float()

    @torch.no_grad()
    def update_bias(self) -> None:
        """Nudge each expert's choice bias toward uniform load: up if under-loaded, down if over-loaded.

        Uses the assignments counted since the last update (one optimizer step's worth), then resets them. No
        counts (no training pass since) move nothing, sign(0) being 0, so nothing is asked of the tensor's
        values here: the step stays free of a read back to the host.
        """
        if not self.bias_rate:
            return
        load_E = self.pending_counts
        self.expert_bias += self.bias_rate * torch.sign(load_E.mean() - load_E)
        self.pending_counts.zero_()


def chosen_scores(scores_TE: torch.Tensor, experts_TK: torch.Tensor, valid_TK: torch.Tensor | None) -> torch.Tensor:
    """The scores of the chosen experts (T, K), -inf where a slot found no room."""
    chosen_TK = scores_TE.gather(1, experts_TK)
    return chosen_TK if valid_TK is None else chosen_TK.masked_fill(~valid_TK, float("-inf"))


class SigmoidRouter(Router, name="sigmoid", scales_input=True, about="Llama 4"):
    """Llama 4's: sigmoid of each chosen score, and that score multiplies the expert's *input*."""

    def weigh(self, scores_TE: torch.Tensor, experts_TK: torch.Tensor, valid_TK: torch.Tensor | None
              ) -> torch.Tensor:
        return torch.sigmoid(chosen_scores(scores_TE, experts_TK, valid_TK))  # sigmoid(-inf) = 0 for empty slots


@dataclass
class SoftmaxSettings:
    """The softmax router's own settings ([model.softmax]; `--set softmax.noise=learned`)."""

    noise: RouterNoise = "none"  # training only: "learned" per-expert scale (noisy top-k gating), "fixed" or "none"
    noise_std: NonNegative = 1.0  # std of the "fixed" noise
    over: SoftmaxOver = "chosen"  # over the top-k ("chosen", the rest -inf) or "all" logits


class SoftmaxRouter(Router, name="softmax", scales_input=False, about="the tutorial"):
    """The tutorial's: the non-chosen scores set to -inf before a softmax (or, with over="all", every
    expert's probability kept as it is), and the weights multiply the experts' *outputs*. In training, noise
    may be added to the logits first: with a fixed std, or with a learned scale softplus(x W_noise)."""

    Settings = SoftmaxSettings
    formerly = {"router_noise": "noise", "router_noise_std": "noise_std", "softmax_over": "over"}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        own = self.settings(cfg)
        self.over_all = own.over == "all"
        self.noise_kind, self.noise_std = own.noise, own.noise_std
        if own.noise == "learned":
            self.noise = Float32Linear(cfg.d_model, cfg.n_experts, bias=False)

    @classmethod
    def extra_parameters(cls, cfg: ModelConfig) -> int:
        return cfg.n_experts * cfg.d_model if cls.settings(cfg).noise == "learned" else 0  # the noise's scale

    def weigh(self, scores_TE: torch.Tensor, experts_TK: torch.Tensor, valid_TK: torch.Tensor | None
              ) -> torch.Tensor:
        if self.over_all:
            weights_TK = torch.softmax(scores_TE, dim=-1).gather(1, experts_TK)
            return weights_TK if valid_TK is None else weights_TK * valid_TK
        return torch.softmax(chosen_scores(scores_TE, experts_TK, valid_TK), dim=-1).nan_to_num(0.0)  # no slot: 0


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
