"""The scanner's fast path for label sets as prometheus_client writes them agrees with the
general parser on every label set, escapes included, and never accepts a malformed one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exporter.engine.parse import ParseError, _parse_labels_escaped, _simple_labels

NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True)
VALUES = st.text(max_size=20)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@given(st.dictionaries(NAMES, VALUES, min_size=1, max_size=6))
def test_fast_path_agrees_with_the_general_parser(labels: dict[str, str]) -> None:
    line = (
        "vllm:x{" + ",".join(f'{key}="{escape(value)}"' for key, value in labels.items()) + "} 1.0"
    )
    start = line.index("{")
    general = _parse_labels_escaped(line, start, 1)
    assert general == (labels, line.index("} 1.0") + 1)
    fast = _simple_labels(line, start)
    if fast is not None:
        assert fast == general
    if all(value.replace(".", "").replace("/", "").isalnum() for value in labels.values()):
        assert fast == general  # the common case takes the fast path


@pytest.mark.parametrize(
    "labels", ['{a=1,b="2"}', '{a="1"b="2"}', '{a="1",}', '{1a="x"}', '{a-b="x"}', '{="x"}']
)
def test_fast_path_never_accepts_a_malformed_set(labels: str) -> None:
    line = f"vllm:x{labels} 1.0"
    assert _simple_labels(line, line.index("{")) is None


@pytest.mark.parametrize("labels", ['{a=1,b="2"}', '{a="1"b="2"}', '{1a="x"}'])
def test_malformed_sets_are_rejected(labels: str) -> None:
    line = f"vllm:x{labels} 1.0"
    with pytest.raises(ParseError):
        _parse_labels_escaped(line, line.index("{"), 1)
