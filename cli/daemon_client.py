"""The `genlab` command's side of the start daemon: hand the run to a daemon of this
Python if one is running and may serve it, forward the signals the command receives,
and end with the run's status. Standard library only, imported before anything else."""

from __future__ import annotations

import os
import resource
import select
import signal
import sys
from types import FrameType
from typing import Any

from cli import daemon_protocol as protocol

# Signals the command passes on to the run (the terminal's Ctrl-C and Ctrl-\ reach only
# the command: the run is not in the terminal's process group), unless the command
# ignores them (`nohup`, a script's background job): then the run ignores them too.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)

# Flags that look at the process's parent (Typer finds the shell to complete for there).
OWN_PROCESS = {"--install-completion", "--show-completion"}


def run_in_daemon() -> int | None:
    """The exit status of this command run by the daemon; None when no daemon serves it
    (none running, switched off, or it declined), and the command should run here."""
    if not protocol.enabled() or OWN_PROCESS.intersection(sys.argv) or not _plain():
        return None
    try:
        request, fds = _request()  # before the socket, which may take a closed stream's fd
    except (OSError, TypeError, ValueError):  # its folder was removed; an odd sys.path
        return None
    sock = protocol.connect(protocol.socket_path())
    if sock is None:
        return None
    relay = Relay()  # from here a signal waits for the run, or for this process to go on
    with sock:
        try:
            protocol.send(sock, request, fds)
            reply, _ = protocol.receive(sock)
        except (OSError, ValueError):
            reply = None
        if reply is None or not isinstance(reply.get("ready"), int):
            if reply is not None and reply.get("stopped"):  # later commands start slowly
                _say(f"the start daemon stopped: {reply.get('refused')}; `genlab daemon "
                     "start` starts a new one")
            elif reply is not None and "failed" in reply:  # a fault of genlab's: say it
                _say(f"the start daemon could not take this command on ({reply['failed']}); "
                     "it runs on its own")
            relay.release()
            return None
        relay.to(reply["ready"])
        return _wait(sock, relay)


def _plain() -> bool:
    """Whether a forked run could take this command on as it stands: no argument names
    one of this process's descriptors (`-o >(gzip)`, `/dev/fd/3`: the run's descriptor
    of that number is another), and it is not a background job reading a terminal
    (which its shell stops, and a run outside its process group would not be)."""
    if any(place in arg for arg in sys.argv for place in _DESCRIPTOR_PATHS):
        return False
    try:
        return not os.isatty(0) or os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return True


_DESCRIPTOR_PATHS = ("/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/")


def _request() -> tuple[dict[str, Any], list[int]]:
    streams = [_stream(s) for s in (sys.stdin, sys.stdout, sys.stderr)]
    main = sys.modules.get("__main__")
    request = {"argv": sys.argv, "orig_argv": getattr(sys, "orig_argv", sys.argv),
               "cwd": os.getcwd(), "environment": dict(os.environ), "path": sys.path,
               "main_package": getattr(main, "__package__", None), "streams": streams,
               "identity": protocol.identity(), "process": protocol.process_state(),
               "ignored_signals": [int(s) for s in FORWARDED if _ignored(s)]}
    return request, [fd for fd, stream in enumerate(streams) if stream is not None]


def _stream(stream: Any) -> dict[str, str] | None:
    """How the run should make this standard stream, or None where it is closed."""
    if stream is None:
        return None
    try:
        os.fstat(stream.fileno())
    except (OSError, ValueError):
        return None
    return {"encoding": stream.encoding, "errors": stream.errors,
            "line_buffering": stream.line_buffering, "write_through": stream.write_through}


def _ignored(sig: int) -> bool:
    return signal.getsignal(sig) is signal.SIG_IGN


class Relay:
    """Passes the signals this command receives on to the run; those that come before
    the run has taken the command on wait for it (or, if no run comes, for this
    process). Signals the command ignores stay ignored, here and in the run."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        self.before = {sig: signal.getsignal(sig) for sig in (*FORWARDED, signal.SIGTSTP)}
        for sig in FORWARDED:
            if not _ignored(sig):
                signal.signal(sig, self._forward)
        signal.signal(signal.SIGTSTP, self._suspend)

    def to(self, pid: int) -> None:
        self.pid = pid
        for sig in self.pending:
            _kill(pid, sig)

    def release(self) -> None:
        """No run: the signals act on this process again, the waiting ones first."""
        for sig, handler in self.before.items():
            signal.signal(sig, handler)
        for sig in self.pending:
            signal.raise_signal(sig)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if self.pid is None:
            self.pending.append(signum)
        else:
            _kill(self.pid, signum)

    def _suspend(self, signum: int, frame: FrameType | None) -> None:  # Ctrl-Z: both stop
        if self.pid is not None:
            _kill(self.pid, signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)
        signal.signal(signal.SIGTSTP, self._suspend)  # continued (fg, bg)
        if self.pid is not None:
            _kill(self.pid, signal.SIGCONT)


def _wait(sock: Any, relay: Relay) -> int:
    """The run's exit code once the daemon reports its end (a run a signal ended ends
    this command by the same signal). Should the daemon end first, the command waits for
    the run, which still writes to its streams, then fails."""
    try:
        reply, _ = protocol.receive(sock)
    except (OSError, ValueError):
        reply = None
    if reply is None or not isinstance(reply.get("status"), int):
        _outlive(relay.pid)
        _say("error: the genlab daemon ended during the run, so its exit status is "
             "unknown (`genlab daemon start` starts it again)")
        return 1
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the run dumped its own
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


def _outlive(pid: int | None) -> None:
    """Wait until process `pid`, not this one's child, has ended."""
    if pid is None:
        return
    try:
        watched = os.pidfd_open(pid)
    except OSError:
        return
    try:
        select.select([watched], [], [])
    finally:
        os.close(watched)


def _say(line: str) -> None:
    if sys.stderr is not None:
        print(line, file=sys.stderr)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
