"""The request bodies of `nanollama4 serve` are read from `Sampling`: a setting added there is a field of both
endpoints, typed as JSON, checked by Sampling's own limits and passed through, with nothing edited in serve/.
No model here: a request is only read and checked, against a tokenizer and the engine's sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from nanollama4.engine.sampling import Sampling, SamplingError
from nanollama4.model.tokenizer import CharTokenizer
from nanollama4.serve.chat import PlayFormat
from nanollama4.serve.schema import BODIES, ApiError, json_type, parse_request, request_bodies

NAME = "tiny-test"
ENGINE = SimpleNamespace(tokenizer=CharTokenizer.from_text("But soft, what light USER ASSISTANT.\n"), context=64,
                         max_batch=2, max_queue=2)
ASK = {"completions": {"model": NAME, "prompt": "But soft", "max_tokens": 4},
       "chat": {"model": NAME, "messages": [{"role": "user", "content": "But soft"}], "max_tokens": 4}}


@dataclass(frozen=True)
class Wider(Sampling):
    """Sampling with one setting more, as a contributor would add it: its type, its default, its own check."""

    typical_p: float | None = None  # > 0; 1 = no filter

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.typical_p is not None and not self.typical_p > 0:
            raise SamplingError("typical_p",
                                f"typical_p ({self.typical_p!r}) must be a positive number")


def refusal(body: dict, kind: str, bodies: dict = BODIES) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(body, bodies[kind], ENGINE, NAME)
    return e.value


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_field_added_to_sampling_is_a_json_field_of_both_bodies_checked_and_passed_through(kind):
    wider = request_bodies(Wider)
    assert "typical_p" in wider[kind].model_fields and "typical_p" not in BODIES[kind].model_fields
    for value in (0.9, 1):  # JSON's 2 is a number too
        params = parse_request({**ASK[kind], "typical_p": value}, wider[kind], ENGINE, NAME)
        assert type(params.sampling) is Wider and params.sampling.typical_p == value
    assert parse_request({**ASK[kind], "typical_p": None}, wider[kind], ENGINE, NAME
                         ).sampling.typical_p is None

    for wrong in ("high", True, [0.9]):
        error = refusal({**ASK[kind], "typical_p": wrong}, kind, wider)
        assert (error.status, error.param) == (400, "typical_p")
        assert error.message.startswith("typical_p (") and error.message.endswith(") must be a number")

    with pytest.raises(SamplingError) as own:
        Wider(typical_p=0)
    error = refusal({**ASK[kind], "typical_p": 0}, kind, wider)
    assert (error.status, error.param, error.message) == (400, "typical_p", str(own.value))

    error = refusal({**ASK[kind], "typical_p": 0.9}, kind)  # the real bodies do not know it
    assert error.param == "typical_p" and error.message.startswith("unknown field 'typical_p'")


def test_every_sampling_field_but_stop_ids_is_a_field_of_both_bodies():
    names = {f.name for f in dataclasses.fields(Sampling)} - {"stop_ids"}
    for body in BODIES.values():
        assert names <= set(body.model_fields) and "stop_ids" not in body.model_fields
        assert body.SAMPLING is Sampling


def test_the_apis_own_spellings_of_sampling_fields():
    """OpenAI's `stop` (a string or a list, plus a chat's end of turn), vLLM's `top_k` -1, and `stop_ids`
    only from the chat format."""
    got = parse_request({**ASK["completions"], "stop": "soft", "top_k": -1, "temperature": 0}, BODIES["completions"],
                        ENGINE, NAME).sampling
    assert got == Sampling(temperature=0, stop=("soft",))
    chat = PlayFormat()
    got = parse_request({**ASK["chat"], "stop": ["a", "b"], "top_k": 3}, BODIES["chat"], ENGINE, NAME, chat).sampling
    assert got.stop == ("a", "b", *chat.stop) and got.stop_ids == tuple(chat.stop_ids) and got.top_k == 3
    assert refusal({**ASK["completions"], "stop_ids": [1]}, "completions").param == "stop_ids"
    assert refusal({**ASK["completions"], "stop": ["a"] * 5}, "completions").param == "stop"


def test_an_unknown_field_is_named_before_any_wrong_value():
    """pydantic lists unknown fields after the fields it knows; a misspelt field is what the client most needs
    to hear about, and a key that is not text (a lone surrogate) pydantic cannot name at all."""
    error = refusal({**ASK["completions"], "temperature": "hot", "zz": 1, "aa": 2}, "completions")
    assert error.param == "aa" and error.message.startswith("unknown field 'aa'; this server accepts: best_of, ")
    assert refusal({**ASK["completions"], "\ud800": 1}, "completions").param == "\ud800"
    error = refusal({**ASK["completions"], "temperature": "hot"}, "completions")
    assert (error.param, error.message) == ("temperature", 'temperature ("hot") must be a number')


def test_a_sampling_type_without_a_json_spelling_is_a_clear_error_at_import():
    with pytest.raises(TypeError, match="no JSON type for"):
        json_type(dict[str, float])
