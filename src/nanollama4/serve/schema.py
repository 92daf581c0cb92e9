"""What a request to `nanollama4 serve` may say: the bodies of OpenAI's completions and chat completions,
their checking into `Params`, and the API's error object for whatever is wrong.

The sampling fields are not written here: `request_bodies` reads them from `Sampling` (its fields and
their types), so a setting added there is a field of both bodies with nothing to edit here, and its
limits stay `Sampling`'s own (a bad value is answered with its SamplingError's message, naming the
field). The API spells three of them its own way, each said once below: `stop` (a string or a list, at
most four, plus the chat format's own), `top_k` (-1 means every token) and `stop_ids` (the chat format's
end-of-turn ids, never a client's). JSON types are pydantic's to check, unknown fields included
(extra="forbid"); `read_body` turns its first complaint into the API's error object.

Just over 400 lines: the bodies, their checking and the error object are one contract with the client,
read together when a field is added or a message is changed.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.responses import Response

from ..base.errors import GenerationError, TokenizerError
from ..engine.sampling import Sampling, SamplingError
from ..model.tokenizer import UnknownCharacters, prompt_ids, replacing_unknown
from .chat import ChatFormat, ChatTemplateError, PlayFormat

if TYPE_CHECKING:
    from .engine import BackgroundEngine

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_PROMPTS = 64  # prompts in one completions request


class ApiError(Exception):
    """An OpenAI-style error: the status and the object a client library reads."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    @property
    def body(self) -> dict[str, dict[str, Any]]:
        """The error object, as a response's body or a stream's `error` event."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body), status_code=self.status, headers=self.headers,
                        media_type="application/json")  # ASCII JSON: any text a client sent can be quoted back


def _bad(param: str, rule: str, value: Any) -> ApiError:
    shown = json.dumps(value)[:80] if not isinstance(value, float) else repr(value)
    return ApiError(400, f"{param} ({shown}) {rule}", param=param)


# ---------------------------------------------------------------------------------------------- Sampling's fields
SERVER_SET = frozenset({"stop_ids"})  # set from the chat format's end of turn, never by a client
FROM_API: dict[str, Callable[[Any], Any]] = {"top_k": lambda k: None if k == -1 else k}  # -1: all (vLLM's too)
STOP_RULE = f"must be a non-empty string or a list of up to {MAX_STOPS} of them"
RULES = {"stop": STOP_RULE}  # a wrong JSON type's words, where the type's own say too little

_SCALARS: dict[Any, tuple[Any, str]] = {bool: (StrictBool, "must be true or false"),
                                         int: (StrictInt, "must be an integer"),
                                         float: (StrictInt | StrictFloat, "must be a number"),  # JSON's 1 is a number
                                         str: (StrictStr, "must be a string")}


def json_type(hint: Any) -> tuple[Any, str]:
    """The pydantic annotation of the JSON values a field of Python type `hint` takes, and the words for a
    wrong one. A tuple is sent as one value or a list of them (OpenAI's `stop`); None is dropped, as every
    body field may be null anyway."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if len(members) == 1:
            return json_type(members[0])
    elif typing.get_origin(hint) is tuple and len(typing.get_args(hint)) == 2 and typing.get_args(hint)[1] is ...:
        item, rule = json_type(typing.get_args(hint)[0])
        return item | list[item], f"{rule} or a list of them"
    elif typing.get_origin(hint) is Literal:
        return hint, "must be one of " + ", ".join(json.dumps(c) for c in typing.get_args(hint))
    elif hint in _SCALARS:
        return _SCALARS[hint]
    raise TypeError(f"serve.schema: no JSON type for {hint!r}; say how the API spells it")


def sampling_fields(sampling: type = Sampling) -> dict[str, tuple[Any, Any]]:
    """The request fields of the dataclass `sampling`'s settings, for `pydantic.create_model`: each one's JSON
    type or null (absent or null: `sampling`'s default). The rule of a wrong type is the field's description."""
    hints = typing.get_type_hints(sampling)  # Annotated's limits stripped: they are `sampling`'s to check
    fields = {}
    for f in dataclasses.fields(sampling):
        if f.name not in SERVER_SET:
            annotation, rule = json_type(hints[f.name])
            fields[f.name] = (annotation | None, Field(None, description=RULES.get(f.name, rule)))
    return fields


# ---------------------------------------------------------------------------------------------- the bodies
@dataclass
class Params:
    """A checked completions or chat request."""

    prompts: list[list[int]]
    prompt_texts: list[str]
    max_tokens: int
    sampling: Sampling
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    trace: bool


@dataclass
class _Asked:
    """What a request asks of its own endpoint, checked: its prompts, logprobs and length, and the stops its
    format adds."""

    texts: list[str]
    prompts: list[list[int]]
    logprobs: int | None
    echo: bool
    max_tokens: int | None  # None: score the prompt, generate nothing
    field: str  # the field that set max_tokens, named when it is wrong
    what: str  # "prompt" or "messages", as errors name it
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class Body(BaseModel):
    """The fields both endpoints take besides `Sampling`'s (`request_bodies` adds those). Each field's
    description, where it has one, is what its error says whatever is wrong inside it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    SAMPLING: ClassVar[type] = Sampling  # the dataclass a request's sampling fields build
    MAX_LOGPROBS: ClassVar[int]  # alternatives per token, OpenAI's limit for the endpoint

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: _StreamOptions | None = Field(None, description='must be {"include_usage": true|false}')
    n: StrictInt | None = None
    user: StrictStr | None = None
    frequency_penalty: StrictInt | StrictFloat | None = Field(None, description="must be a number")
    presence_penalty: StrictInt | StrictFloat | None = Field(None, description="must be a number")
    logit_bias: dict[str, Any] | None = None
    nanollama4_trace: StrictBool | None = None  # ours: each streamed token with the step that chose it
    replace_unknown: StrictStr | None = None  # ours: a character put for each one the vocabulary lacks

    def asked(self, body: dict, engine: BackgroundEngine, chat: ChatFormat, trace: bool) -> _Asked:
        raise NotImplementedError


class CompletionFields(Body):
    """POST /v1/completions."""

    MAX_LOGPROBS = 5
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = Field(None, description=(
        f"must be a string, a list of up to {MAX_PROMPTS} strings, or token ids (a list, or a list of lists)"))
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def asked(self, body: dict, engine: BackgroundEngine, chat: ChatFormat, trace: bool) -> _Asked:
        texts, prompts = _prompts(self.prompt, engine, self.replace_unknown)
        if trace and len(prompts) > 1:
            raise _bad("nanollama4_trace", "takes one prompt at a time", True)
        logprobs = self.logprobs
        if logprobs is not None and not 0 <= logprobs <= self.MAX_LOGPROBS:
            raise _bad("logprobs", f"must be an integer from 0 to {self.MAX_LOGPROBS} (or null)", logprobs)
        echo = bool(self.echo)
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if max_tokens == 0 and echo and logprobs is not None:
            max_tokens = None  # scoring the prompt alone: allowed, as OpenAI's legacy API allowed it
        return _Asked(texts, prompts, logprobs, echo, max_tokens, "max_tokens", "prompt")


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | list[_TextPart]
    name: StrictStr | None = None


MESSAGES_RULE = "must be a non-empty list of {role, content} objects"


class ChatFields(Body):
    """POST /v1/chat/completions."""

    MAX_LOGPROBS = 20
    messages: list[Message] | None = Field(None, description=MESSAGES_RULE)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None

    def asked(self, body: dict, engine: BackgroundEngine, chat: ChatFormat, trace: bool) -> _Asked:
        if not self.messages:
            raise _bad("messages", MESSAGES_RULE, body.get("messages"))
        text = chat_prompt([m.model_dump(exclude_none=True) for m in self.messages], chat)
        prompt = _encode(text, engine, "messages", self.replace_unknown)
        top = self.top_logprobs
        if top is not None and not 0 <= top <= self.MAX_LOGPROBS:
            raise _bad("top_logprobs", f"must be an integer from 0 to {self.MAX_LOGPROBS} (or null)", top)
        if top is not None and not self.logprobs:
            raise _bad("top_logprobs", "needs logprobs: true", top)
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(self, field)
        if max_tokens is None:  # the rest of the context; 1 when there is none, which the length check names
            max_tokens = engine.context - len(prompt) if len(prompt) < engine.context else 1
        return _Asked([text], [prompt], (top or 0) if self.logprobs else None, False, max_tokens, field, "messages",
                      tuple(chat.stop), tuple(chat.stop_ids))


def request_bodies(sampling: type = Sampling) -> dict[str, type[Body]]:
    """The body models of the two endpoints ("completions", "chat"), their sampling fields those of the
    dataclass `sampling` (which a request's settings then build)."""
    fields = sampling_fields(sampling)
    bodies: dict[str, type[Body]] = {}
    for kind, base in (("completions", CompletionFields), ("chat", ChatFields)):
        name = base.__name__.replace("Fields", "Body")
        bodies[kind] = pydantic.create_model(name, __base__=base, __module__=__name__, **fields)
        bodies[kind].SAMPLING = sampling
    return bodies


BODIES = request_bodies()
CompletionBody, ChatBody = BODIES["completions"], BODIES["chat"]


# ---------------------------------------------------------------------------------------------- reading a body
_NESTED = {"messages"}  # fields whose inner errors are named by their path, not by the field's description
_TYPE_RULES = {"int_type": "must be an integer", "bool_type": "must be true or false",
               "string_type": "must be a string", "float_type": "must be a number",
               "literal_error": "must be text parts ({type: text, text})", "extra_forbidden": "is not a field here",
               "missing": "is required"}


def read_body(body: Any, schema: type[Body]) -> Body:
    """`body` as a `schema`, or the API's error object for what pydantic found wrong first."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise _refusal(e.errors(), body, schema) from None


def _refusal(errors: list[dict], body: dict, schema: type[Body]) -> ApiError:
    """The API's error object for pydantic's `errors` about `body`: an unknown field first (what a client with
    a misspelt field most needs to hear), else the first complaint, naming the field it is about."""
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1)
    if any(not e["loc"] for e in errors):  # a key that is not text (a lone surrogate): pydantic cannot name it
        unknown = sorted(set(body) - set(schema.model_fields))
    if unknown:
        return ApiError(400, f"unknown field {unknown[0]!r}; this server accepts: "
                        f"{', '.join(sorted(schema.model_fields))}", param=unknown[0])
    error = errors[0]
    loc = error["loc"]
    path, value = "", body
    for part in loc:  # union members are named in loc too ("str", "list[int]", ...): not part of the path
        if isinstance(part, int) and isinstance(value, list) and part < len(value):
            path, value = f"{path}[{part}]", value[part]
        elif isinstance(part, str) and isinstance(value, dict) and part in value:
            path, value = f"{path}.{part}" if path else part, value[part]
    if error["type"] == "missing":
        return _bad(path, f"needs {loc[-1]!r}", value)
    top = str(loc[0])
    field = schema.model_fields.get(top)
    if field is not None and field.description and (path == top or top not in _NESTED):
        return _bad(top, field.description, body.get(top))
    return _bad(path or top, _TYPE_RULES.get(error["type"], error["msg"]), value)


_NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "best_of": (1,), "n": (1,),
            "logit_bias": ({},), "suffix": ("",)}  # accepted at their no-op values only


def parse_request(body: Any, schema: type[Body], engine: BackgroundEngine, model_name: str,
                  chat: ChatFormat | None = None) -> Params:
    """The fields of a request body for `schema` (`CompletionBody` or `ChatBody`), checked; chat messages
    become a prompt in `chat`'s format (default: the play template) and end where it says."""
    chat = chat or PlayFormat()
    req = read_body(body, schema)
    for name, neutral in _NEUTRAL.items():
        if getattr(req, name, None) is not None and getattr(req, name) not in neutral:
            raise _bad(name, f"is not supported here; leave it out (or {json.dumps(neutral[0])})", body[name])
    if req.model is None:
        raise ApiError(400, f"model is required: {model_name!r} (see GET /v1/models)", param="model")
    if req.model != model_name:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else req.stop
    if len(stop) > MAX_STOPS or not all(stop):
        raise _bad("stop", STOP_RULE, body.get("stop"))
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise _bad("stream_options", "is only allowed with stream: true", body["stream_options"])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    trace = bool(req.nanollama4_trace)
    if trace and not stream:
        raise _bad("nanollama4_trace", "needs stream: true (the page's stream of steps)", True)

    asked = req.asked(body, engine, chat, trace)
    limit, field = engine.context, asked.field
    max_tokens = 0 if asked.max_tokens is None else asked.max_tokens  # None: scoring only
    if asked.max_tokens is not None and max_tokens < 1:
        raise _bad(field, f"must be a positive integer (at most the context, {limit} tokens, minus the prompt)",
                   max_tokens)
    if len(asked.prompts) > engine.max_batch + engine.max_queue:
        raise ApiError(400, f"{len(asked.prompts)} prompts are more than this server ever holds at once "
                       f"({engine.max_batch} decoding + {engine.max_queue} waiting); send fewer", param="prompt")
    what = asked.what
    for ids in asked.prompts:
        if len(ids) + max_tokens > limit:
            raise ApiError(400, f"this model's context is {limit} tokens; the {what} takes {len(ids)} and "
                           f"{field} asks for {max_tokens} more ({len(ids) + max_tokens}); shorten the {what} or "
                           f"lower {field}", param=field if len(ids) < limit else what,
                           code="context_length_exceeded")
    sampling = _sampling(req, (*stop, *asked.stop), asked.stop_ids)
    return Params(asked.prompts, asked.texts, max_tokens, sampling, stream, include_usage, asked.logprobs, asked.echo,
                  trace)


def _sampling(req: Body, stop: tuple[str, ...], stop_ids: tuple[int, ...]) -> Sampling:
    """The request's settings as its body's `SAMPLING`, checked there: each field as sent (absent or null: its
    default), in the dataclass's own spelling."""
    values: dict[str, Any] = {"stop": stop, "stop_ids": stop_ids}
    for f in dataclasses.fields(req.SAMPLING):
        value = getattr(req, f.name, None)
        if f.name not in values and value is not None:
            values[f.name] = FROM_API.get(f.name, lambda v: v)(value)
    try:
        return req.SAMPLING(**values)
    except SamplingError as e:
        raise ApiError(400, str(e), param=e.field) from None


def _prompts(prompt: Any, engine: BackgroundEngine, replace: str | None = None) -> tuple[list[str], list[list[int]]]:
    """A completions prompt (its JSON type already checked): a string, a list of strings, a list of token
    ids or a list of such lists."""
    vocab = engine.tokenizer.vocab_size
    if isinstance(prompt, str):
        return [prompt], [_encode(prompt, engine, "prompt", replace)]
    if isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt), [_encode(p, engine, "prompt", replace) for p in prompt]
        lists = [prompt] if all(isinstance(t, int) for t in prompt) else prompt  # one id list, or a list of them
        if all(ids and all(0 <= t < vocab for t in ids) for ids in lists):
            return [engine.tokenizer.decode(ids) for ids in lists], [list(ids) for ids in lists]
    raise _bad("prompt", f"must be a string, a list of up to {MAX_PROMPTS} strings, or token ids in "
               f"[0, {vocab}) (a list, or a list of lists)", prompt)


def _encode(text: str, engine: BackgroundEngine, param: str, replace: str | None = None) -> list[int]:
    """The ids of a prompt's text; a character the vocabulary lacks is a 400 that names it and the request
    field that substitutes one (`replace_unknown`), which an HTTP client can send."""
    tokenizer = engine.tokenizer
    if replace is not None:
        if len(replace) != 1:
            raise _bad("replace_unknown", "must be one character (one the vocabulary has, such as \"?\")", replace)
        try:
            tokenizer = replacing_unknown(tokenizer, replace)
        except TokenizerError as e:
            raise ApiError(400, f"replace_unknown: {e}", param="replace_unknown") from None
    try:
        return prompt_ids(tokenizer, text, "give some text to continue (as valid Unicode)", name=param)
    except GenerationError as e:
        raise ApiError(400, str(e), param=param) from None
    except UnknownCharacters as e:
        raise ApiError(400, f"{param}: cannot encode {e.listing}; send \"replace_unknown\": \"?\" (or another "
                       "character the vocabulary has) to put it in their place", param=param) from None
    except TokenizerError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None


def chat_prompt(messages: Any, chat: ChatFormat | None = None) -> str:
    """The prompt for chat `messages` (checked: roles system, developer, user, assistant; text content, or
    text parts joined), in `chat`'s format: the play template (`chat.PlayFormat`) unless the served
    checkpoint brought its own (`chat.TemplateFormat`)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", MESSAGES_RULE, messages)
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise _bad(f"messages[{i}]", "must be an object with role and content", m)
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise _bad(f"messages[{i}].name", "must be a string", m["name"])
        role, content = m.get("role"), m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content", "may hold only text parts ({type: text, text})", content)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string", content)
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"messages[{i}].role", "must be system, developer, user or assistant", role)
        checked.append({"role": role, "content": content, **({"name": m["name"]} if m.get("name") else {})})
    try:
        return (chat or PlayFormat()).render(checked)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from None
