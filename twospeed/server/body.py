"""A request body from bytes to a validated request model, in a worker thread, never holding the GIL long.

The event loop's thread needs the GIL to answer anyone, so every step here works in slices: JSON is
parsed a top-level element at a time (a 40k-message chat is 40k short C calls, not one of ~60 ms),
large lists are validated item by item, and text is checked for invalid Unicode (a lone surrogate
such as "\\ud800", or bytes that are not UTF-8) before anything else reads it, with the field named.
Errors are APIErrors (HTTP 400) in the same format as every other validation error.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from twospeed.engine.sampling_params import valid_unicode
from twospeed.server.errors import APIError, validation_error

def _parse_int(text: str) -> int | float:
    """An integer literal; one longer than Python converts (4,300 digits) is out of every field's range, so it
    reads as an infinity the field's own check refuses (a 400 naming the field, not a 500)."""
    if len(text) > 4000:
        return float("-inf") if text.startswith("-") else float("inf")
    return int(text)


_decoder = json.JSONDecoder(parse_int=_parse_int)
_WS = re.compile(r"[ \t\n\r]*")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a surrogate gets into parsed JSON from valid UTF-8
_ITEMWISE = 256  # lists longer than this are validated one item at a time


def parse_request(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """raw JSON body -> model instance, or an APIError (400) naming the field."""
    return validate_sliced(model, load_body(raw))


def load_body(raw: bytes) -> Any:
    """raw JSON body -> Python value, its text checked for invalid Unicode; APIError (400) otherwise."""
    if not raw.strip():
        raise APIError(400, "the request body is missing (expected a JSON object)")
    try:
        text, utf8 = raw.decode("utf-8"), True
    except UnicodeDecodeError:
        text, utf8 = raw.decode("utf-8", errors="surrogateescape"), False  # bad bytes become lone surrogates
    try:
        data = loads_sliced(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not utf8 or _SURROGATE_ESCAPE.search(text):
        where = find_invalid_unicode(data)
        if where is not None:
            raise APIError(400, f"{where or 'the request body'} is not valid Unicode (a lone surrogate such as "
                                "\\ud800, or bytes that are not UTF-8)", param=where or None)
    return data


# -- JSON, a top-level element at a time ------------------------------------------------------------------
def loads_sliced(text: str) -> Any:
    """json.loads(text), but the values of a top-level container, and the elements of the containers among
    them, are each parsed by a separate C call, with the GIL free for other threads in between."""
    value, end = _value(text, _WS.match(text, 0).end(), 0)
    end = _WS.match(text, end).end()
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _value(s: str, i: int, depth: int) -> tuple[Any, int]:
    if depth >= 2 or i >= len(s) or s[i] not in "[{":
        return _decoder.raw_decode(s, i)
    is_object = s[i] == "{"
    close = "}" if is_object else "]"
    out: dict | list = {} if is_object else []
    i = _WS.match(s, i + 1).end()
    if i < len(s) and s[i] == close:
        return out, i + 1
    while True:
        if is_object:
            if i >= len(s) or s[i] != '"':
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, i)
            key, i = _decoder.raw_decode(s, i)
            i = _WS.match(s, i).end()
            if i >= len(s) or s[i] != ":":
                raise json.JSONDecodeError("Expecting ':' delimiter", s, i)
            item, i = _value(s, _WS.match(s, i + 1).end(), depth + 1)
            out[key] = item
        else:
            item, i = _value(s, i, depth + 1)
            out.append(item)
        i = _WS.match(s, i).end()
        if i < len(s) and s[i] == close:
            return out, i + 1
        if i >= len(s) or s[i] != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", s, i)
        i = _WS.match(s, i + 1).end()


# -- Unicode ---------------------------------------------------------------------------------------------
def find_invalid_unicode(value: Any, path: str = "") -> str | None:
    """The path (messages.0.content) of the first string, or key, that is not valid Unicode; None if all are."""
    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            if not valid_unicode(node):
                return where
        elif isinstance(node, dict):
            for key, item in node.items():
                if not valid_unicode(key):  # named with the bad character escaped
                    key = key.encode("utf-8", "backslashreplace").decode("utf-8")
                    return f"{where}.{key}" if where else key
                stack.append((item, f"{where}.{key}" if where else str(key)))
        elif isinstance(node, list):
            stack.extend((item, f"{where}.{i}" if where else str(i)) for i, item in enumerate(node))
    return None


# -- validation, long lists item by item -----------------------------------------------------------------
def validate_sliced(model: type[BaseModel], data: Any) -> BaseModel:
    """model.model_validate(data); a list field of models longer than _ITEMWISE is validated item by item first
    (an already-validated instance passes the model's own check at the cost of an isinstance)."""
    if isinstance(data, dict):
        for name, field in model.model_fields.items():
            items = data.get(name)
            item_model = _list_item_model(field.annotation)
            if item_model is not None and isinstance(items, list) and len(items) > _ITEMWISE:
                data = {**data, name: [_validate_item(item_model, item, name, i) for i, item in enumerate(items)]}
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _validate_item(item_model: type[BaseModel], item: Any, name: str, index: int) -> BaseModel:
    try:
        return item_model.model_validate(item)
    except ValidationError as e:
        raise validation_error([{**err, "loc": (name, index, *err["loc"])} for err in e.errors()]) from None


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    """M for a field annotated list[M] (M a pydantic model), else None."""
    import typing

    if typing.get_origin(annotation) is list:
        (arg,) = typing.get_args(annotation) or (None,)
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
