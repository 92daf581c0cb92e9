"""Feed-forward layers: the SwiGLU MLP and the mixture of experts built from it.

An MoE layer sends each token to the top-k of N routed experts (plus an always-on shared expert).
Only the chosen experts run: assignments are sorted by expert, the experts run as one grouped matrix
product over contiguous groups, and results are added back per token, so compute grows with k, not N.

Training-time routing, all optional (config): noise on the softmax router's logits, an expert capacity
with overflow to each token's next-best expert, the Switch load-balancing loss and router z-loss, and
the auxiliary-loss-free alternative, a per-expert bias that steers only the top-k choice.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import ModelConfig

SPLIT_BYTES = 1 << 20  # one-row products with larger weights are split across two threads (see row_matmul)


def _split_pays(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One row, CPU, eager inference, two threads, a weight too big to stay in cache, even output width."""
    return (x.device.type == "cpu" and x.shape[:-1].numel() == 1 and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and torch.get_num_threads() >= 2
            and w.numel() * w.element_size() >= SPLIT_BYTES and w.shape[0] % 2 == 0 and w.shape[1] % 2 == 0)


def row_matmul(x: torch.Tensor, w_DO: torch.Tensor, out_in: bool = False) -> torch.Tensor:
    """x (..., D) @ w (D, O), or F.linear(x, w) for an (O, D) weight with out_in=True.

    Decoding multiplies one row by each weight. On this CPU such a matrix-vector product runs on one
    core and streams a weight that is not in cache at ~15-22 GB/s; one bmm over the two halves of the
    output columns keeps both cores streaming (~28-31 GB/s, benchmarks/RESULTS.md). Otherwise this is
    the plain product.
    """
    if not _split_pays(x, w_DO):
        return F.linear(x, w_DO) if out_in else x @ w_DO
    d_in = x.shape[-1]
    half = (w_DO.shape[0] if out_in else w_DO.shape[1]) // 2
    halves = w_DO.view(2, half, d_in).transpose(1, 2) if out_in else w_DO.view(d_in, 2, half).transpose(0, 1)
    return torch.bmm(x.reshape(1, 1, d_in).expand(2, 1, d_in), halves).view(*x.shape[:-1], 2 * half)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the dense FFN and the shared expert."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 on the CPU: our kernel, like the routed experts; decoding one token with big weights: the
        # two-core row product. Both multiply by the projections' weights directly (forward hooks or
        # wrappers on the projections are bypassed).
        if kernels.linear_pays(x):
            product = kernels.linear
        elif _split_pays(x, self.gate_proj.weight):
            product = functools.partial(row_matmul, out_in=True)
        else:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = (product(x, lin.weight) for lin in (self.gate_proj, self.up_proj))
        return product(F.silu(gate) * up, self.down_proj.weight)


# ---------------------------------------------------------------------------------------------- experts
class Experts(nn.Module):
    """N SwiGLU experts with fused weights, stored (in, out) as the reference checkpoints store them.

    gate_up (E, d, 2I) holds each expert's gate and up matrices side by side; down is (E, I, d).
    `dispatch` picks how the chosen rows are multiplied; all four compute the same function:
    "kernel" (our compiled CPU float32 grouped product, `kernels.py`), "grouped" (one F.grouped_mm over
    contiguous per-expert groups), "loop" (a matmul per expert) and "padded" (one bmm over a
    capacity-padded (E, C, d) buffer). "auto" takes the fastest measured.
    """

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.n_experts, self.hidden = n_experts, hidden
        self.gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.dispatch = "auto"

    def forward(self, x_TD: torch.Tensor, token_A: torch.Tensor, expert_A: torch.Tensor, weight_A: torch.Tensor,
                scale_input: bool) -> torch.Tensor:
        """Sum over assignments a of weight_a-scaled SwiGLU_{expert_a}(x[token_a]), per token. Returns (T, d).

        Assignments are (token, expert, weight) triples, any order; weights scale the expert's input
        (Llama 4) or its output (tutorial).
        """
        if expert_A.numel() <= few_assignments(self.n_experts, torch.compiler.is_compiling()):
            return self._gathered(x_TD, token_A, expert_A, weight_A, scale_input)
        order_A = torch.argsort(expert_A, stable=True)
        token_A, expert_A = token_A[order_A], expert_A[order_A]
        weight_A1 = weight_A[order_A].unsqueeze(1).to(x_TD.dtype)
        counts_E = count_per_expert(expert_A, self.n_experts)
        x_AD = x_TD.index_select(0, token_A)  # backward: index_add_ (x_TD[token_A] would use index_put_)
        if scale_input:
            x_AD = x_AD * weight_A1
        y_AD = self.run_groups(x_AD, expert_A, counts_E)
        if not scale_input:
            y_AD = y_AD * weight_A1
        return torch.zeros_like(x_TD).index_add_(0, token_A, y_AD.to(x_TD.dtype))

    def one_row(self, x_1D: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
        """SwiGLU of expert e on one row (1, d), multiplying views of its weights (host-side dispatch)."""
        gate, up = row_matmul(x_1D, self.gate_up[e].to(dtype)).chunk(2, dim=-1)
        return row_matmul(F.silu(gate) * up, self.down[e].to(dtype))

    def _gathered(self, x_TD: torch.Tensor, token_A: torch.Tensor, expert_A: torch.Tensor, weight_A: torch.Tensor,
                  scale_input: bool) -> torch.Tensor:
        """A handful of assignments (decoding): no sort and no kernel call per idle expert.

        On the CPU, reading the expert ids on the host costs nothing, so each assignment multiplies by a
        view of its expert's weights; elsewhere, and while compiling (no host reads in a graph), the
        chosen experts' weights are gathered (copied) for one bmm.
        """
        dev = x_TD.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_TD.dtype
        weight_A1 = weight_A.to(dtype)[:, None]
        x_AD = x_TD[token_A].to(dtype)
        if scale_input:
            x_AD = x_AD * weight_A1
        if dev == "cpu" and not torch.compiler.is_compiling():
            y_AD = torch.cat([self.one_row(x_AD[a:a + 1], e, dtype) for a, e in enumerate(expert_A.tolist())])
        else:
            gate, up = torch.bmm(x_AD[:, None], self.gate_up[expert_A].to(dtype)).chunk(2, dim=-1)  # (A, 1, I)
            y_AD = torch.bmm(F.silu(gate) * up, self.down[expert_A].to(dtype)).squeeze(1)
        if not scale_input:
            y_AD = y_AD * weight_A1
        return torch.zeros_like(x_TD).index_add_(0, token_A, y_AD.to(x_TD.dtype))

    def run_groups(self, x_AD: torch.Tensor, expert_A: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """SwiGLU of rows sorted by expert (expert_A ascending, counts_E rows each) -> (A, d).

        Under autocast the experts run in the autocast dtype like every nn.Linear does (autocast does
        not know grouped_mm/bmm on raw parameters, so the cast is explicit here).
        """
        dev = x_AD.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_AD.dtype
        x_AD, gate_up, down = x_AD.to(dtype), self.gate_up.to(dtype), self.down.to(dtype)
        mode = self.dispatch
        if mode == "auto":
            mode = _auto_mode(x_AD, self.hidden)
        if mode in ("kernel", "grouped"):
            if mode == "kernel":
                product = functools.partial(kernels.grouped_matmul, counts_G=counts_E)
            else:
                product = functools.partial(F.grouped_mm, offs=torch.cumsum(counts_E, 0).to(torch.int32))
            gate, up = product(x_AD, gate_up).chunk(2, dim=-1)  # (A, I) each
            return product(F.silu(gate) * up, down)
        if mode == "padded":
            return self._padded(x_AD, expert_A, counts_E, gate_up, down)
        # unbind/split make one backward node each; indexing gate_up[e] per expert would instead build
        # a full-size zero gradient for every expert.
        outs = []
        for x_e, w1, w2 in zip(x_AD.split(counts_E.tolist()), gate_up.unbind(0), down.unbind(0), strict=True):
            gate, up = (x_e @ w1).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w2)
        return torch.cat(outs) if outs else x_AD.new_zeros(0, down.shape[-1])

    def _padded(self, x_AD: torch.Tensor, expert_A: torch.Tensor, counts_E: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
        """Scatter rows into an (E, C, d) buffer (C = largest group rounded up to 64), two bmm's, gather back."""
        cap = -(-int(counts_E.max()) // 64) * 64 if counts_E.numel() else 0  # few distinct shapes: kernels reuse
        A, D = x_AD.shape
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        slot_A = torch.arange(A, device=x_AD.device) - starts_E[expert_A]
        flat_A = expert_A * cap + slot_A  # each row's place in the flattened (E * C) buffer
        # Copy in and gather out with flat row indices (backward: a gather and an index_add_) rather than
        # index with (expert, slot) pairs: with the gather above, one bf16 expert layer's fwd+bwd at
        # 4096 tokens went from 22.8 to 15.9 ms.
        buf_ECD = x_AD.new_zeros(self.n_experts * cap, D).index_copy(0, flat_A, x_AD).view(self.n_experts, cap, D)
        gate, up = torch.bmm(buf_ECD, gate_up).chunk(2, dim=-1)
        y_ECD = torch.bmm(F.silu(gate) * up, down)
        return y_ECD.view(self.n_experts * cap, -1).index_select(0, flat_A)


def few_assignments(n_experts: int, compiling: bool) -> int:
    """The most (token, expert) assignments multiplied one by one instead of sorted into groups.

    Decoding-sized batches leave most experts idle, so sorting and one product per expert would waste
    calls. Compiled code takes this path up to one assignment per expert, because the sorted dispatch
    reads group sizes on the host (a graph break and a recompilation per group layout).
    """
    return n_experts if compiling else n_experts // 2


def count_per_expert(expert_A: torch.Tensor, n_experts: int) -> torch.Tensor:
    """bincount(expert_A, minlength=n_experts), in a form whose output shape torch.compile knows ahead."""
    zeros_E = torch.zeros(n_experts, dtype=torch.long, device=expert_A.device)
    return zeros_E.index_add_(0, expert_A, torch.ones_like(expert_A))


def _auto_mode(x: torch.Tensor, hidden: int) -> str:
    """The fastest mode measured (benchmarks/RESULTS.md): our kernel for fp32 on CPU (else grouped_mm),
    grouped_mm for bf16 on CUDA.

    While compiling, fp32 takes the loop instead (grouped_mm's shape function accepts only bf16); its
    group sizes are read on the host, so a compiled fp32 MoE step runs its experts outside the graph.

    On CPU, grouped_mm's bf16 path misses the fast bf16 kernels; there one bmm over a padded buffer
    (its size rounded so that kernels are reused across steps) won in training (410-430 vs 470-580 ms
    per step for the per-expert loop on the demo model), and reading the group sizes costs nothing.
    """
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        return "padded"
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling() \
            and kernels.available():
        return "kernel"
    fast = torch.float32 if x.device.type == "cpu" else torch.bfloat16
    if torch.compiler.is_compiling():
        fast = torch.bfloat16  # grouped_mm's shape function (used while compiling) accepts only bf16
    return "grouped" if x.dtype == fast and _grouped_mm_ok(x, hidden) else "loop"


def _grouped_mm_ok(x: torch.Tensor, hidden: int) -> bool:
    """F.grouped_mm wants 16-byte-aligned rows in every operand (widths d, 2I and the (A, I) intermediate);
    on CUDA it also wants bf16 (its Hopper kernels)."""
    if x.dtype not in ((torch.bfloat16,) if x.device.type == "cuda" else (torch.float32, torch.bfloat16)):
        return False
    size = x.element_size()
    return x.device.type in ("cpu", "cuda") and all(n * size % 16 == 0 for n in (x.shape[-1], hidden))

# ---------------------------------------------------------------------------------------------- routing
@dataclass
class Routing:
    """One routing decision for T tokens: which experts, with what weight, and what got in the way."""

    logits_TE: torch.Tensor  # raw router logits, float32 (no noise, no bias)
    experts_TK: torch.Tensor  # chosen experts per slot
    weights_TK: torch.Tensor  # float32; 0 for slots that found no room
    valid_TK: torch.Tensor | None  # False where capacity left a slot empty; None = every slot valid
    rerouted: torch.Tensor  # assignments that went past the token's top-k because an expert was full
    dropped: torch.Tensor  # slots that found no expert with room


def assign_with_capacity(choice_TE: torch.Tensor, k: int, capacity: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each token k experts, at most `capacity` tokens per expert, best choices first.

    Tokens claim slots in order of their best choice score (a confident token should not lose its
    expert to an unsure one that merely came earlier in the batch). In round r every token still short
    of k experts proposes its r-th ranked expert; each expert accepts proposals in priority order while
    it has room. A token whose choice is full thus moves on to its next-best expert with room, and one
    that finds none keeps fewer than k (possibly zero: then only the shared expert and the residual).
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
    for r in range(E):
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


class MoE(nn.Module):
    """Router + routed experts + shared expert, on flattened tokens.

    `sigmoid` router (Llama 4): top-k of the router logits, sigmoid of each chosen logit, and that score
    multiplies the expert's *input*. `softmax` router (the tutorial): the non-chosen logits are set to
    -inf before a softmax, and the weights multiply the experts' *outputs*.

    After each forward pass, `stats` holds tensors (no host sync) about the routing and `aux_loss` the
    weighted load-balancing + z-loss (a zero tensor when both coefficients are 0 or in eval mode).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.kind = cfg.n_experts, cfg.experts_per_token, cfg.router
        self.noise_kind, self.noise_std = cfg.router_noise, cfg.router_noise_std
        self.capacity_factor, self.capacity_in_eval = cfg.capacity_factor, cfg.capacity_in_eval
        self.aux_coef, self.z_coef, self.bias_rate = cfg.aux_loss_coef, cfg.z_loss_coef, cfg.bias_balance_rate
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.noise = nn.Linear(cfg.d_model, cfg.n_experts, bias=False) if cfg.router_noise == "learned" else None
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.expert_dim)
        self.shared_expert = SwiGLU(cfg.d_model, cfg.expert_dim) if cfg.shared_expert else None
        # Auxiliary-loss-free balancing: added to the scores for the top-k choice only, never to weights.
        self.register_buffer("router_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("pending_counts", torch.zeros(cfg.n_experts), persistent=False)
        self.stats: dict[str, torch.Tensor] = {}
        self.aux_loss = torch.zeros(())

    def capacity(self, n_tokens: int) -> int | None:
        """Slots per expert for this batch, or None when routing is dropless."""
        applies = self.capacity_factor is not None and (self.training or self.capacity_in_eval)
        if not applies:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def route(self, x_TD: torch.Tensor) -> Routing:
        """Decide experts and weights for each token; router math in float32 whatever the model dtype."""
        logits_TE = F.linear(x_TD.float(), self.router.weight.float())
        scores_TE = logits_TE
        if self.training and self.noise_kind != "none":
            std = F.softplus(F.linear(x_TD.float(), self.noise.weight.float())) if self.noise is not None \
                else self.noise_std
            scores_TE = logits_TE + torch.randn_like(logits_TE) * std
        choice_TE = scores_TE + self.router_bias
        cap = self.capacity(x_TD.shape[0])
        zero = torch.zeros((), dtype=torch.long, device=x_TD.device)
        if cap is None:
            experts_TK = choice_TE.topk(self.top_k, dim=-1).indices
            valid_TK, rerouted = None, zero
        else:
            experts_TK, valid_TK, rerouted = assign_with_capacity(choice_TE, self.top_k, cap)
        chosen_TK = scores_TE.gather(1, experts_TK)
        if valid_TK is not None:
            chosen_TK = chosen_TK.masked_fill(~valid_TK, float("-inf"))
        if self.kind == "sigmoid":
            weights_TK = torch.sigmoid(chosen_TK)  # sigmoid(-inf) = 0 for empty slots
        else:  # softmax over the chosen logits = -inf everywhere else, then softmax over all experts
            weights_TK = torch.softmax(chosen_TK, dim=-1).nan_to_num(0.0)  # a token with no slot: all 0
        dropped = zero if valid_TK is None else (~valid_TK).sum()
        return Routing(logits_TE, experts_TK, weights_TK, valid_TK, rerouted, dropped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x_TD = x.reshape(B * T, d)
        r = self.route(x_TD)
        n, k = B * T, self.top_k
        if x.device.type == "cpu" and not self.training and not torch.is_grad_enabled() \
                and not torch.compiler.is_compiling() \
                and r.valid_TK is None and n * k <= few_assignments(self.n_experts, compiling=False):
            return self._decode(x_TD, r).view(B, T, d)
        token_A = torch.arange(n, device=x.device).repeat_interleave(k)
        expert_A, weight_A = r.experts_TK.reshape(-1), r.weights_TK.reshape(-1)
        if r.valid_TK is not None:  # capacity path: drop empty slots (one host sync, training only)
            keep_A = r.valid_TK.reshape(-1).nonzero().squeeze(1)
            token_A, expert_A, weight_A = token_A[keep_A], expert_A[keep_A], weight_A[keep_A]
        y_TD = self.experts(x_TD, token_A, expert_A, weight_A, scale_input=self.kind == "sigmoid")
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        self._record(r, expert_A, n)
        return y_TD.view(B, T, d)

    def _decode(self, x_TD: torch.Tensor, r: Routing) -> torch.Tensor:
        """Inference on the CPU for a handful of tokens (decoding): the same function, far fewer kernel calls.

        Reading the chosen expert ids on the host costs nothing on the CPU, so each (token, expert) pair
        multiplies by a view of that expert's weights and adds into its token's row; the shared expert is
        added last, in the same order of additions as `forward`. The load is counted on the host too.
        """
        dev = x_TD.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_TD.dtype
        scale_input = self.kind == "sigmoid"
        y_TD = torch.zeros_like(x_TD)
        weights_TK = r.weights_TK.to(dtype)
        counts = [0] * self.n_experts
        for t, row in enumerate(r.experts_TK.tolist()):
            for j, e in enumerate(row):
                counts[e] += 1
                w = weights_TK[t, j]
                x_1D = x_TD[t:t + 1].to(dtype)
                y_1D = self.experts.one_row(x_1D * w if scale_input else x_1D, e, dtype)
                y_TD[t:t + 1] += y_1D if scale_input else y_1D * w
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        mean_load = x_TD.shape[0] * self.top_k / self.n_experts
        self.stats = {"counts": torch.tensor(counts), "max_load": torch.tensor(max(counts) / mean_load),
                      "min_load": torch.tensor(min(counts) / mean_load)}
        self.aux_loss = torch.zeros(())
        return y_TD

    def _record(self, r: Routing, expert_A: torch.Tensor, n_tokens: int) -> None:
        """Statistics and auxiliary losses of this pass, as tensors: reading them is the caller's sync.

        In eval mode only the load is kept: decoding runs this once per token per layer, and the rest
        (rerouting, entropy, losses) serves training logs.
        """
        counts_E = count_per_expert(expert_A, self.n_experts)
        slots = n_tokens * self.top_k
        mean_load = slots / self.n_experts
        self.stats = {"counts": counts_E, "max_load": counts_E.max().float() / mean_load,
                      "min_load": counts_E.min().float() / mean_load}
        if not self.training:
            self.aux_loss = counts_E.new_zeros((), dtype=torch.float32)
            return
        probs_TE = r.logits_TE.softmax(-1)
        self.stats.update({
            "rerouted_frac": r.rerouted.float() / slots,
            "dropped_frac": r.dropped.float() / slots,
            "entropy": -(probs_TE * probs_TE.clamp_min(1e-12).log()).sum(-1).mean().detach(),
        })
        aux = r.logits_TE.new_zeros(())
        if self.training and self.aux_coef:
            frac_E = counts_E.float() / slots  # f_e: share of assignments (not differentiable)
            aux = aux + self.aux_coef * self.n_experts * (frac_E * probs_TE.mean(0)).sum()
        if self.training and self.z_coef:
            aux = aux + self.z_coef * torch.logsumexp(r.logits_TE, dim=-1).pow(2).mean()
        self.aux_loss = aux
        if self.training and self.bias_rate:
            self.pending_counts += counts_E.float()

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
