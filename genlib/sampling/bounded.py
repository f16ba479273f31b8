"""A long C call that Ctrl-C, SIGTERM and a time limit can stop.

xgrammar's compiler holds its thread for as long as a grammar takes to compile (minutes
for a JSON schema with thousands of keys), and Python runs signal handlers only in the
main thread, between bytecodes: a compile on the main thread cannot be interrupted. It
releases the GIL while it works, so `run` calls it on a worker thread and the main thread
waits in short, interruptible waits. A call that is given up on (interrupted, or past its
time) cannot be stopped: its daemon thread runs on until the call returns, and `running`
says so, because such a thread must not be running while the interpreter shuts down (a C++
call returning into a finalized interpreter aborts the process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

POLL_S = 0.1  # how long a wait lasts before the main thread looks again (and runs handlers)

_WORKERS: list[threading.Thread] = []


class OutOfTime(Exception):
    """The call did not return within its time limit (it goes on in the background)."""


@dataclass
class _Outcome:
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


def run(call: Callable[[], Any], limit_s: float, quiet_s: float = 0.0,
        shown: Callable[[], AbstractContextManager[None]] | None = None) -> Any:
    """`call()`'s value (or its exception), called on a worker thread. OutOfTime after
    `limit_s` seconds; KeyboardInterrupt as soon as a signal handler raises it. `shown`:
    a context entered if the call is still running after `quiet_s` seconds (a spinner),
    so a quick call shows nothing."""
    outcome = _Outcome()
    worker = threading.Thread(target=_work, args=(call, outcome), daemon=True,
                              name="genlab-bounded")
    _WORKERS.append(worker)
    worker.start()
    if outcome.done.wait(min(quiet_s, limit_s)) or quiet_s >= limit_s:
        return _result(outcome, limit_s)
    with shown() if shown is not None else nullcontext():
        _wait(outcome, limit_s - quiet_s)
    return _result(outcome, limit_s)


def _work(call: Callable[[], Any], outcome: _Outcome) -> None:
    try:
        outcome.value = call()
    except BaseException as exc:  # handed to the waiting thread, which raises it
        outcome.error = exc
    finally:
        outcome.done.set()


def _wait(outcome: _Outcome, limit_s: float) -> None:
    for _ in _polls(limit_s):
        if outcome.done.wait(POLL_S):
            return


def _polls(limit_s: float) -> Iterator[None]:
    import time

    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        yield


def _result(outcome: _Outcome, limit_s: float) -> Any:
    if not outcome.done.is_set():
        raise OutOfTime(f"not done after {limit_s:g} s")
    if outcome.error is not None:
        raise outcome.error
    return outcome.value


def running() -> bool:
    """Whether a call given up on is still running (the process should then end with
    os._exit once its own work is done and written)."""
    _WORKERS[:] = [worker for worker in _WORKERS if worker.is_alive()]
    return bool(_WORKERS)
