"""What an HTTP request may ask, and its body settled into one call's settings: the body's shape and
bounds (pydantic, unknown fields refused), the server's limits, then the model's own checks
(sdquant.runs.sample.settle_call), every refusal naming the request's field."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..errors import UserError
from ..families.pipeline import SamplingSettings
from ..runs.model import Model
from ..runs.sample import settle_call

# A call setting as settle_call names it in its messages, and the request field that gave it.
FIELD_OF_SETTING = {"height": "size", "width": "size", "num_frames": "frames", "num_images_per_prompt": "n",
                    "prompts": "prompt", "steps": "steps", "seed": "seed", "guidance_scale": "guidance_scale",
                    "guidance_scale_2": "guidance_scale_2", "negative_prompt": "negative_prompt", "fps": "fps"}
SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


class RequestError(Exception):
    """A request refused before it reaches a replica: its HTTP status, the field at fault (None:
    the request as a whole) and the error's type in OpenAI's vocabulary."""

    def __init__(self, message: str, param: str | None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


class Asked(BaseModel):
    """What an image and a video request both may ask; strict, so a number given as text is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    model: Optional[str] = None
    size: Optional[str] = None
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    steps: Optional[int] = Field(None, ge=1)
    guidance_scale: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    negative_prompt: Optional[str] = None


class ImageRequest(Asked):
    """POST /v1/images/generations, OpenAI's fields and ours (seed, steps, guidance, negative prompt)."""

    n: int = Field(1, ge=1)
    response_format: Literal["b64_json"] = "b64_json"


class VideoRequest(Asked):
    """POST /v1/videos: one video of `frames` frames (4k + 1 for Wan2.2) at `fps` in its MP4."""

    frames: Optional[int] = Field(None, ge=1)
    fps: Optional[int] = Field(None, ge=1, le=120)
    guidance_scale_2: Optional[float] = Field(None, ge=0, allow_inf_nan=False)


@dataclass(frozen=True)
class Served:
    """What the ingress checks a request against: the model (read without weights), the call
    defaults (the config's sampling.*) and the server's bounds."""

    model: Model
    defaults: dict
    max_images_per_request: int
    max_prompt_chars: int
    max_steps: int

    @property
    def name(self) -> str:
        return self.model.name


def settle_request(body: Asked, served: Served) -> SamplingSettings:
    """The call `body` asks for, checked against the server's bounds and the model; a RequestError
    naming the field at fault otherwise."""
    if body.model is not None and body.model != served.name:
        raise RequestError(f"model={body.model!r}: this server serves {served.name!r}", "model")
    for field in ("prompt", "negative_prompt"):
        text = getattr(body, field)
        if text is not None and len(text) > served.max_prompt_chars:
            raise RequestError(f"{field} has {len(text)} characters, more than this server takes "
                               f"({served.max_prompt_chars})", field)
    if not body.prompt.strip():
        raise RequestError("prompt is empty: describe the image or video to draw", "prompt")
    if body.steps is not None and body.steps > served.max_steps:
        raise RequestError(f"steps={body.steps} is more than this server draws ({served.max_steps})", "steps")
    images = getattr(body, "n", 1)
    if images > served.max_images_per_request:
        raise RequestError(f"n={images} is more than this server draws for one request "
                           f"({served.max_images_per_request})", "n")
    height, width = _size(body.size)
    asked = {"height": height, "width": width, "seed": body.seed if body.seed is not None else fresh_seed(), "steps": body.steps,
             "guidance_scale": body.guidance_scale, "negative_prompt": body.negative_prompt,
             "num_images_per_prompt": images, "num_frames": getattr(body, "frames", None),
             "fps": getattr(body, "fps", None), "guidance_scale_2": getattr(body, "guidance_scale_2", None)}
    given = {key: value for key, value in asked.items() if value is not None}
    try:
        return settle_call(served.model, [body.prompt], **{**served.defaults, **given})
    except UserError as error:
        raise RequestError(*named_field(str(error))) from None


def fresh_seed() -> int:
    """A request's seed where it gives none: the same prompt then draws a new image each time, as
    OpenAI's endpoint does, and the answer's seed draws it again."""
    return secrets.randbelow(2**31)


def _size(size: str | None) -> tuple[int | None, int | None]:
    """(height, width) of "WxH", as OpenAI writes a size; (None, None): the model's own."""
    if size is None:
        return None, None
    match = SIZE.match(size)
    if match is None:
        raise RequestError(f"size={size!r}: give it as WIDTHxHEIGHT, e.g. 1024x1024", "size")
    return int(match.group(2)), int(match.group(1))


def named_field(message: str) -> tuple[str, str | None]:
    """A settle_call message said in the request's words, and the request field it is about."""
    setting = re.match(r"\w+", message)
    field = FIELD_OF_SETTING.get(setting.group(0)) if setting else None
    if field is None:
        return message, None
    return (message if field == setting.group(0) else f"{field}: {message}"), field
