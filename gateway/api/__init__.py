"""The HTTP surfaces (`openai`, `tgi`, `admin`, `health`, `metrics`) and what their request
bodies share."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from backends.base import MAX_TOKENS

TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


class ClientBody(BaseModel):
    """A client's JSON body. JSON's `\\u` escapes can spell a lone surrogate, which is no Unicode
    text and made encoding the prompt raise: refused here, naming where it is."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        where = _lone_surrogate(data, "")
        if where is not None:
            raise ValueError(f"{where or 'the body'} is not valid Unicode text (it holds a lone surrogate)")
        return data


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) in `value` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = [(str(key), item) for key, item in value.items()]
        for key, _ in items:
            if _lone_surrogate(key, path) is not None:
                return f"{path}.{key!r}" if path else repr(key)
    elif isinstance(value, list):
        items = [(str(index), item) for index, item in enumerate(value)]
    else:
        return None
    for key, item in items:
        found = _lone_surrogate(item, f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None
