"""engine/sampling.py: the sampler takes the row (its Sampling, its tokens so far, its generator), and an option
that reads the history, the repetition penalty, is one field and its `adjust`: here it is followed through
Python, the engine's batches, the command line and the trace (the API's door: tests/test_serve.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanollama4.engine import Engine, Request, Sampling, TokenEvent
from nanollama4.engine.generation import generate_ids, sample
from nanollama4.engine.sampling import MIN_PENALTY, SamplingError, choose, distribution
from nanollama4.model.tokenizer import CharTokenizer
from tests.helpers import assert_same_greedy_ids, random_model, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .,;:!?ABCDEFGHIJKLMN")
CFG = dict(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=96,
           attention_chunk_size=8, nope_interval=2, ffn_dim=48, n_experts=4, experts_per_token=2, expert_dim=24)


def penalised(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """The penalty as CTRL (Keskar et al., 2019) states it, written out here as the reference: each token the
    row already holds has its logit divided by the penalty when positive, multiplied when negative."""
    out = logits.clone()
    for t in set(history):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=5)


def test_adjust_is_the_reference_penalty_on_each_rows_own_history():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    got = Sampling(repetition_penalty=2.0).adjust(logits, [[0, 1, 1], [3]])
    torch.testing.assert_close(got[0], penalised(logits[0], [0, 1, 1], 2.0))
    torch.testing.assert_close(got[1], penalised(logits[1], [3], 2.0))
    assert torch.equal(Sampling().adjust(logits, [[0], [1]]), logits)  # no penalty: the logits as they are
    assert Sampling(repetition_penalty=1.3).reads_history and not Sampling(repetition_penalty=1.0).reads_history


@pytest.mark.parametrize("penalty", [1e-300, 1e-39, 0.0099, 0.0, -1.0, 2.01])
def test_a_penalty_past_its_limits_is_refused_before_it_can_overflow_the_logits(penalty):
    """1e-300 divided a held logit into inf and the draw failed (a 500 from the server, a traceback from
    generate); the floor, 0.01, keeps every finite float32 logit of a trained model finite."""
    with pytest.raises(SamplingError, match=r"^repetition_penalty \(.+\) must be a number from 0\.01 to 2 "):
        Sampling(repetition_penalty=penalty)
    logits = torch.tensor([[30.0, -30.0, 1e30]])
    adjusted = Sampling(repetition_penalty=MIN_PENALTY, temperature=1e-5).adjust(logits, [[0, 1, 2]])
    assert torch.isfinite(adjusted).all() and torch.isfinite(distribution(logits, Sampling(
        repetition_penalty=MIN_PENALTY, temperature=1e-5), [[0, 1, 2]])).all()


def test_generate_with_the_penalty_equals_the_plain_loop_and_changes_the_text(model):
    """The engine (KV cache, the C++ step where it runs) against `sample` (the whole context recomputed, the
    penalty on the whole sequence so far, prompt included), greedy and seeded."""
    prompt = [3, 4, 5, 3, 4, 5]
    for settings in (dict(temperature=0), dict(temperature=0.9, seed=4)):
        got = generate_ids(model, [prompt], 40, repetition_penalty=1.8, **settings)[0]
        g = torch.Generator().manual_seed(4) if "seed" in settings else None
        want = sample(model, torch.tensor([prompt]), 40, Sampling(repetition_penalty=1.8, **settings), g)[0, 6:]
        if "seed" in settings:  # the same seeded draws: apart only within rounding (~1e-7) of an edge
            assert got == want.tolist()
        else:  # two code paths: the same greedy tokens up to a near tie of the penalised logits
            assert_same_greedy_ids(model, prompt, got, want.tolist(), adjust=Sampling(repetition_penalty=1.8).adjust)
    assert generate_ids(model, [prompt], 40, temperature=0)[0] != generate_ids(model, [prompt], 40, temperature=0,
                                                                             repetition_penalty=1.8)[0]


def test_rows_that_read_their_history_choose_alone_and_a_batch_equals_each_row_alone(model):
    prompts = [[1, 2, 3], [1, 2, 3], [7, 8]]
    settings = [Sampling(temperature=0), Sampling(temperature=0, repetition_penalty=1.5),
                Sampling(temperature=0, repetition_penalty=1.5)]
    alone = [generate_ids(model, [p], 30, s)[0] for p, s in zip(prompts, settings, strict=True)]
    engine, out = Engine(model, max_batch=4), {}
    for i, (p, s) in enumerate(zip(prompts, settings, strict=True)):
        engine.add(Request(p, 30, s, lambda e, i=i: out.setdefault(i, []).append(e)))
    engine.run()
    assert [[e.token_id for e in out[i] if isinstance(e, TokenEvent)] for i in range(3)] == alone
    assert alone[0] != alone[1]  # the same prompt, with and without the penalty


def test_choose_gives_equal_greedy_rows_one_call_and_history_readers_their_own(monkeypatch):
    from nanollama4.engine import sampling as sampling_module

    calls = []
    real = sampling_module.next_token
    monkeypatch.setattr(sampling_module, "next_token",
                        lambda logits, *a: (calls.append(logits.shape[0]), real(logits, *a))[1])
    greedy, penalised_row = Sampling(temperature=0), Sampling(temperature=0, repetition_penalty=2.0)
    rows = [SimpleNamespace(sampling=greedy, tokens=[0], generator=None),
            SimpleNamespace(sampling=greedy, tokens=[1], generator=None),
            SimpleNamespace(sampling=penalised_row, tokens=[3], generator=None)]
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.5]] * 3)
    assert choose(logits, rows) == [3, 3, 1]  # the third row holds token 3: 1.5 / 2 < 1
    assert sorted(calls) == [1, 2]


def test_the_command_line_takes_the_penalty(tiny_run, capsys):
    argv = ["generate", str(tiny_run), "--prompt", "the the the", "--max-new-tokens", "30", "--greedy"]
    rc, plain, err = run_cli(argv, capsys)
    assert rc == 0, err
    rc, penalised_text, err = run_cli([*argv, "--repetition-penalty", "2"], capsys)
    assert rc == 0, err
    assert penalised_text.startswith("the the the") and penalised_text != plain


def test_the_trace_shows_the_penalised_distribution(model):
    """A traced, sampled row with the penalty: the trace's second number for each of the likeliest tokens is
    the probability under the penalised distribution (the reference above, then temperature and softmax)."""
    prompt = [1, 2, 3, 1, 2, 3]
    sampling = Sampling(temperature=0.7, seed=2, repetition_penalty=1.7)
    engine, events = Engine(model, TOK, max_batch=1), []
    engine.add(Request(prompt, 3, sampling, events.append, trace=True))
    engine.run()
    steps = [e for e in events if isinstance(e, TokenEvent)]
    history = list(prompt)
    for event in steps:
        logits = model(torch.tensor([history]))[0, -1].detach().float()
        want = (penalised(logits, history, 1.7) / 0.7).softmax(-1)
        plain = (logits / 0.7).softmax(-1)
        trace = event.trace
        shown = {text: drawn for text, _, drawn in trace.odds}
        texts = engine.observer.texts
        for t in logits.topk(3).indices.tolist():
            if texts[t] in shown:
                assert shown[texts[t]] == pytest.approx(float(want[t]), abs=1e-5)
        assert trace.chosen_odds[1] == pytest.approx(float(want[event.token_id]), abs=1e-5)
        assert not torch.allclose(want, plain)  # the penalty moved the distribution the token was drawn from
        history.append(event.token_id)
    assert torch.allclose(distribution(logits[None], sampling, [history[:-1]])[0], want)
