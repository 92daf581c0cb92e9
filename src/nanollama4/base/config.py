"""Model and training configuration: typed, validated dataclasses and the named presets.

Every architectural choice of the model is a field of `ModelConfig`, every training choice one of
`TrainConfig`, so that a config file fully describes a run. Each field is declared once, on its line: its
type, its limits (`fields.Rule`, named aliases below) and its meaning (the comment). `fields.check` judges a
value by that line at construction, whichever door it came through, with a message that names the field;
the validators here hold only the rules between fields. Just over 400 lines: the presets' shapes and the
reasons for them belong beside the fields they set.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from .errors import ConfigError, MissingImport
from .fields import (
    NON_NEGATIVE,
    OWN,
    POSITIVE,
    POSITIVE_NUMBER,
    WHOLE,
    Rule,
    Seed,
    above,
    at_least,
    at_most,
    check,
    plain_fields,
    read_text,
    size,
)
from .parts import OPTIMIZERS, ROUTERS, Composed, code_of, declared_hint, kind_of_key, own_keys, renamed, renamed_words

RouterKind = str  # "sigmoid", "softmax", or a kind your own code registers (router.py; plugins.py)
RouterNoise = Literal["none", "fixed", "learned"]
CapacityOverflow = Annotated[Literal["next", "drop"], Rule("'next' (the next-best expert with room) or 'drop'")]
SoftmaxOver = Annotated[Literal["chosen", "all"], Rule("'chosen' (the top-k, the rest -inf) or 'all' (every logit)")]


# What each field takes: its type and limits (fields.Rule), read by fields.check for every door (Python, config
# files, --set, config.json). The sizes' upper limits (size(N); the others 2^27) keep real Llama 4 shapes well
# inside (Maverick: width 5,120, 48 layers, 128 experts, vocabulary 202,048; Scout's context 10M) and exist so
# that a crafted config.json is refused before it can ask for terabytes.
Count = Annotated[int, POSITIVE]
Whole = Annotated[int, WHOLE]
NonNegative = Annotated[float, NON_NEGATIVE]
PositiveNumber = Annotated[float, POSITIVE_NUMBER]
Factor = Annotated[float, above(0, "a positive factor or None")]
Interval = Annotated[int, at_least(0, "0 (no NoPE layers) or a positive integer"), at_most(2**27)]
ChunkSize = Annotated[int, above(0, "a positive integer or None (no chunking)"), at_most(2**27)]
ExpertCount = Annotated[int, at_least(0, "0 (dense model) or a positive integer"), at_most(4096)]
SharedWidth = Annotated[int, at_least(0, "0 (expert_dim, the routed experts' width) or a positive integer"),
                        at_most(2**20)]
TopK = Annotated[int, at_most(4096)]  # positive where there are experts (a cross-field rule)
CapacityFactor = Annotated[float, above(0, "positive or None (dropless)")]
Decay = Annotated[float, Rule("in [0, 1)", lambda v: 0 <= v < 1)]
BudgetShare = Annotated[float, Rule("a share of the time budget in [0, 1)", lambda v: 0 <= v < 1)]
Share = Annotated[float, Rule("a share of the time budget in [0, 1] (0: validate by eval_interval steps alone)",
                                  lambda v: 0 <= v <= 1)]
Turns = Annotated[int, at_least(0, "a whole number >= 0 (0: every expert every step)")]
Steps = Annotated[int, above(0, "a positive integer")]
Seconds = Annotated[float, above(0, "a positive, finite number of seconds or None")]
Timeout = Annotated[float, above(0, "a positive, finite number of seconds")]
Bf16 = Annotated[bool | str, Rule("true, false or 'auto' (bf16 autocast where its products measure faster than "
                                  "float32's at the start of the run)", lambda v: v in (True, False, "auto"))]
_DEVICE = re.compile(r"auto|cpu|mps|(cuda|xpu)(:\d+)?")
Device = Annotated[str, Rule("'auto', 'cpu', 'cuda' or 'cuda:N' (N a GPU index), 'mps' or 'xpu'",
                             lambda v: bool(_DEVICE.fullmatch(v)))]
InvalidUtf8 = Annotated[Literal["error", "replace"], Rule("'error' (stop, naming the file and offset) or "
                                                          "'replace' (read bad bytes as U+FFFD)")]
Held = Annotated[float, Rule("a share in (0, 0.5]: the end of the corpus kept for validation",
                                    lambda v: 0 < v <= 0.5)]
Text = Annotated[str, Rule("the path of a text (file, folder or glob) or None", bool)]
MAX_THREADS = 1024  # as serve --threads: torch.set_num_threads(100000) crashed the process (SIGSEGV, run.lock left)
Threads = Annotated[int, Rule(f"a whole number from 0 (all cores, watched) to {MAX_THREADS:,}",
                              lambda v: 0 <= v <= MAX_THREADS)]
Weights = Annotated[str, Rule("the path of a run, a checkpoint or a transformers folder, or None", bool)]
LoraRank = Annotated[int, at_least(0, "a whole number >= 0 (0: train every weight)")]
LoraAlpha = Annotated[float, above(0, "a positive number or None (= lora_rank)")]
Parallel = Literal["ddp", "fsdp"]
TokenizerKind = Literal["char", "bpe"]
Documents = Annotated[Literal["auto", "files", "none"], Rule(
    "'auto' (after each file of a corpus of several), 'files' (after each file, one too) or 'none'")]
LogKind = Annotated[Literal["jsonl", "tensorboard"], Rule("'jsonl' (metrics.jsonl) or 'tensorboard' (TensorBoard "
                                                          "events as well)")]


@dataclass(eq=False)
class ModelConfig(Composed):
    """Shapes and switches of a Llama 4-style decoder. Defaults make a small, sensible MoE model."""

    # --- sizes
    vocab_size: size(2**22) = 256  # rows of the token embedding and of the LM head
    d_model: size(2**16) = 128  # model width (residual stream)
    n_layers: size(1024) = 4  # number of transformer blocks
    n_heads: size(1024) = 8  # query heads
    n_kv_heads: size(1024) = 2  # key/value heads (GQA); must divide n_heads
    head_dim: size(2048) = 16  # width of one head; n_heads * head_dim need not equal d_model
    max_seq_len: size() = 256  # longest sequence the model is used with (training windows, generation)
    # --- positions: RoPE, llama3-style frequency scaling, NoPE interleaving (iRoPE)
    rope_theta: PositiveNumber = 10000.0  # RoPE base: theta_i = base^(-2i/head_dim)
    rope_scaling: Factor | None = None  # llama3 scaling factor for long context; None = plain RoPE
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above L0/low are divided by the factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below L0/high are kept as they are
    rope_original_max_len: size() = 8192  # llama3 scaling: L0, the context the base model was trained on
    nope_interval: Interval = 4  # layer i has no positional embedding when (i+1) % interval == 0; 0 = none
    # --- attention
    attention_chunk_size: ChunkSize | None = None  # RoPE layers attend within fixed chunks of this size; None = off
    use_qk_norm: bool = True  # weightless RMS norm of q and k per head, on RoPE layers only
    attn_temperature_tuning: bool = True  # scale NoPE-layer queries up slowly with position
    floor_scale: size() = 8192  # temperature tuning: positions are bucketed by this many tokens
    attn_scale: NonNegative = 0.1  # temperature tuning: strength of the log growth
    # --- feed-forward: dense SwiGLU and mixture of experts
    ffn_dim: size(2**20) = 256  # width of the dense SwiGLU on non-MoE layers
    n_experts: ExpertCount = 4  # routed experts per MoE layer; 0 = dense model
    experts_per_token: TopK = 1  # top-k: experts each token is sent to
    expert_dim: size(2**20) = 128  # width of each routed expert (and of the shared expert, unless shared_expert_dim)
    shared_expert: bool = True  # one always-on SwiGLU expert next to the routed ones
    shared_expert_dim: SharedWidth = 0  # width of the shared expert; 0 = expert_dim (as Llama 4: one width for both)
    moe_every: size(1024) = 1  # layer i is MoE when (i+1) % moe_every == 0 (1 = all, 2 = layers 1,3,5...)
    router: RouterKind = "sigmoid"  # sigmoid: Llama 4 (score scales input); softmax: tutorial (weights output)
    capacity_factor: CapacityFactor | None = None  # expert capacity = ceil(cf * tokens * k / N); None = dropless
    capacity_in_eval: bool = False  # also apply the capacity limit in eval() mode
    capacity_overflow: CapacityOverflow = "next"  # a full expert's token: to the "next" best with room, or "drop"
    aux_loss_coef: NonNegative = 0.0  # Switch-style load-balancing loss coefficient (0 = off)
    z_loss_coef: NonNegative = 0.0  # router z-loss coefficient (0 = off)
    bias_balance_rate: NonNegative = 0.0  # aux-loss-free balancing: per-step bias update size (0 = off)
    # --- the rest
    norm_eps: PositiveNumber = 1e-5  # epsilon of every RMSNorm and of the QK norm
    tie_embeddings: bool = False  # LM head shares the token embedding matrix
    init_std: PositiveNumber = 0.02  # std of the normal initialisation of matrices
    imports: str = ""  # the modules (--import) that define this model's parts, comma-separated; filled in for you
    settings: dict[str, Any] = field(default_factory=dict, metadata=OWN)  # router kinds' own: [model.softmax]

    KINDS = {"router": ROUTERS}

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise one ConfigError naming the first bad field and how to fix it: each field's own type and limits
        (its declaration above), then the rules between fields."""
        check(self)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}); "
                             "pick n_kv_heads among its divisors")
        if self.head_dim % 2 and self.nope_interval != 1:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs of dimensions")
        if self.rope_scaling is not None:
            if not 0 < self.rope_low_freq_factor <= self.rope_high_freq_factor:
                raise ConfigError(f"rope_low_freq_factor ({self.rope_low_freq_factor}) must be positive and "
                                 f"<= rope_high_freq_factor ({self.rope_high_freq_factor})")
        if self.n_experts:
            if self.experts_per_token <= 0:
                raise ConfigError(f"experts_per_token ({self.experts_per_token!r}) must be a positive integer")
            if self.experts_per_token > self.n_experts:
                raise ConfigError(f"experts_per_token ({self.experts_per_token}) must be <= n_experts "
                                 f"({self.n_experts})")
        if self.router not in ROUTERS and self.imports:
            raise MissingImport("router", self.router, self.imports)
        module = code_of(ROUTERS.find(self.router))  # a ConfigError naming the kinds there are
        if module is not None and module not in self.imports.split(","):  # what a run records it needs
            self.imports = ",".join(filter(None, [*self.imports.split(","), module]))
        self._settle_kinds()

    # ------------------------------------------------------------------ derived layout
    def uses_rope(self, layer: int) -> bool:
        """RoPE layers are all but every nope_interval-th (0-based 3, 7, 11 ... for 4), as Llama 4 does."""
        return self.nope_interval == 0 or (layer + 1) % self.nope_interval != 0

    def chunk_size(self, layer: int) -> int | None:
        """Chunked local attention applies to RoPE layers only; NoPE layers see the whole past."""
        return self.attention_chunk_size if self.uses_rope(layer) else None

    def cache_slots(self, layer: int, context: int) -> tuple[int, bool]:
        """(slots, ring) of a KV cache for `layer` over positions 0..context-1: the one statement of how many
        keys a layer keeps (the engine's and generation's caches, and the memory arithmetic, read it). A query
        of a chunked layer never looks further back than the start of its own chunk, so chunk - 1 earlier keys
        are all it can use: a ring of chunk - 1 slots, where that is shorter than the context. Otherwise one
        slot per position."""
        chunk = self.chunk_size(layer)
        return (chunk - 1, True) if chunk is not None and chunk - 1 < context else (context, False)

    @property
    def capacity_at_inference(self) -> bool:
        """Whether expert capacity also acts in eval mode: the tokens of a batch then compete for expert slots,
        so a row's output can depend on the others."""
        return bool(self.n_experts and self.capacity_factor is not None and self.capacity_in_eval)

    def is_moe(self, layer: int) -> bool:
        """MoE layers are every moe_every-th, counting from 1 (the reference's interleave rule)."""
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def shared_dim(self) -> int:
        """The shared expert's width: its own (shared_expert_dim) or, by default, the routed experts'. Its own lets
        a top-2 of half-width experts keep the whole shared expert of a top-1 at equal active parameters."""
        return self.shared_expert_dim or self.expert_dim

    @property
    def n_rep(self) -> int:
        """Query heads that share one key/value head."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed, validated again."""
        return self.from_dict({**self.to_dict(), **changes})


@dataclass(eq=False)
class TrainConfig(Composed):
    """How to train: optimisation, schedule, evaluation and checkpointing.

    The defaults are a plain float32 AdamW recipe; `make demo` also sets bf16=auto, seq_len=256, optimizer=muon,
    lr=2e-3 and min_lr=2e-4, the best of benchmarks/demo_sweep.py on a CPU, muon.experts_per_step=2
    (docs/experiments.md section 7), eval_batches=4 (fewer seconds of its five minutes spent validating) and
    batch_size=16 with the model's experts at 192 (more steps in five minutes; benchmarks/RESULTS.md, the
    record of Quality III).
    """

    batch_size: Count = 32  # sequences per optimizer step (per accumulation micro-step)
    seq_len: Count | None = None  # tokens per training window, at most max_seq_len; None = the model's max_seq_len
    grad_accum: Count = 1  # micro-batches accumulated per optimizer step
    optimizer: str = "adamw"  # "adamw", "muon" (hidden matrices; AdamW for the rest) or a kind of yours (optim.py)
    optimizer_imports: str = ""  # the module (--import) that defines a kind of your own; filled in for you
    lr: NonNegative = 7e-4  # peak learning rate, reached after warmup (best of 4e-4..3e-3 in 5-minute demo runs)
    min_lr: NonNegative = 7e-5  # learning rate at the end of the cosine decay
    warmup_steps: Whole = 100  # under --max-steps: linear warmup from 0 to lr over this many steps
    warmup_frac: BudgetShare = 0.05  # under --max-time: linear warmup over this share of the time budget
    weight_decay: NonNegative = 0.1  # AdamW decay, applied to matrices only (not norms' gains)
    beta1: Decay = 0.9  # AdamW first-moment decay
    beta2: Decay = 0.99  # AdamW second-moment decay
    grad_clip: NonNegative = 1.0  # clip the global gradient norm to this (0 = off)
    max_steps: Steps | None = None  # stop after this many optimizer steps
    max_time: Seconds | None = None  # stop after this many seconds of training (the schedule follows time)
    decay_steps: Steps | None = None  # cosine horizon in steps; None = max_steps (set it to stop early on plan)
    eval_interval: Count = 250  # validate (and checkpoint) every this many steps (under --max-time: see eval_share)
    eval_share: Share = 0.2  # under --max-time: validate each time this share of the budget has passed (0 = by steps)
    eval_batches: Count = 16  # fixed validation batches per evaluation
    bf16: Bf16 = False  # autocast products to bfloat16 (weights, optimizer stay float32); "auto": if it pays
    compile: bool = False  # torch.compile the model
    seed: Seed = 1337  # seeds initialisation, batch sampling and router noise
    tokenizer: TokenizerKind = "char"  # "char" (the tutorial's) or "bpe" (byte-level BPE trained on the corpus)
    bpe_vocab_size: Count = 2048  # vocabulary size when tokenizer = "bpe"
    documents: Documents = "auto"  # end-of-text token after each file: "auto" (if several files), "files" or "none"
    threads: Threads = 0  # torch CPU threads; 0 = all cores, fewer while other work holds or slows them (threads.py)
    device: Device = "auto"  # "auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:N", "mps" or "xpu"
    invalid_utf8: InvalidUtf8 = "error"  # a corpus byte that is not UTF-8: "error" (name file and offset) or "replace"
    val_fraction: Held = 0.1  # the corpus's last share held out for validation (in [0, 0.5])
    val_data: Text | None = None  # a separate validation text (file, folder or glob); then all the corpus trains
    init_from: Weights | None = None  # start from these weights: a run, a checkpoint or a transformers folder
    lora_rank: LoraRank = 0  # with init_from: train rank-r adapters (attention, feed-forward, experts), the rest frozen
    lora_alpha: LoraAlpha | None = None  # adapters' scale alpha / lora_rank; None = lora_rank (scale 1)
    # under torchrun (see distributed/); batch_size and grad_accum are then per rank
    parallel: Parallel = "ddp"  # data parallelism: "ddp" (every rank holds the model) or "fsdp" (FSDP2: sharded)
    expert_parallel: Count = 1  # spread each MoE layer's experts over this many ranks (1 = every rank holds all)
    log: LogKind = "jsonl"  # "jsonl" (metrics.jsonl) or "tensorboard" (also TensorBoard events in RUN/tensorboard/)
    dist_timeout: Timeout = 600.0  # seconds a rank waits for its peers in one collective before giving up
    settings: dict[str, Any] = field(default_factory=dict, metadata=OWN)  # optimizer kinds' own: [train.muon]

    KINDS = {"optimizer": OPTIMIZERS}

    def __post_init__(self) -> None:
        """Each field's own type and limits (its declaration above), then the rules between fields."""
        check(self)
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.max_time is not None and self.max_time > MAX_DURATION:
            raise ConfigError(f"max_time ({self.max_time:g} s) is more than a year; give the time you mean to train")
        if self.optimizer not in OPTIMIZERS and self.optimizer_imports:
            raise MissingImport("optimizer", self.optimizer, self.optimizer_imports)
        kind = OPTIMIZERS.find(self.optimizer)  # a ConfigError naming the kinds there are
        self.optimizer_imports = code_of(kind) or ""  # what a run records it needs
        self._settle_kinds()
        if self.lora_rank and self.init_from is None:
            raise ConfigError(f"lora_rank={self.lora_rank} adapts trained weights: give them with --init-from "
                              "RUN|HF_DIR")
        kind.check(self)  # what the optimizer cannot do (Muon: FSDP, LoRA)
        if self.lora_rank:
            if self.parallel == "fsdp" or self.expert_parallel > 1:
                raise ConfigError("lora_rank works in one process or under torchrun with parallel=ddp and "
                                  "expert_parallel=1: the adapters are small, so every rank holds them whole")

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed, validated again."""
        return self.from_dict({**self.to_dict(), **changes})




def _llama4_common() -> dict[str, Any]:
    # Shapes shared by the published Llama 4 text models (Scout and Maverick).
    return dict(vocab_size=202048, d_model=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128,
                rope_theta=500000.0, nope_interval=4, attention_chunk_size=8192, ffn_dim=16384,
                expert_dim=8192, experts_per_token=1, shared_expert=True, router="sigmoid",
                attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1)


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for unit tests: every feature switched on, runs in milliseconds.
    "tiny": dict(vocab_size=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                 max_seq_len=64, attention_chunk_size=8, ffn_dim=128, n_experts=4,
                 experts_per_token=2, expert_dim=64, floor_scale=4, attn_scale=0.1),
    # The demo: a character-level MoE that learns Shakespeare in minutes on a laptop CPU (`make demo` trains it
    # with experts of 192, `--set expert_dim=192`, for more steps in its five minutes). 4 heads of 64
    # rather than 8 of 32: the CPU's attention kernels run the wider heads faster, and in 5 minutes the
    # model reached a lower validation loss (runs q15 and q21, measured 2026-11-29, see git history of
    # benchmarks/RESULTS.md). A miniature of Llama 4's attention: its RoPE layers attend in chunks of
    # 8,192 and its NoPE layers' temperature steps every 8,192 positions (floor_scale), in contexts many
    # chunks long; here chunks of 64 and a floor of 64 put 4 chunks and 4 temperature steps in the
    # 256-token context, so both act in the demo.
    "shakespeare-char": dict(vocab_size=128, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                             head_dim=64, max_seq_len=256, attention_chunk_size=64, floor_scale=64,
                             nope_interval=4,
                             ffn_dim=768, n_experts=8, experts_per_token=1, expert_dim=384,
                             rope_theta=10000.0, bias_balance_rate=0.03),
    # The tutorial's MoE (the seeds' makeMoE walk), at the demo's size: a softmax over the two chosen logits,
    # learned noise on the logits in training (noisy top-k gating), and expert capacity whose overflow goes
    # to each token's next-best expert with room. Experts half the demo's width, so top-2 costs what its
    # top-1 does. Chunks of 64 on the RoPE layers and a temperature floor of 64 on the NoPE layer: the
    # context holds 4 chunks, and the temperature grows at positions 63, 127 and 191 (as Llama 4's does
    # at multiples of 8,192).
    "tutorial": dict(vocab_size=128, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
                     max_seq_len=256, attention_chunk_size=64, nope_interval=4, floor_scale=64, attn_scale=0.1,
                     ffn_dim=768, n_experts=8, experts_per_token=2, expert_dim=192, rope_theta=10000.0,
                     router="softmax", **{"softmax.noise": "learned"}, capacity_factor=1.25, capacity_overflow="next"),
    # The experiments' model (docs/experiments.md): dense, width 128, 4 layers of 8 query heads over 2 KV heads,
    # all RoPE, unchunked; an FFN of 384 = the active width of top-1 + a shared expert of 192. A minute an arm.
    "experiments": dict(d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16, max_seq_len=128,
                        ffn_dim=384, n_experts=0, expert_dim=192, nope_interval=0, attention_chunk_size=None),
    # Sized for one accelerator (an H100 or H200): width 1024, 12 layers of 16 query heads of 64 over 4 KV heads,
    # iRoPE (chunks of 512 on the RoPE layers, NoPE every 4th with a temperature floor of 512) in a context of
    # 2,048, and 8 experts of 2,048 top-1 + a shared expert: ~0.7 B parameters, ~0.19 B active per token with
    # an 8K BPE vocabulary. Its dense twin (`--set n_experts=0 --set ffn_dim=4096`) has the same active size.
    # Train it on your corpus with `--preset gpu --set tokenizer=bpe --set bf16=true --device cuda`.
    "gpu": dict(vocab_size=8192, d_model=1024, n_layers=12, n_heads=16, n_kv_heads=4, head_dim=64,
                max_seq_len=2048, attention_chunk_size=512, floor_scale=512, nope_interval=4, ffn_dim=4096,
                n_experts=8, experts_per_token=1, expert_dim=2048, rope_theta=500000.0, bias_balance_rate=0.001),
    # The mission's arithmetic example: Llama-3-8B-like attention shapes, dense.
    "seed-example": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, max_seq_len=8192, attention_chunk_size=None, nope_interval=0,
                         ffn_dim=14336, n_experts=0, rope_theta=500000.0),
    # Published text-model shapes, for arithmetic (parameter counts, KV cache), not for training here.
    "llama4-scout": dict(_llama4_common(), n_experts=16, moe_every=1, use_qk_norm=True,
                         max_seq_len=10485760, rope_scaling=16.0, rope_low_freq_factor=1.0,
                         rope_high_freq_factor=1.0, rope_original_max_len=8192),
    "llama4-maverick": dict(_llama4_common(), n_experts=128, moe_every=2, use_qk_norm=False,
                            max_seq_len=1048576),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset, optionally with some fields changed."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})


# ---------------------------------------------------------------------------------------------- text values
def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '10m' or '1.5h': positive and finite ('nan' would never end a run)."""
    units = {"s": 1, "m": 60, "h": 3600}
    raw = text.strip().lower()
    try:
        seconds = float(raw[:-1]) * units[raw[-1]] if raw and raw[-1] in units else float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"duration {text!r} must be a positive time such as 300, 300s, 10m or 1.5h")
    if seconds > MAX_DURATION:
        raise ConfigError(f"duration {text!r} is more than a year ({MAX_DURATION / 3600:,.0f}h); the learning rate "
                          "follows the whole budget, so give the time you mean to train, such as 10m or 8h")
    return seconds


MAX_DURATION = 366 * 24 * 3600.0  # seconds: a longer --max-time is a slip of the unit, not a plan


def parse_overrides(pairs: list[str], cls: type = ModelConfig) -> dict[str, Any]:
    """["key=value", ...] as typed values for the dataclass `cls`, unknown keys refused; "kind.key=value" sets
    one of a kind's own settings ("muon.lr=0.01").

    Each value is read as its field's declared type (`fields.read_text`), so `--set n_experts=eight` fails
    here, naming the field, instead of deep in torch; the config's own checks then judge the value.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} must look like key=value")
        key, raw = (part.strip() for part in pair.split("=", 1))
        out[key] = read_text(key, raw, declared_hint(cls, key))
    return out


def config_of(key: str) -> type | None:
    """The config class (ModelConfig or TrainConfig) a key belongs to, "kind.key" included; None if neither."""
    return next((cls for cls in (TrainConfig, ModelConfig)
                 if key in {f.name for f in plain_fields(cls)} or kind_of_key(cls, key) is not None), None)


def split_overrides(pairs: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """--set pairs as (ModelConfig values, TrainConfig values): a key goes to the config that has it."""
    model_pairs, train_pairs = [], []
    for pair in pairs:
        key = pair.split("=", 1)[0].strip()
        cls = config_of(key)
        new = renamed(ModelConfig, key) or renamed(TrainConfig, key)
        if cls is None and new is not None:  # a key older runs took: its name now, not the list of every key
            raise ConfigError(renamed_words(key, new, pair.split("=", 1)[1].strip() if "=" in pair else "..."))
        if cls is None:
            model_keys = [f.name for f in plain_fields(ModelConfig)] + own_keys(ModelConfig)
            train_keys = [f.name for f in plain_fields(TrainConfig)] + own_keys(TrainConfig)
            raise ConfigError(f"unknown key {key!r}; valid keys: model {', '.join(sorted(model_keys))}; "
                              f"training {', '.join(sorted(train_keys))}")
        (train_pairs if cls is TrainConfig else model_pairs).append(pair)
    return parse_overrides(model_pairs, ModelConfig), parse_overrides(train_pairs, TrainConfig)


__all__ = ["ModelConfig", "TrainConfig", "PRESETS", "preset", "parse_overrides", "parse_duration"]
