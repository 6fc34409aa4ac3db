"""POST /v1/embeddings (OpenAI's): the body (a pydantic model), its inputs → token ids, the
vectors from an `Embedder` (engine/embed.py) on a worker thread, and the answer in OpenAI's shape
(floats, or base64 of little-endian float32, which the `openai` client asks for by default).

The model is the served chat model (its ids and `BASE+ADAPTER` ids, as the other routes take) or
an embedding model served beside it (`potluck serve --embedding-model`: `serve_beside`); the
models are the app's `EmbeddingModels` (`app.state.embeddings`, which /v1/models lists too).
Unlike the completion bodies, this one refuses a field it does not know (400 naming it): a
field a client sends here changes the vectors it gets (`dimensions`, `encoding_format`), so one
the server cannot honour must not pass silently.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from fastapi import FastAPI, params
from pydantic import BaseModel, ConfigDict, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from potluck.api import errors
from potluck.api.state import Api, model_id_of
from potluck.engine.embed import Embedder, shorten, text_ids
from potluck.engine.generate import Model

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)
_INPUT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body; `user` is taken and ignored, as OpenAI does."""

    model_config = ConfigDict(extra="allow")  # (then refused, naming the field: `unknown`)

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _form(cls, v: Any) -> Any:
        """One of OpenAI's four forms, said in one line (pydantic's own error names a union
        member); token ids are JSON integers (not true, not 1.5)."""
        ok = isinstance(v, str) or (
            isinstance(v, list)
            and (
                all(isinstance(x, str) for x in v)
                or all(type(x) is int for x in v)
                or all(isinstance(x, list) and all(type(t) is int for t in x) for x in v)
            )
        )
        if not ok:
            raise ValueError(f"give {_INPUT_FORMS}")
        return v

    def unknown(self) -> list[str]:
        return sorted(self.model_extra or {})


class EmbeddingModels:
    """The models /v1/embeddings serves: the app's chat model and those served beside it."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.chat = Embedder(api.model, api.scheduler.config.n_batch)
        self.beside: list[tuple[str, Embedder]] = []  # (model id, embedder)
        self._aliases: dict[str, Embedder] = {}

    def add(self, model: Model) -> None:
        """An embedding model served beside the chat model, under its file's names."""
        embedder = Embedder(model)
        self.beside.append((model_id_of(model), embedder))
        name = model.file.metadata.get("general.name")
        names = {model_id_of(model), model.path.name} | ({str(name)} if name else set())
        for alias in names - self.api.aliases:  # (the chat model keeps its own names)
            self._aliases[alias] = embedder

    def find(self, name: str) -> tuple[Embedder, int | None]:
        """The embedder a body's `model` names, and the adapter (SeqChunk.lora); 404 else."""
        if name in self._aliases:
            return self._aliases[name], None
        if name in self.api.aliases or name in self.api.adapter_ids:
            return self.chat, self.api.check_model(name)
        served = "', '".join([self.api.config.model_id, *(i for i, _ in self.beside)])
        raise errors.ApiError(
            404,
            f"The model '{name}' does not exist; this server embeds with '{served}' "
            f"(see GET /v1/models)",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def serve_beside(app: FastAPI, model: Model) -> None:
    """Serve `model` (loaded in this process) for embeddings beside the app's chat model."""
    embeddings_of(app).add(model)


def embeddings_of(app: FastAPI) -> EmbeddingModels:
    models: EmbeddingModels = app.state.embeddings
    return models


def add_embedding_routes(app: FastAPI, api: Api, posted: list[params.Depends]) -> None:
    """POST /v1/embeddings on `app` (posted: the API key and JSON body checks)."""
    models = EmbeddingModels(api)
    app.state.embeddings = models

    @app.post("/v1/embeddings", dependencies=posted)
    async def embeddings(body: EmbeddingRequest) -> Response:
        if unknown := body.unknown():
            raise errors.bad_request(
                f"unknown field {unknown[0]!r}: /v1/embeddings takes model, input, "
                "encoding_format, dimensions and user",
                unknown[0],
            )
        embedder, lora = models.find(body.model)
        if embedder.refusal is not None:
            raise errors.bad_request(embedder.refusal, "model")
        n_embd = embedder.n_embd
        if body.dimensions is not None and not 1 <= body.dimensions <= n_embd:
            raise errors.bad_request(
                f"dimensions {body.dimensions}: give 1 to {n_embd} (the model's embeddings "
                f"have {n_embd})",
                "dimensions",
            )
        hint = embedder is models.chat
        inputs = await run_in_threadpool(_input_ids, embedder.model, body.input, hint)
        try:
            vectors = await run_in_threadpool(embedder.embed, inputs, lora)
        except Exception as exc:
            raise errors.api_error(exc) from exc
        if body.dimensions is not None:
            vectors = shorten(vectors, body.dimensions)
        n = sum(len(ids) for ids in inputs)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": _encoded(v, body)}
                    for i, v in enumerate(vectors)
                ],
                "model": body.model,
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )


def _input_ids(model: Model, given: Any, hint: bool) -> list[list[int]]:
    """OpenAI's input forms → one list of ids per input, each 1..n_ctx ids of the vocabulary.
    hint: the chat model's (a larger -c is the user's to give)."""
    if not given:
        raise errors.bad_request("input is empty: give a text or token ids", "input")
    single = isinstance(given, str) or all(type(x) is int for x in given)
    lists = [given] if single else given
    if len(lists) > MAX_INPUTS:
        raise errors.bad_request(
            f"input has {len(lists)} entries; at most {MAX_INPUTS} per request", "input"
        )
    n_ctx, n_vocab = model.n_ctx, model.tokenizer.vocab_size
    out: list[list[int]] = []
    for i, x in enumerate(lists):
        where = "input" if single else f"input[{i}]"
        if not x:
            raise errors.bad_request(f"{where} is empty: give some text or token ids", where)
        ids = text_ids(model, x) if isinstance(x, str) else list(x)
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise errors.bad_request(
                f"{where}: token id {bad[0]} is outside the vocabulary [0, {n_vocab})", where
            )
        if len(ids) > n_ctx:
            raise errors.ApiError(
                400,
                f"This model's maximum context length is {n_ctx} tokens. However, {where} is "
                f"{len(ids)} tokens. Please reduce the length of the input"
                + (", or restart the server with a larger -c." if hint else "."),
                "invalid_request_error",
                where,
                "context_length_exceeded",
            )
        out.append(ids)
    return out


def _encoded(v: npt.NDArray[np.float32], body: EmbeddingRequest) -> list[float] | str:
    """A vector as the body asks: JSON numbers, or base64 of its little-endian float32 bytes."""
    if body.encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    values: list[float] = v.tolist()
    return values
