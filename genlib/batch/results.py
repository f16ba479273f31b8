"""The results file of a batch run, written exactly once per input line.

What makes a batch run safe to repeat, interrupt, kill and resume, for any engine that
writes batch results (the local loop in genlib.batch.jobs, or a distributed one):

- `ResultsFile.lock()`: one writer per file. An exclusive `flock` on the file itself,
  taken before the file is read; a second run gets OutputBusyError at once. The kernel
  drops the lock when its process ends, however it ends (SIGKILL included), so there is
  never a stale lock to clean up.
- Every record carries the `fingerprint` of its input line: a hash of the prompt and
  the effective settings (`fingerprint()`). `plan_resume()` keeps a result only if the
  line with its id still has that fingerprint; a changed line is refused
  (StaleResultsError) unless the caller asks to redo it.
- `ResultsFile.drop()` removes records before they are generated again, by writing the
  kept lines to a new file and renaming it over the old one, already locked: at every
  instant the path holds a complete file, and no second writer can slip in between.
- `ResultsFile.append()` writes each record with one write call and no buffering, so a
  killed run leaves at most one half-written last line, which `read()` cuts off.
- `ResultsFile.check()` (before each append, and by the caller before it exits): the path
  still names the file being written (device and inode) and holds the bytes written to
  it, else ResultsLostError (a file removed, replaced or truncated under the run).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from genlib import jsonl
from genlib.errors import GenlabError, UserInputError

FINGERPRINT_KEY = "fingerprint"
FINGERPRINT_VERSION = 1  # part of every hash: a change of what is hashed redoes old files


class BatchFileError(UserInputError):
    """The input or output file of a batch run cannot be used as given."""


class OutputBusyError(GenlabError):
    """Another process holds the results file's lock (a runtime condition: exit 1)."""


class ResultsLostError(GenlabError):
    """The results file was removed, replaced or truncated while the run wrote it: what
    was written is not (all) there (a runtime condition: exit 1)."""


class StaleResultsError(UserInputError):
    """The results file holds results for input lines that have changed since."""


def id_key(value: str | int) -> str:
    """A hashable, type-exact key for an id (1 and "1" are different ids)."""
    return json.dumps(value)


def fingerprint(payload: Mapping[str, Any]) -> str:
    """`sha256:<hex>` of `payload` as canonical JSON (sorted keys, ASCII escapes)."""
    text = json.dumps({"v": FINGERPRINT_VERSION, **payload}, sort_keys=True,
                      ensure_ascii=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class Prior:
    """What the results file holds for one id: its fingerprint (None in files written
    before fingerprints existed) and whether it is an error record."""

    fingerprint: str | None
    failed: bool
    line: int


@dataclass
class ResumePlan:
    """What a run does with each input line, given the results file (keys: `id_key`)."""

    run: list[str] = field(default_factory=list)  # to generate, in input order
    kept: dict[str, Prior] = field(default_factory=dict)  # done: left as they are
    drop: list[str] = field(default_factory=list)  # old records to remove before running
    changed: list[str] = field(default_factory=list)  # results whose line changed (redone)
    orphans: int = 0  # records whose id no input line has (kept, untouched)

    @property
    def failed_before(self) -> int:
        return sum(prior.failed for prior in self.kept.values())


def plan_resume(wanted: Mapping[str, str], prior: Mapping[str, Prior], *,
                redo_changed: bool = False, retry_errors: bool = False) -> ResumePlan:
    """Decide for each input line (`wanted`: id_key -> fingerprint, in input order):

    - no record yet: run it;
    - a result with the same fingerprint: keep it (done);
    - a result with another fingerprint (or none): StaleResultsError naming the first
      ids, unless `redo_changed`, which drops and runs them;
    - an error record: kept as a failure, unless `retry_errors` or its line changed
      (a fixed line is what a user reruns for), which drop and run it again.
    """
    plan = ResumePlan()
    stale: list[str] = []
    for key, print_ in wanted.items():
        old = prior.get(key)
        if old is None:
            plan.run.append(key)
        elif old.fingerprint == print_ and not (old.failed and retry_errors):
            plan.kept[key] = old
        elif old.failed or redo_changed:
            plan.drop.append(key)
            plan.run.append(key)
            if not old.failed:
                plan.changed.append(key)
        else:
            stale.append(key)
    if stale:
        raise StaleResultsError(_stale_message(stale, prior))
    plan.orphans = sum(key not in wanted for key in prior)
    return plan


def _stale_message(stale: list[str], prior: Mapping[str, Prior]) -> str:
    shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
    unprinted = sum(prior[key].fingerprint is None for key in stale)
    why = ("their prompt or settings differ from the input now" if not unprinted else
           "they were written without input fingerprints, so they cannot be matched to it")
    return (f"the results file holds {len(stale)} result(s) for ids {shown}, but {why}; "
            f"rerun with --redo-changed to generate them again, or give another --output")


class ResultsFile:
    """The results of one batch run: a regular file (locked, resumable) or a stream
    (stdout, a pipe, a device: written only; nothing to resume from).

    Use: `open()` -> `lock()` -> `read()` -> `plan_resume(...)` -> `drop(plan.drop)` ->
    `append(record)` per finished line -> `close()` (or use it as a context manager).
    """

    def __init__(self, path: Path | None, fd: int | None = None,
                 stream: IO[bytes] | None = None):
        self.path = path
        self._fd = fd  # regular files: read/write, O_APPEND
        self._size = os.fstat(fd).st_size if fd is not None else 0  # bytes there by us
        self._writing = 0  # bytes of the line being appended, until it is counted
        self._stream = stream  # everything else
        self.locked = False
        self.repaired_bytes = 0  # a half-written last line cut off by read()
        self.duplicates = 0  # records whose id a later record repeats (dropped by drop())
        self._last: dict[str, int] = {}  # id_key -> line number of its last record
        # Another file format (OpenAI's batch format): a record as the line written, and
        # a line read back as the record; genlab's own records pass as they are.
        self._line_of: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
        self._record_of: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None

    def in_format(self, line_of: Callable[[Mapping[str, Any]], Mapping[str, Any]],
                  record_of: Callable[[Mapping[str, Any]], Mapping[str, Any]]) -> None:
        """Write and read lines of another format: `line_of` turns each record into the
        line appended, `record_of` each line read back into the record (with the id and
        fingerprint the record had), so locking, resuming and dropping work the same."""
        self._line_of, self._record_of = line_of, record_of

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: Path) -> ResultsFile:
        """Open `path` for results: a regular file (created if missing) is read-write
        and resumable; a FIFO or a character device (/dev/null, /dev/stdout) is only
        written to, never read (reading one would block or never end)."""
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as exc:
            raise BatchFileError(f"cannot use {path} for results ({exc.strerror})") from None
        if mode is not None and stat.S_ISDIR(mode):
            raise BatchFileError(f"--output {path} is a directory; give a file name")
        try:
            if mode is not None and not stat.S_ISREG(mode):
                return cls(path, stream=open(path, "ab", buffering=0))  # noqa: SIM115
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as exc:
            raise BatchFileError(f"cannot write results to {path} ({exc.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between stat and open
            os.close(fd)
            raise BatchFileError(f"{path} changed while it was being opened; try again")
        return cls(path, fd=fd)

    @classmethod
    def stdout(cls) -> ResultsFile:
        """Results on standard output, as UTF-8 whatever the locale says (JSONL is UTF-8)."""
        sys.stdout.flush()
        stream = getattr(sys.stdout, "buffer", None)
        return cls(None, stream=stream if stream is not None else _TextBytes(sys.stdout))

    @property
    def resumable(self) -> bool:
        """Whether earlier results can be read back (a regular file)."""
        return self._fd is not None

    @property
    def name(self) -> str:
        return "stdout" if self.path is None else str(self.path)

    # ------------------------------------------------------------ locking

    def lock(self) -> bool:
        """Take the exclusive lock; OutputBusyError if another process holds it. Returns
        False (and locks nothing) for a stream, or where the platform has no `flock`
        (not POSIX): there, two runs on one file are not detected."""
        if self._fd is None:
            return False
        try:
            import fcntl
        except ImportError:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputBusyError(f"{self.path} is being written by another genlab run (it "
                                  f"holds the file's lock); wait for that run to end, or "
                                  f"give another --output") from None
        except OSError as exc:
            raise BatchFileError(f"cannot lock {self.path} ({exc.strerror}); give an "
                                 f"--output on a local file system") from None
        self.locked = True
        return True

    # ------------------------------------------------------------ reading

    def read(self) -> dict[str, Prior]:
        """Every id the file holds a record for (the last record wins). BatchFileError
        if a line is not a genlab record: the file is then not one to resume or append
        to, and is left as it is. A last line without its newline is cut off only when
        it is a half-written record (`half_written`, counted in `repaired_bytes`); a
        whole record there gets its newline."""
        if self._fd is None:
            return {}
        found: dict[str, Prior] = {}
        self._last = {}
        self.duplicates = 0
        for number, offset, raw in self._lines():
            ended = raw.endswith(b"\n")  # only the last line can lack one
            if not ended and half_written(raw):
                self.repaired_bytes = len(raw)
                os.ftruncate(self._fd, offset)
                break
            record = self._record(raw, number)
            if not ended:  # every line before it is a record too, so the file is ours
                _write_all(self._fd, b"\n")
            if record is None:
                continue
            key = id_key(record["id"])
            self.duplicates += key in found
            found[key] = Prior(record.get(FINGERPRINT_KEY), "error" in record, number)
            self._last[key] = number
        self._size = os.fstat(self._fd).st_size
        return found

    def _lines(self) -> Iterator[tuple[int, int, bytes]]:
        """(line number, byte offset, raw line with its "\\n") of the file, streamed."""
        if self._fd is None:
            return
        with open(os.dup(self._fd), "rb") as fh:  # own offset; the lock stays on ours
            fh.seek(0)
            offset = 0
            for number, raw in enumerate(fh, start=1):  # binary lines end at b"\n" only
                yield number, offset, raw
                offset += len(raw)

    def _record(self, raw: bytes, number: int) -> dict[str, Any] | None:
        """The record of one line (None for a blank one); BatchFileError naming the
        line if it is not one."""
        if not raw.strip():
            return None
        try:
            record = jsonl.loads(jsonl.decode_line(raw.rstrip(b"\r\n")))
        except jsonl.JsonLineError as exc:
            raise self._foreign(number, f"is {exc}") from None
        if self._record_of is not None and isinstance(record, dict):
            record = dict(self._record_of(record))
        if not is_record(record):
            what = ("an OpenAI batch result (one has custom_id and response)"
                    if self._record_of else
                    'a genlab result (one has "id" and "text" or "error")')
            raise self._foreign(number, f"is not {what}")
        return record

    def _foreign(self, number: int, why: str) -> BatchFileError:
        return BatchFileError(f"{self.path} line {number} {why}: genlab appends only to "
                              f"its own results files; pick another --output (-o) file")

    # ------------------------------------------------------------ rewriting

    def drop(self, keys: Collection[str]) -> int:
        """Remove the records of `keys` (and records a later one repeats) from the file;
        return how many lines went. The kept lines go to a new file, locked before it
        is renamed over the old one, so the path always holds a complete file and stays
        locked throughout. Call after `read()`."""
        if self._fd is None or self.path is None or (not keys and not self.duplicates):
            return 0
        gone = set(keys)
        real = Path(os.path.realpath(self.path))
        temp = real.with_name(f".{real.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
        except OSError as exc:
            raise BatchFileError(f"cannot rewrite {self.path} to redo lines: its folder "
                                 f"must be writable ({exc.strerror})") from None
        try:
            moved = ResultsFile(self.path, fd=fd)
            if self.locked:
                moved.lock()
            dropped = self._copy_kept(fd, gone)
            os.fsync(fd)
            os.chmod(temp, stat.S_IMODE(os.fstat(self._fd).st_mode))
            os.replace(temp, real)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        _fsync_dir(real.parent)
        os.close(self._fd)
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self.duplicates = 0
        return dropped

    def _copy_kept(self, fd: int, gone: set[str]) -> int:
        dropped = 0
        for number, _, raw in self._lines():
            record = self._record(raw, number)
            if record is None:
                continue
            key = id_key(record["id"])
            if key in gone or self._last.get(key) != number:
                dropped += 1
                continue
            _write_all(fd, raw)
        return dropped

    # ------------------------------------------------------------ writing

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one record as one JSON line, at once (no buffering)."""
        line = record if self._line_of is None else self._line_of(record)
        data = jsonl.dumps(dict(line))
        if self._fd is not None:
            self.check()
            # Ctrl-C or SIGTERM can land between the write and the count: `check`
            # allows the line in flight, so a stopped run keeps what it wrote.
            self._writing = len(data)
            try:
                _write_all(self._fd, data)
            except OSError:  # what it wrote of the line is a torn line: not allowed for
                self._writing = 0
                raise
            self._size += len(data)
            self._writing = 0
        elif self._stream is not None:
            self._stream.write(data)
            self._stream.flush()

    def check(self) -> None:
        """ResultsLostError unless the path still names the file this run writes (same
        device and inode) and it holds exactly the bytes written to it: a file removed,
        renamed over or truncated under the run has lost results that exit 0 would
        claim. A stream has nothing to check."""
        if self._fd is None or self.path is None:
            return
        own = os.fstat(self._fd)
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            named = None
        if named is None:
            why = "was removed during the run"
        elif (named.st_dev, named.st_ino) != (own.st_dev, own.st_ino):
            why = "was replaced by another file during the run"
        elif not self._size <= own.st_size <= self._size + self._writing:
            why = (f"changed size during the run ({own.st_size:,} bytes where this run had "
                   f"{self._size:,})")
        else:
            return
        raise ResultsLostError(
            f"{self.path} {why}: results written to it were lost; rerun the same command "
            f"to generate them again (lines whose results are still in the file are kept)")

    def close(self) -> None:
        """Flush to disk and release the lock (closing the file releases it)."""
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError:
                pass  # a file system without fsync still has every line written
            os.close(self._fd)
            self._fd = None
        elif self._stream is not None and self.path is not None:
            self._stream.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_record(value: Any) -> bool:
    """Whether a parsed line is a result record: what `genlib.batch.jobs.result_record` and
    `error_record` always write (and genlab wrote before fingerprints), an id (a string
    or an integer) with a "text" or an "error"."""
    return isinstance(value, dict) and isinstance(value.get("id"), (str, int)) \
        and not isinstance(value["id"], bool) and ("text" in value or "error" in value)


# Every line genlab appends begins `{"id": ID, ` and then its "text" or "error" (its
# records) or "custom_id" (OpenAI's format, `genlib.batch.openai.result_line`).
_HEAD = b'{"id": '
_SECOND_KEYS = (b', "text"', b', "error"', b', "custom_id"')
_ID = re.compile(rb'-?[0-9]+|"(?:[^"\\]|\\.)*"')  # a string or an integer, whole
_ID_CUT = re.compile(rb'-?[0-9]*|"(?:[^"\\]|\\.)*\\?')  # one cut short


def half_written(raw: bytes) -> bool:
    """Whether a last line without its newline is what an interrupted `append` leaves:
    not a whole JSON value, and a beginning of a line genlab writes (`_HEAD`, an id,
    one of `_SECOND_KEYS`). Any other text there is not genlab's to cut."""
    try:
        jsonl.loads(jsonl.decode_line(raw), text_only=False)
    except jsonl.JsonLineError:
        pass
    else:
        return False  # whole: a record short of its newline, or not a record at all
    if not raw.startswith(_HEAD):
        return _HEAD.startswith(raw)
    rest = raw[len(_HEAD):]
    whole_id = _ID.match(rest)
    if whole_id is None:
        return _ID_CUT.fullmatch(rest) is not None
    after = rest[whole_id.end():]
    return any(key.startswith(after[:len(key)]) for key in _SECOND_KEYS)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX); a platform that cannot open folders skips it."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


class _TextBytes:
    """A text stream seen as a bytes stream (stdout replaced by one without `.buffer`)."""

    def __init__(self, text: IO[str]):
        self._text = text

    def write(self, data: bytes) -> None:
        self._text.write(data.decode("utf-8"))

    def flush(self) -> None:
        self._text.flush()

    def close(self) -> None:
        pass
