"""The shape a chat request's messages must have, checked where they are tokenized.

Torch-free, so a worker process that tokenizes a conversation for its engine applies the very
rule the engine does (``LLMEngine.apply_chat_template``)."""

from __future__ import annotations

from typing import Any


def check_messages(messages: Any) -> None:
    """Raise ``ValueError`` naming what is wrong unless ``messages`` is a non-empty list of
    ``{role, content}`` objects with string roles and contents."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")


def well_formed(messages: Any) -> bool:
    """``check_messages`` as a test."""
    try:
        check_messages(messages)
    except ValueError:
        return False
    return True
