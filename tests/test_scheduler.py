"""The engine's scheduler alone (who waits, who gets which row, who leaves, how much of a prompt a step takes),
the one way requests get in, the one function tokens are chosen by, and the StepTrace a traced step writes."""

from __future__ import annotations

import pytest
import torch

import nanollama4
from nanollama4.engine import sampling as sampling_module
from nanollama4.engine.core import Engine
from nanollama4.engine.request import Request, TokenEvent
from nanollama4.engine.sampling import Sampling
from nanollama4.engine.scheduler import QueueFull, Scheduler
from nanollama4.engine.trace import StepTrace
from nanollama4.model.tokenizer import CharTokenizer
from tests.helpers import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = Sampling(temperature=0)
TEXT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"


def request(n: int = 3, **kw) -> Request:
    return Request(list(range(1, n + 1)), 4, GREEDY, lambda e: None, **kw)


def _model():
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    model = nanollama4.build_model(nanollama4.preset("tiny", vocab_size=tok.vocab_size, max_seq_len=64)).eval()
    randomize_(model, seed=7)
    return model, tok


# ---------------------------------------------------------------------------------------------- the scheduler
def test_waiting_requests_are_admitted_oldest_first_into_the_free_rows():
    s = Scheduler(max_batch=2)
    a, b, c = request(), request(), request()
    s.add([a, b, c])
    assert s.free_rows == 2 and s.has_work
    assert s.take() == [a, b]
    assert s.free_rows == 0 and s.take() == [] and list(s.waiting) == [c]  # taken requests hold their rows
    for r in (a, b):
        s.admit(r)
    assert s.admitting == [] and s.prefilling == [a, b] and s.admitted == 2
    assert s.seat(a) == 0 and s.seat(b) == 1 and s.rows == [a, b] and s.prefilling == []
    assert s.retire(a) == (1, 0)  # the last row moves into the gap
    assert s.rows == [b] and s.free_rows == 1
    assert s.take() == [c]


def test_retiring_keeps_the_rows_contiguous_and_a_request_leaves_from_anywhere():
    s = Scheduler(max_batch=4)
    rows = [request() for _ in range(3)]
    for r in rows:
        s.admit(r)
        s.seat(r)
    a, b, c = rows
    assert s.retire(b) == (2, 1) and s.rows == [a, c]
    assert s.retire(c) is None and s.rows == [a]  # the last row leaves no gap
    waiting, prefilling = request(), request()
    s.add([waiting])
    s.admit(prefilling)
    assert s.retire(waiting) is None and s.retire(prefilling) is None
    assert not s.waiting and not s.prefilling and s.retire(a) is None and not s.has_work


def test_a_bounded_queue_takes_requests_together_or_not_at_all():
    s = Scheduler(max_batch=1, max_queue=1)
    s.add([request(), request()])  # a free row and the one queue place
    with pytest.raises(QueueFull):
        s.add([request()])
    assert len(s.waiting) == 2
    (first,) = s.take()
    with pytest.raises(QueueFull):  # the first holds the row; the second waits in the one place
        s.add([request()])
    s.admit(first)
    s.seat(first)
    s.retire(first)
    s.add([request()])  # the row is free again
    with pytest.raises(QueueFull):
        s.add([request()])
    assert len(s.waiting) == 2


def test_cancelled_requests_are_found_where_they_are():
    s = Scheduler(max_batch=4)
    row, prompt, queued, kept = request(), request(), request(), request()
    s.admit(row)
    s.seat(row)
    s.admit(prompt)
    s.add([queued, kept])
    for r in (row, prompt, queued):
        r.cancel()
    assert s.cancelled() == [row, prompt]  # decoding rows first, then prompts
    assert s.forget_cancelled() == [queued] and list(s.waiting) == [kept]
    assert set(s.clear()) == {row, prompt} and not s.rows and not s.prefilling


def test_a_prompt_goes_in_a_chunk_per_step_unless_traced_or_scored():
    s = Scheduler(max_batch=2, prefill_chunk=16)
    r = request(40)
    spans = []
    while r.prefilled < 40:
        spans.append(s.chunk(r))
        r.prefilled = spans[-1][1]
    assert spans == [(0, 16), (16, 32), (32, 40)]
    assert s.chunk(request(40, trace=True)) == (0, 40) and s.chunk(request(40, prompt_logprobs=True)) == (0, 40)


# ---------------------------------------------------------------------------------------------- one way in
def test_every_caller_queues_through_engine_add(monkeypatch):
    """generate, explain --generate and the server all enqueue through `Engine.add` (which checks, then
    hands the scheduler the requests): none appends to the queue itself."""
    from nanollama4.engine.generation import generate
    from nanollama4.explain import trace_generation
    from nanollama4.serve.engine import BackgroundEngine

    model, tok = _model()
    added: list[int] = []
    original = Engine.add
    monkeypatch.setattr(Engine, "add", lambda self, *rs: (added.append(len(rs)), original(self, *rs))[1])
    generate(model, tok, ["But", "soft"], 3, temperature=0)
    trace_generation(model, tok, "But", 3)
    BackgroundEngine(model, tok, max_batch=1).submit_all([Request(tok.encode("But"), 3, GREEDY, lambda e: None)])
    assert added == [2, 1, 1]


def test_a_refused_request_queues_none_of_those_added_with_it():
    model, tok = _model()
    engine = Engine(model, tok, max_batch=2)
    with pytest.raises(nanollama4.base.errors.GenerationError):
        engine.add(Request(tok.encode("But"), 3, GREEDY, lambda e: None), Request([], 3, GREEDY, lambda e: None))
    assert not engine.scheduler.waiting and not engine.has_work


def test_a_greedy_batch_chooses_through_next_token_in_one_call(monkeypatch):
    """Every token comes from `sampling.next_token`: a greedy batch in one call per step (one argmax), a
    sampled row in a call of its own."""
    model, tok = _model()
    calls: list[int] = []
    original = sampling_module.next_token
    monkeypatch.setattr(sampling_module, "next_token",
                        lambda logits, *a: (calls.append(logits.shape[0]), original(logits, *a))[1])
    engine = Engine(model, tok, max_batch=4)
    engine.add(*[Request(tok.encode(p), 5, GREEDY, lambda e: None) for p in ("But", "soft", "what", "light")])
    engine.run()
    assert calls == [1, 1, 1, 1] + [4] * 4  # each prompt's first token, then four steps of the four rows
    calls.clear()
    engine.add(Request(tok.encode("But"), 3, GREEDY, lambda e: None),
               Request(tok.encode("soft"), 3, Sampling(temperature=0.8, seed=1), lambda e: None))
    engine.run()
    assert sorted(calls) == [1] * 2 + [1] * 4  # two first tokens, then per step the greedy row and the sampled one


# ---------------------------------------------------------------------------------------------- the step trace
def test_a_traced_greedy_step_is_written_by_the_observer_and_costs_nothing_untraced():
    model, tok = _model()
    engine = Engine(model, tok, max_batch=2)
    plain, traced = [], []
    engine.add(Request(tok.encode("soft"), 4, GREEDY, plain.append))
    engine.run()
    assert "observer" not in vars(engine)  # no traced request: no observer made, no pass observed
    prompt = tok.encode("But soft")
    engine.add(Request(tok.encode("what"), 4, GREEDY, plain.append),
               Request(prompt, 4, GREEDY, traced.append, trace=True))
    engine.run()
    assert all(e.trace is None for e in plain if isinstance(e, TokenEvent))
    steps = [e for e in traced if isinstance(e, TokenEvent)]
    assert len(steps) == 4 and all(isinstance(e.trace, StepTrace) for e in steps)
    first, later = steps[0].trace, [e.trace for e in steps[1:]]
    assert first.kind == "prefill" and first.fed == list("But soft") and first.position == len(prompt) - 1
    assert [p.token for p in first.prompt] == list("But soft") and [p.position for p in first.prompt] == list(range(8))
    assert [t.kind for t in later] == ["decode"] * 3 and all(t.prompt is None for t in later)
    for i, (event, step) in enumerate(zip(steps, [first, *later], strict=True)):
        if i:
            assert step.fed == [steps[i - 1].trace.chosen] and step.position == len(prompt) + i - 1
        assert step.chosen == tok.decode([event.token_id]) == step.odds[0][0]  # greedy: the likeliest
        assert [s for _, _, s in step.odds] == [1.0] + [0.0] * (len(step.odds) - 1)  # drawn from: one-hot
        assert step.chosen_odds == (pytest.approx(step.odds[0][1]), 1.0)
        assert [p for _, p, _ in step.odds] == sorted((p for _, p, _ in step.odds), reverse=True)
        moe = [i for i in range(model.cfg.n_layers) if model.cfg.is_moe(i)]
        assert [r.layer for r in step.routes] == moe
        assert all(len(r.experts) == model.cfg.experts_per_token for r in step.routes)
        assert [a.layer for a in step.attention] == list(range(model.cfg.n_layers))
        assert all(sum(p for _, p in a.keys) == pytest.approx(1.0, abs=0.05) for a in step.attention)
        assert len(step.cache) == model.cfg.n_layers and max(step.cache) == step.position + 1
    page = first.to_json()  # what the server sends the page: its keys, "from" for a rerouted slot's expert
    assert set(page) == {"kind", "position", "token", "fed", "routes", "attention", "cache", "odds", "chosen",
                         "chosen_odds", "prompt"}
    assert set(page["routes"][0]) == {"layer", "experts", "weights", "kinds", "from"}
    assert set(page["prompt"][0]) == {"position", "token", "routes"} and "prompt" not in later[0].to_json()


def test_a_row_whose_draw_fails_ends_alone_and_the_others_go_on(monkeypatch):
    """A sampled row's next_token raising ends that request with an error; a greedy row beside it finishes."""
    import torch

    import nanollama4
    from nanollama4.engine import Engine, Finished, Request, Sampling
    from nanollama4.engine import sampling as sampling_mod

    torch.manual_seed(0)
    model = nanollama4.Transformer(nanollama4.preset("tiny")).eval()
    engine = Engine(model, max_batch=2)
    real = sampling_mod.next_token

    def failing(logits, sampling, generator, history=None):
        if not sampling.greedy and engine.steps >= 2:
            raise RuntimeError("a draw that failed")
        return real(logits, sampling, generator, history)

    monkeypatch.setattr(sampling_mod, "next_token", failing)
    ends = {}
    for name, sampling in (("greedy", Sampling(temperature=0)), ("sampled", Sampling(seed=1))):
        engine.add(Request([1, 2, 3], 6, sampling,
                           lambda e, name=name: ends.__setitem__(name, e) if isinstance(e, Finished) else None))
    while engine.has_work:
        engine.step()
    assert ends["greedy"].reason == "length"
    assert ends["sampled"].reason == "error" and "a draw that failed" in ends["sampled"].error
