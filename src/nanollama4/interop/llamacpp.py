"""A trained model as a GGUF file that llama.cpp (and so Ollama and LM Studio) runs as exactly our model.

llama.cpp's Llama 4 graph reads the shapes, the RoPE base, the norm epsilon, the experts and which layers
are chunked from the file, but fixes the rest in code: a RoPE chunk of 8,192, every 4th layer without
positional embedding, the NoPE layers' temperature with a floor of 8,192 and a scale of 0.1, and QK-norm on
unless the model has 128 experts. A model that differs in any of these would load and run and give other
numbers, so `llamacpp_differences` compares first and the export refuses, naming each difference and the
setting that removes it. A difference that cannot change a result within the model's `max_seq_len` (a
chunk of 8,192 on a 256-token model chunks nothing) is not one, and is said as a note.

Tokenizers are written as llama.cpp's byte-level BPE ("gpt2") with the GPT-2 pre-tokenizer ("gpt-2"),
which is what our BPE tokenizer is (tokenizers' ByteLevel with its default split). The character tokenizer
is the same thing with no merges between characters: each character is spelled in bytes as byte-level BPE
spells them, and a character of several bytes is put back together by merges of its own.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base.config import ModelConfig
from ..base.errors import CheckpointError, ConfigError
from ..base.files import clear_stale_temporaries, hold_lock, write_failed
from ..model.rope import rope_frequencies
from ..model.router import SigmoidRouter, router_class
from ..model.tokenizer import END_OF_TEXT, BPETokenizer, CharTokenizer, byte_level_spelling
from ..model.transformer import Transformer
from .hf import hf_expert_width, hf_tensors

# What llama.cpp's Llama 4 graph (src/models/llama4.cpp) fixes in code rather than reading from the file.
CHUNK = 8192
NOPE_EVERY = 4
TEMPERATURE_FLOOR = 8192
TEMPERATURE_SCALE = 0.1
QK_NORM_OFF_AT_EXPERTS = 128


@dataclass(frozen=True)
class Comparison:
    """What llama.cpp would compute differently from the model (`differences`, each with its fix), and
    what differs only outside the model's context (`notes`)."""

    differences: list[str]
    notes: list[str]


def _temperature(cfg: ModelConfig, tuned: bool, floor: int, scale: float) -> tuple[int, float] | None:
    """The NoPE layers' query scale at the positions the model is used at, as (floor, scale), or None where it
    is 1 throughout: log(floor((p + 1) / floor) + 1) * scale + 1 is 1 while p + 1 < floor."""
    if not tuned or scale == 0 or cfg.max_seq_len < floor:
        return None
    return floor, scale


def llamacpp_differences(cfg: ModelConfig) -> Comparison:
    """Compare the model with what llama.cpp's Llama 4 graph computes from its GGUF (module docstring)."""
    L, ctx = cfg.n_layers, cfg.max_seq_len
    diffs, notes = [], []
    if not cfg.n_experts:
        diffs.append("a dense model (n_experts=0): llama.cpp's llama4 needs experts on its MoE layers; train with "
                     "n_experts >= 1")
        return Comparison(diffs, notes)
    if router_class(cfg.router) is not SigmoidRouter:
        diffs.append(f"router={cfg.router!r}: llama.cpp routes as Llama 4 does; train with router=sigmoid")
    if cfg.capacity_in_eval:
        diffs.append("capacity_in_eval=true drops or moves tokens at inference; llama.cpp never does: set "
                     "capacity_in_eval=false")
    ours_nope = [i for i in range(L) if not cfg.uses_rope(i)]
    theirs_nope = [i for i in range(L) if (i + 1) % NOPE_EVERY == 0]
    if ours_nope != theirs_nope:
        diffs.append(f"layers without RoPE {ours_nope or 'none'} (nope_interval={cfg.nope_interval}); llama.cpp has "
                     f"them at {theirs_nope or 'none'} (every {NOPE_EVERY}th): train with nope_interval={NOPE_EVERY}")
    chunk = cfg.attention_chunk_size
    if chunk != CHUNK and any(cfg.uses_rope(i) for i in range(L)):
        ours = "full attention" if chunk is None else f"attention_chunk_size={chunk}"
        if min(chunk or ctx, CHUNK) < ctx:
            diffs.append(f"{ours} on the RoPE layers differs inside the model's context of {ctx}; llama.cpp chunks "
                         f"them at {CHUNK}: train with attention_chunk_size={CHUNK}"
                         + (" or none" if ctx <= CHUNK else f" (or max_seq_len <= {CHUNK})"))
        else:
            notes.append(f"the RoPE layers' {ours} and llama.cpp's chunk of {CHUNK} both see the whole context of "
                         f"{ctx}: the same within it (llama.cpp run past {ctx} tokens chunks at {CHUNK})")
    if ours_nope:
        ours = _temperature(cfg, cfg.attn_temperature_tuning, cfg.floor_scale, cfg.attn_scale)
        theirs = _temperature(cfg, True, TEMPERATURE_FLOOR, TEMPERATURE_SCALE)
        if ours != theirs:
            fix = (f"attn_temperature_tuning=false or floor_scale={TEMPERATURE_FLOOR}" if theirs is None else
                   f"floor_scale={TEMPERATURE_FLOOR} and attn_scale={TEMPERATURE_SCALE}")
            diffs.append(f"the NoPE layers' temperature (attn_temperature_tuning={cfg.attn_temperature_tuning}, "
                         f"floor_scale={cfg.floor_scale}, attn_scale={cfg.attn_scale}) differs within the model's "
                         f"context of {ctx} from llama.cpp's (floor {TEMPERATURE_FLOOR}, scale {TEMPERATURE_SCALE}"
                         f"{', 1 throughout it' if theirs is None else ''}): train with {fix}")
        elif (cfg.attn_temperature_tuning, cfg.floor_scale, cfg.attn_scale) != (True, TEMPERATURE_FLOOR,
                                                                                  TEMPERATURE_SCALE):
            notes.append(f"the NoPE layers' temperature is 1 throughout the model's context of {ctx} here and in "
                         f"llama.cpp (floor {TEMPERATURE_FLOOR}): the same within it")
    theirs_qk = cfg.n_experts != QK_NORM_OFF_AT_EXPERTS
    if cfg.use_qk_norm != theirs_qk and any(cfg.uses_rope(i) for i in range(L)):
        fix = "use_qk_norm=true" if theirs_qk else "use_qk_norm=false"
        diffs.append(f"use_qk_norm={str(cfg.use_qk_norm).lower()}; llama.cpp decides QK-norm from the expert count "
                     f"(on unless {QK_NORM_OFF_AT_EXPERTS} experts): train with {fix}")
    return Comparison(diffs, notes)


def nearest_llamacpp(cfg: ModelConfig) -> tuple[ModelConfig, list[str]]:
    """The model llama.cpp computes from this one's weights, where the two differ only in what llama.cpp's
    Llama 4 graph fixes rather than reads from the file: its chunk of 8,192 on the RoPE layers and its NoPE
    temperature (floor 8,192, scale 0.1). Returns that config and each change in words; the weights carry
    over as they are (`export --approximate` measures what the changes cost first). Differences of another
    kind (the router, the NoPE layers' places, QK-norm) remain, and `check_llamacpp` still refuses them."""
    ctx, changes, fields = cfg.max_seq_len, [], {}
    chunk = cfg.attention_chunk_size
    if chunk != CHUNK and min(chunk or ctx, CHUNK) < ctx and any(cfg.uses_rope(i) for i in range(cfg.n_layers)):
        fields["attention_chunk_size"] = None if ctx <= CHUNK else CHUNK
        theirs = "full attention within the context" if ctx <= CHUNK else f"chunks of {CHUNK}"
        changes.append(f"the RoPE layers' chunks of {chunk} become llama.cpp's {theirs} of {ctx}")
    if any(not cfg.uses_rope(i) for i in range(cfg.n_layers)):
        ours = _temperature(cfg, cfg.attn_temperature_tuning, cfg.floor_scale, cfg.attn_scale)
        theirs = _temperature(cfg, True, TEMPERATURE_FLOOR, TEMPERATURE_SCALE)
        if ours != theirs:
            fields.update(attn_temperature_tuning=True, floor_scale=TEMPERATURE_FLOOR, attn_scale=TEMPERATURE_SCALE)
            changes.append(f"the NoPE layers' temperature (floor {cfg.floor_scale}, scale {cfg.attn_scale}) becomes "
                           f"llama.cpp's (floor {TEMPERATURE_FLOOR}, scale {TEMPERATURE_SCALE}"
                           f"{', 1 throughout the context' if theirs is None else ''})")
    return cfg.replace(**fields), changes


def check_llamacpp(model: Transformer) -> list[str]:
    """Refuse (CheckpointError, one line) a model llama.cpp would compute differently; the notes otherwise."""
    found = llamacpp_differences(model.cfg)
    if found.differences:
        raise CheckpointError("llama.cpp would compute a different model from this GGUF, so it is not written: "
                              + "; ".join(found.differences)
                              + " (docs/interop.md: the llama.cpp recipe)")
    return found.notes


# ---------------------------------------------------------------------------------------------- tokenizer


def char_vocabulary(tokenizer: CharTokenizer) -> tuple[list[str], list[str]]:
    """The character tokenizer as byte-level BPE: each character spelled in bytes (`byte_level_spelling`), at
    its id, and the merges that rebuild the characters of several bytes (their bytes left to right). None of
    its merges joins two characters, so every character stays its own token, as ours."""
    tokens = [byte_level_spelling(c) for c in tokenizer.chars]
    merges = []
    for spelled in tokens:
        for end in range(2, len(spelled) + 1):
            merges.append(f"{spelled[:end - 1]} {spelled[end - 1]}")
    if not merges:
        # llama.cpp refuses a BPE vocabulary without a merges list, and an empty list is not written: one
        # merge whose left side never exists (no merge builds it) changes nothing.
        first = tokens[0]
        merges.append(f"{first}{first} {first}")
    if tokenizer.eos_id is not None:
        tokens.append(END_OF_TEXT)
    return tokens, list(dict.fromkeys(merges))


def bpe_vocabulary(tokenizer: BPETokenizer) -> tuple[list[str], list[str]]:
    """Our byte-level BPE's tokens by id and its merges in rank order, as llama.cpp reads them."""
    state = json.loads(tokenizer.to_json())
    vocab = dict(state["model"]["vocab"]) | {a["content"]: a["id"] for a in state.get("added_tokens") or []}
    tokens = [""] * tokenizer.vocab_size
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return tokens, merges


# ---------------------------------------------------------------------------------------------- writing


def gguf_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The weights under llama.cpp's names, in the layout its loader expects (row-major, as torch holds a
    Linear's (out, in)): the reference checkpoint's tensors (`hf_tensors`) renamed by the `gguf` package's
    map, the experts' fused gate/up split in two and both expert products transposed to (E, out, in)."""
    import gguf

    cfg = model.cfg
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, cfg.n_layers)
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_tensors(model).items():
        t = t.float()
        if name.endswith("experts.gate_up_proj"):  # (E, D, 2H): gate then up along the last axis
            gate, up = t.transpose(1, 2).chunk(2, dim=1)
            stem = name.removesuffix("gate_up_proj")
            out[names.get_name(stem + "gate_proj.weight", try_suffixes=(".weight",))] = gate
            out[names.get_name(stem + "up_proj.weight", try_suffixes=(".weight",))] = up
            continue
        if name.endswith("experts.down_proj"):  # (E, H, D) -> (E, D, H)
            t, name = t.transpose(1, 2), name + ".weight"
        mapped = names.get_name(name, try_suffixes=(".weight",))
        if mapped is None:
            raise CheckpointError(f"no llama.cpp name for the weight {name}; this model cannot be written as GGUF")
        out[mapped] = t
    if cfg.rope_scaling is not None:  # llama.cpp divides each RoPE frequency by its factor
        out["rope_freqs.weight"] = rope_frequencies(cfg.replace(rope_scaling=None)) / rope_frequencies(cfg)
    return {name: t.contiguous() for name, t in out.items()}


# What export_gguf writes the weight matrices as: llama.cpp's types that the gguf package's own quantizer
# writes (its k-quants it does not). Q8_0 to Q4_0: blocks of 32 values of 8, 5 or 4 bits with a float16
# scale each (the _1 types a minimum too).
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def export_gguf(model: Transformer, tokenizer: CharTokenizer | BPETokenizer, path: str | os.PathLike[str],
                name: str = "nanollama4", weights: str = "f32") -> list[str]:
    """Write `model` and `tokenizer` as one GGUF file at `path` (a new file, not a link), after
    `check_llamacpp`; returns its notes. The weight matrices as `weights` (one of GGUF_TYPES), the norms and
    other vectors in float32 as llama.cpp's own converter keeps them. Written beside `path` and renamed into place,
    so a failed export leaves nothing a retry would refuse."""
    import gguf

    if weights not in GGUF_TYPES:
        raise ConfigError(f"unknown GGUF weight type {weights!r}; choose one of {', '.join(GGUF_TYPES)}")
    qtype = getattr(gguf.GGMLQuantizationType, weights.upper())

    path = Path(path)
    if path.is_symlink() or path.exists():
        raise ConfigError(f"{path} exists; export the GGUF to a new file name")
    notes = check_llamacpp(model)
    cfg = model.cfg
    tensors = gguf_tensors(model)
    tokens, merges = char_vocabulary(tokenizer) if isinstance(tokenizer, CharTokenizer) else bpe_vocabulary(tokenizer)
    if len(tokens) != cfg.vocab_size:
        raise CheckpointError(f"the tokenizer has {len(tokens)} tokens and the model {cfg.vocab_size}; export a run "
                              "whose tokenizer is its own")
    tmp, fd = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        notes += clear_stale_exports(path.parent)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-{os.getpid()}-")
        hold_lock(fd)  # held until the end: a live export's file is never taken for a stale one
        tmp = Path(tmp_name)
        w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA4])
        w.add_name(name)
        w.add_vocab_size(cfg.vocab_size)
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(cfg.d_model)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.ffn_dim)
        w.add_expert_feed_forward_length(hf_expert_width(cfg))
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.experts_per_token)
        w.add_interleave_moe_layer_step(cfg.moe_every)
        # the chunked layers: the RoPE layers (llama.cpp's graph wants at least one, at its chunk of 8,192)
        w.add_sliding_window_pattern([cfg.uses_rope(i) for i in range(cfg.n_layers)])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        types = [gguf.TokenType.NORMAL] * len(tokens)
        w.add_token_merges(merges)
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        eos = tokenizer.eos_id
        if eos is not None:  # BOS too, as in the transformers export (hf.tokenizer_config); never added
            w.add_eos_token_id(eos)
            w.add_bos_token_id(eos)
            types[eos] = gguf.TokenType.CONTROL
        else:
            notes.append("this run's tokenizer has no end-of-text token (it was trained before nanollama4 had one): "
                         "llama.cpp then takes token 11 for its end; generate with --ignore-eos there")
        w.add_token_types(types)
        for key, t in tensors.items():
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if qtype == gguf.GGMLQuantizationType.F32 or t.dim() < 2 or t.shape[-1] % block:
                w.add_tensor(key, t.numpy())  # (a row Q8_0 cannot split into blocks stays float32)
            else:
                w.add_tensor(key, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.chmod(0o644)
        os.replace(tmp, path)
    except OSError as e:
        raise write_failed(path, e, "make room or pass a file name you can write to, then export again") from None
    finally:
        if tmp is not None and tmp.exists():
            tmp.unlink()
        if fd is not None:
            os.close(fd)
    return notes


def clear_stale_exports(folder: Path) -> list[str]:
    """Remove the temporary files that GGUF exports killed while writing left in `folder` (`files.
    clear_stale_temporaries`'s rules), each a regular file holding GGUF's magic or nothing yet."""

    def ours(fd: int, held: os.stat_result) -> int | None:
        return held.st_size if stat.S_ISREG(held.st_mode) and os.pread(fd, 4, 0) in (b"", b"GGUF") else None

    return clear_stale_temporaries(folder, os.O_NONBLOCK, ours, lambda fd, path: os.unlink(path), "file")
