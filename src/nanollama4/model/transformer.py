"""The Llama 4-style decoder, top to bottom: norm, block, transformer.

ids -> embedding -> n_layers x [x + Attn(RMSNorm(x)); x + FFN(RMSNorm(x))] -> RMSNorm -> LM head.
FFN is a dense SwiGLU or a mixture of experts (moe.py); attention and positions are in attention.py
and rope.py. No biases anywhere. The model computes; it never prints or reads files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..base.config import ModelConfig
from .attention import Attention, KVCache, LayerCache, Masks, numbered_from, rms_unit
from .moe import Experts, MoE, SwiGLU
from .rope import Rope, rope_angles, rope_frequencies


class RMSNorm(nn.Module):
    """x / rms(x) * gain, normalised in float32 and cast back before the gain (as the reference does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same arithmetic in one fused op (with a cheaper backward)
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            if torch.is_autocast_enabled(x.device.type):
                # Cast once here rather than once per projection that reads the output (q, k and v;
                # the experts' gather and the shared expert's gate and up), and as often in backward.
                out = out.to(torch.get_autocast_dtype(x.device.type))
            return out
        return rms_unit(x, self.eps) * self.weight


class Block(nn.Module):
    """One pre-norm transformer block: attention then feed-forward, each added to the residual."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn: nn.Module = MoE(cfg) if cfg.is_moe(layer) else SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                cache: LayerCache | None = None, start: int | None = None, masks: Masks | None = None
                ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, rope, cache, start, masks)
        return x + self.ffn(self.ffn_norm(x))


@dataclass
class Loss:
    """What `Transformer.loss` returns: the total to backpropagate and its parts, for logging."""

    total: torch.Tensor  # lm + auxiliary losses
    lm: torch.Tensor  # mean next-token cross-entropy, nats
    aux: torch.Tensor  # sum of the MoE auxiliary losses with their coefficients (0 when none)


class Transformer(nn.Module):
    """A Llama 4-style decoder-only language model: `model(ids)` gives logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) matrices, residual-output projections shrunk by 1/sqrt(2 n_layers), unit gains.

        The shrink keeps the residual stream's variance from growing with depth at the start of training.
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        residual_outputs = set()  # the projections that write into the residual stream
        for m in self.modules():
            if isinstance(m, Attention):
                residual_outputs.add(m.o_proj.weight)
            elif isinstance(m, SwiGLU):
                residual_outputs.add(m.down_proj.weight)
            elif isinstance(m, Experts):
                residual_outputs.add(m.down)
        for p in self.parameters():  # in registration order, so that a seed gives the same weights
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=out_std if p in residual_outputs else std)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE frequencies in float32 on `device`. Not a buffer: `model.to(bfloat16)` must not round them."""
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_frequencies(self.cfg).to(device)
        return self._inv_freq[device]

    def forward(self, ids: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, last_only: bool = False, head: bool = True) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab), in the model's dtype; (B, 1, vocab) with last_only.

        Tokens sit at positions start_pos, start_pos+1, ...; or pass `positions` (B, T) per row, where
        -1 marks left padding. With a KVCache the keys/values are kept for the next call (decoding).
        `last_only` runs the LM head on the last position alone, all that sampling needs (a long prompt
        with a large vocabulary would otherwise build a (B, T, vocab) tensor to read one row of).
        `head=False` stops before the final norm and the LM head, returning the residual stream (B, T, d):
        for a chunk of a prompt that only fills the cache.
        """
        T = ids.shape[1]
        start = None  # the first position of a whole sequence without a cache: chunked layers go chunk by chunk
        if positions is None:
            start = start_pos if cache is None else None
            positions = torch.arange(start_pos, start_pos + T, device=ids.device)
        elif cache is None:
            start = numbered_from(positions)
        rope = rope_angles(self.inv_freq(ids.device), positions.clamp(min=0))
        x = self.embed(ids)  # (B, T, d)
        masks = Masks()  # built once per layer kind, for this pass only
        for i, block in enumerate(self.blocks):
            x = block(x, positions, rope, None if cache is None else cache.layers[i], start, masks)
        if not head:
            return x
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> Loss:
        """Next-token cross-entropy of targets (B, T) given ids (B, T), plus the MoE auxiliary losses.

        Targets equal to -100 are ignored. The logits are upcast to float32 for the loss so that bf16
        training does not round the log-probabilities.
        """
        logits = self(ids)
        lm = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        aux = sum((m.aux_loss for m in self.moe_layers()), lm.new_zeros(()))
        return Loss(total=lm + aux, lm=lm, aux=aux)

    def moe_layers(self) -> list[MoE]:
        """The MoE feed-forward modules, in layer order (their `stats` describe the last forward pass)."""
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoE)]

    def update_router_biases(self) -> None:
        """After an optimizer step: move each MoE's choice bias toward uniform load (if that is configured)."""
        for moe in self.moe_layers():
            moe.router.update_bias()

    def num_params(self) -> int:
        """Distinct parameters (a tied LM head counts once)."""
        return sum(p.numel() for p in self.parameters())
