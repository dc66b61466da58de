"""worker.store.json_text.dumps writes exactly what json.dumps writes, for any JSON value."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.store.json_text import dumps

_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-10**40, max_value=10**40)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text())  # lone surrogates included
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text() | st.integers(), inner, max_size=4), max_leaves=20)


@settings(max_examples=500, deadline=None)
@given(_VALUES)
def test_the_same_text_as_json_dumps(value):
    assert dumps(value) == json.dumps(value)


@pytest.mark.parametrize("value", [float("nan"), -math.inf, "\ud800", "é\n\"", [], {}, {1: [None, -0.0]}, 10**100])
def test_edge_values(value):
    assert dumps(value) == json.dumps(value)


def test_what_json_cannot_encode_raises_as_json_dumps_does():
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps({"a": object()})
    with pytest.raises(TypeError):
        dumps({(1, 2): 3})


def test_dumps_is_no_closure():
    """psycopg logs a resource-leak warning on every connection for a closure used as the JSON
    dumper (SQLAlchemy installs ``json_text.dumps`` as one): it spammed every PostgreSQL worker."""
    assert dumps.__closure__ is None
