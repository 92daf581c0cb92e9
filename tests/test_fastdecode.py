"""The C++ decode step (ops/fastdecode.py, ops/csrc/decode.cpp) against the plain engine path, which is the
reference: logits to 1e-5 in float32 step by step, and the same tokens through the engine (greedy, seeded
sampling, stop strings) with chunks, rings, the NoPE temperature, QK-norm, every built-in router, a
shared expert, dense layers and capacity at inference; what it refuses names why, and the runner keeps
the plain path wherever the step would not compute what the plain one does."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import string

import pytest
import torch
import torch.nn.functional as F

from nanollama4.base.config import ModelConfig
from nanollama4.engine import Engine, Request, Sampling, TokenEvent
from nanollama4.engine.cache import SlotCache
from nanollama4.engine.generation import generate_ids
from nanollama4.engine.observe import observe
from nanollama4.engine.runner import Runner
from nanollama4.model.lora import attach
from nanollama4.model.moe import Experts
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.ops import build_model, fastdecode
from tests.helpers import LOGPROB_TOLERANCE, assert_same_greedy, host_reads, randomize_

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(fastdecode.load() is None, reason="no C++ compiler: the C++ decode step is not built")]

# chunks of 8 (a ring of 7 slots), NoPE every 2nd layer with temperature (floor 4), QK-norm, MoE top-2 of 4
BASE = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=48,
            attention_chunk_size=8, nope_interval=2, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
            ffn_dim=48, n_experts=4, experts_per_token=2, expert_dim=24)
VARIANTS = {
    "sigmoid, shared expert, every feature": {},
    "softmax over the chosen, no shared expert": dict(router="softmax", shared_expert=False),
    "softmax over all, capacity at inference": dict(router="softmax", settings={"softmax": {"over": "all"}},
                                                    capacity_factor=1.0, capacity_in_eval=True,
                                                    capacity_overflow="drop"),
    "top-1, no QK-norm, one MoE layer in two": dict(experts_per_token=1, use_qk_norm=False, moe_every=2),
    "dense, unchunked, all RoPE": dict(n_experts=0, attention_chunk_size=None, nope_interval=0),
    "chunk as long as the context (no ring)": dict(attention_chunk_size=48),
    "llama3 RoPE scaling, tied embeddings, one KV head, no temperature": dict(
        n_layers=3, n_kv_heads=1, rope_theta=500000.0, rope_scaling=8.0, rope_low_freq_factor=2.0,
        rope_high_freq_factor=8.0, rope_original_max_len=16, attn_temperature_tuning=False, shared_expert_dim=16,
        norm_eps=1e-6, tie_embeddings=True),
}


def test_every_config_field_is_in_the_steps_contract():
    """decode.cpp restates the model's math, so an option it does not know would be ignored without a word:
    each ModelConfig field, and each own setting of a router kind the step computes, is in its contract
    (`fastdecode.COMPUTES` or `NEEDLESS`), and each field it computes is set off its default by some case of
    test_each_step_equals_the_plain_step below, which holds the step to the plain one there."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    declared = fastdecode.COMPUTES.keys() | fastdecode.NEEDLESS.keys()
    assert not fields.keys() - declared, "ModelConfig fields the C++ step's contract does not name (ops/fastdecode.py)"
    assert not declared - fields.keys(), "the contract names fields ModelConfig no longer has"
    assert not fastdecode.COMPUTES.keys() & fastdecode.NEEDLESS.keys()
    for router in fastdecode.ROUTERS:
        own = {f.name for f in dataclasses.fields(router.Settings)} if dataclasses.is_dataclass(router.Settings) \
            else set()
        assert own == fastdecode.ROUTER_SETTINGS.get(router.name, {}).keys(), router.name
    defaults = {name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for name, f in fields.items()}
    varied = {key for case in VARIANTS.values() for key, value in {**BASE, **case}.items() if value != defaults[key]}
    assert not fastdecode.COMPUTES.keys() - varied, "computed fields no case below sets off their default"


def model_for(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**BASE, **overrides})).eval()
    randomize_(model, seed=3, gain=1.5)  # trained-like weights: routers and norms that are not uniform
    for moe in model.moe_layers():
        moe.router.expert_bias.normal_(std=0.5)
    return model


@pytest.mark.parametrize("name", VARIANTS)
def test_each_step_equals_the_plain_step(name):
    """Rows at different positions (past several chunks, before and after the ring wraps), decoding together:
    the C++ step's logits equal the plain step's to 1e-5 of their scale, and it leaves the cache as the plain
    one does."""
    model = model_for(**VARIANTS[name])
    cfg = model.cfg
    plain_cache, fast_cache = (SlotCache(cfg, 3, torch.float32, torch.device("cpu")) for _ in range(2))
    plain = Runner(model, plain_cache)
    plain.only = "plain"
    fast = fastdecode.FastStep(model, fast_cache.layers, plain_cache.context)
    g = torch.Generator().manual_seed(1)
    together = 3 if fast.usable(3) else 1  # (with capacity at inference, rows compete: one row at a time)
    with torch.no_grad():
        for step in range(cfg.max_seq_len - 1):
            rows = 1 if step < 20 else together  # one row alone, then three, the later ones starting at 0
            positions = [step, step - 20, max(0, step - 27)][:rows]
            tokens = torch.randint(0, cfg.vocab_size, (rows,), generator=g).tolist()
            want = plain.decode(tokens, positions)
            got = fast(tokens, positions)
            assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max()), step  # float32 rounding
    for mine, theirs in zip(fast_cache.layers, plain_cache.layers, strict=True):
        assert torch.equal(mine.pos, theirs.pos)
        torch.testing.assert_close(mine.k, theirs.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.v, theirs.v, atol=1e-4, rtol=1e-4)


def run_engine(model, prompts, max_tokens, sampling, only, tokenizer=None):
    engine = Engine(model, tokenizer, max_batch=4)
    engine.runner.only = only
    engine.fail_fast = True
    out = {}
    for i, p in enumerate(prompts):
        engine.add(Request(list(p), max_tokens, sampling, emit=lambda e, i=i: out.setdefault(i, []).append(e),
                           id=str(i), logprobs=0))
    engine.run()
    return out, engine


def scored(events: dict) -> dict:
    """Each request's (token id, log-probability) pairs."""
    return {i: [(e.token_id, e.logprob) for e in ev if isinstance(e, TokenEvent)] for i, ev in events.items()}


def assert_same_decodes(a: dict, b: dict, sampling: Sampling) -> None:
    """Two code paths' decodes of the same requests. Greedy: `assert_same_greedy` (a near tie may break apart).
    Sampled: the same seeded draws choose the same tokens; a draw would choose apart only within the paths'
    rounding (~1e-7) of the edge between two tokens' probabilities, about once in 10^7 tokens."""
    assert a.keys() == b.keys()
    for i in a:
        if sampling.temperature == 0:
            assert_same_greedy(a[i], b[i])
        else:
            assert [t for t, _ in a[i]] == [t for t, _ in b[i]], i
            assert all(abs(x - y) <= LOGPROB_TOLERANCE for (_, x), (_, y) in zip(a[i], b[i], strict=True)), i


@pytest.mark.parametrize("name", ["sigmoid, shared expert, every feature", "softmax over all, capacity at inference",
                                  "dense, unchunked, all RoPE"])
@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=1.0, top_k=20, seed=5),
                                      Sampling(temperature=0.9, top_p=0.9, seed=6)])
def test_the_engine_gives_the_same_tokens_either_way(name, sampling):
    """Four requests decoding together (one row alone at the end), 40 tokens each, past several chunks."""
    model = model_for(**VARIANTS[name])
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 5, 1, 7)]
    got = {}
    for only in ("plain", "fast"):
        events, engine = run_engine(model, prompts, 40, sampling, only)
        got[only] = scored(events)
        assert only == "plain" or engine.runner.fast_step() is not None
    assert_same_decodes(got["fast"], got["plain"], sampling)
    assert all(len(t) == 40 for t in got["plain"].values())


def test_stop_strings_end_the_same_tokens():
    tok = CharTokenizer("abcdefgh ")
    model = model_for(vocab_size=tok.vocab_size)
    sampling = Sampling(temperature=1.0, seed=3, stop=["ab", "h"])
    text = {}
    for only in ("plain", "fast"):
        events, _ = run_engine(model, [tok.encode("abc"), tok.encode("hg")], 40, sampling, only, tok)
        text[only] = {i: "".join(e.text for e in ev) for i, ev in events.items()}
    assert text["fast"] == text["plain"]


def test_greedy_generate_matches_the_plain_path_on_the_demo_shape():
    """The demo preset (chunks of 64, temperature floor 64) over 150 tokens, past two chunks, on two threads
    (its products are big enough to be split between them)."""
    from nanollama4.base.config import preset

    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        model = build_model(preset("shakespeare-char", vocab_size=96, max_seq_len=160)).eval()
        randomize_(model, seed=1, gain=1.3)
        tokens = {}
        for only in ("plain", "fast"):
            events, _ = run_engine(model, [[5, 6, 7]], 150, Sampling(temperature=0), only)
            tokens[only] = scored(events)
    finally:
        torch.set_num_threads(1)  # this file's threads (the one_thread fixture)
    assert_same_decodes(tokens["fast"], tokens["plain"], Sampling(temperature=0))
    assert len(tokens["fast"][0]) == 150


@pytest.mark.parametrize("routing", ["spread", "one expert takes every row"])
def test_every_tile_of_rows_equals_the_plain_step_at_the_demo_shape(routing):
    """The demo's sizes (width 256, experts of 384: whole 64-column blocks and 16-column groups) at 1 to 16 rows
    decoding together and a 31-token prompt in one call, so that every tile of the products runs: 1, 2 and 4
    rows of the linear ones, 1 to 6 rows of an expert's (16 rows in one expert take three). Logits to 1e-5."""
    from nanollama4.base.config import preset

    torch.manual_seed(0)
    model = build_model(preset("shakespeare-char", vocab_size=96, max_seq_len=64)).eval()
    randomize_(model, seed=2, gain=1.3)
    if routing != "spread":
        for moe in model.moe_layers():
            moe.router.expert_bias.zero_()[3] = 100.0
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            for rows in (1, 2, 3, 4, 5, 7, 16):
                plain_cache, fast_cache = (SlotCache(cfg, rows, torch.float32, torch.device("cpu")) for _ in range(2))
                plain = Runner(model, plain_cache)
                plain.only = "plain"
                fast = fastdecode.FastStep(model, fast_cache.layers, plain_cache.context)
                for step in range(3):
                    tokens = torch.randint(0, cfg.vocab_size, (rows,), generator=g).tolist()
                    want = plain.decode(tokens, [step] * rows)
                    got = fast(tokens, [step] * rows)
                    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max()), (rows, step)
            runner = Runner(model, SlotCache(cfg, 1, torch.float32, torch.device("cpu")))
            ids = torch.randint(0, cfg.vocab_size, (1, 31), generator=g)
            got = runner.prefill(ids, runner.prefill_cache(31), last_only=False)
            want = runner.prefill(ids, runner.prefill_cache(31, plain=True), last_only=False)
    finally:
        torch.set_num_threads(1)  # this file's threads (the one_thread fixture)
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())


def prefill_all(model, only, monkeypatch, fail=False):
    """Five requests admitted at one step (a chunk of 8 tokens a step): whole short prompts, one of 12 tokens
    (two chunks) and a traced one. Each request's token ids and log-probabilities, and the prompt lengths
    of each call of `Runner.prefill_together`."""
    calls = []
    together = Runner.prefill_together

    def spy(self, prompts):
        calls.append(sorted(len(p) for p in prompts))
        if fail:
            raise RuntimeError("a failure of the batched call")
        return together(self, prompts)

    monkeypatch.setattr(Runner, "prefill_together", spy)
    engine = Engine(model, CharTokenizer(string.ascii_letters), max_batch=8)  # (a trace names tokens)
    engine.runner.only, engine.prefill_chunk = only, 8
    out = {}
    prompts = {"a": [1, 2, 3], "b": list(range(4, 11)), "long": list(range(20, 32)), "c": [5], "traced": [7, 8, 9]}
    engine.add(*(Request(list(p), 6, Sampling(temperature=0), emit=lambda e, i=i: out.setdefault(i, []).append(e),
                         logprobs=2, trace=i == "traced", id=i) for i, p in prompts.items()))
    engine.run()
    tokens = {i: [(e.token_id, e.logprob) for e in ev if isinstance(e, TokenEvent)] for i, ev in out.items()}
    return tokens, calls


def assert_same_requests(a: dict, b: dict) -> None:
    """Each request's greedy tokens the same across the two paths (`assert_same_greedy`'s tolerance)."""
    assert a.keys() == b.keys()
    for i in a:
        assert_same_greedy(a[i], b[i])


def test_prompts_that_go_in_whole_together_share_one_call(monkeypatch):
    """The whole untraced prompts admitted at one step are prefilled by one call of the C++ step, a row each;
    the longer one (two chunks) and the traced one go in alone. Every request's tokens and log-probabilities
    equal the plain path's, where each prompt goes in alone; and when the shared call fails, each goes in
    alone and gives the same. A call takes at most `TOGETHER_TOKENS` tokens, in the order admitted."""
    model = model_for(vocab_size=CharTokenizer(string.ascii_letters).vocab_size)
    fast, calls = prefill_all(model, "fast", monkeypatch)
    assert calls == [[1, 3, 7]]
    plain, _ = prefill_all(model, "plain", monkeypatch)
    assert_same_requests(fast, plain)
    assert all(len(t) == 6 for t in fast.values()) and len(fast) == 5
    alone, calls = prefill_all(model, "fast", monkeypatch, fail=True)
    assert calls == [[1, 3, 7]]
    assert_same_requests(alone, plain)
    monkeypatch.setattr("nanollama4.engine.runner.TOGETHER_TOKENS", 8)  # calls of at most 8 tokens: b and c
    bounded, calls = prefill_all(model, "fast", monkeypatch)
    assert calls == [[1, 7]]
    assert_same_requests(bounded, plain)


def test_the_runner_chooses_by_timing_and_keeps_the_plain_path_where_it_must(monkeypatch):
    model = model_for()
    out = generate_ids(model, [[1, 2, 3]], 30, temperature=0)
    engine = Engine(model, max_batch=2)
    engine.add(Request([1, 2, 3], 30, Sampling(temperature=0), emit=lambda e: None, id="a"))
    engine.run()
    chosen = engine.runner.choice
    assert set(chosen) == {(1, 1)} and chosen[1, 1][0] in ("fast", "plain")  # the first steps decided, for one row
    assert Engine(model).runner.choice is chosen  # and the next engine of this model takes that decision
    assert out and len(out[0]) == 30

    calls = []
    fast = engine.runner.fast_step()
    monkeypatch.setattr(fast, "_step", type("Spy", (), {"step": lambda self, t, p: calls.append(1)})())
    with observe(model):  # a traced step records the layers' insides: the plain path runs
        assert not fast.usable(1)
        engine.runner.choice[1, 1] = ("fast", 1)
        engine.runner.decode([4], [3])
    assert calls == []
    assert fast.usable(1)
    handle = model.blocks[0].register_forward_hook(lambda *a: None)
    assert not fast.usable(1)
    handle.remove()


def test_capacity_at_inference_keeps_batches_plain():
    """With capacity at inference the rows of a batch compete for experts: one row may take the C++ step,
    several may not."""
    model = model_for(**VARIANTS["softmax over all, capacity at inference"])
    fast = fastdecode.FastStep(model, SlotCache(model.cfg, 2, torch.float32, torch.device("cpu")).layers, 48)
    assert fast.usable(1) and not fast.usable(2)


@pytest.mark.parametrize("name", ["sigmoid, shared expert, every feature", "dense, unchunked, all RoPE",
                                  "softmax over the chosen, no shared expert"])
def test_a_bfloat16_model_steps_from_its_own_weights(name):
    """A model in bfloat16 (`--dtype bfloat16`) decodes through the C++ step, which reads its bf16 weights and
    bf16 cache and computes in float32. A 40-token prompt in one call (40 rows: the tiles, which a float32
    step leaves to torch's products from 32 rows), then three rows together: the logits equal those of the
    float32 plain step on the same weight values (the bf16 model upcast) whose cache rounds each key and
    value to bf16 as it stores them, and the two caches hold the same keys."""
    model = model_for(**VARIANTS[name]).to(torch.bfloat16)
    upcast = model_for(**VARIANTS[name]).to(torch.bfloat16).float()
    cfg, cpu = model.cfg, torch.device("cpu")
    fast_cache, plain_cache = SlotCache(cfg, 3, torch.bfloat16, cpu), SlotCache(cfg, 3, torch.float32, cpu)
    for layer in plain_cache.layers:  # store keys and values as a bf16 cache holds them
        layer.update = lambda k, v, pos, _store=layer.update: _store(k.bfloat16().float(), v.bfloat16().float(), pos)
    plain = Runner(upcast, plain_cache)
    plain.only = "plain"
    fast = fastdecode.FastStep(model, fast_cache.layers, plain_cache.context)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()
    worst = 0.0
    with torch.no_grad():
        got = fast(prompt, list(range(40)), [0] * 40)
        assert got.dtype == torch.float32
        for i, token in enumerate(prompt):
            want = plain.decode([token], [i])[0]
            worst = max(worst, ((got[i] - want).abs().max() / want.abs().max()).item())
        for step in range(40, cfg.max_seq_len - 1):
            positions = [step, step - 40, step - 38]
            tokens = torch.randint(0, cfg.vocab_size, (3,), generator=g).tolist()
            want = plain.decode(tokens, positions)
            got = fast(tokens, positions)
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    # A key the two float32 paths compute a rounding apart can round to neighbouring bf16 values, 2^-8 apart
    # (measured worst 1.0e-3 to 2.6e-3 of the logits' scale here; with an unrounded float32 cache, 2e-2).
    assert worst < 1e-2, worst
    for mine, theirs in zip(fast_cache.layers, plain_cache.layers, strict=True):
        assert mine.k.dtype == torch.bfloat16 and torch.equal(mine.pos, theirs.pos)
        torch.testing.assert_close(mine.k.float(), theirs.k, atol=1e-2, rtol=1e-2)


# the variants' widths made multiples of 32, the block of 8-bit codes (inputs of 48 cannot be cut into blocks)
Q8_WIDTHS = dict(expert_dim=32, ffn_dim=64)


def round_inputs(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the 8-bit step rounds a product's input: blocks of 32, scale = largest magnitude / 127."""
    blocks = x.reshape(-1, 32)
    scale = blocks.abs().amax(1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return (q.round().clamp(-127, 127) * scale).reshape(x.shape)


@contextlib.contextmanager
def inputs_rounded(model: torch.nn.Module):
    """The plain model with every rounded matrix's input rounded first (a pre-hook on each linear but the
    routers; the experts through their plain per-expert products): the 8-bit step's arithmetic, in torch."""
    routers = {moe.router for moe in model.moe_layers()}
    hooks = [m.register_forward_pre_hook(lambda _, args: (round_inputs(args[0]),))
             for m in model.modules() if isinstance(m, torch.nn.Linear) and m not in routers]

    def products(experts, x_AD, counts_E):
        outs = []
        for x, gate_up, down in zip(x_AD.split(counts_E.tolist()), *map(torch.unbind, experts.weights()),
                                    strict=True):
            gate, up = (round_inputs(x) @ gate_up).chunk(2, -1)
            outs.append(round_inputs(F.silu(gate) * up) @ down)
        return torch.cat(outs)

    for moe in model.moe_layers():
        moe.experts.products = functools.partial(products, moe.experts)
        moe.experts.forward = functools.partial(Experts.forward, moe.experts)  # (not the few-row path)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for moe in model.moe_layers():
            del moe.experts.products, moe.experts.forward


@pytest.mark.parametrize("name", ["sigmoid, shared expert, every feature", "dense, unchunked, all RoPE",
                                  "softmax over the chosen, no shared expert", "two threads, 256 wide"])
def test_a_q8_0_model_steps_from_its_codes(name, request):
    """`--dtype q8_0`: the matrices rounded to 8-bit codes in blocks of 32 along their inputs, the parameters
    holding the rounded values. The C++ step (its DecodeStepQ8) rounds each product's input the same way and
    multiplies codes by codes: for a 40-token prompt a token at a time and then three rows together, each
    call from the same cache, its logits equal those of the plain model with rounded inputs
    (`inputs_rounded`) to 1e-5 of their scale (float32 rounding) — except where a value lies within float32
    rounding of the midpoint between two codes, and the two paths, which differ by that much before
    rounding, take neighbouring codes: one step of 1/127 of the block's largest magnitude, 6e-3 to 2e-2 of
    these chaotic models' logits, in 1 call of 47 in each variant here. So: all but 3 calls to 1e-5, all
    within 5e-2."""
    if name == "two threads, 256 wide":  # wide enough that each product's columns are split between threads
        model = model_for(**Q8_WIDTHS, d_model=256, head_dim=64)
        request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
        torch.set_num_threads(2)
    else:
        model = model_for(**VARIANTS[name], **Q8_WIDTHS)
    original = {n: p.clone() for n, p in model.named_parameters()}
    assert fastdecode.round_to_q8_0(model) == len(fastdecode.matrices(model))
    cfg, cpu = model.cfg, torch.device("cpu")
    caches = [SlotCache(cfg, 3, torch.float32, cpu) for _ in range(2)]
    q8 = fastdecode.FastStep(model, caches[0].layers, caches[0].context)
    assert type(q8._step).__name__ == "DecodeStepQ8"
    plain = Runner(model, caches[1])
    plain.only = "plain"
    g = torch.Generator().manual_seed(1)
    calls = [([t], [i]) for i, t in enumerate(torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist())]
    calls += [(torch.randint(0, cfg.vocab_size, (3,), generator=g).tolist(), [step, step - 40, step - 38])
              for step in range(40, cfg.max_seq_len - 1)]
    errors = []
    with torch.no_grad(), inputs_rounded(model):
        for tokens, positions in calls:
            for mine, theirs in zip(caches[0].layers, caches[1].layers, strict=True):  # the same keys
                for part in ("k", "v", "pos"):
                    getattr(theirs, part).copy_(getattr(mine, part))
            got, want = q8(tokens, positions), plain.decode(tokens, positions)
            errors.append(((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item())
    assert sum(e > 1e-5 for e in errors) <= 3 and max(errors) < 5e-2, sorted(errors)[-5:]
    rounded = dict(fastdecode.matrices(model))
    for n, p in model.named_parameters():  # each matrix on its grid along its input, within half a step
        if n not in rounded:
            assert torch.equal(p, original[n]), n  # (the embedding, norms and routers are not rounded)
            continue
        along_input = (lambda w: w.transpose(-1, -2)) if p.dim() == 3 else (lambda w: w)  # (experts: (in, out))
        blocks, before = along_input(p).reshape(-1, 32), along_input(original[n]).reshape(-1, 32)
        scale = before.abs().amax(1, keepdim=True) / 127
        assert torch.equal(blocks, (before / scale).round() * scale), n
        assert ((blocks - before).abs() <= scale / 2 + before.abs() * 2**-23).all(), n  # (+ code * scale's rounding)


def test_a_q8_0_step_is_set_aside_when_a_weight_changes_and_bad_widths_are_named():
    """The codes are the rounded weights as they were: a matrix written since (a loaded state dict, an edit)
    makes the step unusable and decoding takes the plain path, which reads the parameters themselves. A model
    whose rows are not a multiple of 32, or not float32, is refused with its reason."""
    model = model_for(**Q8_WIDTHS)
    fastdecode.round_to_q8_0(model)
    cache = SlotCache(model.cfg, 1, torch.float32, torch.device("cpu"))
    step = fastdecode.FastStep(model, cache.layers, cache.context)
    assert step.usable(1)
    with torch.no_grad():
        model.blocks[2].ffn.experts.down.mul_(2)
    assert not step.usable(1)
    partly = model_for(**Q8_WIDTHS)
    fastdecode.round_to_q8_0(partly)
    partly.q8_0.pop(partly.lm_head.weight)
    reason = "8-bit codes for some of its matrices only, or on weights no longer float32"
    assert fastdecode.unsupported(partly) == reason
    moved = model_for(**Q8_WIDTHS)
    fastdecode.round_to_q8_0(moved)
    moved.to(torch.bfloat16)  # (the same parameters in another dtype: its codes are not what they hold)
    assert fastdecode.unsupported(moved) == reason
    with pytest.raises(ValueError, match=r"multiple of 32; blocks\.0\.ffn\.experts\.down has inputs of 24"):
        fastdecode.round_to_q8_0(model_for())
    with pytest.raises(ValueError, match="starts from float32 weights"):
        fastdecode.round_to_q8_0(model_for(**Q8_WIDTHS).to(torch.bfloat16))


def test_what_it_cannot_run_is_named():
    model = model_for()
    assert fastdecode.unsupported(model) is None
    assert fastdecode.unsupported(model_for().to(torch.bfloat16)) is None
    half = model_for().to(torch.float16)
    assert fastdecode.unsupported(half) == "weights other than all float32 or all bfloat16"
    mixed = model_for()
    mixed.lm_head.to(torch.bfloat16)
    assert fastdecode.unsupported(mixed) == "weights other than all float32 or all bfloat16"
    lora = model_for()
    attach(lora, rank=2, alpha=4.0)
    assert fastdecode.unsupported(lora) == "parametrised weights (LoRA adapters)"
    with pytest.raises(ValueError, match="cannot run this model: weights other than all float32 or all bfloat16"):
        fastdecode.FastStep(half, [], 8)
    engine = Engine(lora, max_batch=1)  # the engine decodes it on the plain path
    engine.add(Request([1, 2], 5, Sampling(temperature=0), emit=lambda e: None, id="x"))
    engine.run()
    assert engine.runner._fast is False and engine.finished["length"] == 1


def test_a_decode_step_reads_no_tensor_back():
    """Steady-state decode steps of four rows (`helpers.host_reads`): the C++ step reads nothing back; the plain
    step only the chosen experts' ids in `ops.decode.few_rows`' CPU branch (eager on the CPU, where reading
    them costs nothing; elsewhere it gathers the experts' weights on the device instead)."""
    from nanollama4.base.config import preset

    torch.manual_seed(0)
    model = build_model(preset("shakespeare-char", vocab_size=96)).eval()
    for only, allowed in (("fast", ()), ("plain", ("Tensor.tolist at ops/decode.py",))):
        runner = Runner(model, SlotCache(model.cfg, 4, torch.float32, torch.device("cpu")))
        runner.only = only
        with torch.no_grad():
            for s in range(3):
                runner.decode([1, 2, 3, 4], [s] * 4)
            reads = host_reads(lambda r=runner: [r.decode([1, 2, 3, 4], [s] * 4) for s in range(3, 6)])
        assert [r for r in reads if not r.startswith(allowed)] == [], only


@pytest.mark.parametrize("name", ["sigmoid, shared expert, every feature", "softmax over the chosen, no shared expert",
                                  "dense, unchunked, all RoPE"])
def test_the_static_step_a_cuda_graph_records_computes_the_plain_step(name):
    """The CPU dry run of the CUDA-graph decode step (`engine.graphs.StaticStep`): rows padded to their bucket,
    full layers over the whole context, the graph-safe expert paths; the engine's tokens equal the plain
    path's, and a step of it reads nothing back (what a capture needs). Whether a GPU captures it is
    benchmarks/gpu.sh's to show."""
    model = model_for(**VARIANTS[name])
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 5, 1)]
    got = {}
    for only in ("plain", "graph"):
        events, engine = run_engine(model, prompts, 30, Sampling(temperature=0), only)
        got[only] = scored(events)
    assert_same_decodes(got["graph"], got["plain"], Sampling(temperature=0))
    assert set(engine.runner._static.graphs) == {4}  # the 3 rows padded to a batch of 4
    runner = Runner(model, SlotCache(model.cfg, 4, torch.float32, torch.device("cpu")))
    runner.only = "graph"
    with torch.no_grad():
        runner.decode([1, 2, 3], [0, 0, 0])
        reads = host_reads(lambda: runner._static._forward(runner._static.graphs[4][1]))
    assert reads == []


def test_a_choice_made_among_some_ways_does_not_bind_the_default():
    """An engine told to decode one way only (benchmarks, tests) leaves the model's default choice open."""
    model = model_for()
    for only in ("plain", None):
        engine = Engine(model, max_batch=1)
        engine.runner.only = only
        engine.add(Request([1, 2, 3], 30, Sampling(temperature=0), emit=lambda e: None, id="a"))
        engine.run()
    chosen = engine.runner.choice
    assert (1, 1) in chosen and all(way[0] == "plain" for key, way in chosen.items() if "plain" in key)


def test_a_patched_forward_keeps_the_plain_path():
    """A forward replaced on a module instance would be skipped by the C++ step: the step is not usable then."""
    model = model_for()
    fast = fastdecode.FastStep(model, SlotCache(model.cfg, 1, torch.float32, torch.device("cpu")).layers, 48)
    assert fast.usable(1)
    model.blocks[2].ffn.forward = lambda x: x
    assert not fast.usable(1)
    del model.blocks[2].ffn.forward
    assert fast.usable(1)


@pytest.mark.parametrize("name", ["sigmoid, shared expert, every feature", "dense, unchunked, all RoPE"])
def test_a_prompt_prefilled_by_the_cpp_step_equals_the_plain_prefill(name):
    """A 40-token prompt (five chunks of 8: the ring wraps within the prefill) in two pieces, every position's
    logits, then the cache moved into an engine row: the same logits and the same next steps."""
    model = model_for(**VARIANTS[name])
    runner = Runner(model, SlotCache(model.cfg, 2, torch.float32, torch.device("cpu")))
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(4))
    fast, plain = runner.prefill_cache(40), runner.prefill_cache(40, plain=True)
    assert type(fast).__name__ == "FastPrefill" and type(plain).__name__ == "KVCache"
    with torch.no_grad():
        got = torch.cat([runner.prefill(ids[:, :25], fast, last_only=False),
                         runner.prefill(ids[:, 25:], fast, start=25, last_only=False)], 1)
        want = torch.cat([runner.prefill(ids[:, :25], plain, last_only=False),
                          runner.prefill(ids[:, 25:], plain, start=25, last_only=False)], 1)
        assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())
        runner.seat(0, fast)
        runner.seat(1, plain)
        runner.only = "plain"
        steps = runner.decode([7, 7], [40, 40])
    torch.testing.assert_close(steps[0], steps[1], atol=1e-5, rtol=1e-5)
