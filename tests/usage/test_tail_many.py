"""Many followed files: the open-file cap (least recently written closed first, reopened on
change, nothing lost or counted twice), one read budget shared in turn, yielding between
steps, and the losses that can be known counted by reason (issue 29, fails 5 and 6).

Driven poll by poll, no clock and no sleeps; each event carries a sequence number in
``prompt_tokens`` and its file in ``caller``, so every test says exactly what was read.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from pathlib import Path

from exporter.limits import FileDescriptors, FollowedFilesCollector
from exporter.usage.event import validate
from exporter.usage.tail import (
    DELETED_IDLE_POLLS,
    GONE_UNREAD,
    OVER_MAX_FILES,
    POLL_BUDGET_BYTES,
    FileFollower,
    follow,
)
from exporter.values import UsageEvent


def line(caller: str, seq: int) -> str:
    return json.dumps({"caller": caller, "prompt_tokens": seq}) + "\n"


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


class Seen:
    def __init__(self) -> None:
        self.events: list[UsageEvent] = []
        self.rejected: list[str] = []

    def record(self, events: list[UsageEvent]) -> None:
        self.events.extend(events)

    def pairs(self) -> list[tuple[str, int]]:
        return [(event.caller, event.prompt_tokens) for event in self.events]


def make(pattern: Path, **kwargs: object) -> tuple[FileFollower, Seen]:
    seen = Seen()
    return FileFollower([str(pattern)], validate, seen.record, seen.rejected.append, **kwargs), seen  # type: ignore[arg-type]


def drain(tail: FileFollower, budget: int | None = None) -> int:
    steps = 1
    while tail.poll(**({} if budget is None else {"budget": budget})):
        steps += 1
    return steps


def test_the_open_cap_closes_the_least_recently_written_and_loses_nothing(tmp_path):
    """40 files written in a random order, partial lines cut at random places, under a cap
    of 4 open files (and a descriptor share of 4): never more than 4 open, every complete
    line counted exactly once."""
    rng = random.Random(29)
    names = [f"f{index:02d}" for index in range(40)]
    paths = {name: tmp_path / f"{name}.jsonl" for name in names}
    for path in paths.values():
        path.write_text(line("before", 0))  # present at start: read from its end
    share = FileDescriptors(4)
    tail, seen = make(
        tmp_path / "*.jsonl",
        max_open=4,
        acquire_descriptor=share.acquire,
        release_descriptor=share.release,
    )
    tail.poll()
    assert tail.open_files == 4 and len(tail.files) == 40  # open while there is room
    written: list[tuple[str, int]] = []
    held = {name: "" for name in names}  # the part of a line not yet written
    seq = 0
    for _round in range(30):
        for name in rng.sample(names, 12):
            seq += 1
            text = held[name] + line(name, seq)
            cut = rng.randrange(len(text) + 1) if rng.random() < 0.3 else len(text)
            append(paths[name], text[:cut])
            held[name] = text[cut:]
            written.append((name, seq))
        while tail.poll():
            assert tail.open_files <= 4 and share.in_use <= 4
    for name in names:  # finish every partial line
        append(paths[name], held[name])
    drain(tail)
    assert Counter(seen.pairs()) == Counter(written)  # each once, none from before start
    assert seen.rejected == []
    assert tail.reopens > 0 and share.in_use == tail.open_files <= 4
    tail.close()
    assert share.in_use == 0


def open_names(tail: FileFollower) -> list[str]:
    """The open files' stems, least recently written first."""
    return [Path(tail.files[identity].path).stem for identity in tail._open]


def test_a_closed_file_is_reopened_where_it_was_left_even_mid_line(tmp_path):
    """Under a cap of two: the least recently written file is the one closed; closed with
    half a line read, then changed, it is reopened (the same file, checked) and the line is
    read whole, once."""
    paths = {name: tmp_path / f"{name}.jsonl" for name in "abc"}
    for path in paths.values():
        path.write_text("")
    tail, seen = make(tmp_path / "*.jsonl", max_open=2)
    tail.poll()
    half = line("a", 1)
    append(paths["a"], half[:9])
    drain(tail)
    append(paths["b"], line("b", 2))
    drain(tail)
    assert open_names(tail) == ["a", "b"]
    append(paths["a"], half[9:14])  # a is written again: b is now the least recent
    drain(tail)
    append(paths["c"], line("c", 3))
    drain(tail)
    assert open_names(tail) == ["a", "c"]
    append(paths["b"], line("b", 4))  # a is the least recently written: closed mid-line
    drain(tail)
    assert open_names(tail) == ["c", "b"] and tail.reopens == 1
    append(paths["a"], half[14:] + line("a", 5))
    drain(tail)
    assert seen.pairs() == [("b", 2), ("c", 3), ("b", 4), ("a", 1), ("a", 5)]
    assert open_names(tail) == ["b", "a"] and tail.reopens == 2
    tail.close()


def test_one_budget_is_shared_by_every_file_in_turn(tmp_path):
    """Eight files with a backlog each (a from-start replay): each step reads at most the
    budget in all, and no file waits while another reads twice."""
    budget = 4096
    paths = [tmp_path / f"r{index}.jsonl" for index in range(8)]
    lines_each = 600  # about 20 KB a file: several turns each
    for index, path in enumerate(paths):
        path.write_text("".join(line(f"r{index}", seq) for seq in range(lines_each)))
    tail, seen = make(tmp_path / "*.jsonl", from_start=True)
    progress: list[Counter[str]] = []
    more = True
    while more:
        read_before = {identity: followed.offset for identity, followed in tail.files.items()}
        more = tail.poll(budget=budget)
        read = sum(
            followed.offset - read_before.get(identity, 0)
            for identity, followed in tail.files.items()
        )
        assert read <= budget
        progress.append(Counter(event.caller for event in seen.events))
    assert Counter(seen.pairs()) == Counter(
        (f"r{index}", seq) for index in range(8) for seq in range(lines_each)
    )
    # Fair: whenever a file has read k turns' worth, every unfinished file is within one turn.
    per_turn = budget // len(line("r0", 100)) + 1
    for counts in progress:
        unfinished = [
            counts.get(f"r{index}", 0)
            for index in range(8)
            if counts.get(f"r{index}", 0) < lines_each
        ]
        if unfinished:
            assert max(unfinished) - min(unfinished) <= 2 * per_turn
    tail.close()


async def test_follow_yields_to_the_event_loop_between_steps(tmp_path):
    """A burst of new files is read over many steps, and between any two steps other tasks
    run (a liveness probe is answered within one step, never after the whole backlog)."""
    for index in range(10):
        (tmp_path / f"new{index}.jsonl").write_text(
            "".join(line(f"n{index}", seq) for seq in range(3000))
        )
    tail, seen = make(tmp_path / "*.jsonl", from_start=True)
    ticks = 0
    at_poll: list[int] = []
    done = asyncio.Event()
    real_poll = tail.poll

    def poll(*args: object, **kwargs: object) -> bool:
        at_poll.append(ticks)
        more = real_poll(*args, **kwargs)  # type: ignore[arg-type]
        if not more and len(seen.events) == 30_000:
            done.set()
        return more

    tail.poll = poll  # type: ignore[method-assign]

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticking = asyncio.ensure_future(ticker())
    following = asyncio.ensure_future(follow(tail, 0.01))
    await asyncio.wait_for(done.wait(), 60)
    following.cancel()
    ticking.cancel()
    await asyncio.gather(following, ticking, return_exceptions=True)
    total = sum(path.stat().st_size for path in tmp_path.iterdir())
    assert len(at_poll) >= total // POLL_BUDGET_BYTES >= 4  # one budget a step
    assert all(later > earlier for earlier, later in zip(at_poll, at_poll[1:], strict=False))
    assert len(seen.events) == 30_000


def test_a_closed_file_gone_with_unread_bytes_is_counted(tmp_path):
    """Closed (past the cap) and renamed out of the globs before it was read: its unread
    bytes (as its last stat showed them) are counted as gone_unread, nothing read twice."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("")
    b.write_text("")
    tail, seen = make(tmp_path / "*.jsonl", max_open=1)
    tail.poll()
    append(a, line("a", 1))
    drain(tail)
    append(b, line("b", 2))
    drain(tail)  # a closed for b
    unread = line("a", 3)
    append(a, unread)
    tail.poll(budget=0)  # the scan sees a change, nothing is read yet
    os.rename(a, tmp_path / "a.old")  # out of the globs: no name opens it any more
    drain(tail)
    assert seen.pairs() == [("a", 1), ("b", 2)]
    assert tail.lost_bytes[GONE_UNREAD] == len(unread)
    tail.close()


def test_a_file_seen_then_deleted_before_it_was_opened_is_counted(tmp_path):
    """Seen by a scan with no room to open it (the cap held by another file), gone before
    its turn: what its stat showed is counted as gone_unread."""
    (tmp_path / "busy.jsonl").write_text("")
    tail, seen = make(tmp_path / "*.jsonl", max_open=1)
    tail.poll()
    assert tail.open_files == 1
    short = tmp_path / "short.jsonl"
    text = line("s", 1) + line("s", 2)
    short.write_text(text)
    tail.poll(budget=0)  # seen by the scan, not read yet
    short.unlink()
    drain(tail)
    assert seen.events == []
    assert tail.lost_bytes[GONE_UNREAD] == len(text)
    assert [Path(followed.path).name for followed in tail.files.values()] == ["busy.jsonl"]
    tail.close()


def test_the_followed_files_cap_is_filled_and_said(tmp_path):
    """max_files files followed at most; the others are reported, and a file admitted once
    there is room (it may be old) is read from its end, what it held counted as lost."""
    for index in range(5):
        (tmp_path / f"c{index}.jsonl").write_text(line("old", index))
    tail, seen = make(tmp_path / "*.jsonl", max_files=3)
    tail.poll()
    assert len(tail.files) == 3 and tail.over_limit == 2
    collected = {family.name: family for family in FollowedFilesCollector(tail).collect()}
    states = {
        sample.labels["state"]: sample.value
        for sample in collected["vllm_cache_usage_files"].samples
    }
    assert states == {"open": 3, "closed": 0, "not_followed": 2}
    followed = sorted(Path(followed.path).name for followed in tail.files.values())
    os.unlink(tmp_path / followed[0])  # room for one more once it is drained and let go
    for _ in range(DELETED_IDLE_POLLS + 2):
        tail.poll()
    admitted = set(Path(f.path).name for f in tail.files.values()) - set(followed)
    assert len(admitted) == 1 and tail.over_limit == 1
    assert tail.lost_bytes[OVER_MAX_FILES] == len(line("old", 0))
    append(tmp_path / admitted.pop(), line("new", 9))
    drain(tail)
    assert seen.pairs() == [("new", 9)]
    tail.close()


def test_idle_files_hold_no_more_descriptors_than_the_cap(tmp_path):
    """2,000 idle files hold the cap's descriptors, no more (the fail-5 case, at the
    follower's level); written to, each is read through the cap, the share never refused."""
    for index in range(2000):
        (tmp_path / f"idle{index:05d}.jsonl").write_text(line("idle", index))
    share = FileDescriptors(8)
    tail, seen = make(
        tmp_path / "*.jsonl",
        acquire_descriptor=share.acquire,
        release_descriptor=share.release,
        max_open=8,
    )
    steps = drain(tail)
    assert steps > 1  # the scan is sliced
    assert tail.open_files == share.in_use == 8 and len(tail.files) == 2000
    for index in range(0, 2000, 100):
        append(tmp_path / f"idle{index:05d}.jsonl", line("woke", index))
    drain(tail)
    assert sorted(seq for caller, seq in seen.pairs()) == list(range(0, 2000, 100))
    assert share.in_use == 8 and share.refused == 0
    tail.close()
    assert share.in_use == 0
