"""The `genlab` command's side of the start daemon: hand the run to a daemon of this
Python if one is running and may serve it, forward the signals the command receives,
and end with the run's status. Standard library only, imported before anything else."""

from __future__ import annotations

import os
import signal
import socket
import sys
from types import FrameType
from typing import Any

from cli import daemon_protocol as protocol

# Signals the command passes on to the run (the terminal's Ctrl-C and Ctrl-\ reach only
# the command: the run is not in the terminal's process group).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)


# Flags that look at the process's parent (Typer finds the shell to complete for there).
OWN_PROCESS = {"--install-completion", "--show-completion"}


def run_in_daemon() -> int | None:
    """The exit status of this command run by the daemon; None when no daemon serves it
    (none running, switched off, or it declined), and the command should run here."""
    if not protocol.enabled() or OWN_PROCESS.intersection(sys.argv):
        return None
    path = protocol.socket_path()
    if not path.exists():
        return None
    try:
        request, fds = _request()  # before the socket, which may take a closed stream's fd
    except OSError:  # the folder it runs in was removed
        return None
    relay = Relay()  # from here a Ctrl-C waits for the run, or for this process to go on
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        try:
            sock.connect(str(path))
            protocol.send(sock, request, fds)
            reply, _ = protocol.receive(sock)
        except (OSError, ValueError):
            reply = None
        if reply is None or not isinstance(reply.get("pid"), int):
            relay.release()
            if reply is not None and reply.get("stopped"):  # later commands start slowly
                print(f"the start daemon stopped: {reply.get('refused')}; `genlab daemon "
                      "start` starts a new one", file=sys.stderr)
            return None
        relay.to(reply["pid"])
        return _wait(sock)


def _request() -> tuple[dict[str, Any], list[int]]:
    streams = [_stream(s) for s in (sys.stdin, sys.stdout, sys.stderr)]
    request = {"argv": sys.argv, "cwd": os.getcwd(), "environment": dict(os.environ),
               "path": sys.path, "streams": streams, "identity": protocol.identity(),
               "process": protocol.process_state()}
    return request, [fd for fd, stream in enumerate(streams) if stream is not None]


def _stream(stream: Any) -> dict[str, str] | None:
    """How the run should make this standard stream, or None where it is closed."""
    if stream is None:
        return None
    try:
        os.fstat(stream.fileno())
    except (OSError, ValueError):
        return None
    return {"encoding": stream.encoding, "errors": stream.errors}


class Relay:
    """Passes the signals this command receives on to the run; those that come before
    the run's pid is known wait for it (or, if no run comes, for this process)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        signal.signal(signal.SIGTSTP, self._suspend)

    def to(self, pid: int) -> None:
        self.pid = pid
        for sig in self.pending:
            _kill(pid, sig)

    def release(self) -> None:
        """No run: the signals act on this process again, the waiting ones first."""
        for sig in (*FORWARDED, signal.SIGTSTP):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
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


def _wait(sock: socket.socket) -> int:
    """The run's exit code once the daemon reports its end (a run a signal ended ends
    this command by the same signal)."""
    try:
        reply, _ = protocol.receive(sock)
    except (OSError, ValueError):
        reply = None
    if reply is None or not isinstance(reply.get("status"), int):
        print("error: the genlab daemon ended during the run; its output may be "
              "incomplete (`genlab daemon start` starts it again)", file=sys.stderr)
        return 1
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
