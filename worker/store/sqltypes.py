"""Text columns that keep every Python string intact, NUL included.

PostgreSQL ``text``/``varchar`` cannot hold the NUL character (``\\x00``), yet a custom_id,
a prompt or a model's output may contain one. On PostgreSQL such a string is stored escaped:
a marker (U+FDD0, a Unicode noncharacter) then the text with ``\\`` doubled and NUL written
``\\0``. Strings without a NUL that do not start with the marker, i.e. all ordinary text,
are stored as they are, so existing rows read back unchanged and SQL stays readable.
SQLite stores NUL natively and gets the strings untouched. The column DDL is plain
``Text``/``String``: no migration.
"""

from __future__ import annotations

import re
import sys
from array import array

from sqlalchemy import LargeBinary, String, Text
from sqlalchemy.types import TypeDecorator

MARK = "\ufdd0"
_UNESCAPE = re.compile(r"\\(.)", re.S)


def escape_nul(text: str) -> str:
    """The stored form of ``text`` (injective: ``unescape_nul`` undoes it exactly)."""
    if "\x00" not in text and not text.startswith(MARK):
        return text
    return MARK + text.replace("\\", "\\\\").replace("\x00", "\\0")


def unescape_nul(stored: str) -> str:
    if not stored.startswith(MARK):
        return stored
    return _UNESCAPE.sub(lambda m: "\x00" if m.group(1) == "0" else m.group(1), stored[1:])


def stored_length(text: str) -> int:
    """Characters ``text`` takes in a PostgreSQL column (for length limits such as custom_id's)."""
    return len(escape_nul(text))


class _NulSafe(TypeDecorator):
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None or dialect.name != "postgresql":
            return value
        return escape_nul(value)

    def process_result_value(self, value, dialect):
        if value is None or dialect.name != "postgresql":
            return value
        return unescape_nul(value)


class NulSafeText(_NulSafe):
    impl = Text
    cache_ok = True  # SQLAlchemy reads it from each class itself


class NulSafeString(_NulSafe):
    impl = String
    cache_ok = True


class TokenIds(TypeDecorator):
    """A list of token ids stored as packed little-endian uint32 (4 bytes a token): a prompt
    the producer tokenized travels to the engine without JSON's 6-7 bytes and parse per token."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        packed = array("I", value)
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        packed = array("I")
        packed.frombytes(bytes(value))
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tolist()
