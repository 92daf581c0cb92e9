"""`nanollama4 serve`: the real server on a free local port, driven by the official `openai` client and a
real browser; its tokens equal offline generation's; bad requests get the API's error objects."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

import nanollama4
from nanollama4.engine.generation import generate
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.serve.api import create_app
from nanollama4.serve.chat import END_OF_TURN
from nanollama4.serve.engine import BackgroundEngine, Finished, QueueFull, Request, TokenEvent
from nanollama4.serve.schema import chat_prompt
from nanollama4.serve.server import bind
from tests.helpers import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "ROMEO.\nBut soft, what light through yonder window breaks?\n\nJULIET.\nAy me! USER ASSISTANT xyz qjk\n"
NAME = "tiny-test"
JSON = {"Content-Type": "application/json"}  # the server refuses bodies not declared as JSON (415)


@contextmanager
def running(engine: BackgroundEngine, name: str = NAME, app_options: dict | None = None, **config):
    """The app over `engine` on uvicorn, on a free local port, in a thread; yields its base URL."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, name, **(app_options or {})), log_level="warning",
                                           lifespan="off", **config))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _model(max_seq_len: int = 64, seed: int = 7):
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    cfg = nanollama4.preset("tiny", vocab_size=tok.vocab_size, max_seq_len=max_seq_len)
    model = nanollama4.build_model(cfg).eval()
    randomize_(model, seed=seed)
    return model, tok


@pytest.fixture(scope="module")
def served():
    """A tiny model (chunks of 8, top-2 of 4 experts) behind the real server, and an identical copy offline."""
    model, tok = _model()
    offline = copy.deepcopy(model)
    engine = BackgroundEngine(model, tok, max_batch=8, max_queue=8).start()
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield SimpleNamespace(url=url, engine=engine, client=client, offline=offline, tok=tok)
    engine.close(cancel=True, timeout=30)


# ---------------------------------------------------------------------------------------------- the API
def test_models_and_health(served):
    assert [m.id for m in served.client.models.list().data] == [NAME]
    health = httpx.get(f"{served.url}/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completion_equals_offline_generate_token_for_token(served, stream):
    prompt = "ROMEO.\nBut soft, what light"
    want = generate(served.offline, served.tok, prompt, 30, temperature=0)
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=30, temperature=0, logprobs=0)
    if stream:
        chunks = list(served.client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
    else:
        r = served.client.completions.create(**kwargs)
        text, tokens, usage = r.choices[0].text, r.choices[0].logprobs.tokens, r.usage
        assert r.choices[0].finish_reason == "length"
    assert text == want
    assert tokens == [served.tok.decode([i]) for i in served.tok.encode(want)]  # one token per character
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 30)


def test_eight_concurrent_seeded_requests_each_equal_their_offline_run(served, monkeypatch):
    runner = served.engine.runner
    decode = runner.decode

    def slowed(*args, **kwargs):  # 40 tokens take 80 ms or more: the staggered requests surely overlap
        time.sleep(0.002)
        return decode(*args, **kwargs)

    monkeypatch.setattr(runner, "decode", slowed)
    prompts = ["ROMEO.\n", "But soft", "what light", "JULIET.\nAy me", "yonder", "window breaks?", "Ay", "xyz"]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        stream = served.client.completions.create(model=NAME, prompt=prompts[i], max_tokens=40, temperature=0.9,
                                                  top_p=0.95, seed=100 + i, stream=True)
        results[i] = "".join(c.choices[0].text for c in stream)

    steps = served.engine.steps
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.01 * (t.ident % 3))  # joining a running batch at different steps
    for t in threads:
        t.join(120)
    assert served.engine.steps - steps < 8 * 39  # they did decode together
    for i, prompt in enumerate(prompts):
        want = generate(served.offline, served.tok, prompt, 40, temperature=0.9, top_p=0.95, seed=100 + i)
        assert results[i] == want, i


def test_chat_continues_the_documented_template_and_ends_at_a_blank_line(served):
    messages = [{"role": "system", "content": "ROMEO."}, {"role": "user", "content": "But soft"}]
    text = chat_prompt(messages)
    assert text == "ROMEO.\n\nUSER.\nBut soft\n\nASSISTANT.\n"
    want = generate(served.offline, served.tok, text, 64 - len(text), temperature=0.7, seed=3, stop=[END_OF_TURN])
    r = served.client.chat.completions.create(model=NAME, messages=messages, temperature=0.7, seed=3)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(served.client.chat.completions.create(model=NAME, messages=messages, temperature=0.7, seed=3,
                                                        stream=True, logprobs=True, top_logprobs=2))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    scored = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-6 for lp in scored)


def test_stop_strings_echo_and_logprobs(served):
    prompt = "But soft"
    full = generate(served.offline, served.tok, prompt, 20, temperature=0)
    stop = full[5:7]
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop],
                                         echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.text == prompt + full[:full.index(stop)]
    lp = choice.logprobs
    assert lp.tokens[:len(prompt)] == list(prompt) and lp.token_logprobs[0] is None
    assert lp.text_offset[:3] == [0, 1, 2]
    # the log-probabilities are the model's (temperature 1), checked against one offline pass
    ids = served.tok.encode(prompt + full[:len(lp.tokens) - len(prompt)])
    with torch.no_grad():
        logp = served.offline(torch.tensor([ids]))[0].float().log_softmax(-1)
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(float(logp[t - 1, ids[t]]), abs=1e-4)
        assert len(lp.top_logprobs[t]) == 3 and max(lp.top_logprobs[t].values()) == pytest.approx(
            float(logp[t - 1].max()), abs=1e-4)


def test_a_list_of_prompts_gets_one_choice_each(served):
    r = served.client.completions.create(model=NAME, prompt=["ROMEO.", "JULIET."], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [generate(served.offline, served.tok, p, 5, temperature=0)
                                           for p in ("ROMEO.", "JULIET.")]
    assert r.usage.completion_tokens == 10


# ---------------------------------------------------------------------------------------------- bad input
OK = {"model": NAME, "prompt": "But soft", "max_tokens": 4}
BAD = [
    ("malformed JSON", b'{"model": "tiny-test", "prompt": ', 400, None),
    ("not an object", b'["But soft"]', 400, None),
    ("unknown field", {**OK, "temprature": 0.5}, 400, "temprature"),
    ("wrong type", {**OK, "max_tokens": "4"}, 400, "max_tokens"),
    ("max_tokens 0", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {**OK, "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens huge", {**OK, "max_tokens": 10**12}, 400, "max_tokens"),
    ("temperature -1", {**OK, "temperature": -1}, 400, "temperature"),
    ("temperature NaN", b'{"model": "tiny-test", "prompt": "But soft", "temperature": NaN}', 400, "temperature"),
    ("temperature an integer past any float", {**OK, "temperature": 10**400}, 400, "temperature"),
    ("a lone surrogate as a key", b'{"model": "tiny-test", "prompt": "But soft", "\\ud800": 1}', 400, "\ud800"),
    ("a lone surrogate in the prompt", b'{"model": "tiny-test", "prompt": "But \\ud800"}', 400, "prompt"),
    ("a trace without a stream", {**OK, "nanollama4_trace": True}, 400, "nanollama4_trace"),
    ("more prompts than the server holds", {**OK, "prompt": ["But"] * 17}, 400, "prompt"),
    ("top_p 0", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p 2", {**OK, "top_p": 2}, 400, "top_p"),
    ("seed negative", {**OK, "seed": -1}, 400, "seed"),
    ("stream not a flag", {**OK, "stream": "yes"}, 400, "stream"),
    ("too many stops", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("over-long prompt", {**OK, "prompt": "a" * 70}, 400, "prompt"),
    ("prompt + max_tokens over the context", {**OK, "prompt": "a" * 40, "max_tokens": 30}, 400, "max_tokens"),
    ("unknown characters", {**OK, "prompt": "But soft \u263a"}, 400, "prompt"),
    ("empty prompt", {**OK, "prompt": ""}, 400, "prompt"),
    ("token ids outside the vocabulary", {**OK, "prompt": [1, 2, 999]}, 400, "prompt"),
    ("an unsupported setting", {**OK, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("another model", {**OK, "model": "gpt-4"}, 404, "model"),
    ("chat messages longer than the context", {"model": NAME, "messages": [{"role": "user", "content": "a" * 80}]},
     400, "messages"),
]


@pytest.mark.parametrize(("body", "status", "param"), [pytest.param(b, s, p, id=i) for i, b, s, p in BAD])
def test_bad_requests_get_the_apis_error_object_and_the_server_goes_on(served, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = "chat/completions" if isinstance(body, dict) and "messages" in body else "completions"
    r = httpx.post(f"{served.url}/v1/{path}", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["message"]
    if param:  # named in the message (a lone surrogate as its escape)
        assert param in error["message"] or param.encode("unicode_escape").decode() in error["message"]
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert served.client.completions.create(**OK).choices[0].finish_reason == "length"


@pytest.mark.parametrize(("field", "value"), [("temperature", 2.5), ("top_p", 0.0), ("min_p", 1.5), ("top_k", 0),
                                             ("seed", -1), ("repetition_penalty", 0),
                                             ("repetition_penalty", 1e-300)])  # was a 500: the logits overflowed
def test_the_api_refuses_a_sampling_value_with_the_limit_python_and_the_cli_use(served, field, value):
    """The error object's message is the Python API's SamplingError, word for word (tests/test_engine.py checks
    the command line prints it too)."""
    from nanollama4.engine import Sampling, SamplingError

    with pytest.raises(SamplingError) as e:
        Sampling(**{field: value})
    r = httpx.post(f"{served.url}/v1/completions", json={**OK, field: value})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"] == str(e.value)


def test_min_p_reaches_the_api(served):
    """min_p 1 keeps only the most likely token: sampled at temperature 1 the reply is the greedy one."""
    ask = dict(model=NAME, prompt="But soft", max_tokens=12)
    greedy = served.client.completions.create(**ask, temperature=0).choices[0].text
    got = served.client.completions.create(**ask, temperature=1, seed=3, extra_body={"min_p": 1.0}).choices[0].text
    assert got == greedy
    assert served.client.completions.create(**ask, temperature=1, seed=3).choices[0].text != greedy


def test_the_repetition_penalty_reaches_the_api(served):
    """A greedy reply with the penalty equals offline `generate` with it, and differs from one without."""
    ask = dict(model=NAME, prompt="But soft", max_tokens=24, temperature=0)
    got = served.client.completions.create(**ask, extra_body={"repetition_penalty": 1.8}).choices[0].text
    assert got == generate(served.offline, served.tok, "But soft", 24, temperature=0, repetition_penalty=1.8)
    assert got != served.client.completions.create(**ask).choices[0].text


def test_scoring_a_prompt_token_ids_a_tiny_temperature_and_the_model_card(served):
    """What scoring harnesses and other clients send: max_tokens 0 with echo and logprobs, a prompt of token
    ids longer than 64, a temperature too small to divide by."""
    prompt = "But soft, what light through yonder window"
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    ids = served.tok.encode(prompt)
    with torch.no_grad():
        logp = served.offline(torch.tensor([ids]))[0].float().log_softmax(-1)
    got = r.choices[0].logprobs.token_logprobs
    assert r.choices[0].text == prompt and got[0] is None and r.usage.completion_tokens == 0
    assert got[1:] == pytest.approx([float(logp[t - 1, ids[t]]) for t in range(1, len(ids))], abs=1e-4)
    long_ids = served.tok.encode("But soft, what light " * 3)[:63]
    r = served.client.completions.create(model=NAME, prompt=long_ids, max_tokens=1, temperature=0)
    assert r.choices[0].text == generate(served.offline, served.tok, served.tok.decode(long_ids), 1, temperature=0)
    r = served.client.completions.create(model=NAME, prompt="But soft", max_tokens=10, temperature=1e-300)
    assert r.choices[0].text == generate(served.offline, served.tok, "But soft", 10, temperature=0)
    assert served.client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("gpt-4")


def test_the_openai_client_raises_on_a_bad_field(served):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        served.client.completions.create(model=NAME, prompt="But soft", top_p=0)
    with pytest.raises(openai.BadRequestError, match="not in the vocabulary.*replace_unknown"):
        served.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "\u00e9t\u00e9"}])
    # what the 400 advises, an HTTP client can send: the replacement as a request field
    r = served.client.completions.create(model=NAME, prompt="\u00e9t\u00e9", max_tokens=3, temperature=0,
                                         extra_body={"replace_unknown": "t"})
    assert r.choices[0].text == generate(served.offline, served.tok, "ttt", 3, temperature=0)
    with pytest.raises(openai.BadRequestError, match="replace_unknown"):
        served.client.completions.create(model=NAME, prompt="\u00e9", extra_body={"replace_unknown": "\u00e9"})
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="other", prompt="But soft")


def test_a_full_queue_is_429_with_retry_after_and_the_server_recovers():
    model, tok = _model()
    engine = BackgroundEngine(model, tok, max_batch=1, max_queue=1)  # not started: requests wait
    with running(engine) as url:
        ok = json.dumps(OK).encode()
        with httpx.Client(timeout=60) as http:
            waiting = [http.stream("POST", f"{url}/v1/completions", content=json.dumps({**OK, "stream": True}),
                                   headers=JSON)
                       for _ in range(2)]
            responses = [w.__enter__() for w in waiting]  # a free row and the one queue place
            assert [r.status_code for r in responses] == [200, 200]
            r = http.post(f"{url}/v1/completions", content=ok, headers=JSON)
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert http.get(f"{url}/health").json()["waiting"] == 2
            engine.start()
            for response, w in zip(responses, waiting, strict=True):
                assert response.read().decode().endswith("data: [DONE]\n\n")
                w.__exit__(None, None, None)
            assert http.post(f"{url}/v1/completions", content=ok, headers=JSON).status_code == 200
    engine.close(cancel=True, timeout=30)


def test_a_closing_server_answers_503_and_says_so_on_health():
    model, tok = _model()
    engine = BackgroundEngine(model, tok, max_batch=2, max_queue=2).start()
    with running(engine) as url:
        engine.stop_accepting()
        r = httpx.post(f"{url}/v1/completions", json=OK)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "closing"
    engine.close(timeout=30)


def test_clients_that_hang_up_free_their_rows_at_once():
    """8 streams dropped after their first token leave the batch; a new request then completes at once."""
    model, tok = _model(max_seq_len=2048)
    engine = BackgroundEngine(model, tok, max_batch=8, max_queue=0).start()
    with running(engine) as url, httpx.Client(timeout=60) as http:
        body = json.dumps({**OK, "max_tokens": 2000, "stream": True})
        with ExitStack() as streams:
            lines = []  # kept: an httpx line iterator closes its response when it is collected
            for _ in range(8):
                response = streams.enter_context(http.stream("POST", f"{url}/v1/completions", content=body,
                                                             headers=JSON))
                lines.append(response.iter_lines())
                next(lines[-1])  # its first token has arrived
            deadline = time.time() + 10  # (sent from its prefill, just before it takes its row)
            while engine.busy != (8, 0) and time.time() < deadline:
                time.sleep(0.01)
            assert engine.busy == (8, 0) and not engine.finished
        # all 8 hung up
        deadline = time.time() + 10
        while (engine.busy != (0, 0) or engine.finished["cancelled"] < 8) and time.time() < deadline:
            time.sleep(0.01)
        assert engine.busy == (0, 0) and engine.finished == {"cancelled": 8}
        started = time.time()
        r = http.post(f"{url}/v1/completions", content=json.dumps({**OK, "max_tokens": 8}),
                      headers=JSON)  # max_queue 0: a free row
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert time.time() - started < 5
    engine.close(cancel=True, timeout=30)


# ---------------------------------------------------------------------------------------------- the engine alone
def _reads(stream: bool, interval: float, script: list[tuple[float, str]]) -> list[tuple[float, list[str]]]:
    """When and in which batches the loop reads a `Session`'s events that an engine thread emits by `script`
    (seconds to sleep first, then a token's text, or "end")."""
    from nanollama4.engine.sampling import Sampling
    from nanollama4.serve.api import Session
    from nanollama4.serve.schema import Params

    params = Params(prompts=[[1, 2]], prompt_texts=["ab"], max_tokens=8, sampling=Sampling(), stream=stream,
                    include_usage=False, logprobs=None, echo=False, trace=False)

    async def run() -> list[tuple[float, list[str]]]:
        session = Session(SimpleNamespace(), params, interval)
        emit = session.requests[0].emit
        loop = asyncio.get_running_loop()

        def engine() -> None:
            for i, (pause, text) in enumerate(script):
                time.sleep(pause)
                emit(Finished("length", "", 2, i) if text == "end" else TokenEvent(i, text))

        start = loop.time()
        thread = threading.Thread(target=engine)
        thread.start()
        reads = [(loop.time() - start, [e.text if isinstance(e, TokenEvent) else "end" for _, e in batch])
                 async for batch in session.batches()]
        thread.join()
        return reads

    return asyncio.run(run())


def test_a_fast_stream_is_read_in_batches_never_an_interval_late_and_its_end_at_once():
    """A stream's first token is read at once; tokens that come within the interval of the last read wait and
    are read together, at most the interval later even when nothing follows them; the end is read at once."""
    fast = _reads(True, 0.4, [(0, "0"), (0.01, "1"), (0.01, "2"), (0.01, "3"), (0.01, "end")])
    assert fast[0][1] == ["0"] and fast[0][0] < 0.25
    assert [texts for _, texts in fast[1:]] == [["1", "2", "3", "end"]] and fast[1][0] < 0.25  # (not 0.4)
    paused = _reads(True, 0.3, [(0, "0"), (0.01, "1"), (0.9, "end")])  # "1" then nothing for 0.9 s
    assert [texts for _, texts in paused] == [["0"], ["1"], ["end"]]
    assert 0.25 < paused[1][0] < 0.6 and paused[2][0] > 0.85
    each = _reads(True, 0.0, [(0, "0"), (0.05, "1"), (0.05, "end")])  # no interval: a read per token
    assert [texts for _, texts in each] == [["0"], ["1"], ["end"]]


def test_a_whole_answer_is_read_once_at_its_end():
    reads = _reads(False, 0.4, [(0, "0"), (0.01, "1"), (0.01, "2"), (0.01, "end")])
    assert [texts for _, texts in reads] == [["0", "1", "2", "end"]] and reads[0][0] < 0.25


def test_the_engine_refuses_past_its_queue_and_admits_in_order():
    model, tok = _model()
    engine = BackgroundEngine(model, tok, max_batch=2, max_queue=1)
    events: list = []
    requests = [Request(tok.encode("But"), 3, nanollama4.Sampling(temperature=0), events.append) for _ in range(3)]
    engine.submit_all(requests)
    with pytest.raises(QueueFull):
        engine.submit(Request(tok.encode("But"), 3, nanollama4.Sampling(temperature=0), events.append))
    engine.step([engine.scheduler.waiting.popleft(), engine.scheduler.waiting.popleft()])
    assert len(engine.rows) == 2 and len(engine.scheduler.waiting) == 1
    while engine.rows:
        engine.step()
    ends = [e for e in events if isinstance(e, Finished)]
    assert [e.reason for e in ends] == ["length", "length"]
    assert sum(isinstance(e, TokenEvent) for e in events) == 6


def test_a_traced_step_is_the_step_that_ran(served):
    """The page's data: each token's route and the odds after it, from the batched step itself; greedy, so
    they must be those `explain --generate` records one pass at a time."""
    from nanollama4.explain import trace_generation

    prompt = "But soft, what"
    r = httpx.post(f"{served.url}/v1/completions", json={**OK, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                         "stream": True, "nanollama4_trace": True}, timeout=60)
    steps = [json.loads(line[6:])["choices"][0]["nanollama4"] for line in r.text.splitlines()
             if line.startswith("data: {") and '"nanollama4"' in line]
    offline = trace_generation(served.offline, served.tok, prompt, 12)
    assert [s["token"] for s in steps] == [o.chosen for o in offline]
    assert [p["token"] for p in steps[0]["step"]["prompt"]] == list(prompt)
    for mine, theirs in zip(steps, offline, strict=True):
        step = mine["step"]
        assert step["position"] == theirs.positions[1]
        routes = [r for r in theirs.routes if r is not None]
        assert [[e for e in r["experts"]] for r in step["routes"]] == [[e for e, _ in route] for route in routes]
        for r, route in zip(step["routes"], routes, strict=True):
            assert r["weights"] == pytest.approx([w for _, w in route], abs=1e-3)
        assert step["odds"][0][0] == theirs.next_tokens[0][0]
        assert step["odds"][0][1] == pytest.approx(theirs.next_tokens[0][1], abs=1e-3)
        attn = {a["layer"]: a for a in step["attention"]}
        assert all(math.isclose(sum(p for _, p in a["keys"]), 1.0, abs_tol=0.05) for a in attn.values())
        chunked = [a for a in attn.values() if a["chunk"]]
        assert all(min(k for k, _ in a["keys"]) >= step["position"] // a["chunk"] * a["chunk"] for a in chunked)


# ---------------------------------------------------------------------------------------------- the page
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-headless-shell")


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium here (.ci/run installs Debian's chromium)")
def test_the_page_streams_tokens_and_shows_a_clicked_tokens_route(served, tmp_path):
    from playwright.sync_api import sync_playwright

    prompt = "But soft, what"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(served.url + "/")
        page.fill("#prompt", prompt)
        page.fill("#max_tokens", "20")
        page.fill("#temperature", "0")
        page.click("#generate")
        page.wait_for_selector("body[data-state=done]", timeout=60_000)
        generated = page.locator(".tok.gen")
        assert generated.count() == 20
        want = generate(served.offline, served.tok, prompt, 20, temperature=0)
        assert "".join(generated.all_inner_texts()) == want
        assert "finish_reason: length" in page.inner_text("#status")
        generated.nth(2).click()
        routes = page.locator("#routes .route")
        moe_layers = [i for i in range(served.offline.cfg.n_layers) if served.offline.cfg.is_moe(i)]
        assert [int(x) for x in routes.evaluate_all("rs => rs.map(r => r.dataset.layer)")] == moe_layers
        assert routes.nth(0).locator(".slot").count() == served.offline.cfg.experts_per_token
        token_routes = page.evaluate(f"window.nanollama4.tokens[{len(prompt) + 2}].routes")
        shown = routes.nth(0).inner_text()
        assert all(f"expert {e} ({w:.2f})" in shown  # the terminal's notation for a slot
                   for e, w in zip(token_routes[0]["experts"], token_routes[0]["weights"], strict=True))
        assert page.locator("#odds .bar").count() == 8 and page.locator("#attention .attn").count() == 4
        assert page.locator("#odds .chosen").first.inner_text().strip("\u201c\u201d") == want[3]
        page.screenshot(path=str(tmp_path / "page.png"))
        browser.close()
    assert errors == []


# ---------------------------------------------------------------------------------------------- the command
def test_serve_command_logs_each_request_and_exits_0_on_sigterm(tiny_run, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # each decode step made 20 ms slower, so the streamed request is surely still decoding at the signal
    slow_server = ("import sys, time\n"
                   "from nanollama4.cli import main\n"
                   "from nanollama4.engine.runner import Runner\n"
                   "decode = Runner.decode\n"
                   "def slow(self, *args, **kwargs):\n"
                   "    time.sleep(0.02)\n"
                   "    return decode(self, *args, **kwargs)\n"
                   "Runner.decode = slow\n"
                   "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.Popen([sys.executable, "-c", slow_server, "serve", str(tiny_run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", line)[0]
        name = Path(tiny_run).name
        body = {"model": name, "prompt": "the cat", "max_tokens": 20, "temperature": 0}
        with httpx.Client(timeout=60) as http:
            assert http.post(f"{url}/v1/completions", json=body).status_code == 200
            with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
                lines = response.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)  # mid-stream: the stream still ends properly
                rest = list(lines)
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert len(re.findall(r"req-\d+ length: 7 prompt \+ 20 new tokens in [0-9.]+ s", err)) == 2, err
    # the streamed request was still in flight at the signal and finished after it
    stopping = re.search(r"stopping: new requests get 503; (\d+) in flight", err)
    assert stopping and stopping[1] == "1", err
    assert re.search(r"req-\d+ length: 7 prompt \+ 20 new tokens", err[stopping.end():]), err
    assert "Traceback" not in err


def test_serve_refuses_a_port_in_use_in_one_line(tiny_run, capsys):
    from tests.helpers import assert_cli_error, run_cli

    sock = bind("127.0.0.1", 0)
    try:
        rc, _, err = run_cli(["serve", str(tiny_run), "--port", str(sock.getsockname()[1])], capsys)
        assert "pick another --port" in assert_cli_error(rc, err, "serve")
    finally:
        sock.close()


# ---------------------------------------------------------------------------------------------- who may use it
def test_a_page_reaching_the_server_by_another_name_is_refused(served):
    """DNS rebinding: a page whose own name now points at 127.0.0.1 sends its name as Host."""
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        r = httpx.post(f"{served.url}/v1/completions", json=OK, headers={"Host": host})
        assert r.status_code == 400, (host, r.text)
        error = r.json()["error"]
        assert error["param"] == "host" and "--allowed-host" in error["message"] and repr(host) in error["message"]
    port = served.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST"):
        assert httpx.get(f"{served.url}/health", headers={"Host": host}).status_code == 200, host


def test_an_allowed_host_is_answered():
    from nanollama4.serve.guard import HostRule

    model, tok = _model()
    engine = BackgroundEngine(model, tok, max_batch=1, max_queue=1).start()
    with running(engine, app_options={"hosts": HostRule("127.0.0.1", ["my-box.lan"])}) as url:
        assert httpx.post(f"{url}/v1/completions", json=OK, headers={"Host": "my-box.lan:80"}).status_code == 200
        assert httpx.get(f"{url}/health", headers={"Host": "other.lan"}).status_code == 400
    engine.close(cancel=True, timeout=30)
    wide = HostRule("0.0.0.0")
    assert wide.allows("192.168.1.20:8000") and wide.allows("[fe80::1]:8000") and not wide.allows("evil.example")


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x", None])
def test_a_body_not_declared_as_json_is_415(served, kind):
    """A web page may POST text/plain or a form to any site without a preflight; JSON it may not."""
    headers = {"Content-Type": kind} if kind else {}
    r = httpx.post(f"{served.url}/v1/completions", content=json.dumps(OK), headers=headers)
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
    assert served.engine.busy == (0, 0)
    r = httpx.post(f"{served.url}/v1/completions", content=json.dumps(OK),
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_a_foreign_origin_is_refused_and_only_an_allowed_one_gets_cors(served):
    for origin in ("http://evil.example", "null", "http://localhost:3000"):
        r = httpx.post(f"{served.url}/v1/completions", json=OK, headers={"Origin": origin})
        assert r.status_code == 403 and "--allow-origin" in r.json()["error"]["message"], origin
        assert "access-control-allow-origin" not in r.headers
        pre = httpx.options(f"{served.url}/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    r = httpx.post(f"{served.url}/v1/completions", json=OK, headers={"Origin": served.url})  # its own page
    assert r.status_code == 200

    model, tok = _model()
    engine = BackgroundEngine(model, tok, max_batch=1, max_queue=1).start()
    with running(engine, app_options={"origins": ["http://localhost:3000"]}) as url:
        pre = httpx.options(f"{url}/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "content-type" in pre.headers["access-control-allow-headers"]
        r = httpx.post(f"{url}/v1/completions", json=OK, headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert httpx.post(f"{url}/v1/completions", json=OK, headers={"Origin": "http://evil.example"}
                          ).status_code == 403
    engine.close(cancel=True, timeout=30)


def test_half_sent_requests_are_closed_in_bounded_time_and_connections_are_bounded():
    """Idle connections that never finish their request used to be held forever: ~1,000 of them exhausted
    the descriptors and /health stopped answering."""
    import socket

    from nanollama4.serve.guard import guarded_protocol

    model, tok = _model()
    engine = BackgroundEngine(model, tok, max_batch=1, max_queue=1).start()
    with running(engine, http=guarded_protocol(request_timeout=1.0, max_connections=24)) as url:
        port = int(url.rsplit(":", 1)[1])
        stalled = []
        for i in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" if i % 2 else
                      b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")  # half the headers, or half the body
            stalled.append(s)
        started = time.time()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # answered beside them
        extra = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]  # past the bound
        answers = []
        for s in extra:
            s.settimeout(5)
            answers.append(s.recv(200))
        assert sum(a.startswith(b"HTTP/1.1 503") for a in answers) >= 4, answers  # refused at once, not queued
        for s in stalled:
            s.settimeout(10)
            while s.recv(4096):  # whatever comes, then the end: the server closed it
                pass
        assert time.time() - started < 8
        for s in stalled + extra:
            s.close()
        assert httpx.post(f"{url}/v1/completions", json=OK, timeout=30).status_code == 200
    engine.close(cancel=True, timeout=30)


def _until_closed(sock, limit: float) -> tuple[bytes, float | None]:
    """What the server sends on `sock` until it closes it: (bytes, seconds it took), or None for the seconds
    when it is still open after `limit`."""
    started, data = time.time(), b""
    while time.time() - started < limit:
        sock.settimeout(max(0.01, limit - (time.time() - started)))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            break
        if not chunk:
            return data, time.time() - started
        data += chunk
    return data, None


def test_a_pipelined_request_has_the_same_deadline_as_any():
    """A whole GET and the start of a second request in one packet: the second was parsed from the buffer once
    the first was answered, with no new data to arm its deadline, so it held the connection for good (530
    such connections and /health answered 503 until restarted)."""
    import socket

    from nanollama4.serve.guard import guarded_protocol

    model, tok = _model()
    engine = BackgroundEngine(model, tok, max_batch=1, max_queue=1).start()
    with running(engine, http=guarded_protocol(request_timeout=1.0, max_connections=24)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                      b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"pro")
            answer, took = _until_closed(s, limit=6)
        assert answer.startswith(b"HTTP/1.1 200") and b'"status"' in answer, answer  # the first one is answered
        assert took is not None and took < 4, took  # the second one's 1 s ran out: closed
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    engine.close(cancel=True, timeout=30)


def test_a_bracketed_host_is_an_address_and_a_port_and_nothing_else(served):
    from nanollama4.serve.guard import HostRule

    local, wide = HostRule("127.0.0.1"), HostRule("0.0.0.0")
    for header in ("[::1]evil.example", "[::1].evil.example", "[::1]:8000evil", "[::1]:evil.example", "[::1"):
        assert not local.allows(header) and not wide.allows(header), header
    assert local.allows("[::1]") and local.allows("[::1]:8000") and wide.allows("[fe80::1]:8000")
    r = httpx.get(f"{served.url}/health", headers={"Host": "[::1]evil.example"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "host", r.text


def test_a_repeated_host_origin_or_content_type_is_refused():
    """With repeats the last copy won: an evil Origin followed by the server's own passed, and so did text/plain
    followed by application/json."""
    import socket

    from nanollama4.serve.guard import guarded_protocol

    model, tok = _model()
    engine = BackgroundEngine(model, tok, max_batch=1, max_queue=1).start()
    with running(engine, http=guarded_protocol(request_timeout=5.0, max_connections=24)) as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps(OK).encode()
        here = f"127.0.0.1:{port}".encode()
        repeats = {"host": [b"Host: evil.example", b"Host: " + here, b"Content-Type: application/json"],
                   "origin": [b"Host: " + here, b"Origin: http://evil.example", b"Origin: http://" + here,
                              b"Content-Type: application/json"],
                   "content-type": [b"Host: " + here, b"Content-Type: text/plain", b"Content-Type: application/json"]}
        for param, headers in repeats.items():
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\n" + b"\r\n".join(headers) +
                          b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
                answer, _ = _until_closed(s, limit=10)
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400"), (param, answer)
            error = json.loads(payload)["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (param, error)
        assert engine.finished.total() == 0  # none of them ran
        r = httpx.post(f"{url}/v1/completions", content=body, headers=[("Origin", "http://evil.example"),
                                                                       ("Origin", url), *JSON.items()])
        assert r.status_code == 400 and r.json()["error"]["message"] == ("the Origin header is sent 2 times; a "
                                                                         "request may send it once")
        assert httpx.post(f"{url}/v1/completions", content=body, headers=JSON).status_code == 200
    engine.close(cancel=True, timeout=30)


def _refuses_to_serve(**options) -> str:
    """The one-line ConfigError `serve(**options)` raises before it listens."""
    from nanollama4.base.errors import ConfigError
    from nanollama4.serve.server import serve

    def listening(line: str) -> None:
        raise AssertionError(f"it served: {line}")

    model, tok = _model()
    with pytest.raises(ConfigError) as e:
        serve(model, tok, NAME, port=0, announce=listening, **options)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_allowed_origin_must_be_an_origin_and_never_star():
    from nanollama4.serve.guard import check_origin

    assert _refuses_to_serve(allow_origins=["http://localhost:3000", "*"]) == (
        "--allow-origin '*' would let every web page the user opens use the server; name the page's origin "
        "instead (e.g. --allow-origin http://localhost:3000)")
    for bad in ("localhost:3000", "ftp://example.org", "http://example.org/app", "http://example.org:port",
                "http://", "null", "http://example.org?x", "http://user@example.org", "http://example.org:",
                "http://[::1", "http://local host"):
        assert _refuses_to_serve(allow_origins=[bad]) == (
            f"--allow-origin {bad!r} is not an origin: give scheme://host[:port], with scheme http or https and no "
            "path (e.g. http://localhost:3000)")
    assert [check_origin(o) for o in ("HTTP://LocalHost:3000/", "https://example.org", "http://[::1]:8080")] == [
        "http://localhost:3000", "https://example.org", "http://[::1]:8080"]


def test_a_max_context_above_the_models_is_refused_in_one_line():
    """The engine cut it down to the model's max_seq_len without a word."""
    assert _refuses_to_serve(max_context=99999999999) == (
        "--max-context 99999999999 is more than this model can use; the largest accepted is its max_seq_len, 64")


def test_a_cache_that_cannot_fit_is_one_line_and_max_context_bounds_it(tmp_path, capsys):
    """A run whose max_seq_len is 2^27 (within the config's bounds) allocated every KV slot up front: a
    256 GiB allocation traceback."""
    from nanollama4.base.errors import ConfigError

    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    cfg = nanollama4.preset("tiny", vocab_size=tok.vocab_size, max_seq_len=2**27)
    model = nanollama4.build_model(cfg).eval()
    with pytest.raises(ConfigError, match=r"^the KV cache for 16 rows of 134,217,728 tokens needs [\d,.]+ GiB and "
                                          r"[\d,.]+ GiB is free; pass --max-context [\d,]+ or less \(or a smaller "
                                          r"--max-batch\)$"):
        BackgroundEngine(model, tok, max_batch=16)
    engine = BackgroundEngine(model, tok, max_batch=2, max_context=128).start()
    with running(engine) as url:
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["max_model_len"] == 128
        r = httpx.post(f"{url}/v1/completions", json={**OK, "max_tokens": 200})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert httpx.post(f"{url}/v1/completions", json=OK).status_code == 200
    engine.close(cancel=True, timeout=30)


def test_a_padded_vocabulary_is_served_and_generated_without_its_padding():
    """A model whose vocabulary is larger than its tokenizer's (padded reference checkpoints): one traced
    request ended every stream in the batch with "generation failed: IndexError", scoring a prompt was a
    500, a streamed request with logprobs stopped with no error and no [DONE], and generate failed. Here the
    padding ids are made the most likely ones, so any of them sampled or shown would show."""
    tok = CharTokenizer.from_text(TEXT)
    V = tok.vocab_size
    torch.manual_seed(0)
    model = nanollama4.build_model(nanollama4.preset("tiny", vocab_size=V + 20, max_seq_len=64)).eval()
    randomize_(model, seed=7)
    model.lm_head.register_forward_hook(lambda m, i, out: torch.cat([out[..., :V], out[..., V:] + 100.0], -1))
    text = generate(model, tok, "But soft", max_new_tokens=12, temperature=0)
    assert len(text) == 12
    assert "".join(nanollama4.engine.generation.stream(model, tok, "But soft", max_new_tokens=12, temperature=0.9,
                                                seed=1))
    engine = BackgroundEngine(model, tok, max_batch=8, max_queue=8).start()
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        results = {}

        def call(name, **kw):
            results[name] = client.completions.create(model=NAME, prompt="But soft", **kw)

        def streamed():
            chunks = list(client.completions.create(model=NAME, prompt="But soft", max_tokens=10, stream=True,
                                                    logprobs=3, temperature=0.8, seed=3))
            results["streamed"] = chunks

        def traced():
            r = httpx.post(f"{url}/v1/completions", json={**OK, "max_tokens": 10, "nanollama4_trace": True,
                                                          "stream": True}, timeout=60)
            results["traced"] = r

        threads = [threading.Thread(target=traced), threading.Thread(target=streamed),
                   threading.Thread(target=call, args=("plain",), kwargs={"max_tokens": 10, "temperature": 0}),
                   threading.Thread(target=call, args=("sampled",), kwargs={"max_tokens": 10, "temperature": 1.0,
                                                                            "seed": 5}),
                   threading.Thread(target=call, args=("scored",), kwargs={"max_tokens": 0, "echo": True,
                                                                           "logprobs": 2})]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["plain"].choices[0].text == text[:10]
        assert results["plain"].choices[0].finish_reason == "length"
        assert len(results["sampled"].choices[0].text) == 10
        scored = results["scored"].choices[0].logprobs
        assert scored.tokens == list("But soft") and all(len(t) == 2 for t in scored.top_logprobs[1:])
        assert results["streamed"][-1].choices[0].finish_reason == "length" or \
            results["streamed"][-2].choices[0].finish_reason == "length"
        assert results["traced"].status_code == 200 and results["traced"].text.rstrip().endswith("data: [DONE]")
        assert "error" not in results["traced"].text
        assert engine.finished.get("error", 0) == 0
    engine.close(cancel=True, timeout=30)


def test_byte_level_tokens_carry_their_own_bytes_and_alternatives_do_not_collide():
    """Every byte token of a byte-level BPE reported token "\ufffd" with the same bytes, and the completions'
    top_logprobs keys collided, so fewer alternatives came back than asked."""
    from nanollama4.model.tokenizer import BPETokenizer

    tok = BPETokenizer.train("naïve café — déjà vu, 東京 ✓ " * 40, vocab_size=300)
    torch.manual_seed(0)
    model = nanollama4.build_model(nanollama4.preset("tiny", vocab_size=tok.vocab_size, max_seq_len=64)).eval()
    randomize_(model, seed=3)
    engine = BackgroundEngine(model, tok, max_batch=2, max_queue=2).start()
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create(model=NAME, prompt="café", max_tokens=20, temperature=0, logprobs=5)
        tops = done.choices[0].logprobs.top_logprobs
        assert all(len(top) == 5 for top in tops), [len(t) for t in tops]
        labels = [label for top in tops for label in top]
        assert any(label.startswith("bytes:\\x") for label in labels)  # pieces of characters were among them
        chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "déjà"}],
                                              max_tokens=20, temperature=0, logprobs=True, top_logprobs=5)
        for entry in chat.choices[0].logprobs.content:
            for item in (entry, *entry.top_logprobs):
                raw = bytes(item.bytes)
                assert item.token == (raw.decode("utf-8") if not item.token.startswith("bytes:") else
                                      "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
            assert len({bytes(t.bytes) for t in entry.top_logprobs}) == 5
    engine.close(cancel=True, timeout=30)


def test_a_client_that_hangs_up_mid_body_is_one_log_line(served, caplog):
    """Each such client wrote a 30-line "Exception in ASGI application" traceback to the log."""
    import logging
    import socket

    caplog.set_level(logging.INFO)
    port = int(served.url.rsplit(":", 1)[1])
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")
            time.sleep(0.2)
    deadline = time.time() + 10
    while caplog.text.count("the client left before its request arrived whole") < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert caplog.text.count("the client left before its request arrived whole") == 3, caplog.text
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_a_clients_text_reaches_the_log_escaped_and_bounded(served, caplog):
    """A 100 KB model name made a 100 KB log line; a control character a client or a checkpoint wrote
    (a screen clear, a newline that forges a line of the log, a bidi override) reached the terminal raw."""
    import logging

    from nanollama4.serve.engine import log

    caplog.set_level(logging.INFO)
    r = httpx.post(f"{served.url}/v1/completions", json={**OK, "model": "m" * 100_000}, timeout=60)
    assert r.status_code == 404
    line = next(rec.getMessage() for rec in caplog.records if "404 the model" in rec.getMessage())
    assert len(line) < 2100 and line.endswith("more characters cut)")
    log.info("from a client: %s", "hi\x1b[2J\n2026-01-01 nanollama4.serve: forged\u202e\ud800")
    line = caplog.records[-1].getMessage()
    assert line == "from a client: hi\\x1b[2J\\n2026-01-01 nanollama4.serve: forged\\u202e\\ud800"
    caplog.records[-1].getMessage().encode()  # a lone surrogate could not even be written


def test_a_traced_step_carries_the_distribution_it_was_sampled_from(served):
    """Beside the temperature-1 odds, each listed token's probability after the request's temperature and
    top-k, and the chosen token's under both: top_k 3 leaves the other listed tokens at 0."""
    r = httpx.post(f"{served.url}/v1/completions", json={**OK, "prompt": "But soft", "max_tokens": 6,
                                                         "temperature": 0.7, "top_k": 3, "seed": 4, "stream": True,
                                                         "nanollama4_trace": True}, timeout=60)
    steps = [json.loads(line[6:])["choices"][0]["nanollama4"]["step"] for line in r.text.splitlines()
             if line.startswith("data: {") and '"nanollama4"' in line]
    assert len(steps) == 6
    for step in steps:
        t1 = [p for _, p, _ in step["odds"]]
        sampled = [s for _, _, s in step["odds"]]
        assert t1 == sorted(t1, reverse=True) and all(s == 0 for s in sampled[3:])
        assert sum(sampled[:3]) == pytest.approx(1.0, abs=1e-5) and sampled[0] > t1[0]  # sharpened, renormalised
        chosen = [s for text, _, s in step["odds"] if text == step["chosen"]]
        assert step["chosen_odds"][1] > 0 and chosen == [pytest.approx(step["chosen_odds"][1])]
