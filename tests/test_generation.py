"""Generation: the KV cache gives the full forward's logits, batches with left padding give each prompt's own
continuation, greedy decoding matches transformers' generate, sampling is seeded, logit filters keep exactly
what they promise, stop strings/ids, length errors, streaming, and the `generate` command.

float32 everywhere; random weights scaled so the logits are O(1+) and every weight matters.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import nanollama4
from nanollama4.base.config import ModelConfig, TrainConfig, preset
from nanollama4.cli import main
from nanollama4.engine.generation import Sampling, filter_logits, generate, generate_ids, next_token, sample, stream
from nanollama4.model.attention import KVCache
from nanollama4.model.memory import kv_cache
from nanollama4.model.tokenizer import BPETokenizer, CharTokenizer
from nanollama4.model.transformer import Transformer
from nanollama4.ops import build_model
from tests.helpers import assert_same_greedy_ids, randomize_

# Chunked RoPE layers (chunk 4), NoPE every 2nd layer with temperature tuning at a small floor, MoE top-2 of 4.
CHUNKED = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64,
               attention_chunk_size=4, nope_interval=2, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
               ffn_dim=48, n_experts=4, experts_per_token=2, expert_dim=24, moe_every=1)

# The reference tiny config (as in test_hf.py), long enough for a 7-token prompt + 64 new tokens.
TINY_HF = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
               head_dim=16, num_local_experts=8, intermediate_size=48, intermediate_size_mlp=96,
               max_position_embeddings=128, pad_token_id=None, attention_chunk_size=4, attn_temperature_tuning=True,
               floor_scale=2, attn_scale=0.5, use_qk_norm=True, no_rope_layer_interval=4, num_experts_per_tok=2,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

WORDS = "the a cat dog sat on mat and ran to house tree big small red blue fox jumps over lazy king queen".split()


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    yield
    torch.set_num_threads(threads)




def random_model(seed: int = 0, scale: float = 1.0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**{**CHUNKED, **overrides})).eval()
    randomize_(model, seed=seed + 1, gain=scale)
    return model


def random_ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def corpus_text(n_lines: int = 300, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "." for _ in range(n_lines))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- 1. cache = full
@pytest.fixture(scope="module")
def chunked_model() -> Transformer:
    return random_model(seed=2)


PIECES = {
    "prefill_1_then_decode": [1] * 23,
    "prefill_11_then_decode": [11] + [1] * 12,
    "chunked_prefill": [5, 6, 2, 4, 3, 1, 2],
}


@pytest.mark.parametrize("case", sorted(PIECES))
def test_prefill_and_decode_match_full_forward(chunked_model, case):
    model, cfg = chunked_model, chunked_model.cfg
    sizes = PIECES[case]
    T = sum(sizes)
    assert T == 23 and T > 5 * cfg.attention_chunk_size
    layers = range(cfg.n_layers)
    assert any(not cfg.uses_rope(i) for i in layers) and any(cfg.chunk_size(i) for i in layers)
    ids = random_ids(2, T, cfg.vocab_size, seed=3)
    with torch.no_grad():
        full = model(ids)
        assert full.abs().max() > 2.0  # O(1+) logits: a wrong key or mask would show
        cache = KVCache(cfg, 2, T)
        shapes = [tuple(layer.k.shape) for layer in cache.layers]
        a = 0
        for size in sizes:
            b = a + size
            got = model(ids[:, a:b], cache=cache, start_pos=a)
            assert got.shape == (2, size, cfg.vocab_size)
            torch.testing.assert_close(got, full[:, a:b], atol=1e-5, rtol=0, msg=lambda m, a=a, b=b: f"[{a}:{b}] {m}")
            a = b
    # The chunked layers' buffers never grew past chunk - 1 positions.
    assert [tuple(layer.k.shape) for layer in cache.layers] == shapes
    for i, layer in enumerate(cache.layers):
        assert layer.k.shape[1] == (cfg.attention_chunk_size - 1 if cfg.chunk_size(i) else T)


def test_decode_differs_without_the_cache(chunked_model):
    """The check above can fail: decoding the last token with an empty cache gives different logits."""
    cfg = chunked_model.cfg
    ids = random_ids(2, 23, cfg.vocab_size, seed=3)
    with torch.no_grad():
        full = chunked_model(ids)
        alone = chunked_model(ids[:, -1:], cache=KVCache(cfg, 2, 23), start_pos=22)
    assert (alone - full[:, -1:]).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------- 2. cache size
@pytest.mark.parametrize("chunk", [None, 4, 8])
@pytest.mark.parametrize("length", [1, 3, 4, 7, 50])
@pytest.mark.parametrize("batch", [1, 3])
def test_kv_cache_bytes_match_the_arithmetic(chunk, length, batch):
    cfg = ModelConfig(**{**CHUNKED, "attention_chunk_size": chunk, "n_heads": 8, "n_kv_heads": 2, "nope_interval": 4})
    assert cfg.n_kv_heads != cfg.n_heads
    cache = KVCache(cfg, batch, length)
    assert cache.nbytes == batch * kv_cache(cfg, length, "float32").bytes_for_sequence
    for i, layer in enumerate(cache.layers):
        c = cfg.chunk_size(i)
        slots = length if c is None else min(length, c - 1)
        assert tuple(layer.k.shape) == tuple(layer.v.shape) == (batch, slots, cfg.n_kv_heads, cfg.head_dim)
    bf16 = KVCache(cfg, batch, length, dtype=torch.bfloat16)
    assert bf16.layers[0].k.dtype == torch.bfloat16
    assert bf16.nbytes == batch * kv_cache(cfg, length, "bfloat16").bytes_for_sequence == cache.nbytes // 2


def test_chunked_cache_is_smaller_than_full():
    full = ModelConfig(**{**CHUNKED, "attention_chunk_size": None})
    chunked = ModelConfig(**CHUNKED)
    assert KVCache(chunked, 2, 40).nbytes < KVCache(full, 2, 40).nbytes
    # Two of four layers are chunked (3 slots each), two are NoPE (40 slots each).
    assert KVCache(chunked, 2, 40).nbytes == 2 * (2 * 40 + 2 * 3) * 2 * chunked.n_kv_heads * chunked.head_dim * 4


# ---------------------------------------------------------------------------------------------- 3. transformers
@pytest.mark.parametrize("seed", [3])
def test_greedy_matches_transformers_generate(tmp_path, seed):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Llama4TextConfig(**TINY_HF)
    torch.manual_seed(0)
    ref = transformers.Llama4ForCausalLM(cfg).eval()
    randomize_(ref, seed=seed, gain=2.0)  # top-2 logit gaps >= 0.02 all along
    ref.save_pretrained(tmp_path)
    ours = nanollama4.load_hf(tmp_path).eval()
    prompt = random_ids(1, 7, 256, seed=5)
    assert 7 + 64 > 2 * ours.cfg.attention_chunk_size
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=64, do_sample=False, attention_mask=torch.ones_like(prompt),
                            min_new_tokens=64)[0, 7:].tolist()
    got = generate_ids(ours, prompt.tolist(), 64, temperature=0)[0]
    assert len(want) == 64
    assert len(set(want[32:])) > 10  # not stuck repeating a token: late positions matter too
    assert got == want


# ---------------------------------------------------------------------------------------------- 4. batching
def test_batch_of_different_lengths_equals_each_alone(chunked_model):
    cfg = chunked_model.cfg
    prompts = [random_ids(1, n, cfg.vocab_size, seed=10 + n)[0].tolist() for n in (3, 9, 14)]
    together = generate_ids(chunked_model, prompts, 30, temperature=0)
    alone = [generate_ids(chunked_model, [p], 30, temperature=0)[0] for p in prompts]
    assert [len(x) for x in together] == [30, 30, 30]
    for p, x, y in zip(prompts, together, alone, strict=True):  # a batch and a row alone: maybe two paths
        assert_same_greedy_ids(chunked_model, p, x, y)
    assert all(len(set(row[15:])) > 5 for row in alone)  # no row is stuck repeating a token


def test_padded_prefill_logits_equal_unpadded(chunked_model):
    """Left padding with per-row positions: the real tokens' logits are those of the row alone."""
    cfg = chunked_model.cfg
    ids = random_ids(1, 9, cfg.vocab_size, seed=4)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    positions = torch.cat([torch.full((1, 5), -1), torch.arange(9)[None]], 1)
    with torch.no_grad():
        want = chunked_model(ids)
        got = chunked_model(padded, positions=positions)[:, 5:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- 5. seeds
def test_sampling_is_seeded():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CHUNKED)).eval()  # default init: a broad next-token distribution
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    opts = dict(temperature=1.0, top_k=40, top_p=0.95)
    a = generate_ids(model, prompts, 50, seed=7, **opts)
    b = generate_ids(model, prompts, 50, seed=7, **opts)
    c = generate_ids(model, prompts, 50, seed=8, **opts)
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]
    assert a[0] != a[1]
    assert all(len(row) == 50 for row in a + c)


# ---------------------------------------------------------------------------------------------- 6. filters
def kept(logits: torch.Tensor, **kw) -> list[int]:
    out = filter_logits(logits, **kw)
    return torch.isfinite(out).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_largest():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    for k in (1, 3, 10, 49):
        out = filter_logits(logits, top_k=k)
        want = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, logits.topk(k, -1).indices, True)
        assert torch.equal(torch.isfinite(out), want)
        assert torch.equal(out[want], logits[want])  # kept logits are unchanged
    assert torch.equal(filter_logits(logits, top_k=50), logits)
    assert torch.equal(filter_logits(logits, top_k=None, top_p=None), logits)


def test_top_k_keeps_ties_at_the_kth():
    logits = torch.tensor([5.0, 4.0, 3.0, 3.0, 1.0])
    assert kept(logits, top_k=3) == [0, 1, 2, 3]
    assert kept(logits, top_k=2) == [0, 1]
    assert kept(torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0]), top_k=1) == [1, 2, 4]


@pytest.mark.parametrize("p, want", [(0.8, [0, 1]), (0.81, [0, 1, 2]), (0.5, [0]), (0.49, [0]), (0.51, [0, 1]),
                                     (0.95, [0, 1, 2]), (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_prefix_reaching_p(p, want):
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (0), 0.05 (2)
    order = [1, 3, 0, 2]
    got = kept(probs.log(), top_p=p)
    assert got == sorted(order[:len(want)]), (p, got)


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(1)) * 4
    for p in (1e-6, 0.01, 0.1):
        out = filter_logits(logits, top_p=p)
        assert torch.isfinite(out).sum(-1).tolist() == [1] * 6
        assert torch.equal(out.argmax(-1), logits.argmax(-1))


def test_top_k_and_top_p_together():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert kept(logits, top_k=3, top_p=0.5) == [0]  # top-p binds
    assert kept(logits, top_k=2, top_p=0.99) == [0, 1]  # top-k binds
    assert kept(logits, top_k=1, top_p=0.99) == [0]
    # top-p applies to the distribution left by top-k (as transformers' warpers do, in that order).
    transformers = pytest.importorskip("transformers")
    rows = torch.randn(8, 50, generator=torch.Generator().manual_seed(2)) * 2
    for k, p in ((10, 0.7), (25, 0.9), (5, 0.3)):
        ref = transformers.TopPLogitsWarper(p)(None, transformers.TopKLogitsWarper(k)(None, rows.clone()))
        assert torch.equal(torch.isfinite(filter_logits(rows, top_k=k, top_p=p)), torch.isfinite(ref)), (k, p)


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    for kw in (dict(top_k=None, top_p=None), dict(top_k=5, top_p=0.5)):
        assert torch.equal(next_token(logits, Sampling(temperature=0.0, **kw), generator=None), logits.argmax(-1))


def test_sampling_respects_the_filters():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(4)).expand(2000, 20)
    g = torch.Generator().manual_seed(0)
    picked = set(next_token(logits, Sampling(temperature=1.0, top_k=3, top_p=None), generator=g).tolist())
    assert picked == set(logits[0].topk(3).indices.tolist())


# ---------------------------------------------------------------------------------------------- 7. errors
def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert text and "\n" not in text
    return text


def test_too_long_is_a_one_line_value_error(chunked_model):
    limit = chunked_model.cfg.max_seq_len
    tok = CharTokenizer.from_text("abcdefgh")
    with pytest.raises(ValueError) as e:
        generate_ids(chunked_model, [[1] * 10], limit - 9)
    assert "max_seq_len" in one_line(e)
    with pytest.raises(ValueError) as e:
        generate_ids(chunked_model, [[1, 2], [1] * limit], 1)
    assert "max_seq_len" in one_line(e)
    with pytest.raises(ValueError) as e:
        generate(chunked_model, tok, "abc", max_new_tokens=limit)
    assert "max_seq_len" in one_line(e)
    with pytest.raises(ValueError) as e:
        list(stream(chunked_model, tok, "abc", max_new_tokens=limit))
    assert "max_seq_len" in one_line(e)
    assert len(generate_ids(chunked_model, [[1] * 10], limit - 10, temperature=0)[0]) == limit - 10  # exactly fits


def test_empty_prompt_is_a_value_error(chunked_model):
    tok = CharTokenizer.from_text("abcdefgh")
    with pytest.raises(ValueError):
        generate_ids(chunked_model, [[]], 5)
    with pytest.raises(ValueError):
        generate_ids(chunked_model, [[1, 2], []], 5)
    with pytest.raises(ValueError):
        generate_ids(chunked_model, [], 5)
    with pytest.raises(ValueError):
        generate(chunked_model, tok, "", max_new_tokens=5)
    with pytest.raises(ValueError):
        list(stream(chunked_model, tok, "", max_new_tokens=5))


# ---------------------------------------------------------------------------------------------- 8. stream, stops
@pytest.fixture(scope="module")
def char_setup():
    tok = CharTokenizer.from_text("hello world, the quick brown fox.\n")
    model = random_model(seed=1, vocab_size=tok.vocab_size)
    return model, tok


@pytest.mark.parametrize("opts", [dict(temperature=0.0), dict(temperature=1.0, top_k=8, top_p=0.9, seed=11)])
def test_stream_equals_generate(char_setup, opts):
    model, tok = char_setup
    text = generate(model, tok, "the ", max_new_tokens=40, **opts)
    pieces = list(stream(model, tok, "the ", max_new_tokens=40, **opts))
    assert len(text) == 40  # one character per token
    assert "".join(pieces) == text
    assert len(pieces) > 1 and all(pieces)


def test_generate_text_is_the_decoded_ids(char_setup):
    model, tok = char_setup
    ids = generate_ids(model, [tok.encode("hello")], 30, temperature=0)[0]
    assert generate(model, tok, "hello", max_new_tokens=30, temperature=0) == tok.decode(ids)
    assert generate(model, tok, ["hello", "the "], max_new_tokens=30, temperature=0) == [
        tok.decode(ids), generate(model, tok, "the ", max_new_tokens=30, temperature=0)]


def stop_string_in(text: str, length: int) -> tuple[str, int]:
    """A substring of `text` whose first occurrence starts after position 0, and that position."""
    for start in range(5, len(text) - length):
        s = text[start:start + length]
        if text.find(s) > 0:
            return s, text.find(s)
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("length", [1, 3])
def test_stop_strings_end_before_the_stop(char_setup, length):
    model, tok = char_setup
    full = generate(model, tok, "the ", max_new_tokens=40, temperature=0)
    stop, at = stop_string_in(full, length)
    got = generate(model, tok, "the ", max_new_tokens=40, temperature=0, stop=[stop])
    assert got == full[:at] and stop not in got
    pieces = list(stream(model, tok, "the ", max_new_tokens=40, temperature=0, stop=[stop]))
    assert "".join(pieces) == full[:at]
    assert all(stop not in p for p in pieces)
    # A stop string that never appears changes nothing; of several, the earliest wins.
    assert generate(model, tok, "the ", max_new_tokens=40, temperature=0, stop=["zzzz"]) == full
    assert generate(model, tok, "the ", max_new_tokens=40, temperature=0, stop=["zzzz", stop]) == full[:at]
    assert "".join(stream(model, tok, "the ", max_new_tokens=40, temperature=0, stop=["zzzz"])) == full


def test_stop_ids_end_a_row(char_setup):
    model, tok = char_setup
    prompts = [tok.encode("the "), tok.encode("hello w")]
    full = generate_ids(model, prompts, 40, temperature=0)
    stop_id = full[0][10]
    j = full[0].index(stop_id)
    rows = generate_ids(model, prompts, 40, temperature=0, stop_ids=[stop_id])
    for row, got in zip(full, rows, strict=True):
        want = row[:row.index(stop_id) + 1] if stop_id in row else row  # ids keep their stop id
        assert got == want
    assert len(rows[0]) == j + 1 < 40
    want_text = tok.decode(full[0][:j])  # text leaves the stop token out
    assert generate(model, tok, "the ", max_new_tokens=40, temperature=0, stop_ids=[stop_id]) == want_text
    assert "".join(stream(model, tok, "the ", max_new_tokens=40, temperature=0, stop_ids=[stop_id])) == want_text


# ---------------------------------------------------------------------------------------------- 9. cacheless
def test_cacheless_sample_equals_cached_greedy(chunked_model):
    cfg = chunked_model.cfg
    ids = random_ids(2, 6, cfg.vocab_size, seed=9)
    slow = sample(chunked_model, ids, 25, temperature=0)
    assert torch.equal(slow[:, :6], ids)
    fast = generate_ids(chunked_model, ids.tolist(), 25, temperature=0)
    assert slow[:, 6:].tolist() == fast


# ---------------------------------------------------------------------------------------------- 10. CLI
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from nanollama4.training.train import train

    root = tmp_path_factory.mktemp("gen")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text())
    run = root / "run"
    train(preset("tiny", max_seq_len=64), TrainConfig(max_steps=2, eval_interval=1, seq_len=32, batch_size=4,
                                                      eval_batches=2, warmup_steps=1),
          run, data=str(corpus), progress=False, cache_dir=root / "cache")
    return run


def test_cli_generate_from_a_run(run_dir, capsys):
    args = ["generate", str(run_dir), "--prompt", "the cat", "--greedy", "--max-new-tokens", "20"]
    assert main(args) == 0
    plain, err = capsys.readouterr()
    assert err == ""
    assert plain.startswith("the cat") and len(plain.rstrip("\n")) >= len("the cat")
    assert main(args + ["--stream"]) == 0
    streamed, err = capsys.readouterr()
    assert err == ""
    assert streamed == plain
    from nanollama4.interop.hf import load_any

    model, tok = load_any(run_dir)
    assert plain == "the cat" + generate(model, tok, "the cat", max_new_tokens=20, temperature=0) + "\n"


def test_cli_generate_from_a_transformers_checkpoint(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    tok = BPETokenizer.train(corpus_text(), 300)
    cfg = transformers.Llama4TextConfig(**{**TINY_HF, "vocab_size": 320})
    assert cfg.vocab_size >= tok.vocab_size
    torch.manual_seed(0)
    ref = transformers.Llama4ForCausalLM(cfg).eval()
    randomize_(ref, seed=5)
    ref.save_pretrained(tmp_path)
    tok.save(tmp_path / "tokenizer.json")
    capsys.readouterr()  # drop save_pretrained's progress bar
    args = ["generate", str(tmp_path), "--prompt", "the quick fox", "--greedy", "--max-new-tokens", "20"]
    assert main(args) == 0
    plain, err = capsys.readouterr()
    assert err == "" and plain.startswith("the quick fox")
    assert main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == plain
    ids = generate_ids(nanollama4.load_hf(tmp_path), [tok.encode("the quick fox")], 20, temperature=0,
                       vocab=tok.vocab_size)[0]  # the padding ids (300-319) are never sampled
    assert plain == "the quick fox" + tok.decode(ids) + "\n"


def _slide_by_hand(model, prompt: list[int], n: int, keep: int) -> list[int]:
    """Greedy tokens as documented for slide=True, with no cache: predict from the whole context while it is
    shorter than max_seq_len; a full context keeps only its last `keep` tokens (from position 0 again)."""
    limit, ctx, out = model.cfg.max_seq_len, list(prompt), []
    while len(out) < n:
        if len(ctx) >= limit:
            ctx = ctx[-keep:]
        with torch.no_grad():
            t = int(model(torch.tensor([ctx]))[0, -1].argmax())
        out.append(t)
        ctx.append(t)
    return out


def test_sliding_context_goes_past_max_seq_len_exactly_as_documented():
    """With slide=True a full context keeps its last max_seq_len // 2 tokens, re-prefilled from position 0:
    the cached generation equals the same procedure done by hand without a cache, over several slides, and
    keeping 6 or 12 tokens instead of 8 would have given other tokens (so the test sees the window size)."""
    from nanollama4.base.config import preset as _preset
    from nanollama4.engine.generation import generate_ids as _generate_ids

    torch.manual_seed(0)
    model = nanollama4.build_model(_preset("tiny", max_seq_len=16)).eval()
    randomize_(model, seed=21, gain=2.0)  # varied greedy output, not a short cycle
    prompt = [3, 1, 4, 1, 5]
    with pytest.raises(ValueError, match="max_seq_len"):
        _generate_ids(model, [prompt], 30, temperature=0)
    out = _generate_ids(model, [prompt], 40, temperature=0, slide=True)[0]
    assert out[:11] == _generate_ids(model, [prompt], 11, temperature=0)[0]  # 5 + 11 = 16 fills the context
    assert out == _slide_by_hand(model, prompt, 40, keep=8)
    assert len(set(out)) > 6, out
    for other in (6, 12):
        assert _slide_by_hand(model, prompt, 40, keep=other) != out, other


# ---------------------------------------------------------------------------------------------- compiled decode
@pytest.mark.compile
def test_compiled_decode_equals_eager():
    """torch.compile'd decode steps (dynamic shapes, experts gathered on the graph) give the eager logits.

    Chunk 4, NoPE with temperature tuning, MoE top-2 of 4 experts; one prompt alone and two left-padded
    prompts (4 assignments = 4 experts, the most that compile well), 20 steps past several chunks, and
    no recompilation once a batch size has compiled. Three prompts (6 assignments) run every expert on
    every row (`every_expert`). Two layers, a chunked RoPE one and a NoPE one, both MoE: every layer kind
    the graph holds, at half the four layers' compile time (inductor compiles each graph from nothing here).
    """
    import torch._dynamo

    from nanollama4.engine.generation import compiled_decoder

    chunked_model = random_model(seed=2, n_layers=2)
    cfg = chunked_model.cfg
    assert [chunked_model.blocks[i].attn.chunk for i in range(2)] == [4, None]
    decode = compiled_decoder(chunked_model)
    for lengths in ((5,), (3, 9)):
        B, longest = len(lengths), max(lengths)
        ids = random_ids(B, longest, cfg.vocab_size, seed=20 + longest)
        positions = torch.full((B, longest), -1)
        for b, n in enumerate(lengths):
            positions[b, longest - n:] = torch.arange(n)
        # one slot to spare, as generation allocates (a cache filled to the last slot recompiles once)
        caches = [KVCache(cfg, B, longest + 21) for _ in range(2)]
        with torch.no_grad():
            for cache in caches:
                chunked_model(ids, cache=cache, positions=positions)
            pos = positions[:, -1:] + 1
            for step in range(20):
                tok = random_ids(B, 1, cfg.vocab_size, seed=100 + step)
                want = chunked_model(tok, cache=caches[0], positions=pos)
                with torch._dynamo.config.patch(error_on_recompile=step >= 2):
                    got = decode(tok, cache=caches[1], positions=pos)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
                assert want.abs().max() > 1.0
                pos = pos + 1
    prompts = [[1, 2, 3], [4, 5], [6]]
    for rows in (prompts[:1], prompts):
        assert generate_ids(chunked_model, rows, 12, temperature=0, compile=True) == \
            generate_ids(chunked_model, rows, 12, temperature=0)


def test_compiled_decoder_keeps_no_model_alive():
    import gc
    import weakref

    from nanollama4.engine.generation import compiled_decoder

    model = random_model(seed=5)
    compiled_decoder(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_sampling_settings_are_one_object_checked_once(char_setup):
    from nanollama4.base.errors import GenerationError

    model, tok = char_setup[:2]
    with pytest.raises(GenerationError, match="sampling must be a Sampling"):
        generate(model, tok, "the ", 10, 0.8)  # the old positional temperature
    with pytest.raises(GenerationError, match=r"unknown sampling settings \['temprature'\]"):
        generate(model, tok, "the ", 10, temprature=0.5)
    with pytest.raises(GenerationError, match="top_p"):
        Sampling(top_p=0.0)
    assert Sampling(stop="END").stop == ("END",) and Sampling(stop_ids=3).stop_ids == (3,)
    greedy = Sampling(temperature=0)
    assert generate(model, tok, "the ", 12, greedy) == generate(model, tok, "the ", 12, temperature=0)


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 5e-324])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p):
    """float32 compares such a top_p as 0, and every token used to be dropped: sampling then crashed."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    kept = filter_logits(logits, top_p=top_p)
    assert torch.equal(kept.isfinite(), logits == logits.max(-1, keepdim=True).values)
    tokens = next_token(logits, Sampling(temperature=1.0, top_p=top_p), torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))


def test_a_row_ends_at_the_tokenizers_end_of_text_unless_told_to_ignore_it():
    from nanollama4.engine.sampling import Sampling, TextStream

    tok = CharTokenizer.from_text("ab", end_of_text=True)
    stream = TextStream(tok, Sampling())
    assert stream.add(0) == "a" and stream.add(tok.eos_id) == "" and stream.stopped
    assert stream.stop_id == tok.eos_id and stream.add(1) == ""
    going = TextStream(tok, Sampling(ignore_eos=True))
    assert going.add(tok.eos_id) + going.add(1) + going.flush() == "<|end_of_text|>b" and not going.stopped
    old = TextStream(CharTokenizer.from_text("ab"), Sampling())  # no such token: nothing new stops a row
    assert old.add(1) == "b" and not old.stopped
