"""What the start daemon and the `genlab` command that uses it share: where the socket
is, which runs it may serve, and how a message is framed. Standard library only: the
command reads this before it imports anything else.

A run is one message from the command: its arguments, folder, environment, import path,
process state and standard streams (their descriptors ride along, SCM_RIGHTS). Either
the daemon answers at once with why it will not serve the run, or the process it forks
for the run takes the command on and says `ready` (or `failed`, and the command runs on
its own); when that process ends, the daemon reports its wait status."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import socket
import stat
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

# The messages' version: a command and a daemon of different versions do not talk.
VERSION = 2

# Off switch: GENLAB_DAEMON=0 runs every command in its own process, as before.
SWITCH = "GENLAB_DAEMON"

# Variables the libraries the daemon imports read when they are imported (thread pools,
# allocators, CPU dispatch, the locale, Typer's look), so a run may differ from the
# daemon's only where it would have made no difference: a run whose values differ
# starts on its own.
_FIXED_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "GOTO_", "OPENBLAS_", "TORCH",
                   "PYTORCH_", "ATEN_", "CUDA", "LD_", "LC_", "NUMEXPR_", "NPY_", "NUMPY_",
                   "MALLOC_", "GLIBC_", "TYPER_", "_TYPER_")
_FIXED_NAMES = ("LANG", "LANGUAGE")

# The limits a command's shell may set (`ulimit`) that its run must keep.
_LIMITS = ("RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE",
           "RLIMIT_MEMLOCK", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_RSS", "RLIMIT_STACK")

_HEADER = struct.Struct("!I")
_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
MAX_MESSAGE = 16 << 20


def supported() -> bool:
    """Linux only: the daemon asks the kernel who connects (SO_PEERCRED) and sets the
    run's CPUs (sched_setaffinity)."""
    return sys.platform == "linux"


def enabled() -> bool:
    return supported() and os.environ.get(SWITCH, "1") != "0"


def folder() -> Path:
    """The user's folder for the socket: `$XDG_RUNTIME_DIR/genlab`, else
    `genlab-UID` in the temporary folder. Only its owner may enter it."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "genlab"
    return Path(tempfile.gettempdir()) / f"genlab-{os.getuid()}"


def private(path: Path) -> bool:
    """Whether `path` is a folder this user owns that no one else may enter."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & 0o077)


def interpreter() -> str:
    """This Python, as a short name: a daemon serves runs of the interpreter it runs on."""
    ident = f"{os.path.realpath(sys.executable)}\0{sys.prefix}\0{sys.version}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def socket_path() -> Path:
    """One daemon per interpreter and control group (a login's, a container's, a
    terminal tab's on some desktops): it can serve only commands of its own group."""
    scope = hashlib.sha256(_cgroup().encode()).hexdigest()[:8]
    return folder() / f"daemon-{interpreter()}-{scope}.sock"


def connect(path: Path, timeout: float | None = None) -> socket.socket | None:
    """A connection to this user's daemon at `path`; None when there is none, or when
    the socket, its folder or the process that answers are not this user's alone (a
    command hands the daemon its environment and its terminal)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not (stat.S_ISSOCK(info.st_mode) and info.st_uid == os.getuid()
            and private(path.parent)):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
        if peer_uid(sock) != os.getuid():
            raise ConnectionRefusedError
    except OSError:
        sock.close()
        return None
    return sock


def peer_uid(sock: socket.socket) -> int:
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    return _CREDENTIALS.unpack(credentials)[1]


def fixed_environment(environ: dict[str, str]) -> dict[str, str]:
    """The part of an environment that a daemon's imports have already read."""
    return {name: value for name, value in environ.items()
            if name.startswith(_FIXED_PREFIXES) or name in _FIXED_NAMES}


def identity() -> dict[str, Any]:
    """What a run must share with the daemon to be served by it."""
    return {"version": VERSION, "interpreter": interpreter(), "flags": repr(sys.flags),
            "options": [list(sys.warnoptions), repr(sorted(sys._xoptions.items()))],
            "environment": fixed_environment(dict(os.environ))}


def process_state() -> dict[str, Any]:
    """What a process inherits that its environment does not say: the file mode mask,
    the CPUs it may run on (`taskset`), its niceness (`nice`), its limits (`ulimit`),
    and what it may do as whom (groups, control group)."""
    mask = os.umask(0)
    os.umask(mask)
    return {"umask": mask, "cpus": sorted(os.sched_getaffinity(0)),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "limits": {name: resource.getrlimit(getattr(resource, name))
                       for name in _LIMITS if hasattr(resource, name)},
            "groups": [os.getgid(), os.getegid(), sorted(os.getgroups())],
            "cgroup": _cgroup()}


def _cgroup() -> str:
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as cgroup:
            return cgroup.read()
    except OSError:
        return ""


def unreachable(state: dict[str, Any], ours: dict[str, Any] | None = None) -> str | None:
    """Why this process (or one in state `ours`) could not take on `state` (a higher
    priority or a higher hard limit than its own need privileges; groups and control
    groups it cannot change), or None."""
    ours = ours or process_state()
    if state["groups"] != ours["groups"] or state["cgroup"] != ours["cgroup"]:
        return "other groups or another control group than the daemon's"
    if state["nice"] < ours["nice"]:
        return "a higher priority than the daemon's"
    if not set(state["cpus"]) <= set(ours["cpus"]):
        return "CPUs the daemon may not run on"
    for name, (_, hard) in state["limits"].items():
        mine = ours["limits"][name][1]
        if mine != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > mine):
            return f"a higher {name} limit than the daemon's"
    return None


def take_on(state: dict[str, Any]) -> None:
    """Make this process's mask, CPUs, niceness and limits `state`'s."""
    os.umask(state["umask"])
    os.sched_setaffinity(0, state["cpus"])
    os.nice(state["nice"] - os.getpriority(os.PRIO_PROCESS, 0))
    for name, limits in state["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(limits))


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    packet = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [packet], list(fds)) if fds else 0
    if sent < len(packet):
        sock.sendall(packet[sent:])


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; None at the end of the
    connection. Reads exactly one message, so that the next stays for the next call.
    ValueError for bytes that are not a message."""
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
    else:
        head, fds = sock.recv(_HEADER.size), []
    try:
        if not head:
            raise ValueError("no message") if fds else EOFError
        (size,) = _HEADER.unpack(head + _exactly(sock, _HEADER.size - len(head)))
        if size > MAX_MESSAGE:
            raise ValueError(f"a message of {size} bytes")
        message = json.loads(_exactly(sock, size))
        if not isinstance(message, dict):
            raise ValueError("a message that is not an object")
    except EOFError:
        return None, []
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ValueError("a message cut short")
        data += chunk
    return data
