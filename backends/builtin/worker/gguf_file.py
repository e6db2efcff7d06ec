"""Reading a GGUF file's metadata, shared by the weights' loader and the tokenizer."""

from __future__ import annotations


def gguf_field(reader, name: str, default=None):
    """A GGUF metadata value, or `default` where the file has none."""
    field = reader.fields.get(name)
    return default if field is None else field.contents()
