"""Follow JSONL usage files (``--usage.file``, globs allowed), like ``tail -F`` that counts.

Files are polled, not watched: it works the same on every filesystem (NFS, overlayfs, a
Kubernetes emptyDir) and costs one ``stat`` per file per ``--usage.file.poll-interval``.

What must hold, and how:

- No event counted twice, none lost across rotation. Files are followed by identity
  (device, inode), not by name: a rotated file keeps its read position under its new name
  (even when the glob also matches the new name), and is drained to its end before it is let
  go; the newly created file is new, so it is read from its start.
- Truncation (``copytruncate``, ``: > file``) is noticed when the file shrinks below the read
  position, and also when it was truncated and refilled past that position between two polls:
  the bytes just before the read position are remembered and compared on each poll.
- A line is an event only once its newline has been written; a partial last line waits. A
  line that never ends (over ``MAX_LINE_BYTES``) is rejected and skipped up to its newline.
- Files present at start are read from their end (``--usage.file.from-start`` replays them);
  files that appear later are read from their start, since everything in them is new.
- One bad line is rejected and counted; the rest go on.
- Descriptors: each followed file holds one. When the follower is handed
  ``acquire_descriptor`` (the process's budget for followed files), it asks before opening a
  file and gives the descriptor back when it lets the file go; a file refused one is put off
  to a later poll, logged once, and loses nothing (one present at start is then still read
  from where it ended at start).

Lines are read as ``POST /v1/usage`` reads NDJSON (``ingest.read_line``: orjson where it reads
a line exactly as ``json`` does, ``json`` elsewhere; in the native format the common event in
one step, ``quick_event``), with the same rejection reasons, and the events of each chunk read
are counted together (``UsageState.record_events``), as a body's are.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from exporter.usage.event import MSGSPEC_REFUSALS, InvalidEvent, quick_event, validate
from exporter.usage.formats import Converter
from exporter.usage.ingest import QUICK_MISSES_TRIED, Unreadable, read_line
from exporter.values import UsageEvent

log = logging.getLogger(__name__)

READER = "file"
MAX_LINE_BYTES = 1024 * 1024
READ_CHUNK_BYTES = 1024 * 1024
# A chunk's events are held as events until counted together: one event per accepted line of
# one read (the chunk and a held partial line, at most MAX_LINE_BYTES + READ_CHUNK_BYTES).
# The shortest native line is 33 bytes: about 64,000 events of 144 bytes, 9 MB; a mapping
# format with one-letter keys takes lines half as long, so twice that.
# Bytes per poll() call before yielding to the event loop (a replayed 1 GB file must not
# stall /metrics).
POLL_BUDGET_BYTES = 8 * 1024 * 1024
# Bytes remembered just before the read position, to notice truncate-and-refill.
FINGERPRINT_BYTES = 64
# A file that no longer matches the globs (renamed away by rotation, or deleted) is still
# drained through its descriptor, for writers that keep writing into it until they reopen
# (on a signal, or at their next rotation check): it is let go only after this many polls
# in a row without growth. At most MAX_GONE_FILES are kept so; beyond, the longest idle one
# is let go first.
GONE_IDLE_POLLS = 10
# A deleted file (no name left) is let go sooner: nobody can reopen it by name.
DELETED_IDLE_POLLS = 2
MAX_GONE_FILES = 16


@dataclass
class _Followed:
    identity: tuple[int, int]
    path: str
    handle: int  # file descriptor
    offset: int  # bytes consumed (whole lines) plus the partial line held in ``pending``
    pending: bytes = b""
    skip_to_newline: bool = False  # inside a line we must not read (started mid-line/too long)
    fingerprint: bytes = b""  # the bytes just before ``offset``
    gone_polls: int = 0


class FileFollower:
    """Follows every file matching ``patterns``; ``poll()`` reads what was appended since.

    Synchronous and clock-free so tests drive it step by step; ``follow`` is the loop.
    """

    def __init__(self, patterns: Sequence[str], convert: Converter,
                 record_events: Callable[[list[UsageEvent]], object],
                 reject: Callable[[str], None], from_start: bool = False,
                 acquire_descriptor: Callable[[], bool] | None = None,
                 release_descriptor: Callable[[], None] | None = None) -> None:
        self.patterns = list(patterns)
        self.convert = convert
        # The native format's common event, decoded and checked in one step.
        self._quick = quick_event if self.convert is validate else None
        self.record_events = record_events
        self.reject = reject
        self.from_start = from_start
        self._acquire = acquire_descriptor
        self._release = release_descriptor
        # Files present at start whose open was put off (no descriptor): their size then.
        self._put_off: dict[tuple[int, int], int] = {}
        self.files: dict[tuple[int, int], _Followed] = {}
        self._first_scan = True
        self._warned: set[tuple[str, str]] = set()
        self.truncations = 0
        self.rotations = 0

    # ---- discovery -----------------------------------------------------------------

    def _matches(self) -> list[str]:
        paths: list[str] = []
        seen: set[str] = set()
        for pattern in self.patterns:
            magic = any(char in pattern for char in "*?[")
            found = sorted(glob.glob(pattern)) if magic else [pattern]
            for path in found:
                if path not in seen:
                    seen.add(path)
                    paths.append(path)
        return paths

    def _warn_once(self, path: str, problem: str) -> None:
        if (path, problem) not in self._warned:
            self._warned.add((path, problem))
            log.warning("usage file %s: %s", path, problem)

    def poll(self, budget: int = POLL_BUDGET_BYTES) -> bool:
        """Read every followed file once; True when a file still has unread bytes."""
        first_scan, self._first_scan = self._first_scan, False
        seen: set[tuple[int, int]] = set()
        more = False
        for path in self._matches():
            try:
                info = os.stat(path)
            except OSError:
                continue  # not there (yet), or rotated away between glob and stat
            if not stat.S_ISREG(info.st_mode):
                continue
            identity = (info.st_dev, info.st_ino)
            if identity in seen:
                continue
            followed = self.files.get(identity)
            if followed is None:
                followed = self._open(path, identity, info.st_size, at_end=first_scan
                                      and not self.from_start)
                if followed is None:
                    continue
            elif followed.path != path:
                self.rotations += 1
                log.info("usage file %s is now %s; following it to its end", followed.path,
                         path)
                followed.path = path
            seen.add(identity)
            followed.gone_polls = 0
            more |= self._read(followed, budget)
        gone = [followed for identity, followed in self.files.items() if identity not in seen]
        for followed in gone:
            # Renamed out of the globs or deleted: our descriptor still reads it.
            before = followed.offset
            more |= self._read(followed, budget)
            followed.gone_polls = 0 if followed.offset > before else followed.gone_polls + 1
        gone.sort(key=lambda followed: followed.gone_polls, reverse=True)
        for rank, followed in enumerate(gone):
            idle_limit = GONE_IDLE_POLLS if self._linked(followed) else DELETED_IDLE_POLLS
            if followed.gone_polls >= idle_limit or rank < len(gone) - MAX_GONE_FILES:
                self._finish(followed)
        return more

    def _open(self, path: str, identity: tuple[int, int], size: int,
              at_end: bool) -> _Followed | None:
        if identity in self._put_off:  # present at start: read from where it ended then
            at_end, size = True, self._put_off[identity]
        if self._acquire is not None and not self._acquire():
            self._warn_once(path, "not opened yet: the descriptors for followed files are "
                                  "all in use; it is tried again at each poll")
            if at_end:
                self._put_off.setdefault(identity, size)
            return None
        try:
            handle = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            self._give_back()
            self._warn_once(path, f"cannot open: {err.strerror}")
            return None
        info = os.fstat(handle)
        if (info.st_dev, info.st_ino) != identity:  # replaced between stat and open
            os.close(handle)
            self._give_back()
            return None
        self._put_off.pop(identity, None)
        followed = _Followed(identity, path, handle, 0)
        if at_end and size:
            followed.offset = size
            followed.fingerprint = self._pread(handle, max(0, size - FINGERPRINT_BYTES), size)
            # Starting mid-line would read the tail of a line as an event.
            followed.skip_to_newline = not followed.fingerprint.endswith(b"\n")
        self.files[identity] = followed
        log.info("following usage file %s from its %s", path, "end" if at_end else "start")
        return followed

    def _give_back(self) -> None:
        if self._release is not None:
            self._release()

    @staticmethod
    def _pread(handle: int, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return os.pread(handle, end - start, start)

    # ---- reading -------------------------------------------------------------------

    def _truncated(self, followed: _Followed, size: int) -> bool:
        if size < followed.offset:
            return True
        if not followed.fingerprint:
            return False
        start = followed.offset - len(followed.fingerprint)
        return self._pread(followed.handle, start, followed.offset) != followed.fingerprint

    def _read(self, followed: _Followed, budget: int) -> bool:
        try:
            size = os.fstat(followed.handle).st_size
            if self._truncated(followed, size):
                self.truncations += 1
                log.info("usage file %s was truncated; reading it again from its start",
                         followed.path)
                followed.offset = 0
                followed.pending = b""
                followed.fingerprint = b""
                followed.skip_to_newline = False
            while followed.offset < size and budget > 0:
                want = min(READ_CHUNK_BYTES, size - followed.offset, budget)
                chunk = os.pread(followed.handle, want, followed.offset)
                if not chunk:
                    break
                followed.offset += len(chunk)
                budget -= len(chunk)
                self._lines(followed, chunk)
                followed.fingerprint = self._pread(
                    followed.handle, max(0, followed.offset - FINGERPRINT_BYTES),
                    followed.offset)
        except OSError as err:
            # Keep the position: re-reading from 0 later would count events twice.
            self._warn_once(followed.path, f"read failed: {err.strerror}")
            return False
        return followed.offset < size

    def _lines(self, followed: _Followed, chunk: bytes) -> None:
        data = followed.pending + chunk if followed.pending else chunk
        lines = data.split(b"\n")
        followed.pending = lines.pop()  # after the last newline: incomplete, wait for it
        if followed.skip_to_newline and lines:
            followed.skip_to_newline = False
            lines = lines[1:]
        self._count(lines)
        if len(followed.pending) > MAX_LINE_BYTES:
            if not followed.skip_to_newline:
                self.reject("line_too_long")
            followed.pending = b""
            followed.skip_to_newline = True
        elif followed.skip_to_newline:
            followed.pending = b""

    def _count(self, lines: Iterable[bytes]) -> None:
        """Count the events of complete lines, each once and in their order (together: one
        ``record_events`` call); reject the others with their reason."""
        events: list[UsageEvent] = []
        append = events.append
        convert = self.convert
        quick = self._quick
        misses = tried = 0
        for line in lines:
            if quick is not None:
                tried += 1
                try:
                    event = quick(line)
                except MSGSPEC_REFUSALS:  # a line msgspec refuses is read below
                    event = None
                if event is not None:
                    append(event)
                    continue
                misses += 1  # mostly uncommon lines: stop trying (as the HTTP ingest does)
                if misses >= QUICK_MISSES_TRIED and 2 * misses > tried:
                    quick = None
            item = read_line(line, 0)
            if item is None:  # a blank line is no event
                continue
            value = item[0]
            if type(value) is Unreadable:  # not UTF-8, not JSON, or nested too deeply
                self.reject(value.reason)
                continue
            try:
                append(convert(value))
            except InvalidEvent as err:
                self.reject(err.reason)
            except Exception:  # a converter bug must not stop the file
                log.warning("a usage line could not be converted", exc_info=True)
                self.reject("unprocessable")
        if events:
            self.record_events(events)

    @staticmethod
    def _linked(followed: _Followed) -> bool:
        try:
            return os.fstat(followed.handle).st_nlink > 0
        except OSError:
            return False

    def _finish(self, followed: _Followed) -> None:
        """Let go of a file that is gone for good: its last line is as complete as it gets."""
        if followed.pending and not followed.skip_to_newline:
            self._count((followed.pending,))
        followed.pending = b""
        self.files.pop(followed.identity, None)
        try:
            os.close(followed.handle)
        except OSError:
            pass
        self._give_back()

    def close(self) -> None:
        for followed in list(self.files.values()):
            self.files.pop(followed.identity, None)
            try:
                os.close(followed.handle)
            except OSError:
                pass
            self._give_back()


async def follow(follower: FileFollower, poll_interval: float) -> None:
    """Poll ``follower`` every ``poll_interval`` seconds until cancelled, then close it."""
    try:
        while True:
            while follower.poll():
                await asyncio.sleep(0)  # a backlog: let scrapes in between slices
            await asyncio.sleep(poll_interval)
    finally:
        follower.close()
