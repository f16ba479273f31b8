"""The start daemon: a process that has imported torch and the other libraries a command
needs (about 1.2 s of every start) and forks a process for each run of `genlab` that asks.
The forked process takes the run's standard streams, folder, environment, arguments and
process state, imports genlab's own modules afresh from the run's import path, and runs
the command as a process of its own would; the daemon reports its wait status back.

    genlab daemon start      # starts this in the background (cli/daemon.py)

The daemon is one thread: a selector over the socket, the connections of the runs it
forked (a connection that closes early means its command was killed: the run is
killed too) and a pipe that SIGCHLD writes to."""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import gc
import importlib
import io
import os
import random
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any, NoReturn

from cli import daemon_protocol as protocol

# What a command imports before its work starts, and genlab's own modules do not need to
# have imported first. genlab's modules are imported by each run, so that a run always
# has the code of its own checkout or install.
PRELOAD = ("torch", "numpy", "safetensors.torch", "tokenizers", "typer", "typer._adapters",
           "typer._click.decorators", "rich.console", "rich.table", "yaml", "platformdirs",
           "pydantic.type_adapter", "pydantic.plugin._loader", "shlex", "sysconfig",
           "zoneinfo")
OWN_PACKAGES = ("cli", "genlib")
# genlab's modules the daemon itself runs: changed on disk, it runs code that is gone.
OWN_MODULES = ("cli.daemon_server", "cli.daemon_protocol")
# Signals held from just before a fork until the run has taken its own handlers, so that
# none reaches the daemon's handlers in the forked process.
HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD}
CHECK_S = 60.0  # how often an idle daemon checks that its socket is still its own


class Run:
    """A request to run one command, as the forked process receives it."""

    def __init__(self, request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
        self.request = request
        self.fds = fds
        self.conn = conn  # to say `ready` or `failed` on, then close


class Daemon:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.pid = os.getpid()
        self.lock = -1
        self.inode = 0
        self.identity = protocol.identity()
        self.preloaded = _files_of(PRELOAD + OWN_MODULES)
        self.started = time.time()
        self.served = 0
        self.children: dict[int, socket.socket] = {}
        self.stopping = False
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.wake_read, self.wake_write = os.pipe()

    def serve(self) -> Run | None:
        """Answer until stopped (then None, once every run has ended). In a forked
        process, returns that process's run."""
        self._listen()
        checked = time.monotonic()
        while not self.stopping or self.children:
            events = self.selector.select(CHECK_S)
            if time.monotonic() - checked >= CHECK_S:
                checked = time.monotonic()
                if not self._still_reachable():
                    self._stop()
            for key, _ in events:
                try:
                    run = self._on_ready(key.fileobj)
                except Exception:  # a fault of one command's request: the daemon goes on
                    traceback.print_exc()
                    if os.getpid() != self.pid:  # in a forked run: never a second daemon
                        os._exit(1)
                    continue
                if run is not None:
                    return run
        return None

    def _listen(self) -> None:
        self.lock = os.open(self.path.with_suffix(".lock"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit("another genlab daemon of this Python is running") from None
        if self.path.exists():
            self.path.unlink()  # left by a daemon that was killed: nobody answers on it
        self.listener.bind(str(self.path))
        self.inode = os.stat(self.path).st_ino
        self.listener.listen(64)
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.signal(signal.SIGTERM, lambda signum, frame: self._stop())
        signal.signal(signal.SIGINT, lambda signum, frame: self._stop())
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_read, selectors.EVENT_READ)

    def _still_reachable(self) -> bool:
        """Whether the socket on disk is still this daemon's: a cleaner of the runtime
        or temporary folder may have removed it, and nothing could reach it again."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def _on_ready(self, source: Any) -> Run | None:
        if source is self.listener:
            return self._accept()
        if source == self.wake_read:
            while True:
                try:
                    if not os.read(self.wake_read, 512):
                        break
                except BlockingIOError:
                    break
            self._reap()
            return None
        self._client_gone(source)
        return None

    def _accept(self) -> Run | None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return None
        try:
            conn.settimeout(2)  # a command sends its request at once
            if protocol.peer_uid(conn) != os.getuid():
                conn.close()
                return None
            request, fds = protocol.receive(conn, max_fds=3)
            conn.settimeout(None)
        except (OSError, ValueError):
            conn.close()
            return None
        if request is None:
            conn.close()
            return None
        try:
            return self._answer(conn, request, fds)
        except Exception:  # a request it cannot read: the command runs on its own
            if os.getpid() != self.pid:
                raise
            if not isinstance(sys.exc_info()[1], OSError):
                traceback.print_exc()
            conn.close()
            return None
        finally:
            if os.getpid() == self.pid:  # the run's process keeps them, the daemon not
                _close(fds)

    def _answer(self, conn: socket.socket, request: dict[str, Any],
                fds: list[int]) -> Run | None:
        if request.get("stop"):
            self._stop()  # first: once the command hears back, nothing new comes here
            protocol.send(conn, {"stopping": os.getpid(), "running": len(self.children)})
            conn.close()
            return None
        if request.get("status"):
            protocol.send(conn, self._status())
            conn.close()
            return None
        refusal = self._refusal(request, fds)
        if refusal is not None:
            protocol.send(conn, {"refused": refusal, "stopped": self.stopping})
            conn.close()
            return None
        before = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
        try:
            pid = os.fork()
        finally:
            if os.getpid() == self.pid:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
        if pid == 0:
            self._leave(keep=conn)
            return Run(request, fds, conn)
        self.served += 1
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ)
        return None

    def _refusal(self, request: dict[str, Any], fds: list[int]) -> str | None:
        if self.stopping:
            return "the daemon is stopping"
        if _files_of(PRELOAD + OWN_MODULES) != self.preloaded:
            self._stop()
            return "a library the daemon imported has changed on disk since it started"
        if request.get("identity") != self.identity:
            return "the run's interpreter, flags or environment differ from the daemon's"
        if len(fds) != sum(stream is not None for stream in request["streams"]):
            return "the run's standard streams did not all arrive"
        return protocol.unreachable(request["process"])

    def _status(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "started": self.started, "served": self.served,
                "running": len(self.children), "socket": str(self.path),
                "identity": self.identity, "process": protocol.process_state()}

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            self.selector.unregister(conn)
            try:
                protocol.send(conn, {"status": status})
            except OSError:
                pass
            conn.close()

    def _client_gone(self, conn: socket.socket) -> None:
        """The command that asked for a run went away before the run ended (killed: a
        command that ends normally waits for the run's status): end the run too."""
        if conn.fileno() == -1:  # its run ended, and was reported, in this same round
            return
        for pid, owner in self.children.items():
            if owner is conn:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                del self.children[pid]  # reaped, unowned, on its SIGCHLD
                break
        self.selector.unregister(conn)
        conn.close()

    def _stop(self) -> None:
        if self.stopping or os.getpid() != self.pid:
            return
        self.stopping = True
        if self.listener in (key.fileobj for key in self.selector.get_map().values()):
            self.selector.unregister(self.listener)
        self.listener.close()
        if self._still_reachable():
            self.path.unlink()
        if self.lock >= 0:
            os.close(self.lock)  # a new daemon may start while this one's runs end
            self.lock = -1

    def _leave(self, keep: socket.socket) -> None:
        """In a forked process: let go of what is the daemon's."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        self.listener.close()
        if self.lock >= 0:
            os.close(self.lock)
        os.close(self.wake_read)
        os.close(self.wake_write)
        for conn in self.children.values():
            if conn is not keep:
                conn.close()


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _files_of(modules: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each imported package's file, with its time and size: a changed one (an upgrade)
    means the daemon runs code the install no longer has."""
    files = {}
    for name in modules:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            try:
                info = os.stat(path)
            except OSError:
                files[path] = (0, 0)
                continue
            files[path] = (info.st_mtime_ns, info.st_size)
    return files


def become(run: Run) -> None:
    """In the forked process: take the run's streams, folder, environment, arguments,
    import path, process state and ignored signals; forget genlab's modules and the
    caches the daemon holds; draw fresh random state."""
    request = run.request
    _take_streams(request["streams"], list(run.fds))
    daemon_cpus = len(os.sched_getaffinity(0))
    protocol.take_on(request["process"])
    os.environ.clear()
    os.environ.update(request["environment"])
    os.chdir(request["cwd"])
    time.tzset()
    tempfile.tempdir = None
    sys.argv = list(request["argv"])
    sys.orig_argv = list(request["orig_argv"])
    sys.path[:] = request["path"]
    for name in list(sys.modules):
        if name.split(".")[0] in OWN_PACKAGES:
            del sys.modules[name]
    importlib.invalidate_caches()
    main = types.ModuleType("__main__")
    main.__package__ = request["main_package"]  # `python -m cli` names itself so
    sys.modules["__main__"] = main
    for number in request["ignored_signals"]:
        signal.signal(number, signal.SIG_IGN)
    import torch

    if len(request["process"]["cpus"]) != daemon_cpus and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(request["process"]["cpus"]))  # as OpenMP counts at start
    torch.seed()
    random.seed()


def _take_streams(streams: list[dict[str, str] | None], fds: list[int]) -> None:
    for target, stream in enumerate(streams):
        if stream is None:
            try:
                os.close(target)
            except OSError:
                pass
            continue
        fd = fds.pop(0)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin, sys.stdout, sys.stderr = (
        _text_stream(fd, stream) for fd, stream in enumerate(streams))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def _text_stream(fd: int, stream: dict[str, Any] | None) -> Any:
    """A standard stream on `fd` as the command's Python made it: its encoding, error
    handler and buffering (line by line on a terminal, written through under -u)."""
    if stream is None:
        return None
    unbuffered = stream["write_through"] and fd != 0  # -u: straight to the descriptor
    buffer = open(fd, "rb" if fd == 0 else "wb", buffering=0 if unbuffered else -1,  # noqa: SIM115
                  closefd=False)
    return io.TextIOWrapper(buffer, encoding=stream["encoding"], errors=stream["errors"],
                            newline="\n", line_buffering=stream["line_buffering"],
                            write_through=stream["write_through"])


def end_run(code: object) -> NoReturn:
    """End the run as the interpreter would (wait for its threads, run the atexit
    handlers, flush the streams, C's too) but without tearing down the modules one by
    one, torch's most of all: 0.2 s that a process of its own spends, and a forked one
    need not."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own wait
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    from cli.errors import flush_standard_streams  # the run's own genlab

    flush_standard_streams()
    ctypes.CDLL(None).fflush(None)
    os._exit(status)


def _start(run: Run) -> Any:
    """In the forked process: take the command on and say so to it, then take signals
    again; genlab's `run`. A run that cannot take it on says why and ends: the command
    then runs on its own."""
    try:
        become(run)
    except Exception as exc:  # noqa: BLE001  (whatever it is, the command runs alone)
        _tell(run.conn, {"failed": f"{type(exc).__name__}: {exc}"})
        os._exit(1)
    _tell(run.conn, {"ready": os.getpid()})
    run.conn.close()
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
        from cli.main import run as run_command
    except KeyboardInterrupt:  # Ctrl-C before the command began: it ends as it would
        end_run(130)
    return run_command


def _tell(conn: socket.socket, message: dict[str, Any]) -> None:
    """Say `message` to the command; a command gone already ends the run quietly."""
    try:
        protocol.send(conn, message)
    except OSError:
        os._exit(1)


def main() -> None:
    import genlib  # noqa: F401  (before torch: keeps triton away from a CPU torch)

    for name in PRELOAD:
        importlib.import_module(name)
    sys.modules["pydantic.plugin._loader"].get_plugins()  # reads every package's metadata
    sys.stdout.flush()
    gc.freeze()  # the forked runs' collections leave the daemon's objects' pages shared
    run = Daemon(protocol.socket_path()).serve()
    if run is None:
        return
    run_command = _start(run)
    try:
        run_command()
    except SystemExit as exc:
        end_run(exc.code)
    except KeyboardInterrupt:  # before genlab's own handling began
        end_run(130)
    end_run(0)


if __name__ == "__main__":
    main()
