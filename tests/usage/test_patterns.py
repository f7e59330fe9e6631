"""The operator's name patterns against hostile names (issue 29): bounded input, RE2 where
installed, a warning at start for patterns Python's engine can take exponential time on."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from exporter.redaction import key_label
from exporter.signals import callers
from exporter.signals.callers import (
    DEFAULT_MODEL_PATTERN,
    DEFAULT_NAME_PATTERN,
    NamePolicy,
    can_backtrack,
    compile_pattern,
)
from exporter.values import MAX_CALLER_CHARS, UsageEvent

HOSTILE = r"(a+)+$"


@pytest.mark.parametrize(
    "pattern, nested",
    [
        (HOSTILE, True),
        (r"(a*)*", True),
        (r"(?:x{1,9})+", True),
        (r"([a-z]+-)*[a-z]+", True),
        (r"((ab)+c)+", True),
        (r"(a|b+)*", True),
        (DEFAULT_NAME_PATTERN, False),
        (DEFAULT_MODEL_PATTERN, False),
        (r"(?:[a-z]{1,9}\.){1,4}", False),
        (r"team-[a-z]+", False),
        (r"(foo|bar)+", False),
        (r"(", False),
    ],
)
def test_nested_repeats_are_told(pattern, nested):
    assert can_backtrack(pattern) is nested


def test_a_backtracking_pattern_is_warned_about_at_start_without_re2(monkeypatch, caplog):
    monkeypatch.setattr(callers, "re2", None)
    caplog.set_level(logging.WARNING)
    NamePolicy(DEFAULT_NAME_PATTERN)
    assert caplog.records == []
    NamePolicy(HOSTILE)
    (record,) = caplog.records
    assert "--callers.name-pattern" in record.getMessage()
    assert "google-re2" in record.getMessage()


def test_a_name_past_the_bound_never_reaches_the_pattern():
    """Readers bound names (MAX_CALLER_CHARS); the policy holds to it too, on a path that
    hands it an event no reader checked: a longer name is hashed without the pattern."""
    policy = NamePolicy(HOSTILE)
    tried: list[str] = []
    policy.fullmatch = lambda name: tried.append(name)  # type: ignore[assignment, misc]
    longest = "a-" * (MAX_CALLER_CHARS // 2)  # no key's look: only the pattern decides
    assert policy.label(longest + "a") == key_label(longest + "a")
    assert tried == []
    policy.label(longest)
    assert tried == [longest]


HOSTILE_RUN = textwrap.dedent(f"""
    from exporter.config import Config
    from exporter.wiring import signals_state
    from exporter.values import UsageEvent
    state = signals_state(Config(callers_name_pattern={HOSTILE!r},
                                 callers_model_pattern={HOSTILE!r}))
    name = "a" * {MAX_CALLER_CHARS - 1} + "!"
    for caller in (name, "a" * 25 + "!", "a" * 26 + "!"):
        state.usage.record(UsageEvent(caller, name, 10), "http")
    print(sorted(caller for caller, _model in state.usage.series))
""")


def test_the_hostile_pattern_and_a_longest_caller_finish_at_once_with_re2():
    """The issue's case: '(a+)+$' and a caller that fails it, here of the longest length a
    reader accepts (Python's engine took 17.7 s on 26 characters). With RE2 (the re2
    extra, in the test dependencies) the process is done within seconds, each such name
    hashed. Run in a process of its own, which the timeout ends if it hangs."""
    pytest.importorskip("re2")
    done = subprocess.run(
        [sys.executable, "-c", HOSTILE_RUN], capture_output=True, text=True, timeout=20, check=True
    )
    assert done.stdout.strip() == str(
        sorted(
            key_label(name)
            for name in ("a" * (MAX_CALLER_CHARS - 1) + "!", "a" * 25 + "!", "a" * 26 + "!")
        )
    )


def test_re2_and_python_agree_on_the_default_patterns():
    """Where RE2 is installed it matches every pattern: on the defaults it says what
    Python's engine says."""
    pytest.importorskip("re2")
    names = [
        "agent-1",
        "team.search_2",
        "a" * 64,
        "a" * 65,
        "caf\u00e9",
        "x y",
        "",
        "qwen/qwen3:8b+q4",
        "a\n",
    ]
    for pattern in (DEFAULT_NAME_PATTERN, DEFAULT_MODEL_PATTERN):
        fast = compile_pattern(pattern)
        import re

        assert [fast(name) is not None for name in names] == [
            re.fullmatch(pattern, name) is not None for name in names
        ]


def test_a_pattern_re2_cannot_compile_falls_back_to_python():
    match = compile_pattern(r"(a)\1")
    assert match("aa") is not None and match("ab") is None


def test_the_events_own_bound_holds_on_every_reader_path():
    """An event a reader hands in has a caller of at most MAX_CALLER_CHARS: the schema says
    so (msgspec checks it on the quick reading) and validate refuses longer ones."""
    import msgspec

    from exporter.usage.event import InvalidEvent, quick_event, validate

    line = b'{"caller": "' + b"a" * (MAX_CALLER_CHARS + 1) + b'", "model": "", "prompt_tokens": 1}'
    with pytest.raises(msgspec.ValidationError):
        quick_event(line)
    with pytest.raises(InvalidEvent) as refused:
        validate({"caller": "a" * (MAX_CALLER_CHARS + 1), "prompt_tokens": 1})
    assert refused.value.reason == "caller_too_long"
    assert UsageEvent("a", "", 1).caller == "a"
