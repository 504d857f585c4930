"""OpenAI's image parts: chat's `{"type": "image_url", "image_url": {"url", "detail"}}` (the
Responses API's `input_image` is translated into it, responses_request.py; so are Anthropic's
`image` blocks, gateway/anthropic/request.py), found in a conversation as gateway/media ImageRefs,
and the content parts a vision model's chat template reads (`{"type": "image"}` where each image
goes, `{"type": "text"}` around them: transformers' convention, which its processors' templates
render as the model's image token).

`detail` (auto, low, high) is accepted and checked: "low" asks the engine not to split the image
into tiles (ImageData.split False: Idefics3's global view only, far fewer image tokens); "auto"
and "high" leave the model's image processor to decide (Idefics3 tiles every image)."""
from __future__ import annotations

from ..errors import invalid
from ..media import ImageRef
from .schemas import ChatMessage, ContentPart

IMAGE_PART = "image_url"
ORIGIN = "x_switchyard_param"  # where a translated part came from (Responses, Anthropic), for errors
_DETAILS = ("auto", "low", "high")


def image_refs(messages: list[ChatMessage]) -> list[ImageRef]:
    """Every image part of the conversation, in the order the template renders them."""
    refs = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            refs += [_ref(part, f"messages.{i}.content.{j}") for j, part in enumerate(message.content)
                     if part.type == IMAGE_PART]
    return refs


def _ref(part: ContentPart, param: str) -> ImageRef:
    extra = part.model_extra or {}
    param = extra.get(ORIGIN) or param
    value = extra.get(IMAGE_PART)
    url, detail = (value, None) if isinstance(value, str) else \
        (value.get("url"), value.get("detail")) if isinstance(value, dict) else (None, None)
    if not isinstance(url, str) or not url:
        raise invalid("an image_url part needs image_url.url (an http(s) or data URL)", param)
    if detail is not None and detail not in _DETAILS:
        raise invalid(f"image_url.detail must be one of {', '.join(_DETAILS)}; got {detail!r}",
                      f"{param}.image_url.detail")
    return ImageRef(param, url=url, split=detail != "low")


def has_images(content) -> bool:
    return isinstance(content, list) and any(part.type == IMAGE_PART for part in content)


def template_parts(content: list[ContentPart], text_of) -> list[dict]:
    """A message's parts as a vision template reads them; `text_of(part)` is a text part's text."""
    return [{"type": "image"} if part.type == IMAGE_PART else {"type": "text", "text": text_of(part)}
            for part in content]


def as_parts(messages: list[dict]) -> list[dict]:
    """Every message's content as parts (vision templates index content[0]['type'])."""
    return [{**m, "content": [{"type": "text", "text": m.get("content") or ""}]}
            if not isinstance(m.get("content"), list) else m for m in messages]
