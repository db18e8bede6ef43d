"""The server's API: the request and response models (its OpenAPI schema), the limits the server
sets, a request's checks (``parse_query``) and the one error format (``Rejected``,
``error_response``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastnmt.decoding.next_token import SAMPLING_METHODS, Sampling
from fastnmt.ops.sample_token import MIN_TEMPERATURE
from fastnmt.translator import Translation, Translator

MAX_BEAM = 16
MAX_NGRAM = 16  # --no-repeat-ngram's bound: longer n-grams repeat too rarely to matter
# The request fields that only sampling reads.
SAMPLING_FIELDS = ("sampling_topk", "sampling_topp", "temperature", "seed", "samples")
ERROR_LOG = logging.getLogger("fastnmt.serve")
RETRY = {"Retry-After": "1"}  # the header of the answers that say: try again soon


class Rejected(Exception):
    """A request answered with an error: HTTP status, message, the field at fault."""

    def __init__(self, status: int, message: str, field_name: str | None = None, **headers):
        super().__init__(message)
        self.status, self.field, self.headers = status, field_name, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, str(self), self.field, self.headers)


def error_response(status: int, message: str, field_name=None, headers=None) -> JSONResponse:
    """The one error format: ``{"error": message, "field": name or null}``."""
    body = {"error": message, "field": field_name}
    return JSONResponse(body, status_code=status, headers=headers)


def one_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


@dataclass(frozen=True)
class Limits:
    """Bounds the server sets on every request. None: the model's own maximum."""

    max_sentences: int = 64  # per request
    max_input_tokens: int | None = None  # subword tokens per sentence
    max_output_tokens: int | None = None  # a request's max_length
    max_length_penalty: float = 2.0
    max_queue: int = 4096  # sentences waiting, all requests together
    max_body_bytes: int = 1 << 20
    request_timeout: float = 60.0  # seconds from arrival to answer


def check_limits(limits: Limits, translator: Translator) -> None:
    """ValueError if the limits ask for more than the model takes (it would truncate)."""
    model_limit = translator.max_source_tokens
    if (limits.max_input_tokens or 0) > model_limit:
        raise ValueError(
            f"--max-input-tokens {limits.max_input_tokens} is more than the model's maximum "
            f"source length, {model_limit} subword tokens"
        )
    output_limit = translator.max_target_tokens
    if (limits.max_output_tokens or 0) > output_limit:
        raise ValueError(
            f"--max-output-tokens {limits.max_output_tokens} is more than the model's maximum "
            f"length, {output_limit} tokens"
        )


class TranslateRequest(BaseModel):
    """The body of ``POST /translate``. The server's limits (sentences per request, subword
    tokens per sentence, max_length, length_penalty) are checked after these."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] = Field(
        description="The sentences to translate (one string: one sentence)"
    )
    beam: int = Field(4, ge=1, le=MAX_BEAM, description="Beam size; 1 is greedy search")
    n_best: int = Field(1, ge=1, le=MAX_BEAM, description="Candidates per sentence, <= beam")
    max_length: int | None = Field(
        None, ge=1, description="Target subword tokens at most (eos included); default: "
        "1.2 x the source's + 10",
    )  # fmt: skip
    length_penalty: float = Field(
        1.0, ge=0.0, allow_inf_nan=False, description="Scores are log-probability / "
        "length ** length_penalty: higher favours longer translations",
    )  # fmt: skip
    sampling: Literal[SAMPLING_METHODS] | None = Field(
        None, description="Sample instead of searching (beam unused): from the sampling_topk "
        "most probable tokens (topk) or the sampling_topp nucleus (topp)",
    )  # fmt: skip
    sampling_topk: int | None = Field(None, ge=1, description="topk: K (default: all)")
    sampling_topp: float | None = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False, description="topp: P (default 0.9)"
    )
    temperature: float | None = Field(
        None, ge=MIN_TEMPERATURE, allow_inf_nan=False,
        description="softmax(logits / T) (default 1; lower than 1e-6: use beam 1)",
    )  # fmt: skip
    seed: int | None = Field(
        None, ge=0, lt=1 << 63, description="The same seed and sentences, the same samples"
    )
    samples: int | None = Field(
        None, ge=1, le=MAX_BEAM, description="Samples per sentence, the candidates (default 1)"
    )
    prefix: str | list[str | None] | None = Field(
        None, description="Per sentence (one string: the one sentence), text its translation "
        "must start with, scored by the model",
    )  # fmt: skip
    no_repeat_ngram: int = Field(
        0, ge=0, le=MAX_NGRAM, description="No n-gram of this many subword tokens twice"
    )


class Candidate(BaseModel):
    text: str
    score: float = Field(description="log-probability / length penalty: the ranking")
    truncated: bool = Field(description="cut by the length limit before its end")


class TranslateResponse(BaseModel):
    translations: list[list[Candidate]] = Field(
        description="For each sentence, in the order sent, its n-best candidates, best first"
    )


class ErrorResponse(BaseModel):
    error: str
    field: str | None = Field(description="the request's field at fault, if one is")


@dataclass(frozen=True)
class Options:
    """The search settings of a request: sentences batch together only under equal options."""

    beam: int
    n_best: int
    max_length: int | None
    length_penalty: float
    sampling: Sampling | None = None
    no_repeat_ngram: int = 0

    def search(self) -> dict:
        """``Translator.translate_full``'s keyword arguments."""
        lengths = {} if self.max_length is None else dict(max_len_a=0.0, max_len_b=self.max_length)
        return dict(
            beam=self.beam,
            nbest=self.n_best,
            lenpen=self.length_penalty,
            sampling=self.sampling,
            no_repeat_ngram=self.no_repeat_ngram,
            **lengths,
        )


@dataclass(frozen=True)
class Query:
    """A checked request: its sentences encoded once, their target prefixes (None: none), and
    its options. ``alone``: its sentences may not share a batch with another request's (a
    prefix past its length limit fails its batch)."""

    sentences: list[Translation]
    prefixes: list[str | None]
    options: Options

    @property
    def alone(self) -> bool:
        return any(prefix is not None for prefix in self.prefixes)


def parse_query(
    body: bytes,
    limits: Limits,
    encode: Callable[[list[str]], list[list[int]]],
    max_input_tokens: int,
    max_output_tokens: int,
) -> Query:
    """The request body as a Query, or Rejected naming what is wrong (400: not JSON; 422: a
    field of the wrong type or value; 413: a sentence over the token limit)."""
    try:
        request = TranslateRequest.model_validate_json(body)
    except ValidationError as error:
        raise _rejection(error) from None
    texts = [request.text] if isinstance(request.text, str) else request.text
    if not 1 <= len(texts) <= limits.max_sentences:
        message = f"text must hold 1 to {limits.max_sentences} sentences, got {len(texts)}"
        raise Rejected(422, message, "text")
    sampling = _sampling(request)
    most, name = (request.beam, "beam") if sampling is None else (sampling.samples, "samples")
    if request.n_best > most:
        message = f"n_best must be at most {name} ({most}), got {request.n_best}"
        raise Rejected(422, message, "n_best")
    prefixes = _prefixes(request.prefix, len(texts))
    if request.max_length is not None and request.max_length > max_output_tokens:
        message = f"max_length must be at most {max_output_tokens}, got {request.max_length}"
        raise Rejected(422, message, "max_length")
    if request.length_penalty > limits.max_length_penalty:
        message = (
            f"length_penalty must be at most {limits.max_length_penalty}, "
            f"got {request.length_penalty}"
        )
        raise Rejected(422, message, "length_penalty")
    tokens = _encoded(texts, encode)
    for index, ids in enumerate(tokens):
        if len(ids) > max_input_tokens:
            message = (
                f"text[{index}] has {len(ids)} subword tokens, more than the server's limit "
                f"of {max_input_tokens}"
            )
            raise Rejected(413, message, "text")
    # Blank sentences are not translated (an empty answer), as Translator.translate_full does.
    sentences = [
        Translation(t, ids if t.strip() else []) for t, ids in zip(texts, tokens, strict=True)
    ]
    options = Options(
        request.beam,
        request.n_best,
        request.max_length,
        request.length_penalty,
        sampling,
        request.no_repeat_ngram,
    )
    return Query(sentences, prefixes, options)


def _sampling(request: TranslateRequest) -> Sampling | None:
    """The request's sampling, or None (search); a sampling field without ``sampling`` is a 422
    naming it."""
    given = {name: getattr(request, name) for name in SAMPLING_FIELDS}
    if request.sampling is None:
        for name, value in given.items():
            if value is not None:
                raise Rejected(422, f"{name} needs sampling (topk or topp)", name)
        return None
    names = dict(sampling_topk="topk", sampling_topp="topp")
    values = {names.get(k, k): v for k, v in given.items() if v is not None}
    return Sampling(request.sampling, **values)  # each value within bounds (the model's fields)


def _prefixes(prefix: str | list[str | None] | None, count: int) -> list[str | None]:
    """Each sentence's target prefix (None: none); one string serves a one-sentence request."""
    if prefix is None:
        return [None] * count
    prefixes = [prefix] if isinstance(prefix, str) else prefix
    if len(prefixes) != count:
        given = f"{len(prefixes)} prefixes"
        raise Rejected(
            422, f"prefix must hold one text per sentence ({count}), got {given}", "prefix"
        )
    return [p if p and p.strip() else None for p in prefixes]


def _encoded(texts: list[str], encode) -> list[list[int]]:
    """``encode(texts)``; a sentence the tokenizer refuses is a 422 naming it."""
    try:
        return encode(texts)
    except Exception:
        for index, text in enumerate(texts):
            try:
                encode([text])
            except Exception as error:
                message = f"text[{index}] cannot be tokenized: {one_line(error)}"
                raise Rejected(422, message, "text") from None
        raise


def _rejection(error: ValidationError) -> Rejected:
    """The first problem pydantic found, as a Rejected naming its field."""
    problem = error.errors(include_url=False)[0]
    if problem["type"] == "json_invalid":
        return Rejected(400, f"the body is not valid JSON: {problem['msg']}")
    location = problem["loc"]
    if not location:
        return Rejected(422, "the body must be a JSON object with a 'text' field")
    name = str(location[0])
    if problem["type"] == "extra_forbidden":
        expected = ", ".join(TranslateRequest.model_fields)
        return Rejected(422, f"unknown field {name!r} (expected {expected})", name)
    if name == "text" and problem["type"] != "missing":
        return Rejected(422, "text must be a string or a list of strings", name)
    path = name + "".join(f"[{part}]" for part in location[1:])
    value = problem.get("input")
    got = "" if problem["type"] == "missing" else f", got {_shortened(value)}"
    return Rejected(422, f"{path}: {problem['msg']}{got}", name)


def _shortened(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def candidates(translation: Translation) -> list[dict]:
    """A sentence's n-best list as the response holds it (a blank sentence: one empty one)."""
    if not translation.candidates:
        return [{"text": "", "score": 0.0, "truncated": False}]
    return [
        {"text": c.text, "score": c.score, "truncated": not c.ended} for c in translation.candidates
    ]
