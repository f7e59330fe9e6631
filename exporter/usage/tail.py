"""Follow JSONL usage files (``--usage.file``, globs allowed), like ``tail -F`` that counts.

Files are polled, not watched: it works the same on every filesystem (NFS, overlayfs, a
Kubernetes emptyDir). A full scan (the globs, one ``stat`` per match, ``SCAN_SLICE`` stats a
step) runs every ``--usage.file.poll-interval``, spaced further when it would take more than
``SCAN_SHARE`` of a core (many files); between two, the open files are checked by ``fstat``.
Only a file whose size or modification time changed is read.

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
- Descriptors: at most ``max_open`` files are open at once (``--usage.file.max-open``,
  and within the descriptor budget: when handed ``acquire_descriptor`` it asks before each
  open and gives the descriptor back at each close). Files are opened as they are found while fewer
  are open (an open file loses nothing when it is renamed or deleted). Past the cap the
  least recently written file is closed, keeping its place (a
  partial last line is read again from the file when it is reopened); a scan that sees it
  change opens it again (checked to be the same file) and reads on from there. A file out of
  the globs is never closed early: no name would open it again.
- Reading: one step reads ``POLL_BUDGET_BYTES`` in all, shared by the files with bytes to
  read in turn (one with more goes to the back), then ``follow`` yields to the event loop, so
  40 new 8 MB files (or a from-start replay) never hold /-/healthy or /metrics.
- Losses that can be known are counted (``lost_bytes`` by reason): a closed file that left
  the globs with bytes its last stat showed unread (``gone_unread``), one let go past
  ``MAX_GONE_FILES`` unread (``too_many_gone``), what a file held when it was admitted after
  ``MAX_FOLLOWED_FILES`` had bitten (``over_max_files``). A file that came and went between two
  scans was never seen, and bytes written to a closed file after its last stat and before it
  went are not known: neither can be counted.

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
import time
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
# Bytes one poll() step reads, shared by every file with bytes to read: each takes its turn
# (at most this much), one with more goes to the back of the queue. About 10 ms of parsing
# on the bench machine (docs/performance.md), so /-/healthy and /metrics wait no longer.
POLL_BUDGET_BYTES = 256 * 1024
# Paths stat'ed by one poll() step of a full scan (each stat about 6 us on the bench
# machine): a glob over 10,000 files is scanned in 20 steps, the event loop free between.
SCAN_SLICE = 512
# Files held open at once (--usage.file.max-open, and never more than the descriptor share
# of followed files): past it, the least recently written is closed, and opened again when a
# scan sees it change (size or modification time), read from where it was left.
MAX_OPEN_FILES = 256
# Files followed at once, open or not (about 400 bytes each): matches past it are not
# followed (a gauge says how many); once it has bitten, a file admitted later is read from
# where it ended when admitted, what it held before counted as lost (it may be old).
MAX_FOLLOWED_FILES = 65_536
# The full scan (glob, one stat per match) is spaced so it takes at most this share of one
# core; between two, the open files are checked by fstat every poll interval.
SCAN_SHARE = 0.025
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
# Distinct (path, problem) warnings remembered, so that each is logged once.
MAX_WARNED = 1024
# Why bytes of a followed file were never read (vllm_cache_usage_file_lost_bytes_total).
GONE_UNREAD = "gone_unread"  # it left the globs while closed, or before it could be opened
TOO_MANY_GONE = "too_many_gone"  # let go past MAX_GONE_FILES with bytes still unread
OVER_MAX_FILES = "over_max_files"  # what it held when admitted after the cap had bitten
LOSS_REASONS = (GONE_UNREAD, TOO_MANY_GONE, OVER_MAX_FILES)

_Identity = tuple[int, int]
_UNSEEN = (-1, -1)  # a stamp no stat gives: the next scan looks at the file again


@dataclass(slots=True)
class _Followed:
    identity: _Identity
    path: str
    handle: int | None  # file descriptor; None while closed (past the open-file cap)
    offset: int  # bytes consumed (whole lines) plus the partial line held in ``pending``
    pending: bytes = b""
    skip_to_newline: bool = False  # inside a line we must not read (started mid-line/too long)
    fingerprint: bytes = b""  # the bytes just before ``offset``
    gone_polls: int = 0
    stamp: tuple[int, int] = _UNSEEN  # (size, mtime in ns) at the last stat
    size: int = 0  # its size at the last stat: what a closed file that goes held
    anchor: bool = False  # read from its end at first sight: check where that is at open
    gone: bool = False  # out of the globs: only its descriptor reads it (never closed early)
    opened: bool = False  # opened before: a later open is a reopen


class FileFollower:
    """Follows every file matching ``patterns``; ``poll()`` reads what was appended since.

    Synchronous and clock-free so tests drive it step by step; ``follow`` is the loop. Each
    ``poll()`` is one bounded step: a full scan (the glob, then ``SCAN_SLICE`` stats a step)
    or a quick check of the open files, and ``budget`` bytes read, shared by the files
    with bytes to read in turn.
    """

    def __init__(
        self,
        patterns: Sequence[str],
        convert: Converter,
        record_events: Callable[[list[UsageEvent]], object],
        reject: Callable[[str], None],
        from_start: bool = False,
        acquire_descriptor: Callable[[], bool] | None = None,
        release_descriptor: Callable[[], None] | None = None,
        max_open: int = MAX_OPEN_FILES,
        max_files: int = MAX_FOLLOWED_FILES,
        scan_slice: int = SCAN_SLICE,
    ) -> None:
        self.patterns = list(patterns)
        self.convert = convert
        # The native format's common event, decoded and checked in one step.
        self._quick = quick_event if self.convert is validate else None
        self.record_events = record_events
        self.reject = reject
        self.from_start = from_start
        self._acquire = acquire_descriptor
        self._release = release_descriptor
        self.max_open = max(1, max_open)
        self.max_files = max(1, max_files)
        self.scan_slice = max(1, scan_slice)
        self.files: dict[_Identity, _Followed] = {}
        self._open: dict[_Identity, None] = {}  # open files, least recently written first
        self._ready: dict[_Identity, None] = {}  # files to read, in turn
        self._waiting: dict[_Identity, None] = {}  # ready, but no descriptor: next round
        self._scan: list[str] | None = None  # the paths of the full scan under way
        self._scan_at = 0
        self._seen: set[_Identity] = set()
        self._first_scan = True
        self._capped = False  # MAX_FOLLOWED_FILES has bitten
        self._over = 0
        self._warned: set[tuple[str, str]] = set()
        self.truncations = 0
        self.rotations = 0
        self.reopens = 0
        self.over_limit = 0  # matches not followed at the last full scan (max_files)
        self.lost_bytes: dict[str, int] = dict.fromkeys(LOSS_REASONS, 0)

    @property
    def open_files(self) -> int:
        return len(self._open)

    @property
    def scanning(self) -> bool:
        """A full scan is under way (it goes on at the next ``poll()``)."""
        return self._scan is not None

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
            if len(self._warned) >= MAX_WARNED:
                self._warned.clear()
            self._warned.add((path, problem))
            log.warning("usage file %s: %s", path, problem)

    def poll(self, budget: int = POLL_BUDGET_BYTES, scan: bool | None = True) -> bool:
        """One step; True when there is more to do at once (a scan under way, bytes unread).

        ``scan``: True starts a full scan when none is under way, False a quick check (one
        fstat per open file), None neither (what is under way goes on)."""
        if self._scan is None and scan is not None:
            self._ready.update(self._waiting)
            self._waiting.clear()
            if scan:
                self._scan, self._scan_at, self._over = self._matches(), 0, 0
            else:
                self._check_open()
        if self._scan is not None:
            self._scan_step(self._scan)
        self._read_ready(budget)
        return self._scan is not None or bool(self._ready)

    def _scan_step(self, paths: list[str]) -> None:
        end = min(len(paths), self._scan_at + self.scan_slice)
        for index in range(self._scan_at, end):
            self._stat_path(paths[index])
        self._scan_at = end
        if end >= len(paths):
            self._end_scan()

    def _stat_path(self, path: str) -> None:
        try:
            info = os.stat(path)
        except OSError:
            return  # not there (yet), or rotated away between glob and stat
        if not stat.S_ISREG(info.st_mode):
            return
        identity = (info.st_dev, info.st_ino)
        if identity in self._seen:
            return
        followed = self.files.get(identity)
        if followed is None:
            followed = self._admit(path, identity, info.st_size, info.st_mtime_ns)
            if followed is None:
                return
        elif followed.path != path:
            self.rotations += 1
            log.info("usage file %s is now %s; following it to its end", followed.path, path)
            followed.path = path
        self._seen.add(identity)
        followed.gone = False
        followed.gone_polls = 0
        if followed.handle is None and len(self._open) < self.max_open:
            # Held open while there is room: an open file loses nothing when it is renamed
            # away or deleted, even before its first line is read.
            self._open_file(followed, evict=False)
        self._note(followed, info.st_size, info.st_mtime_ns)

    def _note(self, followed: _Followed, size: int, mtime: int) -> None:
        """A stat of ``followed``: changed since the last, it is read (in turn)."""
        followed.size = size
        if (size, mtime) != followed.stamp:
            followed.stamp = (size, mtime)
            self._ready[followed.identity] = None

    def _admit(self, path: str, identity: _Identity, size: int, mtime: int) -> _Followed | None:
        """Follow a file seen for the first time: from its end at the first scan, from its
        start later."""
        if len(self.files) >= self.max_files:
            self._over += 1
            self._capped = True
            self._warn_once(path, f"not followed: {self.max_files} files are followed already")
            return None
        at_end = (self._first_scan and not self.from_start) or self._capped
        followed = _Followed(
            identity,
            path,
            None,
            size if at_end else 0,
            stamp=(size, mtime) if at_end else _UNSEEN,
            size=size,
            anchor=at_end and size > 0,
        )
        if self._capped and not self._first_scan:
            self._lose(followed, size, OVER_MAX_FILES)
        self.files[identity] = followed
        # Those of the first scan are said together at its end (10,000 lines otherwise).
        log.log(
            logging.DEBUG if self._first_scan else logging.INFO,
            "following usage file %s from its %s",
            path,
            "end" if at_end else "start",
        )
        return followed

    def _end_scan(self) -> None:
        self._scan = None
        if self._first_scan:
            log.info(
                "following %d usage file(s) matching %s from their %s",
                len(self.files),
                " ".join(self.patterns),
                "start" if self.from_start else "end",
            )
        self._first_scan = False
        self.over_limit = self._over
        gone = [followed for identity, followed in self.files.items() if identity not in self._seen]
        self._seen = set()
        still_open = []
        for followed in gone:
            if followed.handle is None:  # nothing reads it any more
                self._lose(followed, followed.size - followed.offset, GONE_UNREAD)
                self._drop(followed)
                continue
            followed.gone = True  # renamed out of the globs or deleted: its descriptor reads
            try:
                info = os.fstat(followed.handle)
            except OSError:
                info = None
            before = followed.stamp
            if info is not None:
                self._note(followed, info.st_size, info.st_mtime_ns)
            idle = followed.stamp == before and followed.identity not in self._ready
            followed.gone_polls = followed.gone_polls + 1 if idle else 0
            still_open.append(followed)
        still_open.sort(key=lambda followed: followed.gone_polls, reverse=True)
        for rank, followed in enumerate(still_open):
            idle_limit = GONE_IDLE_POLLS if self._linked(followed) else DELETED_IDLE_POLLS
            if followed.gone_polls >= idle_limit or rank < len(still_open) - MAX_GONE_FILES:
                unread = followed.size - followed.offset
                self._finish(followed)
                self._lose(followed, unread, TOO_MANY_GONE)

    def _check_open(self) -> None:
        """The quick check between full scans: one fstat per open file."""
        for identity in list(self._open):
            followed = self.files[identity]
            assert followed.handle is not None
            try:
                info = os.fstat(followed.handle)
            except OSError:
                continue
            self._note(followed, info.st_size, info.st_mtime_ns)

    def _lose(self, followed: _Followed, unread: int, reason: str) -> None:
        if unread > 0:
            self.lost_bytes[reason] += unread
            log.warning(
                "usage file %s: %d byte(s) were never read (%s)", followed.path, unread, reason
            )

    # ---- opening and closing -------------------------------------------------------

    def _read_ready(self, budget: int) -> None:
        """Read the files with bytes to read, in turn, ``budget`` bytes in all."""
        while budget > 0 and self._ready:
            identity = next(iter(self._ready))
            del self._ready[identity]
            followed = self.files.get(identity)
            if followed is None:
                continue
            if followed.handle is None and not self._open_file(followed, evict=True):
                continue
            used, more = self._read(followed, budget)
            budget -= used
            if used:  # written to: the most recently written now
                del self._open[identity]
                self._open[identity] = None
                if more:
                    self._ready[identity] = None

    def _open_file(self, followed: _Followed, evict: bool) -> bool:
        """Open a closed file; with ``evict``, closing the least recently written one if
        need be (else, or when none can be closed, it is put off to the next round)."""
        identity = followed.identity
        if evict and len(self._open) >= self.max_open:
            self._evict(identity)
        granted = len(self._open) < self.max_open and (
            self._acquire is None
            or self._acquire()
            or (evict and self._evict(identity) and self._acquire())
        )
        if not granted:
            if evict:
                self._waiting[identity] = None
                self._warn_once(
                    "*",
                    "a file waits for a descriptor: the followed files' "
                    "share of them is held by files being drained",
                )
            return False
        try:
            handle = os.open(followed.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            self._give_back()
            followed.stamp = _UNSEEN  # looked at again by the next scan (or lost if gone)
            if not isinstance(err, FileNotFoundError):
                self._warn_once(followed.path, f"cannot open: {err.strerror}")
            return False
        info = os.fstat(handle)
        if (info.st_dev, info.st_ino) != identity:  # its name is another file's now
            os.close(handle)
            self._give_back()
            followed.stamp = _UNSEEN
            return False
        followed.handle = handle
        self._open[identity] = None
        if followed.opened:
            self.reopens += 1
        followed.opened = True
        if followed.anchor:  # read from where it ended at first sight
            followed.anchor = False
            if info.st_size >= followed.offset:
                followed.fingerprint = self._pread(
                    handle, max(0, followed.offset - FINGERPRINT_BYTES), followed.offset
                )
                # Starting mid-line would read the tail of a line as an event.
                followed.skip_to_newline = not followed.fingerprint.endswith(b"\n")
        return True

    def _evict(self, keep: _Identity) -> bool:
        """Close the least recently written open file (one with nothing to read first);
        a file out of the globs is never closed early: no name would open it again."""
        victim = fallback = None
        for identity in self._open:
            followed = self.files[identity]
            if followed.gone or identity == keep:
                continue
            if identity not in self._ready:
                victim = followed
                break
            fallback = fallback or followed
        victim = victim or fallback
        if victim is None:
            return False
        self._close(victim)
        return True

    def _close(self, followed: _Followed) -> None:
        """Close an open file, keeping its place: a partial last line is read again when it
        is reopened (so a closed file holds no bytes of it)."""
        handle = followed.handle
        assert handle is not None
        if followed.pending:
            followed.offset -= len(followed.pending)
            followed.pending = b""
            try:
                followed.fingerprint = self._pread(
                    handle, max(0, followed.offset - FINGERPRINT_BYTES), followed.offset
                )
            except OSError:
                followed.fingerprint = b""
        followed.handle = None
        del self._open[followed.identity]
        try:
            os.close(handle)
        except OSError:
            pass
        self._give_back()

    def _give_back(self) -> None:
        if self._release is not None:
            self._release()

    @staticmethod
    def _pread(handle: int, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return os.pread(handle, end - start, start)

    # ---- reading -------------------------------------------------------------------

    def _truncated(self, followed: _Followed, handle: int, size: int) -> bool:
        if size < followed.offset:
            return True
        if not followed.fingerprint:
            return False
        start = followed.offset - len(followed.fingerprint)
        return self._pread(handle, start, followed.offset) != followed.fingerprint

    def _read(self, followed: _Followed, budget: int) -> tuple[int, bool]:
        """Read at most ``budget`` bytes of an open file: (bytes read, more left)."""
        handle = followed.handle
        assert handle is not None
        used = 0
        try:
            size = os.fstat(handle).st_size
            if self._truncated(followed, handle, size):
                self.truncations += 1
                log.info(
                    "usage file %s was truncated; reading it again from its start", followed.path
                )
                followed.offset = 0
                followed.pending = b""
                followed.fingerprint = b""
                followed.skip_to_newline = False
            while followed.offset < size and used < budget:
                want = min(READ_CHUNK_BYTES, size - followed.offset, budget - used)
                chunk = os.pread(handle, want, followed.offset)
                if not chunk:
                    break
                followed.offset += len(chunk)
                used += len(chunk)
                self._lines(followed, chunk)
                followed.fingerprint = (
                    chunk[-FINGERPRINT_BYTES:]
                    if len(chunk) >= FINGERPRINT_BYTES
                    else (followed.fingerprint + chunk)[-FINGERPRINT_BYTES:]
                )
        except OSError as err:
            # Keep the position: re-reading from 0 later would count events twice.
            self._warn_once(followed.path, f"read failed: {err.strerror}")
            return used, False
        return used, followed.offset < size

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
            return followed.handle is not None and os.fstat(followed.handle).st_nlink > 0
        except OSError:
            return False

    def _finish(self, followed: _Followed) -> None:
        """Let go of a file that is gone for good: its last line is as complete as it gets."""
        if followed.pending and not followed.skip_to_newline:
            self._count((followed.pending,))
        followed.pending = b""
        self._drop(followed)

    def _drop(self, followed: _Followed) -> None:
        identity = followed.identity
        self.files.pop(identity, None)
        self._ready.pop(identity, None)
        self._waiting.pop(identity, None)
        if followed.handle is not None:
            self._open.pop(identity, None)
            try:
                os.close(followed.handle)
            except OSError:
                pass
            followed.handle = None
            self._give_back()

    def close(self) -> None:
        for followed in list(self.files.values()):
            self._drop(followed)


async def follow(
    follower: FileFollower,
    poll_interval: float,
    clock: Callable[[], float] = time.monotonic,
    scan_share: float = SCAN_SHARE,
) -> None:
    """Poll ``follower`` until cancelled, then close it: a round every ``poll_interval``
    seconds, a full scan at those rounds spaced so that scanning takes at most
    ``scan_share`` of the time (quick checks of the open files between), each step of a
    round followed by a yield to the event loop."""
    try:
        next_round = next_scan = clock()
        scan_started, scan_cost = next_scan, 0.0
        while True:
            now = clock()
            kind: bool | None = None
            if now >= next_round:
                next_round = now + poll_interval
                kind = now >= next_scan and not follower.scanning
                if kind:
                    scan_started, scan_cost = now, 0.0
            scanning = kind is True or follower.scanning
            more = follower.poll(scan=kind)
            if scanning:
                scan_cost += clock() - now
                if not follower.scanning:  # that step ended the scan
                    next_scan = scan_started + max(poll_interval, scan_cost / scan_share)
            if more:
                await asyncio.sleep(0)  # a backlog: let scrapes in between slices
            else:
                await asyncio.sleep(max(0.0, next_round - clock()))
    finally:
        follower.close()
