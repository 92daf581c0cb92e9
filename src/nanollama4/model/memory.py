"""Parameter, KV-cache and training-step memory arithmetic from a ModelConfig alone: no tensors, no torch.

Sizing a model (how many weights, how many of them a token actually uses, how much memory the KV
cache takes at a given context) should not require building it: a 400B-parameter preset must be
answerable on a laptop. Every count here is a closed-form function of the config fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..base.config import ModelConfig
from ..base.errors import ConfigError
from ..base.parts import OPTIMIZERS, ROUTERS

_BYTES_PER_VALUE = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
                    "float8": 1, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts per component (no biases anywhere in the model)."""

    embedding: int
    lm_head: int
    attention: int
    norms: int
    dense_ffn: int
    router: int
    experts: int
    shared_expert: int
    noise: int  # the router kind's weights beyond its (E, D) `weight` (`Router.extra_parameters`): the softmax
    # router's learned noise scale
    experts_per_token: int = 1  # k: routed experts each token visits
    n_experts: int = 0  # N: routed experts per MoE layer

    COMPONENTS: ClassVar[tuple[str, ...]] = ("embedding", "lm_head", "attention", "norms", "dense_ffn", "router",
                                             "experts", "shared_expert", "noise")

    def _components(self) -> list[tuple[str, int]]:
        return [(name, getattr(self, name)) for name in self.COMPONENTS]

    def _active(self, name: str, value: int) -> int:
        # Only the routed experts are sparse: a token reaches k of the N of them.
        if name == "experts" and self.n_experts:
            return value * self.experts_per_token // self.n_experts
        return value

    @property
    def total(self) -> int:
        """Every stored weight (what memory must hold)."""
        return sum(value for _, value in self._components())

    @property
    def active(self) -> int:
        """Weights one token's forward pass touches (what compute scales with)."""
        return sum(self._active(name, value) for name, value in self._components())

    def as_rows(self) -> list[tuple[str, int, int]]:
        """(component, total, active) rows, for printing."""
        return [(name, value, self._active(name, value)) for name, value in self._components()]


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Count the weights of the model `cfg` describes, component by component."""
    d, dh = cfg.d_model, cfg.head_dim
    attn_per_layer = d * cfg.n_heads * dh + 2 * d * cfg.n_kv_heads * dh + cfg.n_heads * dh * d
    n_moe = sum(cfg.is_moe(layer) for layer in range(cfg.n_layers))
    n_dense = cfg.n_layers - n_moe
    embedding = cfg.vocab_size * d
    return ParamCounts(
        embedding=embedding,
        lm_head=0 if cfg.tie_embeddings else embedding,
        attention=attn_per_layer * cfg.n_layers,
        norms=2 * d * cfg.n_layers + d,
        dense_ffn=3 * d * cfg.ffn_dim * n_dense,
        router=cfg.n_experts * d * n_moe,
        experts=cfg.n_experts * 3 * d * cfg.expert_dim * n_moe,
        shared_expert=3 * d * cfg.shared_dim * n_moe if cfg.shared_expert else 0,
        noise=ROUTERS.find(cfg.router).extra_parameters(cfg) * n_moe if n_moe else 0,
        experts_per_token=cfg.experts_per_token,
        n_experts=cfg.n_experts,
    )


@dataclass(frozen=True)
class KVCacheReport:
    """KV-cache size of one sequence: per token, per layer, and for the whole sequence."""

    seq_len: int
    n_layers: int
    dtype: str
    values_per_token_per_layer: int  # 2 * n_kv_heads * head_dim (keys and values)
    mha_values_per_token_per_layer: int  # 2 * n_heads * head_dim: full multi-head attention
    values_per_token: int
    bytes_per_value: int
    bytes_per_token: int
    bytes_for_sequence: int  # chunked layers cache only the current chunk, so this can be < seq_len * per token

    @property
    def gqa_saving(self) -> float:
        """How many times fewer values GQA caches than multi-head attention would."""
        return self.mha_values_per_token_per_layer / self.values_per_token_per_layer


def kv_cache(cfg: ModelConfig, seq_len: int, dtype: str = "float16") -> KVCacheReport:
    """KV-cache memory needed to generate up to `seq_len` tokens with `cfg` in `dtype`."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ConfigError(f"seq_len ({seq_len!r}) must be a positive integer")
    if dtype not in _BYTES_PER_VALUE:
        raise ConfigError(f"unknown dtype {dtype!r}; valid: {', '.join(_BYTES_PER_VALUE)}")
    per_layer = 2 * cfg.n_kv_heads * cfg.head_dim
    bpv = _BYTES_PER_VALUE[dtype]
    positions = sum(cfg.cache_slots(layer, seq_len)[0] for layer in range(cfg.n_layers))
    return KVCacheReport(
        seq_len=seq_len, n_layers=cfg.n_layers, dtype=dtype,
        values_per_token_per_layer=per_layer,
        mha_values_per_token_per_layer=2 * cfg.n_heads * cfg.head_dim,
        values_per_token=per_layer * cfg.n_layers,
        bytes_per_value=bpv,
        bytes_per_token=per_layer * cfg.n_layers * bpv,
        bytes_for_sequence=positions * per_layer * bpv,
    )


@dataclass(frozen=True)
class TrainingMemory:
    """What one training step holds, in bytes: the same for every step, so it can be checked before the first.

    `state` is the float32 weights, their gradients and the optimizer's moments; `per_sequence` what one
    sequence of the micro-batch adds (the activations kept for the backward pass, in float32, its token ids,
    and its share of the fixed validation batches). Activations are estimated per token from the layer
    shapes (about 16 values of the width per layer, plus the feed-forward's hidden values and the logits, 4
bytes each, 3 under bf16 autocast);
    the estimate was checked against the peak memory of real steps (benchmarks/RESULTS.md), and errs low, so
    that only a step that surely cannot fit is refused."""

    state: int
    per_sequence: int
    batch_size: int

    @property
    def total(self) -> int:
        return self.state + self.batch_size * self.per_sequence

    def largest_batch(self, free: int) -> int:
        """The largest batch_size whose step fits in `free` bytes (0 when the state alone does not)."""
        return max(0, (free - self.state) // self.per_sequence)


def training_memory(cfg: ModelConfig, batch_size: int, seq_len: int, optimizer: str = "adamw",
                    eval_batches: int = 16, state_shards: int = 1, bf16: bool = False) -> TrainingMemory:
    """The memory a training step of `cfg` takes (see `TrainingMemory`) with the optimizer of that name (its
    kind's `state_count`); `state_shards` ranks share the state (FSDP); `bf16` autocast keeps some activations
    at half the size (about a quarter less in all)."""
    counts = param_counts(cfg)
    # The registry, not the optimizers' module: it loads that (and torch, which `params` does without) on
    # first use, and keeps this file below training in the house.
    moments = OPTIMIZERS.find(optimizer).state_count(counts)  # AdamW: two per weight
    state = 4 * (2 * counts.total + moments) // state_shards
    d = cfg.d_model
    per_token = 3 * cfg.vocab_size  # logits, their softmax and its gradient
    for layer in range(cfg.n_layers):
        per_token += 16 * d
        if cfg.is_moe(layer):
            k = cfg.experts_per_token
            per_token += 3 * (k * cfg.expert_dim + cfg.shared_expert * cfg.shared_dim) + 2 * k * d + 2 * cfg.n_experts
        else:
            per_token += 3 * cfg.ffn_dim
    ids = 2 * 8 * (1 + eval_batches)  # int64 inputs and targets: this step's and the validation batches'
    per_token = 3 * per_token if bf16 else 4 * per_token
    return TrainingMemory(state=state, per_sequence=seq_len * (per_token + ids), batch_size=batch_size)


def format_bytes(n: int) -> str:
    """Binary units: '128 KiB', '1 GiB', '1.50 MiB' (whole numbers shown without decimals)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} {unit}" if value == int(value) else f"{value:.2f} {unit}"


def format_count(n: float) -> str:
    """Human parameter count: '107.8B', '17.2B', '1.3M', '512'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{int(n)}"


def format_layout(cfg: ModelConfig) -> str:
    """The parameter counts and one line per layer: its attention (RoPE, chunked, or NoPE) and its FFN."""
    counts = param_counts(cfg)
    lines = [f"{format_count(counts.total)} parameters, {format_count(counts.active)} active per token"]
    for i in range(cfg.n_layers):
        attn = "RoPE" if cfg.uses_rope(i) else "NoPE"
        chunk = f", chunk {cfg.chunk_size(i)}" if cfg.chunk_size(i) else ""
        ffn = (f"MoE {cfg.n_experts} experts, top-{cfg.experts_per_token}{shared_words(cfg)}" if cfg.is_moe(i)
               else f"dense SwiGLU {cfg.ffn_dim}")
        lines.append(f"  layer {i}: {attn} attention{chunk}; {ffn}")
    return "\n".join(lines)


def shared_words(cfg: ModelConfig) -> str:
    """' + shared' for an MoE with a shared expert, with its width where it is not the routed experts' (a
    summary that hid it would show two models of different active size as alike); '' without one."""
    if not cfg.shared_expert:
        return ""
    return " + shared" if cfg.shared_dim == cfg.expert_dim else f" + shared of width {cfg.shared_dim}"


def active_size_note(active: Sequence[tuple[str, int | ParamCounts]]) -> str | None:
    """One line naming each setting's active parameters per token when they are not all equal, else None:
    each against the first by how much, and, where its ParamCounts are given, why (the components whose
    active parameters differ from the first's).

    Where settings are compared (a sweep's arms, `nanollama4 compare`), a difference of active size is a
    difference of compute per token: an arm that looks like "the same model, top-2" may also be a smaller
    one (top-2 of half-width experts with the default shared expert of half width too)."""
    rows = [(name, c if isinstance(c, ParamCounts) else None, c.active if isinstance(c, ParamCounts) else c)
            for name, c in active]
    sizes = {n for _, _, n in rows}
    if len(sizes) < 2:
        return None
    exact = len({format_count(n) for n in sizes}) < len(sizes)  # 158.3K and 158.3K that differ: whole numbers
    first, first_counts, base = rows[0]
    listing = []
    for name, counts, n in rows:
        shown = f"{name} {f'{n:,}' if exact else format_count(n)}"
        if name != first and n != base:
            why = [f"{part} {format_count(mine)} against {format_count(theirs)}"
                   for (part, _, mine), (_, _, theirs) in zip(counts.as_rows(), first_counts.as_rows(), strict=True)
                   if mine != theirs] if counts is not None and first_counts is not None else []
            shown += f" ({(n - base) / base:+.0%} on {first}{': ' + ', '.join(why) if why else ''})"
        listing.append(shown)
    return f"active parameters per token differ ({'; '.join(listing)}): these settings differ in compute per token too"


def format_params_table(cfg: ModelConfig) -> str:
    """Table of parameters per component, total and active per token."""
    counts = param_counts(cfg)
    lines = [f"{'component':<15}{'total':>20}{'active/token':>20}"]
    lines += [f"{name:<15}{total:>20,}{active:>20,}" for name, total, active in counts.as_rows()]
    lines.append("-" * 55)
    lines.append(f"{'sum':<15}{counts.total:>20,}{counts.active:>20,}")
    lines.append(f"total {format_count(counts.total)} parameters, {format_count(counts.active)} active per token")
    return "\n".join(lines)


def format_kv_table(report: KVCacheReport) -> str:
    """The KV-cache arithmetic, step by step, for seq_len tokens in report.dtype."""
    r = report
    rows = [
        ("values per token per layer (2 * kv_heads * head_dim)", f"{r.values_per_token_per_layer:,}"),
        ("full multi-head attention would cache",
         f"{r.mha_values_per_token_per_layer:,} (GQA caches {r.gqa_saving:g}x fewer, a {r.gqa_saving:.1f}x saving)"),
        (f"values per token over {r.n_layers} layers", f"{r.values_per_token:,}"),
        (f"bytes per value ({r.dtype})", f"{r.bytes_per_value}"),
        ("per token", f"{format_bytes(r.bytes_per_token)} ({r.bytes_per_token:,} bytes)"),
        (f"for a sequence of {r.seq_len:,} tokens",
         f"{format_bytes(r.bytes_for_sequence)} ({r.bytes_for_sequence:,} bytes)"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


__all__ = ["ParamCounts", "KVCacheReport", "param_counts", "kv_cache", "format_bytes", "format_count",
           "format_kv_compare", "format_params_compare", "shared_words", "active_size_note",
           "format_params_table", "format_kv_table"]


COMPARE_LENGTHS = (1024, 8192, 32768, 131072, 1048576)


def format_kv_compare(cfg: ModelConfig, dtype: str = "float16", lengths: tuple[int, ...] = COMPARE_LENGTHS) -> str:
    """KV-cache bytes for one sequence of each length: full multi-head attention, GQA, and GQA with the RoPE
    layers chunked (the config's chunk, or Llama 4's 8192 when it has none)."""
    chunk = cfg.attention_chunk_size or 8192
    variants = [("multi-head", cfg.replace(n_kv_heads=cfg.n_heads, attention_chunk_size=None)),
                (f"GQA, {cfg.n_kv_heads} KV heads", cfg.replace(attention_chunk_size=None)),
                (f"GQA + chunks of {chunk}", cfg.replace(attention_chunk_size=chunk))]
    width = max(len(name) for name, _ in variants)
    lines = [f"{'tokens':>9}  " + "  ".join(f"{name:>{width}}" for name, _ in variants)]
    for n in lengths:
        lines.append(f"{n:>9,}  " + "  ".join(f"{format_bytes(kv_cache(v, n, dtype).bytes_for_sequence):>{width}}"
                                            for _, v in variants))
    rope_layers = sum(cfg.uses_rope(i) for i in range(cfg.n_layers))
    lines.append(f"({cfg.n_layers} layers, {rope_layers} of them RoPE layers, which chunking bounds; {dtype}; "
                 f"{cfg.n_heads} query heads)")
    if rope_layers == cfg.n_layers:
        lines.append("(no NoPE layer here: chunking every layer would cap how far back any token sees; Llama 4 "
                     "keeps every 4th layer unchunked)")
    return "\n".join(lines)


def format_params_compare(cfg: ModelConfig) -> str:
    """Total against active-per-token parameters for an MoE config and a dense model of the same active size
    (its FFN as wide as the routed experts a token uses plus the shared expert)."""
    if cfg.n_experts == 0:
        moe = cfg.replace(n_experts=8, experts_per_token=1, expert_dim=cfg.ffn_dim // 2, shared_expert=True,
                          shared_expert_dim=0, moe_every=1)
        rows = [("dense (this config)", cfg), ("MoE, 8 experts of half width, top-1 + shared", moe)]
    else:
        ffn = cfg.expert_dim * cfg.experts_per_token + (cfg.shared_dim if cfg.shared_expert else 0)
        # the twin has one FFN width for every layer: the same active size only if the config's own dense
        # layers (moe_every > 1) are that wide already
        same = cfg.moe_every == 1 or cfg.ffn_dim == ffn
        rows = [(f"MoE ({cfg.n_experts} experts, top-{cfg.experts_per_token}{shared_words(cfg)})", cfg),
                (f"dense, FFN {ffn}{' (same active size)' if same else ' on every layer'}",
                 cfg.replace(n_experts=0, ffn_dim=ffn))]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'model':<{width}}  {'total':>10}  {'active/token':>12}  {'total/active':>12}"]
    for name, c in rows:
        p = param_counts(c)
        lines.append(f"{name:<{width}}  {format_count(p.total):>10}  {format_count(p.active):>12}  "
                     f"{p.total / p.active:>11.1f}x")
    return "\n".join(lines)
