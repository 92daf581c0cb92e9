"""Reference checkpoints in and out: Hugging Face `Llama4ForCausalLM` directories <-> our Transformer.

Only safetensors and JSON are read, never pickles. A config we cannot represent exactly fails with a
message naming the field, because a silently different model would give silently different logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..base.config import ModelConfig
from ..base.errors import CheckpointError, ConfigError
from ..base.files import (
    clear_stale_temporaries,
    hold_lock,
    read_json,
    read_safetensors,
    regular_file,
    safetensors_shapes,
    write_failed,
)
from ..model.router import SigmoidRouter, router_class
from ..model.tokenizer import END_OF_TEXT, BPETokenizer, CharTokenizer, load_tokenizer
from ..model.transformer import Transformer
from ..ops import install
from .checkpoint import (
    check_shapes,
    check_vocab,
    expected_shapes,
    load_run,
    non_finite,
    read_model_config,
    resolve_checkpoint,
)

# Our parameter names -> the reference's, as (pattern, replacement) applied in order.
_TO_HF = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^blocks\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blocks\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blocks\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^blocks\.(\d+)\.ffn\.experts\.gate_up$", r"model.layers.\1.feed_forward.experts.gate_up_proj"),
    (r"^blocks\.(\d+)\.ffn\.experts\.down$", r"model.layers.\1.feed_forward.experts.down_proj"),
    (r"^blocks\.(\d+)\.ffn\.", r"model.layers.\1.feed_forward."),
]


def to_hf_name(name: str) -> str:
    """Our parameter name as the reference checkpoint spells it (`_TO_HF`, first match wins)."""
    for pattern, repl in _TO_HF:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name  # lm_head.weight keeps its name


# ---------------------------------------------------------------------------------------------- config
def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate a reference config.json (text or multimodal) into a ModelConfig, or explain why not."""
    if hf.get("model_type") == "llama4" or "text_config" in hf:
        hf = hf.get("text_config") or {}
        if not isinstance(hf, dict):
            raise CheckpointError("config.json: text_config must be a JSON object (the text model's config)")
    if hf.get("model_type", "llama4_text") != "llama4_text":
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; expected 'llama4_text'")
    if hf.get("attention_bias"):
        raise CheckpointError("config.json has attention_bias=true; nanollama4 models have no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json has hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
    try:
        n_layers = hf["num_hidden_layers"]
        rope = _rope_from_hf(hf)
        nope_interval = hf.get("no_rope_layer_interval", 4)
        step = hf.get("interleave_moe_layer_step", 1)
        moe_layers = hf.get("moe_layers")
        n_experts = hf.get("num_local_experts", 16) if moe_layers != [] else 0
        cfg = ModelConfig(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n_layers,
            n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"],
            max_seq_len=hf.get("max_position_embeddings", 131072), **rope, nope_interval=nope_interval,
            attention_chunk_size=hf.get("attention_chunk_size", 8192), use_qk_norm=bool(hf.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
            floor_scale=int(hf.get("floor_scale", 8192)), attn_scale=float(hf.get("attn_scale", 0.1)),
            ffn_dim=hf.get("intermediate_size_mlp", 16384), n_experts=n_experts,
            experts_per_token=hf.get("num_experts_per_tok", 1) if n_experts else 1,
            expert_dim=hf.get("intermediate_size", 8192), shared_expert=True, moe_every=step,
            router="sigmoid", norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required key {e.args[0]!r}") from None
    except (ValueError, TypeError, OverflowError, AttributeError) as e:
        raise CheckpointError(f"config.json describes an invalid model: {e}") from None
    _check_layout(hf, cfg)
    return cfg


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE fields from v5 `rope_parameters` or the legacy `rope_theta` + `rope_scaling` pair."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 500000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=float(theta))
    if kind != "llama3":
        raise CheckpointError(f"config.json uses rope_type {kind!r}; supported: 'default', 'llama3'")
    return dict(rope_theta=float(theta), rope_scaling=float(params["factor"]),
                rope_low_freq_factor=float(params["low_freq_factor"]),
                rope_high_freq_factor=float(params["high_freq_factor"]),
                rope_original_max_len=int(params.get("original_max_position_embeddings",
                                                     hf.get("max_position_embeddings", 131072))))


def _check_layout(hf: dict[str, Any], cfg: ModelConfig) -> None:
    """Stored per-layer lists must match the interval rules we build from, or we would build another model."""
    L = cfg.n_layers
    expected = {
        "no_rope_layers": [int(cfg.uses_rope(i)) for i in range(L)],
        "moe_layers": [i for i in range(L) if cfg.is_moe(i)],
        "layer_types": ["chunked_attention" if cfg.chunk_size(i) else "full_attention" for i in range(L)],
    }
    for key, want in expected.items():
        got = hf.get(key)
        if got is None or (key == "no_rope_layers" and got == []):
            continue  # absent: the reference derives it from the interval fields, as we do
        if got != want:
            raise CheckpointError(f"config.json {key}={got} is not the regular pattern {want} that "
                                  "nanollama4 builds from the interval fields; this layout is unsupported")


def config_to_hf(cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None
                 ) -> dict[str, Any]:
    """The reference config.json for our config, every key written (omitted keys get full-size defaults).
    BOS and EOS are the tokenizer's end-of-text token; None (null) for a tokenizer saved before it existed,
    so that transformers' generate stops on length or a stop the user gives, never at an ordinary token that
    happens to be id 2."""
    if cfg.n_experts and router_class(cfg.router) is not SigmoidRouter:
        raise CheckpointError("only the Llama 4 MoE (router='sigmoid') exists in the reference format; this model "
                              f"has router={cfg.router!r}")
    if cfg.capacity_in_eval:
        raise CheckpointError("eval-time capacity has no reference equivalent; set capacity_in_eval=false to export")
    L = cfg.n_layers
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    return {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "dtype": "float32",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": L,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "intermediate_size": hf_expert_width(cfg), "intermediate_size_mlp": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
        "num_local_experts": max(cfg.n_experts, 1), "num_experts_per_tok": cfg.experts_per_token,
        "interleave_moe_layer_step": cfg.moe_every, "moe_layers": [i for i in range(L) if cfg.is_moe(i)],
        "no_rope_layer_interval": cfg.nope_interval or L + 1,
        "no_rope_layers": [int(cfg.uses_rope(i)) for i in range(L)],
        "attention_chunk_size": cfg.attention_chunk_size,
        "layer_types": ["chunked_attention" if cfg.chunk_size(i) else "full_attention" for i in range(L)],
        "use_qk_norm": cfg.use_qk_norm, "attn_temperature_tuning": cfg.attn_temperature_tuning,
        "floor_scale": cfg.floor_scale, "attn_scale": cfg.attn_scale,
        "pad_token_id": None, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "initializer_range": cfg.init_std,
        "use_cache": True, "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
    }


def hf_expert_width(cfg: ModelConfig) -> int:
    """The reference's `intermediate_size`: one width for the routed experts and the shared expert, so the wider
    of ours (`padded_to_hf` fills the narrower with zeros)."""
    if not cfg.n_experts:
        return cfg.expert_dim
    return max(cfg.expert_dim, cfg.shared_dim if cfg.shared_expert else 0)


def padding_note(cfg: ModelConfig) -> str | None:
    """What `padded_to_hf` does to this model's experts, in a line for the user, or None when it does nothing."""
    if not cfg.n_experts:
        return None
    width, shared = hf_expert_width(cfg), cfg.shared_dim if cfg.shared_expert else 0
    done = [f"the {what} (width {w}) padded with zeros" for what, w in (("routed experts", cfg.expert_dim),
                                                                         ("shared expert", shared)) if 0 < w < width]
    done += ["an all-zero shared expert written (the reference's is always on)"] if not shared else []
    if not done:
        return None
    return (f"note: the reference has one expert width ({width}) and a shared expert; {' and '.join(done)}: the "
            "same function, but loaded back the model holds those zeros as weights")


def hf_parameters(cfg: ModelConfig) -> int:
    """The parameters a transformers export of this model holds: its experts at the reference's one width
    (`hf_expert_width`), with a shared expert (`padded_to_hf`)."""
    from ..model.memory import param_counts

    if not cfg.n_experts:
        return param_counts(cfg).total
    return param_counts(cfg.replace(expert_dim=hf_expert_width(cfg), shared_expert=True, shared_expert_dim=0)).total


def padded_to_hf(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our MoE tensors (reference names) at the reference's one expert width (`hf_expert_width`), exactly.

    A SwiGLU expert widened with zero gate and up rows and zero down columns computes the same function (each
    added hidden unit is silu(0) * 0 = 0, and its down column adds 0), so the narrower of the routed and the
    shared experts is padded with zeros, and a model without a shared expert gets an all-zero one (the
    reference's is always on). Loaded back, the model has that width, and the same logits."""
    width = hf_expert_width(cfg)
    out = dict(tensors)
    for layer in (i for i in range(cfg.n_layers) if cfg.is_moe(i)):
        ffn = f"model.layers.{layer}.feed_forward"
        gate_up, down = out[f"{ffn}.experts.gate_up_proj"], out[f"{ffn}.experts.down_proj"]  # (E, D, 2H), (E, H, D)
        extra = width - cfg.expert_dim
        if extra:
            gate, up = gate_up.chunk(2, dim=-1)
            zeros = gate.new_zeros(*gate.shape[:-1], extra)
            out[f"{ffn}.experts.gate_up_proj"] = torch.cat([gate, zeros, up, zeros], dim=-1)
            out[f"{ffn}.experts.down_proj"] = torch.cat([down, down.new_zeros(down.shape[0], extra, down.shape[2])], 1)
        shared = f"{ffn}.shared_expert"
        d_model, dtype = down.shape[-1], down.dtype
        for name, rows_dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):  # (H, D), (H, D), (D, H)
            key = f"{shared}.{name}.weight"
            w = out.get(key, torch.zeros((0, d_model) if rows_dim == 0 else (d_model, 0), dtype=dtype))
            pad = list(w.shape)
            pad[rows_dim] = width - w.shape[rows_dim]
            out[key] = torch.cat([w, w.new_zeros(pad)], dim=rows_dim) if pad[rows_dim] else w
    return out


# ---------------------------------------------------------------------------------------------- weights


def hf_shards(path: Path) -> list[Path]:
    """The safetensors files of a single-file or sharded checkpoint. A shard named by the index must be a
    regular file inside the checkpoint folder: a crafted index may name ../elsewhere, /etc/... or a FIFO."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return [regular_file(path / "model.safetensors", inside=path)]
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map each tensor name to a shard file name")
    shards = []
    for name in sorted(set(weight_map.values())):
        if Path(name).is_absolute() or Path(name).name != name:
            raise CheckpointError(f"{index} names the shard {name!r}; a shard is a file name in the checkpoint "
                                  "folder itself")
        shards.append(regular_file(path / name, inside=path))
    return shards


def _weight_name(name: str) -> str | None:
    """A stored tensor's name without the multimodal `language_model.` prefix; None for vision tensors."""
    if name.startswith(("vision_model.", "multi_modal_projector.")):
        return None
    return name.removeprefix("language_model.")


def load_hf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, fast: bool = True) -> Transformer:
    """Build our Transformer from a reference `save_pretrained` directory (config.json + safetensors), its
    parameters in `dtype` (torch.bfloat16 halves a float32 model's memory).

    The shards' headers are checked against config.json first; then the model is built plain on the meta
    device (no memory, no initialisation), given the checkpoint's tensors shard by shard in `dtype`, and
    gets the fast modules (`ops.install`) unless fast=False."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass the folder written by save_pretrained")
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} has no config.json; pass the folder written by save_pretrained")
    cfg = config_from_hf(read_json(path / "config.json"))
    with torch.device("meta"):
        model = Transformer(cfg)
    ours = model.state_dict()
    wanted = {to_hf_name(name): name for name in ours if not name.endswith("expert_bias")}  # theirs -> ours
    if cfg.tie_embeddings:
        wanted.pop("lm_head.weight", None)
    found = {}
    for shard in hf_shards(path):
        for name, shape in safetensors_shapes(shard).items():
            if (new := _weight_name(name)) is not None:
                found[new] = shape
    if cfg.tie_embeddings:
        found.pop("lm_head.weight", None)
    check_shapes(path, found, {theirs: tuple(ours[name].shape) for theirs, name in wanted.items()},
                 against=f"{path / 'config.json'}")
    # shard by shard, each tensor converted as it comes and given to the meta model as its parameter (assign):
    # at most the model in `dtype` and one shard as stored, never a second full-size copy
    for shard in hf_shards(path):
        tensors = {name: t for name, t in read_safetensors(shard).items() if _weight_name(name) in wanted}
        bad = non_finite(tensors)  # as for our own checkpoints: else --init-from would say "lower lr"
        if bad is not None:
            raise CheckpointError(f"{shard} holds non-finite values (in {bad}); the weights are damaged: download "
                                  "or convert them again")
        state = {wanted[_weight_name(name)]: t.to(dtype) for name, t in tensors.items()}
        del tensors
        try:
            model.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as e:
            detail = str(e).splitlines()[-1].strip()
            raise CheckpointError(f"{path}: a tensor has the wrong shape for config.json: {detail}") from None
        del state
    for moe in model.moe_layers():  # ours only (aux-loss-free balancing): the reference has no such bias
        moe.router.expert_bias = torch.zeros(cfg.n_experts)
        moe.router.pending_counts = torch.zeros(cfg.n_experts)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return install(model) if fast else model


def check_layers_match_config(model: Transformer) -> None:
    """Every tensor the model holds has the name and shape its config gives it: the reference format keeps one
    config for every layer, so a layer changed after building (8 experts where the config says 4, an MoE
    swapped into a dense layer) would be written under a config.json that describes another model."""
    wanted = expected_shapes(model.cfg)
    found = {name: tuple(t.shape) for name, t in model.state_dict().items()
             if not (name == "lm_head.weight" and model.cfg.tie_embeddings)}
    for name in sorted(set(found) | set(wanted)):
        if found.get(name) != wanted.get(name):
            has = "is missing" if name not in found else f"is {list(found[name])}"
            says = "has no such tensor" if name not in wanted else f"gives it {list(wanted[name])}"
            raise CheckpointError(f"{name} {has} but the model's config {says}: the reference format describes "
                                  "every layer by one config.json, so a model whose layers differ from its "
                                  "config cannot be exported; build the model from a config that describes it")


def check_export_target(out: Path) -> None:
    """Refuse, before any work, an export folder that is a symlink (the export would land wherever it points)
    or that exists and is not an empty folder (an export replaces nothing)."""
    if out.is_symlink():
        raise ConfigError(f"{out} is a symlink (to {os.path.realpath(out)}); export into a new or empty folder "
                          "that is not a link")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder; export into a new or empty folder")


def tokenizer_config(cfg: ModelConfig) -> dict[str, Any]:
    """tokenizer_config.json for an export whose tokenizer has the end-of-text token: it is EOS, and BOS too
    (as GPT-2's one token is both): every document after a corpus's first follows it in training, and a
    consumer that wants a token before a text (lm-eval's empty context, transformers' generate with no
    prompt) finds it."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT,
            "add_bos_token": False, "add_eos_token": False, "model_max_length": cfg.max_seq_len,
            "clean_up_tokenization_spaces": False}


def hf_tensors(model: Transformer, drop_bias: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights under the reference's names and at its one expert width (`padded_to_hf`), on the
    CPU: what an export writes. Refused: layers whose shapes differ from the config (one config describes
    every layer) and routers' balancing biases unless `drop_bias` (the reference router has none)."""
    check_layers_match_config(model)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("expert_bias"):
            if t.abs().max() > 0 and not drop_bias:
                raise CheckpointError("this model's routers carry balancing biases (bias_balance_rate), which the "
                                      "reference format cannot express; pass --drop-bias (drop_bias=True) to write "
                                      "it without them: the export then says how much the validation loss moves")
            continue
        if name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue
        tensors[to_hf_name(name)] = t.detach().to("cpu").contiguous()
    return {name: t.contiguous() for name, t in padded_to_hf(model.cfg, tensors).items()}


def export_hf(model: Transformer, path: str | os.PathLike[str],
              tokenizer_save: Callable[[Path], Any] | None = None, drop_bias: bool = False,
              bos_token_id: int | None = None, eos_token_id: int | None = None,
              notes: list[str] | None = None) -> Path:
    """Write `model` (and the tokenizer, through `tokenizer_save(file)`: a tokenizer's `save_hf`) as a
    reference checkpoint directory that transformers' from_pretrained loads.

    A model the format cannot hold is refused before anything is written: a router kind or option it lacks
    (`config_to_hf`), layers whose shapes differ from the config (one config.json describes every layer),
    and balancing biases unless `drop_bias` (the reference router has none: the model is then written
    without them, which changes its routing; `nanollama4 export --drop-bias` measures by how much). A shared
    expert of another width than the routed experts', or none, is written exactly, padded with zeros
    (`padded_to_hf`).

    Everything is written into a temporary folder beside `path` that is renamed into place at the end (over
    `path` when that is an empty folder): a failed export (a full disk, a kill) leaves no half-written folder
    that a retry would refuse. One that a killed export left is removed first (`clear_stale_export_folders`),
    a note each appended to `notes` when given."""
    path = Path(path)
    check_export_target(path)
    hf_config = config_to_hf(model.cfg, bos_token_id, eos_token_id)
    tensors = hf_tensors(model, drop_bias)
    hf_config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "_from_model_config": True}
    tmp, fd = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        found = clear_stale_export_folders(path.parent)
        if notes is not None:
            notes += found
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-{os.getpid()}-"))
        fd = os.open(tmp, os.O_RDONLY)
        hold_lock(fd)  # held until the end: a live export's folder is never taken for a stale one
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if tokenizer_save is not None:
            tokenizer_save(tmp / "tokenizer.json")
            if eos_token_id is not None:  # AutoTokenizer's eos_token (lm-eval's end of text and prefix token)
                (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model.cfg), indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        tmp.chmod(0o755)
        os.rename(tmp, path)  # replaces an empty folder; a folder with files in it stays (ENOTEMPTY)
    except (OSError, SafetensorError) as e:
        raise write_failed(path, e, "make room or pass a folder you can write to, then export again") from None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if fd is not None:
            os.close(fd)
    return path


EXPORT_FILES = frozenset({"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                          "tokenizer_config.json"})  # what `export_hf` writes into its temporary folder


def clear_stale_export_folders(folder: Path) -> list[str]:
    """Remove the temporary folders that transformers exports killed while writing left in `folder`
    (`files.clear_stale_temporaries`'s rules), each holding only regular files of the names `export_hf` writes."""

    def ours(fd: int, held: os.stat_result) -> int | None:
        names = os.listdir(fd)
        inside = [os.stat(n, dir_fd=fd, follow_symlinks=False) for n in names]
        if not set(names) <= EXPORT_FILES or not all(stat.S_ISREG(st.st_mode) for st in inside):
            return None
        return sum(st.st_size for st in inside)

    def remove(fd: int, path: str) -> None:
        for name in os.listdir(fd):
            os.unlink(name, dir_fd=fd)
        os.rmdir(path)

    return clear_stale_temporaries(folder, os.O_DIRECTORY, ours, remove, "folder")


def config_of_any(path: str | Path) -> ModelConfig:
    """The model config of what `load_any` loads at `path`, read without loading the weights."""
    path = Path(path)
    cfg_file = path / "config.json"
    if cfg_file.exists() and "model_type" in read_json(cfg_file):
        return config_from_hf(read_json(cfg_file))
    return read_model_config(resolve_checkpoint(path, prefer="best"))


def load_any(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Transformer, CharTokenizer | BPETokenizer]:
    """Model (its parameters in `dtype`) and tokenizer from one of our runs or checkpoint folders, or from a
    transformers checkpoint directory (told apart by the `model_type` key that only the reference's
    config.json has)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if cfg_file.exists() and "model_type" in read_json(cfg_file):
        if not (path / "tokenizer.json").exists():
            raise CheckpointError(f"{path} has no tokenizer.json; generation needs the checkpoint's tokenizer")
        model, tokenizer = load_hf(path, dtype=dtype), load_tokenizer(path / "tokenizer.json")
        check_vocab(tokenizer, model.cfg, path)
        return model, tokenizer
    model, tokenizer, _ = load_run(path)
    return model.to(dtype), tokenizer
