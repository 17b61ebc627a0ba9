"""The wire contract of `POST /v1/systemone` (TypeSafe Jev, as `typesafe-sdk` and `jevcompat` define it).

These pydantic models are the single source of truth for request validation and for the OpenAPI
document: every limit a request can break is a constraint here, so the 422 a client gets and the
schema it reads agree. Field order and names follow the official OpenAPI file.

Deviations from the official schema, all stricter and all documented in docs/API.md:
- choice questions take 2..255 options and score questions 2..10 levels (the documented ranges,
  lev_jax.domain.CHOICE_OPTIONS / SCORE_LEVELS);
- question objects and noul criteria reject unknown fields (a typo such as `instruction` would
  otherwise be answered silently without the text it meant to send);
- cheap caps on the request's size (lev_jax.domain's wire limits): questions, assets, string lengths
  and the characters of the state and of the whole request, so a request the engine could never
  answer is refused here, before anything is tokenized or decoded.

A validated question goes to the engine as `question.model_dump()`: the wire shape is the engine's
shape (lev_jax.readout renders structured text and reads noul criteria keyed true/false itself).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lev_jax import domain
from lev_jax.domain import CHOICE_OPTIONS, SCORE_LEVELS

Text = Annotated[str, StringConstraints(max_length=domain.MAX_TEXT_CHARS)]
# Text a client may send wherever the API takes "content": a string, a JSON object or an array
# (a structured value's characters count towards the request's total: SystemOneRequest).
StructuredText = Text | dict[str, Any] | list[Any]

NonEmptyStr = Annotated[str, StringConstraints(min_length=1, max_length=domain.MAX_TEXT_CHARS)]
Id = Annotated[str, StringConstraints(min_length=1, max_length=domain.MAX_ID_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoulCriteria(_Strict):
    """What counts as a yes (`true`) and a no (`false`) answer. Either side may be left out or null."""

    true: StructuredText | None = Field(None, description="What counts as a yes answer.")
    false: StructuredText | None = Field(None, description="What counts as a no answer.")


class NoulQuestion(_Strict):
    type: Literal["noul"] = Field(description="A yes/no question or statement.")
    instructions: StructuredText | None = Field(None, description="The yes/no question or statement to evaluate.")
    criteria: NoulCriteria | None = Field(None, description="Criteria clarifying what counts as yes or no.")


class ChoiceQuestion(_Strict):
    type: Literal["choice"] = Field(description="Select one of the options in criteria.")
    instructions: StructuredText | None = Field(None, description="What to decide when choosing an option.")
    criteria: Annotated[
        dict[NonEmptyStr, StructuredText | None],
        Field(
            min_length=CHOICE_OPTIONS[0],
            max_length=CHOICE_OPTIONS[1],
            description=f"Option names ({CHOICE_OPTIONS[0]} to {CHOICE_OPTIONS[1]}, non-empty) mapped to a "
            "description, or null for none.",
        ),
    ]


class ScoreQuestion(_Strict):
    type: Literal["score"] = Field(description="Rate against ordered levels; level i scores i.")
    instructions: StructuredText | None = Field(None, description="What to rate.")
    criteria: Annotated[
        list[StructuredText],
        Field(
            min_length=SCORE_LEVELS[0],
            max_length=SCORE_LEVELS[1],
            description=f"{SCORE_LEVELS[0]} to {SCORE_LEVELS[1]} ordered level descriptions; a level's position "
            'is its score. The map form ({"0": ...}) is not accepted.',
        ),
    ]


class BoxQuestion(_Strict):
    """Accepted by the schema (the official API has it) but answered 400: this server reads decisions
    (noul, choice, score) and locates nothing, also with a vision model."""

    type: Literal["box"] = Field(description="Locate something in an image (not answered here).")
    instructions: StructuredText | None = Field(None, description="What to locate.")


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion, Field(discriminator="type")]


_ASSET_FORMS = {"anyOf": [{"required": ["part"]}, {"required": ["format", "data_base64"]}]}


class Asset(_Strict):
    """An image: inline (`format` + `data_base64`) or, in a multipart request, a raw part (`part`)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_ASSET_FORMS)

    type: Literal["image"] = Field("image", description="Identifies an image asset.")
    format: Literal["png", "jpg", "jpeg"] = Field(None, description="Image format; required with data_base64.")
    data_base64: Annotated[str, StringConstraints(max_length=domain.MAX_ASSET_BASE64_CHARS)] = Field(
        None, description="Base64-encoded image bytes."
    )
    part: Id = Field(
        None,
        description="Multipart part holding the raw bytes (then data_base64 is ignored): the name of a part this "
        "request carries besides `request`, named by no other asset. A name the request does not carry (and any "
        "`part` in an application/json body, which has no parts) is answered 400: a cross-reference JSON Schema "
        "cannot state.",
    )

    @model_validator(mode="after")
    def _has_data(self) -> Asset:
        if self.part is None and (self.data_base64 is None or self.format is None):
            raise ValueError("an asset needs format and data_base64 or, in a multipart request, part")
        return self


def text_chars(value: Any, limit: int) -> int:
    """Characters in the strings (keys too) of a JSON value, counted up to just past `limit`: a walk
    without recursion that stops as soon as the answer is "too many"."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += sum(len(k) for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def _too_long(what: str, limit: int) -> PydanticCustomError:
    return PydanticCustomError(
        "too_long", "{what} has more than {max_chars} characters in its strings", {"what": what, "max_chars": limit}
    )


class SystemOneRequest(BaseModel):
    """Unknown top-level fields are ignored. Limits the schema states per field, and two it cannot:
    the state's strings hold at most MAX_STATE_CHARS characters, the state's and questions' together
    at most MAX_REQUEST_CHARS (422 past either)."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "description": f"Unknown top-level fields are ignored. Besides the limits each field states: the "
            f"strings of `state` (keys included, whatever its form) hold at most {domain.MAX_STATE_CHARS} "
            f"characters, those of `state` and `questions` together at most {domain.MAX_REQUEST_CHARS} (422)."
        },
    )

    model: Annotated[str, StringConstraints(max_length=domain.MAX_ID_CHARS)] = Field(
        description="Model name: `jev-latest` or a name from GET /v1/models.", examples=["jev-latest"]
    )
    state: Annotated[str, StringConstraints(max_length=domain.MAX_STATE_CHARS)] | dict[str, Any] | list[Any] = Field(
        description="The content every question refers to: a string, an object or an array.",
        examples=["I was charged twice. Please help."],
    )
    questions: Annotated[
        dict[Id, Question],
        Field(
            min_length=1,
            max_length=domain.MAX_QUESTIONS,
            description=f"1 to {domain.MAX_QUESTIONS} questions keyed by any non-empty id; answers use the same ids.",
        ),
    ]
    assets: Annotated[dict[Id, Asset], Field(min_length=1, max_length=domain.MAX_ASSETS)] | None = Field(
        None,
        description=f"Up to {domain.MAX_ASSETS} image assets keyed by the placeholder used for them in state, "
        "instructions or criteria.",
    )

    @field_validator("state", mode="before")
    @classmethod
    def _state_chars(cls, state: Any) -> Any:
        # before the state is validated (a string's own max_length says the same, located there)
        if not isinstance(state, str) and text_chars(state, domain.MAX_STATE_CHARS) > domain.MAX_STATE_CHARS:
            raise _too_long("The state", domain.MAX_STATE_CHARS)
        return state

    @model_validator(mode="before")
    @classmethod
    def _request_chars(cls, doc: Any) -> Any:
        if isinstance(doc, dict):
            text = [doc.get("state"), doc.get("questions")]
            if text_chars(text, domain.MAX_REQUEST_CHARS) > domain.MAX_REQUEST_CHARS:
                raise _too_long("The request (state and questions)", domain.MAX_REQUEST_CHARS)
        return doc


# ---------------------------------------------------------------- responses (for the OpenAPI document)


class NoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(ge=0, le=1, description="Probability of yes.")


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str = Field(description="The most probable option.")
    confidence: float = Field(ge=0, le=1, description="(max p - 1/n) / (1 - 1/n).")
    probabilities: dict[str, float] = Field(description="Probability of every option, keyed by option name; sums to 1.")


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="Expected level: sum of i * p_i.")
    confidence: float = Field(
        ge=0, le=1, description="1 - spread around the mode / spread of the uniform distribution."
    )
    legend: dict[str, StructuredText] = Field(description='"0".."n-1" mapped to the request\'s levels.')
    probabilities: dict[str, float] = Field(description='Probability of every level, keyed "0".."n-1"; sums to 1.')


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int = Field(
        ge=0, description="Tokens the model read: the state prefix once, plus every question row."
    )
    output_tokens: int = Field(
        ge=0, description="One per question: one answer position is read per question; nothing is generated."
    )


class SystemOneResponse(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"description": "Extension fields are prefixed `x_`."})

    model: str = Field(description="The served model's name (also when the request said jev-latest).")
    answers: dict[str, Answer]
    usage: Usage
    x_cached_input_tokens: int = Field(
        0,
        ge=0,
        description="Extension: of usage.input_tokens, the state-prefix tokens "
        "reused from an earlier request with the same state.",
    )
    x_image_tokens: int = Field(
        0, ge=0, description="Extension (requests with images): of usage.input_tokens, the images' tokens."
    )
    x_cached_image_tokens: int = Field(
        0,
        ge=0,
        description="Extension: of x_image_tokens, those whose vision features were cached (the same "
        "picture seen before): no vision tower ran for them.",
    )
    x_readout: dict[str, Literal["mode_a", "mode_a_grouped", "mode_b"]] = Field(
        default_factory=dict,
        description="Extension: how each question was read: `mode_a` (one single-token label code per "
        "option), `mode_a_grouped` (options in groups, then the group winners), `mode_b` (a trained head "
        "scoring a reserved marker after each option, one row).",
    )


class ModelInfo(BaseModel):
    name: str
    description: str
    release_date: str = Field(description="YYYY-MM-DD")


class ModelList(BaseModel):
    models: list[ModelInfo]


class ErrorDetail(BaseModel):
    error_type: str = Field(
        description="api_usage_error, authentication_error, request_too_large, "
        "rate_limit_error, overloaded_error, timeout_error, not_found_error, internal_error"
    )
    message: str


class ErrorResponse(BaseModel):
    detail: ErrorDetail


class ValidationErrorItem(BaseModel):
    loc: list[str | int] = Field(description='["body", ...path to the invalid value]')
    msg: str
    type: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class HTTPValidationError(BaseModel):
    detail: list[ValidationErrorItem]
