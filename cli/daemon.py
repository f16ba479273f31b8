"""`genlab daemon`: start, stop and show the start daemon (cli/daemon_server.py), a
background process that has imported torch, so that a command no longer pays for it:
each later `genlab` command of the same Python and environment is forked from it. Off
with GENLAB_DAEMON=0. None of these commands imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import typer

from cli import daemon_protocol as protocol
from cli import output
from cli.errors import fail, user_errors
from cli.output import Json, OutputFile, opened, sink

app = typer.Typer(help="Keep torch imported in a background process, so that commands "
                       "start in a fraction of a second.", no_args_is_help=True)

NOT_RUNNING = 3  # `daemon status` when none runs, as `systemctl status` says it
START_TIMEOUT_S = 120.0


def ask(message: dict[str, Any]) -> dict[str, Any] | None:
    """The running daemon's answer to `message`; None when none answers."""
    sock = protocol.connect(protocol.socket_path(), timeout=10)
    if sock is None:
        return None
    with sock:
        try:
            protocol.send(sock, message)
            reply, _ = protocol.receive(sock)
        except (OSError, ValueError):
            return None
    return reply


@app.command("start")
@user_errors
def start(as_json: Json = False, output_file: OutputFile = None) -> None:
    """Start the daemon in the background (about as long as one command's start); later
    commands of this Python and environment run forked from it."""
    from cli.render import out

    if not protocol.supported():
        raise fail(f"the start daemon runs on Linux only, not on {sys.platform}", 1)
    target = sink(as_json, False, output_file)
    running = ask({"status": True})
    already = running is not None
    if running is None:
        running = _spawn()
    with opened(target):
        if target.machine:
            target.json_document(output.document(
                "daemon start", None, socket=running["socket"], pid=running["pid"],
                already_running=already))
        elif already:
            out.print(f"the genlab daemon is already running (pid {running['pid']})")
        else:
            out.print(f"started the genlab daemon (pid {running['pid']}); `genlab daemon "
                      "stop` ends it")


def _spawn() -> dict[str, Any]:
    """Start a daemon in a session of its own; its status once it answers."""
    log = _private_folder() / protocol.socket_path().with_suffix(".log").name
    root = str(Path(__file__).resolve().parents[1])
    code = f"import sys; sys.path.insert(0, {root!r}); from cli.daemon_server import main; main()"
    flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    with open(log, "a", encoding="utf-8") as written:  # a second start may be racing
        process = subprocess.Popen([sys.executable, *flags, "-c", code], cwd="/",
                                   stdin=subprocess.DEVNULL, stdout=written,
                                   stderr=written, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (running := ask({"status": True})) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            raise fail(f"the genlab daemon did not start: {_last_line(log)} (its log: "
                       f"{log})", 1)
        time.sleep(0.05)
    return running


@app.command("stop")
@user_errors
def stop(as_json: Json = False, output_file: OutputFile = None) -> None:
    """Stop the daemon: it takes no more commands, and ends when those it runs end."""
    from cli.render import out

    target = sink(as_json, False, output_file)
    reply = ask({"stop": True})
    others = 0 if reply is None else _others(reply["running"], reply["stopping"])
    with opened(target):
        if target.machine:
            target.json_document(output.document(
                "daemon stop", None, socket=str(protocol.socket_path()),
                pid=None if reply is None else reply["stopping"], still_running=others))
        elif reply is None:
            out.print("no genlab daemon is running")
        else:
            still = "" if not others else "; it ends when the command it runs ends" \
                if others == 1 else f"; it ends when the {others} commands it runs end"
            out.print(f"stopped the genlab daemon (pid {reply['stopping']}){still}")


@app.command("status")
@user_errors
def status(as_json: Json = False, output_file: OutputFile = None) -> None:
    """Whether the daemon runs, what it has served, and whether it serves commands run
    from this environment. Exit status 3 when none runs."""
    target = sink(as_json, False, output_file)
    reply = ask({"status": True})
    state = None if reply is None else {
        "pid": reply["pid"], "uptime_seconds": round(time.time() - reply["started"], 3),
        "resident_bytes": _resident_bytes(reply["pid"]),
        "served": _others(reply["served"], reply["pid"]),
        "running": _others(reply["running"], reply["pid"]),
        "differences": _differences(reply)}
    with opened(target):
        if target.machine:
            target.json_document(output.document(
                "daemon status", None, socket=str(protocol.socket_path()), daemon=state))
        else:
            _show_status(state)
    if state is None:
        raise typer.Exit(NOT_RUNNING)


def _show_status(state: dict[str, Any] | None) -> None:
    from cli.cache import size_text
    from cli.render import out

    if state is None:
        out.print("no genlab daemon is running (`genlab daemon start` starts one)")
        return
    rss = state["resident_bytes"]
    memory = f", {size_text(rss)} resident" if rss is not None else ""
    out.print(f"the genlab daemon is running (pid {state['pid']}, up "
              f"{_duration(state['uptime_seconds'])}{memory}); commands served "
              f"{state['served']}, running now {state['running']}")
    differ = state["differences"]
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


def _differences(status: dict[str, Any]) -> list[str]:
    """Why the daemon that answered with `status` would not serve a command run from
    here: the variables, flags or interpreter that differ, or the process state it
    cannot take on."""
    names = _identity_differences(status["identity"], protocol.identity())
    refusal = protocol.unreachable(protocol.process_state(), status["process"])
    return names + ([f"this process's state ({refusal})"] if refusal else [])


def _identity_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    names = sorted(name for name in set(theirs["environment"]) | set(ours["environment"])
                   if theirs["environment"].get(name) != ours["environment"].get(name))
    if theirs["flags"] != ours["flags"] or theirs["options"] != ours["options"]:
        names.insert(0, "the interpreter's flags")
    if theirs["interpreter"] != ours["interpreter"]:
        names.insert(0, "the Python interpreter")
    if theirs.get("version") != ours["version"]:
        names.insert(0, "genlab's daemon protocol")
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
