"""Following JSONL files: appends, rotation, truncation, partial lines, bad lines.

The follower is driven poll by poll (no sleeps, no clock), so every interleaving of writer
and reader below is exact. Each event carries a sequence number in ``prompt_tokens`` so the
tests can say precisely which events were read, and that none was read twice.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.config import Config
from exporter.usage.event import InvalidEvent, validate
from exporter.usage.tail import (
    GONE_IDLE_POLLS,
    MAX_LINE_BYTES,
    READ_CHUNK_BYTES,
    FileFollower,
    follow,
)
from exporter.values import UsageEvent
from exporter.wiring import file_follower
from tests.usage.conftest import make_state
from tests.usage.test_quick_row import exactly
from tests.usage.test_quick_row import lines as native_lines


def line(seq: int, caller: str = "agent") -> str:
    return json.dumps({"caller": caller, "prompt_tokens": seq}) + "\n"


class Recorder:
    def __init__(self) -> None:
        self.events: list[UsageEvent] = []
        self.rejected: list[str] = []
        self.batches = 0  # record_events calls

    def record_events(self, events: list[UsageEvent]) -> None:
        self.batches += 1
        self.events.extend(events)

    @property
    def seqs(self) -> list[int]:
        return [event.prompt_tokens for event in self.events]


def follower(pattern: str | Path, from_start: bool = False) -> tuple[FileFollower, Recorder]:
    seen = Recorder()
    return FileFollower(
        [str(pattern)], validate, seen.record_events, seen.rejected.append, from_start=from_start
    ), seen


def drain(tail: FileFollower) -> None:
    """Poll until nothing is left to read now (each poll() is one bounded step)."""
    while tail.poll():
        pass


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


def test_starts_at_the_end_by_default(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1) + line(2))
    tail, seen = follower(path)
    tail.poll()
    assert seen.seqs == []
    append(path, line(3))
    tail.poll()
    assert seen.seqs == [3]
    tail.close()


def test_from_start_replays(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1) + line(2))
    tail, seen = follower(path, from_start=True)
    tail.poll()
    append(path, line(3))
    tail.poll()
    tail.poll()
    assert seen.seqs == [1, 2, 3]
    tail.close()


def test_starting_at_the_end_of_a_half_written_line_skips_it(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1) + line(2)[:10])
    tail, seen = follower(path)
    tail.poll()
    append(path, line(2)[10:] + line(3))
    tail.poll()
    assert seen.seqs == [3]
    assert seen.rejected == []
    tail.close()


def test_a_partial_last_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text("")
    tail, seen = follower(path)
    tail.poll()
    text = line(1)
    pieces = [text[:3], text[3:15], text[15:-1]]
    for piece in pieces:
        append(path, piece)
        tail.poll()
        assert seen.events == [] and seen.rejected == []
    append(path, "\n")
    tail.poll()
    assert seen.seqs == [1]
    tail.close()


def test_files_appearing_later_are_read_from_their_start(tmp_path):
    tail, seen = follower(tmp_path / "*.jsonl")
    tail.poll()
    (tmp_path / "a.jsonl").write_text(line(1) + line(2))
    tail.poll()
    assert seen.seqs == [1, 2]
    tail.close()


def test_rotation_rename_then_create_loses_nothing_counts_nothing_twice(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1))
    tail, seen = follower(path, from_start=True)
    tail.poll()
    append(path, line(2))  # written after our last poll, before the rotation
    os.rename(path, tmp_path / "usage.jsonl.1")
    append(tmp_path / "usage.jsonl.1", line(3))  # the writer had not reopened yet
    path.write_text(line(4))  # the writer's new file
    tail.poll()
    append(path, line(5))
    for _ in range(GONE_IDLE_POLLS + 1):  # idle that long, the old file is let go
        tail.poll()
    assert sorted(seen.seqs) == [1, 2, 3, 4, 5]
    assert len(tail.files) == 1
    assert tail.rotations == 0  # the old name left the glob: not a rename we follow
    tail.close()


def test_rotation_when_the_glob_matches_the_rotated_name_too(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1))
    tail, seen = follower(tmp_path / "usage.jsonl*", from_start=True)
    tail.poll()
    append(path, line(2))
    os.rename(path, tmp_path / "usage.jsonl.1")
    path.write_text(line(3))
    tail.poll()
    append(tmp_path / "usage.jsonl.1", line(4))
    append(path, line(5))
    for _ in range(5):
        tail.poll()
    assert sorted(seen.seqs) == [1, 2, 3, 4, 5]
    assert tail.rotations == 1
    tail.close()


def test_truncation_is_noticed_and_the_new_content_read_once(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1) + line(2))
    tail, seen = follower(path, from_start=True)
    tail.poll()
    with open(path, "w", encoding="utf-8"):  # copytruncate / ": > file"
        pass
    tail.poll()
    append(path, line(3))
    tail.poll()
    tail.poll()
    assert seen.seqs == [1, 2, 3]
    assert tail.truncations == 1
    tail.close()


def test_truncated_and_refilled_past_the_old_position_between_two_polls(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1))
    tail, seen = follower(path, from_start=True)
    tail.poll()
    old_size = path.stat().st_size
    refill = "".join(line(seq, caller="other") for seq in range(10, 20))
    assert len(refill) > old_size
    path.write_text(refill)  # truncates and writes more than was there
    tail.poll()
    assert seen.seqs == [1] + list(range(10, 20))
    assert tail.truncations == 1
    tail.close()


def test_a_bad_line_is_rejected_and_the_rest_go_on(tmp_path):
    path = tmp_path / "usage.jsonl"
    tail, seen = follower(path, from_start=True)
    path.write_text(
        line(1) + "{not json\n" + json.dumps({"caller": "a"}) + "\n" + "\xff\xfe\n" + line(2)
    )
    tail.poll()
    assert seen.seqs == [1, 2]
    assert seen.rejected == ["malformed_json", "missing_prompt_tokens", "malformed_json"]
    tail.close()


def test_a_line_that_never_ends_is_rejected_once_and_skipped(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text("")
    tail, seen = follower(path)
    tail.poll()
    append(path, line(1) + "x" * (MAX_LINE_BYTES + 10))
    drain(tail)  # one poll() reads POLL_BUDGET_BYTES at most
    append(path, "y" * 1000)
    drain(tail)
    append(path, "z" * 10 + "\n" + line(2))
    drain(tail)
    assert seen.seqs == [1, 2]
    assert seen.rejected == ["line_too_long"]
    tail.close()


def test_a_deleted_file_is_drained_then_released_with_its_last_line(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1))
    tail, seen = follower(path, from_start=True)
    tail.poll()
    with open(path, "a", encoding="utf-8") as writer:
        writer.write(line(2) + line(3).rstrip("\n"))  # the writer never ends its last line
        writer.flush()
        os.unlink(path)
        for _ in range(5):
            tail.poll()
    assert seen.seqs == [1, 2, 3]
    assert tail.files == {}


def test_backlog_is_read_in_slices(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text("".join(line(seq) for seq in range(1, 2001)))
    tail, seen = follower(path, from_start=True)
    polls = 1
    while tail.poll(budget=4096):
        polls += 1
    assert polls > 5
    assert seen.seqs == list(range(1, 2001))
    tail.close()


async def test_follow_counts_into_the_state_and_stops_on_cancel(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(line(1))
    config = Config(
        usage_file=(str(tmp_path / "*.jsonl"),),
        usage_file_from_start=True,
        usage_file_poll_interval=0.01,
    )
    state = make_state(usage_file=config.usage_file)
    task = asyncio.ensure_future(
        follow(file_follower(config, state.usage), config.usage_file_poll_interval)
    )
    append(path, line(2) + "garbage\n")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while state.usage.events.get("file", 0) < 2 and loop.time() < deadline:
        await asyncio.sleep(0.01)  # no event to await: the tailer polls the file
    assert state.usage.events["file"] == 2
    assert state.usage.rejected == {("file", "malformed_json"): 1}
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert done and task.cancelled()


# --- the same reading as POST /v1/usage -----------------------------------------------------


def reference(line: bytes) -> tuple[str, Any] | None:
    """How ``POST /v1/usage`` reads one NDJSON line (docs/metrics.md, Rejection reasons): None
    for a blank line, ("row", the row) or ("rejected", the reason)."""
    line = line.strip(b" \t\r")
    if line.startswith(b"\xef\xbb\xbf"):
        line = line[3:]
    if not line:
        return None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return ("rejected", "bad_encoding")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return ("rejected", "malformed_json")
    try:
        return ("row", validate(value))
    except InvalidEvent as err:
        return ("rejected", err.reason)


ODD_LINES = st.one_of(
    st.binary(max_size=40).map(lambda raw: raw.replace(b"\n", b" ")),
    st.sampled_from(
        [
            b"",
            b"  \r",
            b"\xef\xbb\xbf",
            b"garbage",
            b"[1, 2]",
            b"null",
            b'{"caller": "a"}',
            b'{"caller": "a", "prompt_tokens": 1e400}',
            b'{"caller": "a", "prompt_tokens": NaN}',
            b'{"caller": "\\ud800", "prompt_tokens": 1}',
            b'{"caller": "a", "prompt_tokens": 12345678901234567890123}',
            b'{"caller": "a", "prompt_tokens": 1, "status": 123456789012345678901}',
            b"[" * 5000 + b"]" * 5000,
            b'{"caller": "caf\xc3\xa9", "prompt_tokens": 5}',
            b'{"caller": "a", "prompt_tokens": 5, "x": "\xff"}',
        ]
    ),
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(lines=st.lists(st.one_of(native_lines(), ODD_LINES), max_size=40))
def test_a_followed_line_is_read_as_post_v1_usage_reads_it(lines, tmp_path_factory):
    """Each line's verdict, value for value and type for type (an accepted event's row) or
    reason for reason, is the HTTP ingest's: the two readers share the line reading."""
    path = tmp_path_factory.mktemp("same") / "usage.jsonl"
    path.write_bytes(b"".join(raw + b"\n" for raw in lines))
    rows: list[Any] = []
    rejected: list[str] = []
    tail = FileFollower([str(path)], validate, rows.extend, rejected.append, from_start=True)
    while tail.poll():
        pass
    tail.close()
    expected = [verdict for verdict in map(reference, lines) if verdict is not None]
    assert [exactly(row) for row in rows] == [
        exactly(value) for kind, value in expected if kind == "row"
    ]
    assert rejected == [value for kind, value in expected if kind == "rejected"]


def test_a_chunk_s_events_are_counted_together(tmp_path):
    """One ``record_events`` per chunk read, as the HTTP ingest does per body: a replayed file
    does not pay the per-call cost once per line."""
    path = tmp_path / "usage.jsonl"
    path.write_text("".join(line(seq) for seq in range(1, 2001)) + "not json\n")
    tail, seen = follower(path, from_start=True)
    tail.poll()
    assert seen.seqs == list(range(1, 2001)) and seen.rejected == ["malformed_json"]
    assert seen.batches == 1
    tail.close()


def test_rows_held_at_once_are_bounded_by_one_read(tmp_path):
    """The worst case of the rows held before they are counted: the shortest accepted line,
    over more than one read. Each record_events call holds at most one read's lines."""
    shortest = b'{"caller":"a","prompt_tokens":1}\n'
    assert len(shortest) == 33
    lines = 3 * READ_CHUNK_BYTES // len(shortest)
    path = tmp_path / "usage.jsonl"
    path.write_bytes(shortest * lines)
    batches: list[int] = []
    tail = FileFollower(
        [str(path)], validate, lambda rows: batches.append(len(rows)), [].append, from_start=True
    )
    while tail.poll():
        pass
    tail.close()
    assert sum(batches) == lines and len(batches) >= 3
    assert max(batches) <= (MAX_LINE_BYTES + READ_CHUNK_BYTES) // len(shortest)
