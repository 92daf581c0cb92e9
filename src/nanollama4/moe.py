"""Feed-forward layers: the SwiGLU MLP and the mixture of experts built from it.

An MoE layer sends each token to the top-k of N routed experts (plus an always-on shared expert).
Only the chosen experts run: assignments are sorted by expert, the experts run as one grouped matrix
product over contiguous groups, and results are added back per token, so compute grows with k, not N.
"""

from __future__ import annotations

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


class Experts(nn.Module):
    """N SwiGLU experts with fused weights, stored (in, out) as the reference checkpoints store them.

    gate_up (E, d, 2I) holds each expert's gate and up matrices side by side; down is (E, I, d).
    """

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.n_experts, self.hidden = n_experts, hidden
        self.gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, d_model))

    def forward(self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor,
                scale_input: bool) -> torch.Tensor:
        """Run each token through its k chosen experts and sum, weighting inputs or outputs.

        x_TD (T, d); experts_TK (T, k) expert ids; weights_TK (T, k). Returns (T, d).
        """
        T, k = experts_TK.shape
        expert_A = experts_TK.reshape(-1)  # (A,) one entry per (token, expert) assignment, A = T*k
        order_A = torch.argsort(expert_A, stable=True)
        token_A = order_A // k  # token of each assignment, grouped by expert
        weight_A1 = weights_TK.reshape(-1)[order_A].unsqueeze(1)
        counts_E = torch.bincount(expert_A, minlength=self.n_experts)
        x_AD = x_TD[token_A]
        if scale_input:
            x_AD = x_AD * weight_A1
        y_AD = self._grouped_swiglu(x_AD, counts_E)
        if not scale_input:
            y_AD = y_AD * weight_A1
        return torch.zeros_like(x_TD).index_add_(0, token_A, y_AD.to(x_TD.dtype))

    def _grouped_swiglu(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """SwiGLU of contiguous per-expert groups of rows; counts_E gives each group's size."""
        if _grouped_mm_ok(x_AD, self.gate_up, self.down):
            offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
            h_AH = F.grouped_mm(x_AD, self.gate_up, offs=offs_E)  # (A, 2I)
            gate, up = h_AH.chunk(2, dim=-1)
            return F.grouped_mm(F.silu(gate) * up, self.down, offs=offs_E)  # (A, d)
        outs, start = [], 0
        for e, n in enumerate(counts_E.tolist()):
            gate, up = (x_AD[start:start + n] @ self.gate_up[e]).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ self.down[e])
            start += n
        return torch.cat(outs)


def _grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """F.grouped_mm wants 16-byte-aligned row strides; on CUDA it also wants bf16 (Hopper kernels)."""
    t = tensors[0]
    if t.device.type == "cuda" and t.dtype != torch.bfloat16:
        return False
    return all(x.shape[-1] * x.element_size() % 16 == 0 for x in tensors) and t.device.type in ("cpu", "cuda")


class MoE(nn.Module):
    """Router + routed experts + shared expert, on flattened tokens.

    `sigmoid` router (Llama 4): top-k of the router logits, sigmoid of each chosen logit, and that score
    multiplies the expert's *input*. `softmax` router (the tutorial): the non-top-k logits are set to
    -inf before a softmax, and the weights multiply the experts' *outputs*.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.kind = cfg.n_experts, cfg.experts_per_token, cfg.router
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.expert_dim)
        self.shared_expert = SwiGLU(cfg.d_model, cfg.expert_dim) if cfg.shared_expert else None

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits (T, E) in float32, chosen experts (T, k) and their weights (T, k) in float32."""
        logits_TE = F.linear(x_TD.float(), self.router.weight.float())
        top_logits_TK, experts_TK = logits_TE.topk(self.top_k, dim=-1)
        if self.kind == "sigmoid":
            weights_TK = torch.sigmoid(top_logits_TK)
        else:
            weights_TK = torch.softmax(top_logits_TK, dim=-1)  # same as -inf outside the top-k, then softmax
        return logits_TE, experts_TK, weights_TK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x_TD = x.reshape(B * T, d)
        _, experts_TK, weights_TK = self.route(x_TD)
        self.last_counts_E = torch.bincount(experts_TK.flatten(), minlength=self.n_experts)  # for load statistics
        y_TD = self.experts(x_TD, experts_TK, weights_TK.to(x.dtype), scale_input=self.kind == "sigmoid")
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        return y_TD.view(B, T, d)


def moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same MoE computed plainly: every expert on every token, weight 0 for the ones not chosen.

    Slow (cost grows with N) and obvious; tests check the sparse dispatch against it.
    """
    B, T, d = x.shape
    x_TD = x.reshape(B * T, d)
    _, experts_TK, weights_TK = moe.route(x_TD)
    dense_TE = torch.zeros(B * T, moe.n_experts, dtype=x.dtype, device=x.device)
    dense_TE.scatter_(1, experts_TK, weights_TK.to(x.dtype))
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
