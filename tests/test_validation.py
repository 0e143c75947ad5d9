"""Native request validation: a table of good and bad bodies."""

import pytest

from inference_api.request_errors import RequestError
from inference_api.web.dialects.native.protocol import parse_native

GOOD = [
    ({"text": "hi"}, dict(temperature=1.0, top_k=10, top_p=0.9, max_tokens=128, stop=(), seed=None)),
    (
        {"text": "hi", "temperature": "1", "top_k": "40", "top_p": "0.9", "max_tokens": "32"},
        dict(temperature=1.0, top_k=40, top_p=0.9, max_tokens=32),
    ),
    ({"text": "hi", "temperature": 0, "top_k": 1, "top_p": 1, "max_tokens": 2048}, dict(temperature=0, top_k=1)),
    ({"text": "hi", "temperature": None, "top_k": None}, dict(temperature=1.0, top_k=10)),
    ({"text": "hi", "stop_sequence": "."}, dict(stop=(".",))),
    ({"text": "hi", "stop_sequence": ["a", "bc", "\n", "END"]}, dict(stop=("a", "bc", "\n", "END"))),
    ({"text": "hi", "stop_sequence": "x" * 512}, dict(stop=("x" * 512,))),
    ({"text": "hi", "seed": 7}, dict(seed=7)),
    ({"text": "hi", "seed": "12345678901234567890"}, dict(seed=12345678901234567890)),
    ({"text": "hi", "top_k": 40.0}, dict(top_k=40)),
    ({"text": "hi", "session_id": "abc"}, dict()),
]


@pytest.mark.parametrize("body,expected", GOOD)
def test_good_bodies(body, expected):
    req = parse_native(body)
    for name, value in expected.items():
        assert getattr(req.params, name) == value, name


def test_flags_and_defaults():
    req = parse_native({"text": "hi", "return_prompt": True, "stream": False})
    assert req.return_prompt and not req.stream and req.text == "hi"
    assert parse_native({"text": "hi"}).stream is True


BAD = [
    ({}, "text"),
    ({"text": ""}, "text"),
    ({"text": 5}, "text"),
    ({"text": "hi", "temperature": -0.1}, "temperature"),
    ({"text": "hi", "temperature": 100.5}, "temperature"),
    ({"text": "hi", "temperature": "hot"}, "temperature"),
    ({"text": "hi", "temperature": " "}, "temperature"),  # a blank string is no number (was a 500)
    ({"text": "hi", "temperature": True}, "temperature"),
    ({"text": "hi", "temperature": float("nan")}, "temperature"),
    ({"text": "hi", "temperature": "inf"}, "temperature"),
    ({"text": "hi", "top_k": 0}, "top_k"),
    ({"text": "hi", "top_k": 1001}, "top_k"),
    ({"text": "hi", "top_k": 2.5}, "top_k"),
    ({"text": "hi", "top_k": [1]}, "top_k"),
    ({"text": "hi", "top_p": 0}, "top_p"),
    ({"text": "hi", "top_p": 1.01}, "top_p"),
    ({"text": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text": "hi", "max_tokens": 2049}, "max_tokens"),
    ({"text": "hi", "stop_sequence": ""}, "stop_sequence"),
    ({"text": "hi", "stop_sequence": list("abcdefghi")}, "stop_sequence"),  # over the default 8
    ({"text": "hi", "stop_sequence": ["a", ""]}, "stop_sequence"),
    ({"text": "hi", "stop_sequence": 3}, "stop_sequence"),
    ({"text": "hi", "stop_sequence": ["ok", "x" * 513]}, "stop_sequence"),
    ({"text": "hi", "return_prompt": "yes"}, "return_prompt"),
    ({"text": "hi", "stream": 1}, "stream"),
    ({"text": "hi", "seed": 1.5}, "seed"),
    ({"text": "hi", "seed": "x"}, "seed"),
    ({"text": "hi", "bogus": 1}, "bogus"),
]


@pytest.mark.parametrize("body,field", BAD)
def test_bad_bodies_name_the_field(body, field):
    with pytest.raises(RequestError) as err:
        parse_native(body)
    assert err.value.kind == "invalid"
    assert field in err.value.message
