"""The OpenAPI document for routes that parse their own bodies (in a worker thread, off the event loop).

FastAPI documents a body only when it parses it itself, on the event loop; these routes read raw bytes
instead, so `body()` gives each route's `openapi_extra` (a `$ref` to its model) and `install()` puts the
models' JSON schemas into the document's components. Clients and fuzzers (schemathesis) see the same
schema as if FastAPI had parsed the body.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def body(model: type[BaseModel] | list[type[BaseModel]], extra: dict | None = None) -> dict:
    """A route's openapi_extra: its JSON body is `model` (or `extra`, for a union of models)."""
    if extra is not None:
        return extra
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install(app: FastAPI, models: Iterable[type[BaseModel]]) -> None:
    """Make app.openapi() include these models (and the models they use) in components.schemas."""
    models = list(models)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=_REF)
                for name, sub in schema.pop("$defs", {}).items():
                    schemas.setdefault(name, sub)
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
