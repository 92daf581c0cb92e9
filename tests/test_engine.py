"""The one engine (`nanollama4.engine`): several prompts together equal each alone, a prompt admitted mid-stream
changes no other row, one sampling contract with the same limits everywhere, and min_p through it."""

from __future__ import annotations

import pytest
import torch

from nanollama4.base.config import ModelConfig
from nanollama4.engine import Engine, Finished, Request, Sampling, SamplingError, TokenEvent, filter_logits
from nanollama4.engine.generation import generate_ids, sample
from nanollama4.ops import build_model
from tests.helpers import assert_cli_error, assert_same_greedy_ids, random_model, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

# chunked RoPE layers (chunk 4), a NoPE layer with temperature, MoE top-2 of 4: every path of a step
CFG = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=96,
           attention_chunk_size=4, nope_interval=2, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
           ffn_dim=48, n_experts=4, experts_per_token=2, expert_dim=24)


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=3)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [ids(3, 1), ids(17, 2), ids(8, 3), ids(40, 4)]


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=1.0, top_k=20, seed=5),
                                      dict(temperature=0.9, min_p=0.05, top_p=0.95, seed=6)])
def test_several_prompts_together_equal_each_alone(model, settings):
    together = generate_ids(model, PROMPTS, 24, **settings)
    alone = [generate_ids(model, [p], 24, **settings)[0] for p in PROMPTS]
    if settings["temperature"] == 0:  # a batch and a row alone may take two paths (the C++ step's tiles)
        for p, x, y in zip(PROMPTS, together, alone, strict=True):
            assert_same_greedy_ids(model, p, x, y)
    else:  # the same seeded draws: apart only within rounding (~1e-7) of an edge between two tokens
        assert together == alone
    assert all(len(row) == 24 for row in together) and len({tuple(r) for r in together}) == len(PROMPTS)


def test_greedy_engine_equals_the_cacheless_reference(model):
    """`sample` recomputes the whole context per token: the engine's cached steps pick the same tokens."""
    for p in PROMPTS[:2]:
        want = sample(model, torch.tensor([p]), 20, temperature=0)[0, len(p):].tolist()
        assert_same_greedy_ids(model, p, generate_ids(model, [p], 20, temperature=0)[0], want)


def test_a_long_prompt_admitted_mid_stream_changes_no_other_row(model):
    """Rows decode while a 60-token prompt is admitted into the batch: their tokens are those they make alone."""
    engine = Engine(model, max_batch=4)
    events: dict[str, list] = {"a": [], "b": [], "late": []}
    requests = {"a": Request(PROMPTS[0], 30, Sampling(temperature=0), events["a"].append),
                "b": Request(PROMPTS[2], 30, Sampling(temperature=1.0, seed=9), events["b"].append)}
    engine.add(requests["a"])
    engine.add(requests["b"])
    for _ in range(5):
        engine.step()
    assert len(engine.rows) == 2
    engine.add(Request(ids(60, 7), 10, Sampling(temperature=0), events["late"].append))
    engine.run()
    got = {k: [e.token_id for e in v if isinstance(e, TokenEvent)] for k, v in events.items()}
    assert got["a"] == generate_ids(model, [PROMPTS[0]], 30, temperature=0)[0]
    assert got["b"] == generate_ids(model, [PROMPTS[2]], 30, temperature=1.0, seed=9)[0]
    assert got["late"] == generate_ids(model, [ids(60, 7)], 10, temperature=0)[0]
    assert all(isinstance(v[-1], Finished) and v[-1].reason == "length" for v in events.values())


def test_a_stop_id_ends_the_row_and_is_kept_by_generate_ids(model):
    free = generate_ids(model, [PROMPTS[1]], 20, temperature=0)[0]
    stop = free[6]
    out = generate_ids(model, [PROMPTS[1]], 20, temperature=0, stop_ids=(stop,))[0]
    assert out == free[:free.index(stop) + 1]


# ---------------------------------------------------------------------------------------------- the contract
BAD = [("temperature", 2.5), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5), ("top_k", 0),
       ("seed", -1)]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_an_invalid_sampling_value_is_refused_with_the_same_limit_by_the_cli_and_python(field, value, tmp_path,
                                                                                     capsys):
    """The Python API raises SamplingError naming the field; the command line prints the same sentence as its
    one line and exits 2 (before loading any model). The API's test is tests/test_serve.py."""
    with pytest.raises(SamplingError) as e:
        Sampling(**{field: value})
    assert e.value.field == field and str(e.value).startswith(f"{field} ({value!r}) must be")
    with pytest.raises(SamplingError, match=field):
        generate_ids(build_model(ModelConfig(**CFG)), [[1, 2]], 3, **{field: value})
    option = f"--{field.replace('_', '-')}"
    rc, _, err = run_cli(["generate", str(tmp_path), option, str(value)], capsys)
    line = assert_cli_error(rc, err, "generate")
    assert line.endswith(str(e.value)), line


def test_min_p_keeps_the_tokens_within_its_share_of_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), min_p=0.25).isfinite()[0].tolist()  # keeps p >= 0.125
    assert kept == [True, True, True, False]
    assert filter_logits(probs.log(), min_p=0.0).isfinite().all()
    assert filter_logits(probs.log(), min_p=1.0).isfinite()[0].tolist() == [True, False, False, False]


def test_min_p_reaches_the_python_api_and_the_cli(model, tmp_path, capsys):
    """min_p = 1 keeps only the most likely token: sampling at temperature 1 is then greedy decoding."""
    greedy = generate_ids(model, PROMPTS[:2], 20, temperature=0)
    assert generate_ids(model, PROMPTS[:2], 20, temperature=1.0, min_p=1.0, seed=1) == greedy
    assert generate_ids(model, PROMPTS[:2], 20, temperature=1.0, seed=1) != greedy  # it did act

    from nanollama4.base.config import TrainConfig, preset
    from nanollama4.training.train import train
    from tests.helpers import write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    train(preset("tiny", max_seq_len=64), TrainConfig(max_steps=1, eval_interval=1, seq_len=32, batch_size=4,
                                                      eval_batches=1, warmup_steps=1),
          tmp_path / "run", data=str(corpus), progress=False, cache_dir=tmp_path / "cache")
    base = ["generate", str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "12"]
    rc, want, err = run_cli([*base, "--greedy"], capsys)
    assert rc == 0, err
    rc, got, err = run_cli([*base, "--temperature", "1", "--min-p", "1", "--seed", "3"], capsys)
    assert rc == 0, err
    assert got == want
    rc, other, err = run_cli([*base, "--temperature", "1", "--seed", "3"], capsys)
    assert rc == 0 and other != want  # without min_p the same seed samples other tokens


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_the_rows_decode(model):
    """With chunks of 16, a 60-token prompt takes 4 steps to prefill; the decoding row gets a token at each
    of them, and the chunked prompt's tokens are those of a prompt prefilled in one pass."""
    engine = Engine(model, max_batch=2)
    engine.prefill_chunk = 16
    first: list = []
    late: list = []
    engine.add(Request(PROMPTS[0], 20, Sampling(temperature=0), first.append))
    engine.step()
    engine.add(Request(ids(60, 11), 8, Sampling(temperature=0), late.append))
    for step in range(4):
        before = len(first)
        engine.step()
        assert len(first) == before + 1, step  # the row decoded this step too
        assert (len(late) == 0) == (step < 3), step  # the first token once the 4th chunk is in
    engine.run()
    whole = Engine(model, max_batch=1)
    whole.prefill_chunk = 10_000
    alone: list = []
    whole.add(Request(ids(60, 11), 8, Sampling(temperature=0), alone.append))
    whole.run()
    tokens = [[e.token_id for e in x if isinstance(e, TokenEvent)] for x in (late, alone)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


# ---------------------------------------------------------------------------------------------- split characters
SPLIT_TEXT = "déjà vu, 東京 ✓ z🙂 naïve"


@pytest.fixture(scope="module")
def bpe():
    from nanollama4.model.tokenizer import BPETokenizer

    return BPETokenizer.train("naïve café — déjà vu, 東京 ✓ 🙂 " * 40, vocab_size=300)


def byte_ids(tok, text: str) -> list[int]:
    """`text` as one byte-level token per byte: every character past ASCII split across tokens."""
    from nanollama4.model.tokenizer import token_bytes

    single = {token_bytes(tok, i): i for i in range(tok.vocab_size) if len(token_bytes(tok, i)) == 1}
    return [single[bytes([b])] for b in text.encode("utf-8")]


def test_characters_split_across_tokens_come_out_whole_in_generate_and_stream(bpe, monkeypatch):
    """A character whose bytes are split across byte-level BPE tokens must be held until it is whole: the pieces
    never hold U+FFFD and join to the text of every id decoded at once. A stop string right after such a
    character used to be shown in part ("z" came out before "🙂" was whole, then the text was cut before it);
    a row that ends mid-character ends as decoding its ids does."""
    from nanollama4.engine import sampling as sampling_module
    from nanollama4.engine.generation import generate, stream

    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**CFG, "vocab_size": bpe.vocab_size})).eval()
    script = byte_ids(bpe, SPLIT_TEXT)
    assert bpe.decode(script) == SPLIT_TEXT and "\ufffd" in bpe.decode(script[:2])  # "d" and half of "é"

    def scripted(n: int | None = None):
        queue = iter(script)
        monkeypatch.setattr(sampling_module, "next_token", lambda logits, sampling, generator, history=None:
                            torch.tensor([next(queue) for _ in range(logits.shape[0])]))
        return dict(max_new_tokens=n or len(script), temperature=0)

    pieces = list(stream(model, bpe, "café", **scripted()))
    assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == SPLIT_TEXT and len(pieces) > 5
    assert generate(model, bpe, "café", **scripted()) == SPLIT_TEXT
    for stop in ("z🙂", "🙂"):
        pieces = list(stream(model, bpe, "café", stop=[stop], **scripted()))
        assert "".join(pieces) == SPLIT_TEXT[:SPLIT_TEXT.index(stop)] and not any("\ufffd" in p for p in pieces)
        assert generate(model, bpe, "café", stop=[stop], **scripted()) == SPLIT_TEXT[:SPLIT_TEXT.index(stop)]
    cut = len(byte_ids(bpe, SPLIT_TEXT[:SPLIT_TEXT.index("🙂")])) + 2  # 2 of its 4 bytes
    *pieces, tail = stream(model, bpe, "café", **scripted(cut))
    assert not any("\ufffd" in p for p in pieces) and "".join(pieces) + tail == bpe.decode(script[:cut])
    assert tail.endswith("\ufffd")


def test_text_stream_pieces_join_to_the_decoded_ids_for_any_split(bpe):
    """Every way the text's characters are spelled (whole tokens, one token per byte, the first k characters
    whole), with and without stop strings: the pieces join to the ids decoded at once, cut before the first
    stop, and hold no U+FFFD."""
    from nanollama4.engine.sampling import TextStream

    for k in range(len(SPLIT_TEXT) + 1):
        for ids in (bpe.encode(SPLIT_TEXT[:k]) + byte_ids(bpe, SPLIT_TEXT[k:]),
                    byte_ids(bpe, SPLIT_TEXT[:k]) + bpe.encode(SPLIT_TEXT[k:])):
            for stop in ((), ("z🙂",), ("京 ✓", "ïve"), ("vu, 東",)):
                stream_ = TextStream(bpe, Sampling(stop=stop))
                pieces = [stream_.add(i) for i in ids] + [stream_.flush()]
                cuts = [SPLIT_TEXT.find(s) for s in stop if s in SPLIT_TEXT]
                assert "".join(pieces) == SPLIT_TEXT[:min(cuts, default=len(SPLIT_TEXT))], (k, stop, pieces)
                assert not any("\ufffd" in p for p in pieces)


def test_bytes_that_no_character_completes_are_shown_not_held_to_the_end(bpe):
    """A model may write bytes that are not UTF-8 (a run of continuation bytes): once more ids are pending
    than any character has bytes, they are shown (as U+FFFD) rather than held until the row ends."""
    from nanollama4.engine.sampling import MAX_PENDING, TextStream
    from nanollama4.model.tokenizer import token_bytes

    lone = next(i for i in range(bpe.vocab_size) if token_bytes(bpe, i) == b"\x80")
    stream_ = TextStream(bpe, Sampling())
    pieces = [stream_.add(lone) for _ in range(3 * MAX_PENDING)]
    assert all(p == "" for p in pieces[:MAX_PENDING - 1]) and "\ufffd" in "".join(pieces[:MAX_PENDING])
    assert "".join(pieces) + stream_.flush() == bpe.decode([lone] * 3 * MAX_PENDING)


def test_a_stop_id_after_a_split_character_keeps_the_text_before_it(bpe):
    """A row that ends on a stop id while a character's bytes are pending: flush gives them as decoding every
    id at once does (the whole characters they hold, U+FFFD for the unfinished one), losing nothing."""
    from nanollama4.engine.sampling import TextStream

    ids = bpe.encode("ab") + byte_ids(bpe, "é")[:1]
    stream_ = TextStream(bpe, Sampling(stop_ids=(0,)))
    pieces = [stream_.add(i) for i in ids] + [stream_.add(0)]
    assert "".join(pieces) + stream_.flush() == bpe.decode(ids) and stream_.stop_id == 0
