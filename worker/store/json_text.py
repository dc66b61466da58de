"""``json.dumps``'s exact text, without its per-call Python wrapper.

A million-line ingest writes each job's messages and params as JSON text (two dumps a row):
``json.dumps`` spends ~3.5 us a call building the encoder's arguments and wrapping
``iterencode``, ~1 us of which is the encoding itself. ``dumps`` calls the same C encoder the
standard library builds for ``json.dumps(obj)`` with its default options (ASCII escapes,
``", "`` and ``": "`` separators, NaN allowed) directly. The only dropped step is the check for
circular containers, which values parsed from JSON cannot form. Where the C encoder is missing
(another Python implementation) it is ``json.dumps`` itself.
"""

from __future__ import annotations

import json
from json import encoder as _encoder
from typing import Any, Callable

_C_ENCODER = getattr(_encoder, "c_make_encoder", None)


def _make_dumps() -> Callable[[Any], str]:
    if _C_ENCODER is None:  # pragma: no cover - CPython always has it
        return json.dumps
    encode = _C_ENCODER(None, json.JSONEncoder().default, _encoder.encode_basestring_ascii, None,
                        ": ", ", ", False, False, True)

    # The encoder is a default argument, not a closure: psycopg caches a JSON dumper per
    # function code and logs "using a closure in a dumps/loads function may cause a resource
    # leak" on every connection for a closure (SQLAlchemy hands it this as json_serializer).
    def dumps(obj: Any, _encode: Any = encode) -> str:
        """``json.dumps(obj)``, for values without circular references (e.g. parsed JSON)."""
        return "".join(_encode(obj, 0))

    return dumps


dumps = _make_dumps()
