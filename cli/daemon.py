"""`genlab daemon`: start, stop and show the start daemon (cli/daemon_server.py), a
background process that has imported torch, so that a command no longer pays for it:
each later `genlab` command of the same Python and environment is forked from it. Off
with GENLAB_DAEMON=0. None of these commands imports torch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import typer

from cli import daemon_protocol as protocol
from cli.errors import fail, user_errors

app = typer.Typer(help="Keep torch imported in a background process, so that commands "
                       "start in a fraction of a second.", no_args_is_help=True)

NOT_RUNNING = 3  # `daemon status` when none runs, as `systemctl status` says it
START_TIMEOUT_S = 120.0


def ask(message: dict[str, Any]) -> dict[str, Any] | None:
    """The running daemon's answer to `message`; None when none answers."""
    path = protocol.socket_path()
    if not path.exists():
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        try:
            sock.connect(str(path))
            protocol.send(sock, message)
            reply, _ = protocol.receive(sock)
        except (OSError, ValueError):
            return None
    return reply


@app.command("start")
@user_errors
def start() -> None:
    """Start the daemon in the background (about as long as one command's start); later
    commands of this Python and environment run forked from it."""
    from cli.render import out

    if not protocol.supported():
        raise fail(f"the start daemon runs on Linux only, not on {sys.platform}", 1)
    running = ask({"status": True})
    if running is not None:
        out.print(f"the genlab daemon is already running (pid {running['pid']})")
        return
    log = _private_folder() / f"daemon-{protocol.interpreter()}.log"
    root = str(Path(__file__).resolve().parents[1])
    code = f"import sys; sys.path.insert(0, {root!r}); from cli.daemon_server import main; main()"
    with open(log, "w", encoding="utf-8") as written:
        process = subprocess.Popen([sys.executable, "-c", code], cwd="/",
                                   stdin=subprocess.DEVNULL, stdout=written,
                                   stderr=written, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (running := ask({"status": True})) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            raise fail(f"the genlab daemon did not start: {_last_line(log)} (its log: "
                       f"{log})", 1)
        time.sleep(0.05)
    out.print(f"started the genlab daemon (pid {running['pid']}); `genlab daemon stop` "
              "ends it")


@app.command("stop")
@user_errors
def stop() -> None:
    """Stop the daemon: it takes no more commands, and ends when those it runs end."""
    from cli.render import out

    reply = ask({"stop": True})
    if reply is None:
        out.print("no genlab daemon is running")
        return
    others = _others(reply["running"], reply["stopping"])
    still = "" if not others else "; it ends when the command it runs ends" \
        if others == 1 else f"; it ends when the {others} commands it runs end"
    out.print(f"stopped the genlab daemon (pid {reply['stopping']}){still}")


@app.command("status")
@user_errors
def status() -> None:
    """Whether the daemon runs, what it has served, and whether it serves commands run
    from this environment. Exit status 3 when none runs."""
    from cli.cache import size_text
    from cli.render import out

    reply = ask({"status": True})
    if reply is None:
        out.print("no genlab daemon is running (`genlab daemon start` starts one)")
        raise typer.Exit(NOT_RUNNING)
    uptime = _duration(time.time() - reply["started"])
    rss = _resident_bytes(reply["pid"])
    memory = f", {size_text(rss)} resident" if rss is not None else ""
    out.print(f"the genlab daemon is running (pid {reply['pid']}, up {uptime}{memory}); "
              f"commands served {reply['served']}, running now "
              f"{_others(reply['running'], reply['pid'])}")
    differ = _differences(reply["identity"], protocol.identity())
    if differ:
        verb = "differs" if len(differ) == 1 else "differ"
        out.print(f"it does not serve commands run from here: {', '.join(differ)} {verb} "
                  "from its own; `genlab daemon stop`, then `genlab daemon start` here")
    else:
        out.print("it serves commands run from here")


def _private_folder() -> Path:
    folder = protocol.folder()
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise fail(f"cannot make {folder} for the daemon's socket: {exc.strerror}", 1) \
            from None
    if not protocol.private(folder):
        raise fail(f"{folder} is not a folder only you may enter; remove it, or set "
                   "XDG_RUNTIME_DIR to a folder of your own", 1)
    return folder


def _others(running: int, pid: int) -> int:
    """Daemon `pid`'s runs but this command, if it is one of them."""
    return running - 1 if os.getppid() == pid else running


def _differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    names = sorted(name for name in set(theirs["environment"]) | set(ours["environment"])
                   if theirs["environment"].get(name) != ours["environment"].get(name))
    if theirs["flags"] != ours["flags"]:
        names.insert(0, "the interpreter's flags")
    if theirs["interpreter"] != ours["interpreter"]:
        names.insert(0, "the Python interpreter")
    return names


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s" if minutes \
        else f"{secs} s"


def _resident_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status_file:
            for line in status_file:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return "it wrote no log"
    return lines[-1] if lines else "it exited without a message"
