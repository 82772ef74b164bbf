"""OpenAI request parsing and response shapes, independent of the web framework.

`parse_completion` / `parse_chat` turn a decoded JSON body into a `Parsed` request (prompt or
messages plus SamplingParams) or raise `ApiError` with a message that says what to fix. Field
names and meanings follow the OpenAI API; extras that vLLM also accepts (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, return_token_ids) are accepted too. Unknown
fields are ignored, as OpenAI-compatible servers do; known fields of the wrong type are refused,
and so are OpenAI fields this server does not implement (logit_bias, tools, response_format ...)
when their value would change the answer.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engine.config import MAX_STOP_CHARS, MAX_STOPS, SamplingParams, shown
from engine.errors import InvalidRequest


class ApiError(Exception):
    """An HTTP error in OpenAI's error JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


NUMBER = (int, float)
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               list: "a list", dict: "an object"}

# field -> accepted JSON types (bool is never accepted as a number)
COMMON_FIELDS = {
    "model": (str,), "stream": (bool,), "stream_options": (dict, type(None)),
    "max_tokens": (int, type(None)), "temperature": NUMBER + (type(None),), "top_p": NUMBER + (type(None),),
    "top_k": (int, type(None)), "min_p": NUMBER + (type(None),),
    "presence_penalty": NUMBER + (type(None),), "frequency_penalty": NUMBER + (type(None),),
    "repetition_penalty": NUMBER + (type(None),), "stop": (str, list, type(None)),
    "seed": (int, type(None)), "n": (int, type(None)), "ignore_eos": (bool,),
    "stop_token_ids": (list, type(None)), "return_token_ids": (bool, type(None)), "user": (str,),
    "cache_salt": (str, type(None)),     # vLLM's field: share cached KV pages only within a salt
    # speculative decoding per request (tokentop's own fields; absent = the worker's flags)
    "speculate": (str, type(None)), "spec_k": (int, str, type(None)),
    "spec_tv_budget": NUMBER + (type(None),),
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": (str, list), "logprobs": (int, type(None)),
                     "echo": (bool, type(None)), "best_of": (int, type(None)), "suffix": (str, type(None))}
CHAT_FIELDS = {**COMMON_FIELDS, "messages": (list,), "logprobs": (bool, type(None)),
               "top_logprobs": (int, type(None)), "max_completion_tokens": (int, type(None))}


@dataclass
class Parsed:
    kind: str                            # "completion" | "chat"
    model: str | None
    params: SamplingParams
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False               # return logprobs at all
    top_logprobs: int = 0
    max_tokens_given: str | bool = False   # the field's name when the client gave one
    return_token_ids: bool = False
    extra: dict = field(default_factory=dict)


# OpenAI fields this server does not implement: refused when they would change the answer,
# rather than ignored (a client relying on them must hear it); the harmless values pass
UNSUPPORTED = {
    "logit_bias": lambda v: v in (None, {}), "tools": lambda v: v in (None, []),
    "functions": lambda v: v in (None, []), "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
}


MAX_JSON_DEPTH = 64      # a real request nests 5 deep (messages, a message, content parts)


def check_json_values(body) -> None:
    """Refuse what json.loads accepts but no request can hold: nesting deeper than
    MAX_JSON_DEPTH, and text with a lone UTF-16 surrogate ("\\ud800" decodes to one: it is not
    Unicode, no tokenizer or response encoder takes it). The error names where it is."""
    stack = [(body, ())] if isinstance(body, (dict, list)) else []
    while stack:
        value, path = stack.pop()
        field = path[0] if path and isinstance(path[0], str) else None
        if len(path) >= MAX_JSON_DEPTH:
            raise ApiError(400, f"the request nests deeper than {MAX_JSON_DEPTH} levels"
                                f"{f' in {field!r}' if field else ''}; send a flatter body", field)
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(key, str) and not _is_unicode(key):
                raise ApiError(400, f"a key in {_path(path)} holds a lone UTF-16 surrogate; send valid "
                                    "Unicode", field)
            if isinstance(item, str):
                if not _is_unicode(item):
                    raise ApiError(400, f"{_path(path + (key,))} holds a lone UTF-16 surrogate (such as "
                                        "\\ud800), which is not Unicode; send valid text",
                                   field or (key if isinstance(key, str) else None))
            elif isinstance(item, (dict, list)):
                stack.append((item, path + (key,)))


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(path: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the body"


def _check_unsupported(body: dict) -> None:
    for name, harmless in UNSUPPORTED.items():
        if name in body and not harmless(body[name]):
            raise ApiError(400, f"'{name}' is not supported by this server; leave it out", param=name)


def _check_types(body: dict, fields: dict) -> None:
    for name, types in fields.items():
        if name not in body:
            continue
        value = body[name]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            names = dict.fromkeys(_TYPE_NAMES[float if t is int and float in types else t]
                                  for t in types if t is not type(None))
            want = " or ".join(names)
            raise ApiError(400, f"'{name}' must be {want}, got {_json_type(value)}", param=name)


def _json_type(value) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _params(body: dict, max_tokens: int | None, logprobs: int, want_logprobs: bool = False) -> SamplingParams:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    stop = stop or []
    if any(not isinstance(s, str) or not s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"'stop' takes up to {MAX_STOPS} strings of up to {MAX_STOP_CHARS} characters each, "
                            f"got {len(stop)} of up to {max(map(len, stop))}; send fewer or shorter ones", "stop")
    ids = body.get("stop_token_ids") or []
    if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
        raise ApiError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"'n' must be 1 (one completion per request), got {shown(body['n'])}", "n")

    def num(name, default):
        v = body.get(name)
        return default if v is None else v

    top_k = num("top_k", 0)
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 16,
            temperature=num("temperature", 1.0), top_p=num("top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,       # vLLM spells "off" as -1
            min_p=num("min_p", 0.0), repetition_penalty=num("repetition_penalty", 1.0),
            presence_penalty=num("presence_penalty", 0.0),
            frequency_penalty=num("frequency_penalty", 0.0), seed=body.get("seed"),
            stop=tuple(stop), stop_token_ids=tuple(ids), ignore_eos=bool(body.get("ignore_eos", False)),
            logprobs=logprobs, return_logprobs=want_logprobs, cache_salt=body.get("cache_salt"),
            speculate=body.get("speculate") or "",
            spec_k="" if body.get("spec_k") is None else str(body["spec_k"]),
            spec_tv_budget=body.get("spec_tv_budget"),
        ).validate()
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param_of(str(exc))) from None


def param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return word if word in COMMON_FIELDS or word == "logprobs" else None


def _max_tokens(body: dict, *names: str) -> tuple[int | None, bool]:
    for name in names:
        v = body.get(name)
        if v is not None:
            if v <= 0:
                raise ApiError(400, f"'{name}' must be at least 1, got {v}", name)
            return v, name
    return None, False


def _stream_options(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not body.get("stream"):
        raise ApiError(400, "'stream_options' is only allowed with \"stream\": true", "stream_options")
    inc = opts.get("include_usage", False)
    if not isinstance(inc, bool):
        raise ApiError(400, "'stream_options.include_usage' must be true or false", "stream_options")
    return inc


def parse_completion(body) -> Parsed:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_types(body, COMPLETION_FIELDS)
    _check_unsupported(body)
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required: the text to continue", "prompt")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported by this server; leave it out", name)
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "'best_of' must be 1", "best_of")
    prompt, prompt_ids = _prompt(body["prompt"])
    max_tokens, given = _max_tokens(body, "max_tokens")
    lp = body.get("logprobs")
    if lp is not None and not 0 <= lp <= 20:
        raise ApiError(400, f"'logprobs' must be between 0 and 20, got {lp}", "logprobs")
    parsed = Parsed("completion", body.get("model"), _params(body, max_tokens, lp or 0, lp is not None), prompt=prompt,
                    prompt_ids=prompt_ids, stream=bool(body.get("stream")), include_usage=_stream_options(body),
                    logprobs=lp is not None, top_logprobs=lp or 0, max_tokens_given=given,
                    return_token_ids=bool(body.get("return_token_ids")))
    return parsed


def _prompt(p) -> tuple[str | None, list[int] | None]:
    if isinstance(p, list):
        if len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]                                   # a batch of one
        elif p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return None, list(p)
        elif not p:
            raise ApiError(400, "'prompt' is empty; send some text", "prompt")
        else:
            raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of one of "
                                "those (one prompt per request)", "prompt")
        if isinstance(p, list):
            return _prompt(p)
    if not p.strip():
        raise ApiError(400, "'prompt' is empty; send some text", "prompt")
    return p, None


def parse_chat(body) -> Parsed:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_types(body, CHAT_FIELDS)
    _check_unsupported(body)
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required: a list of {\"role\", \"content\"} objects", "messages")
    messages = [_flatten_content(m, i) for i, m in enumerate(messages)]
    max_tokens, given = _max_tokens(body, "max_completion_tokens", "max_tokens")
    top = body.get("top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise ApiError(400, f"'top_logprobs' must be between 0 and 20, got {top}", "top_logprobs")
    want_lp = bool(body.get("logprobs"))
    if top and not want_lp:
        raise ApiError(400, "'top_logprobs' needs \"logprobs\": true", "top_logprobs")
    return Parsed("chat", body.get("model"), _params(body, max_tokens, top or 0, want_lp), messages=messages,
                  stream=bool(body.get("stream")), include_usage=_stream_options(body), logprobs=want_lp,
                  top_logprobs=top or 0, max_tokens_given=given, return_token_ids=bool(body.get("return_token_ids")))


def _flatten_content(m, i: int):
    """OpenAI allows content as a list of parts; text parts are joined, others refused."""
    if isinstance(m, dict) and isinstance(m.get("content"), list):
        parts = m["content"]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in parts):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
        return {**m, "content": "".join(p["text"] for p in parts)}
    return m


# --- responses ---------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


class LogprobFormatter:
    """TokenDelta logprobs -> OpenAI's completion or chat logprob objects."""

    def __init__(self, tokenizer, kind: str, top: int):
        self.tok, self.kind, self.top = tokenizer, kind, top
        self.offset = 0

    def _text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def entries(self, deltas) -> list:
        out = []
        for d in deltas:
            offset = self.offset
            self.offset += len(d.text)       # every token's text moves the offset, logprob or not
            if d.logprob is None:
                continue
            if d.token_str is not None:      # a remote worker's: by token text
                t, tops = d.token_str, list(d.top_strs[: self.top])
            elif d.token_id >= 0:
                t = self._text(d.token_id)
                tops = [(self._text(i), lp) for i, lp in d.top_logprobs[: self.top]]
            else:
                continue
            if self.kind == "chat":
                out.append({"token": t, "logprob": d.logprob, "bytes": list(t.encode("utf-8")),
                            "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
                                             for s, lp in tops]})
            else:
                out.append((t, d.logprob, dict(tops), offset))
        return out

    def block(self, entries: list) -> dict | None:
        if self.kind == "chat":
            return {"content": entries}
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


def completion_body(rid: str, model: str, created: int, kind: str, text: str, finish: str | None,
                    logprobs: dict | None, usage_: dict | None, token_ids: list[int] | None = None) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_}


def chunk_body(rid: str, model: str, created: int, kind: str, text: str | None, finish: str | None,
               logprobs: dict | None, first: bool = False, usage_: dict | None = None,
               token_ids: list[int] | None = None, with_usage_field: bool = False) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if with_usage_field:
        body["usage"] = usage_
    return body


def usage_chunk(rid: str, model: str, created: int, kind: str, usage_: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


def now() -> int:
    return int(time.time())
