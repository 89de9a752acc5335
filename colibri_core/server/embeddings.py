"""POST /v1/embeddings: OpenAI's embeddings API over `Engine.embed`.

An embedding is the mean over an input's tokens of the model's last decoder layer's output, before
the final norm (Engine.embed says why, and what it runs), float32, not normalised to unit length.
`input` is a string, a list of strings, a list of token ids or a list of lists of token ids (a
string is tokenized as a completion's prompt is, special tokens included); each is one vector, in
order. `encoding_format` "base64" sends each vector as its little-endian float32 bytes, which the
`openai` client asks for by default and decodes. The inputs run as one job of the worker's batch
(worker.EmbeddingJob, submitted by app.py's handler), beside the generations, and touch neither
sessions nor the prefix cache.
"""
from __future__ import annotations

import base64
from typing import Annotated, Literal, Union

import numpy as np
from pydantic import BeforeValidator, Field

from .schemas import Body, Limits, Name, Text, TokenIds, by_kind, neutral, validate

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)


def _batch(v):
    """One input (a string, or a list of token ids) as a batch of one; a batch as it is."""
    if isinstance(v, str) or (isinstance(v, list) and v and all(type(x) is int for x in v)):
        return [v]
    return v


Inputs = Annotated[list[by_kind(string=Text, array=TokenIds)], Field(min_length=1, max_length=MAX_INPUTS),
                   BeforeValidator(_batch, json_schema_input_type=Union[
                       Text, TokenIds, Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)],
                       Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]])]


class EmbeddingBody(Body):
    """POST /v1/embeddings."""

    input: Inputs = Field(description="A string, a list of strings, a list of token ids or a list of lists of "
                          "token ids: one embedding each.")
    model: Name | None = None
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="'float' (the default): arrays of numbers; 'base64': each vector's little-endian "
        "float32 bytes.")
    dimensions: neutral(None, "an embedding has the model's hidden width; it is never shortened") = None
    user: Name | None = Field(None, description="Accepted, unused.")


def parse_embeddings(body: dict, lim: Limits = Limits()) -> dict:
    b = validate(EmbeddingBody, body, lim)
    return {"model": b.model, "input": b.input, "base64": b.encoding_format == "base64"}


def encoded(vector: np.ndarray, as_base64: bool):
    """A vector as OpenAI sends it: a list of numbers (each float32 exactly), or base64 of its bytes."""
    if as_base64:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
