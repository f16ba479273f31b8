"""The start daemon (`genlab daemon`): a command it serves behaves as the same command in
a process of its own (output, exit status, signals, terminal), and the daemon serves
only what it may. Each test runs real `genlab` processes against one daemon of this
module's, in a socket folder of its own."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli import daemon_protocol as protocol
from tests.conftest import CODE_TARGET, ROOT, STORIES

# Every test here starts processes and waits on them (tests/test_daemon_protocol.py
# holds the quick ones).
pytestmark = pytest.mark.slow

MODEL = ["-m", str(STORIES)]
# A run of some seconds (code-target, about 500 tokens a second), to stop midway.
LONG = ["-m", str(CODE_TARGET), "-n", "1000", "--ignore-eos"]


def genlab(env: dict[str, str], *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, **kwargs)


def wait_for_bytes(path: Path, size: int, proc: subprocess.Popen) -> None:
    """Until `path` holds `size` bytes (the run is midway) or `proc` ends."""
    deadline = time.monotonic() + 120
    while path.stat().st_size < size and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def served(env: dict[str, str]) -> int:
    """How many commands the daemon has run, as it says itself."""
    return ask(env, {"status": True})["served"]


def ask(env: dict[str, str], message: dict) -> dict:
    path = Path(env["XDG_RUNTIME_DIR"]) / "genlab" / protocol.socket_path().name
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        protocol.send(sock, message)
        reply, _ = protocol.receive(sock)
    return reply


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The environment of commands the module's daemon serves."""
    runtime = tmp_path_factory.mktemp("runtime")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), protocol.SWITCH: "1"}
    started = genlab(env, "daemon", "start")
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("started the genlab daemon (pid ")
    yield env
    genlab(env, "daemon", "stop")


@pytest.fixture
def cold(daemon):
    """The same environment with the daemon switched off: a process of its own."""
    return {**daemon, protocol.SWITCH: "0"}


def test_a_served_command_prints_and_exits_as_its_own_process_would(daemon, cold):
    args = ("generate", *MODEL, "-n", "24", "--json")
    before = served(daemon)
    by_daemon = genlab(daemon, *args, input="Once upon a time")
    assert served(daemon) == before + 1
    alone = genlab(cold, *args, input="Once upon a time")
    assert served(daemon) == before + 1
    assert by_daemon.returncode == alone.returncode == 0
    ours, theirs = json.loads(by_daemon.stdout), json.loads(alone.stdout)
    assert ours["outputs"][0]["token_ids"] == theirs["outputs"][0]["token_ids"]
    assert ours["outputs"][0]["text"] == theirs["outputs"][0]["text"]
    assert len(ours["outputs"][0]["token_ids"]) == 24


def test_a_served_usage_error_is_the_same_line_and_status(daemon, cold):
    args = ("generate", *MODEL, "--temperature", "-3", "x")
    before = served(daemon)
    by_daemon, alone = genlab(daemon, *args), genlab(cold, *args)
    assert served(daemon) == before + 1
    assert by_daemon.returncode == alone.returncode == 2
    assert by_daemon.stderr == alone.stderr
    assert by_daemon.stderr.startswith("error: ") and by_daemon.stderr.count("\n") == 1


@pytest.mark.parametrize(("closed", "status", "says"), [
    (1, 2, "standard output is closed"), (0, 0, ""), (2, 0, None)])
def test_a_closed_standard_stream_is_closed_for_the_run_too(daemon, cold, closed, status,
                                                             says):
    """`>&-`, `<&-`, `2>&-`: the run sees the stream closed, as the command would; with
    stdin closed the prompt is the argument, with stderr closed nothing is said."""
    code = (f"import os, runpy, sys; os.close({closed}); sys.argv = ['genlab', *sys.argv[1:]]; "
            "runpy.run_module('cli', run_name='__main__')")
    args = [sys.executable, "-c", code, "generate", *MODEL, "-n", "4", "Once"]
    before = served(daemon)
    results = [subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300) for env in (daemon, cold)]
    assert served(daemon) == before + 1
    assert results[0].returncode == results[1].returncode == status
    assert (results[0].stdout, results[0].stderr) == (results[1].stdout, results[1].stderr)
    if says is not None:
        assert says in results[0].stderr
    if closed != 1:
        assert results[0].stdout == " upon a time,\n"


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_command_stops_the_run_as_it_would_stop_the_command(
        daemon, tmp_path, signum, status):
    out = tmp_path / "out.txt"
    before = served(daemon)
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", *LONG, "def f("],
                                cwd=ROOT, env=daemon, stdout=stdout,
                                stderr=subprocess.PIPE, text=True)
        wait_for_bytes(out, 40, proc)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    assert served(daemon) == before + 1
    assert ask(daemon, {"status": True})["running"] == 0
    assert proc.returncode == status, err
    assert "Traceback" not in err
    assert out.stat().st_size >= 40  # what it printed stays


def test_a_run_the_system_kills_ends_its_command_as_killed(daemon, tmp_path):
    """The run killed outright (the out-of-memory killer): the command ends by SIGKILL
    too, as it would have, without a traceback of its own."""
    parent = ask(daemon, {"status": True})["pid"]
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", *LONG, "def f("],
                                cwd=ROOT, env=daemon, stdout=stdout,
                                stderr=subprocess.PIPE, text=True)
        wait_for_bytes(out, 40, proc)
        os.kill(_child_of(parent, proc), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert err == ""


def test_a_command_that_ignores_hangups_keeps_its_run_through_one(daemon, tmp_path):
    """`nohup genlab ...`: SIGHUP is ignored by the command, so by its run too."""
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", "-m",
                                 str(CODE_TARGET), "-n", "300", "--ignore-eos", "def f("],
                                cwd=ROOT, env=daemon, stdout=stdout, stderr=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP,
                                                                            signal.SIG_IGN))
        wait_for_bytes(out, 20, proc)  # the run has taken the command on
        run = _child_of(ask(daemon, {"status": True})["pid"], proc)
        ignored = int(next(line for line in Path(f"/proc/{run}/status").read_text()
                           .splitlines() if line.startswith("SigIgn:")).split()[1], 16)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=120)
    assert ignored & (1 << (signal.SIGHUP - 1))  # the run ignores it too
    assert proc.returncode == 0, err
    alone = genlab({**daemon, protocol.SWITCH: "0"}, "generate", "-m", str(CODE_TARGET),
                   "-n", "300", "--ignore-eos", "def f(")
    assert out.read_text() == alone.stdout


def test_the_daemon_killed_mid_run_leaves_the_command_waiting_for_its_run(tmp_path):
    """Its daemon gone, a command cannot learn its run's status: it waits for the run
    (which still writes its output), then fails in one line."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), protocol.SWITCH: "1"}
    assert genlab(env, "daemon", "start").returncode == 0
    pid = ask(env, {"status": True})["pid"]
    out, errors = tmp_path / "out.json", tmp_path / "err.txt"
    try:
        with open(out, "w") as stdout, open(errors, "w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", *LONG,
                                     "--json", "def f("], cwd=ROOT, env=env, stdout=stdout,
                                    stderr=stderr)
        run = _child_of(pid, proc)
    finally:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=120)  # files, not pipes: this returns when the command ends
    assert _ended(run)  # and it ended after its run
    err = errors.read_text()
    assert proc.returncode == 1
    assert err == ("error: the genlab daemon ended during the run, so its exit status is "
                   "unknown (`genlab daemon start` starts it again)\n")
    assert len(json.loads(out.read_text())["outputs"][0]["token_ids"]) == 1000


def test_an_argument_naming_a_descriptor_runs_on_its_own(daemon, tmp_path):
    """`-o >(gzip > out.gz)` names /dev/fd/N, which in a forked run would be another
    descriptor: the command runs in its own process, and writes where it was told."""
    read, write = os.pipe()
    before = served(daemon)
    result = subprocess.run([sys.executable, "-m", "cli", "generate", *MODEL, "-n", "4",
                             "-o", f"/dev/fd/{write}", "Once"], cwd=ROOT, env=daemon,
                            pass_fds=(write,), capture_output=True, text=True, timeout=300)
    os.close(write)
    with os.fdopen(read) as written:
        assert written.read() == " upon a time,\n"
    assert result.returncode == 0 and result.stdout == ""
    assert served(daemon) == before


def test_python_dash_m_cli_names_itself_as_alone(daemon, cold):
    by_daemon, alone = genlab(daemon, "generate", "--nope"), genlab(cold, "generate", "--nope")
    assert by_daemon.returncode == alone.returncode == 2
    assert by_daemon.stderr == alone.stderr
    assert "see 'python -m cli generate -h'" in by_daemon.stderr


def test_a_run_that_cannot_take_the_command_on_says_so_and_is_not_run(daemon):
    """A folder gone between the command's look and the run's: the run says `failed`
    before it runs anything, and the command would run on its own."""
    from cli import daemon_client

    request, _ = daemon_client._request()
    request["identity"] = ask(daemon, {"status": True})["identity"]  # as a command's
    request["cwd"] = "/nonexistent/genlab-test"
    request["streams"] = [None, None, None]
    sock = protocol.connect(Path(daemon["XDG_RUNTIME_DIR"]) / "genlab" /
                            protocol.socket_path().name)
    with sock:
        protocol.send(sock, request)
        first, _ = protocol.receive(sock)
        second, _ = protocol.receive(sock)
    assert first == {"failed": "FileNotFoundError: [Errno 2] No such file or directory: "
                               "'/nonexistent/genlab-test'"}
    assert os.waitstatus_to_exitcode(second["status"]) == 1


def test_ctrl_c_as_the_run_starts_ends_it_as_it_would_end_the_command(daemon):
    """Ctrl-C while the run is still taking on the command (its streams, its imports)
    ends it with 130 and no traceback, as in the command's own process once it runs."""
    parent = ask(daemon, {"status": True})["pid"]
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", *LONG, "def f("],
                                cwd=ROOT, env=daemon, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        _child_of(parent, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "Traceback" not in err


def test_a_command_killed_outright_takes_its_run_with_it(daemon, tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", *LONG, "def f("],
                                cwd=ROOT, env=daemon, stdout=stdout,
                                stderr=subprocess.DEVNULL)
        wait_for_bytes(out, 40, proc)
        running = ask(daemon, {"status": True})["running"]
        assert running >= 1
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while ask(daemon, {"status": True})["running"] >= running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ask(daemon, {"status": True})["running"] == running - 1
    size = out.stat().st_size
    time.sleep(0.5)
    assert out.stat().st_size == size  # nothing writes to it any more
    assert genlab(daemon, "generate", *MODEL, "-n", "2", "Once").returncode == 0


def test_the_run_keeps_the_commands_niceness_cpus_limits_and_file_mask(daemon, tmp_path):
    """What a process inherits outside its environment (`nice`, `taskset`, `ulimit`,
    `umask`), read from the run's /proc entry while it runs."""
    parent = ask(daemon, {"status": True})["pid"]
    code = ("import os, runpy, sys; os.umask(0o027); sys.argv = ['genlab', *sys.argv[1:]]; "
            "runpy.run_module('cli', run_name='__main__')")
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = subprocess.Popen(["nice", "-n", "7", "taskset", "-c", "0", "prlimit",
                                 "--nofile=300:400", sys.executable, "-c", code, "generate",
                                 *LONG, "def f("], cwd=ROOT, env=daemon, stdout=stdout,
                                stderr=subprocess.PIPE, text=True)
    try:
        wait_for_bytes(out, 40, proc)
        run = _child_of(parent, proc)
        status = Path(f"/proc/{run}/status").read_text()
        stat = Path(f"/proc/{run}/stat").read_text().rsplit(")", 1)[1].split()
        limits = Path(f"/proc/{run}/limits").read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert int(stat[16]) == 7  # nice: field 19 of /proc/PID/stat
    assert "Cpus_allowed_list:\t0\n" in status
    assert "Umask:\t0027\n" in status
    assert [line.split()[3:5] for line in limits.splitlines()
            if line.startswith("Max open files")] == [["300", "400"]]


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie its new parent has yet to
    reap: its daemon, its parent, was killed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _child_of(parent: int, proc: subprocess.Popen) -> int:
    """The pid of daemon `parent`'s run for `proc` (its only one), once it runs."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == parent:
                    return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no run of the daemon appeared; {proc.stderr.read()}")


def test_runs_without_a_seed_draw_different_samples(daemon):
    args = ("generate", *MODEL, "-n", "16", "-s", "sample", "--temperature", "1.5", "--json")
    seeds, texts = set(), set()
    for _ in range(3):
        doc = json.loads(genlab(daemon, *args, input="Once upon a time").stdout)
        seeds.add(doc["settings"]["seed"])
        texts.add(doc["outputs"][0]["text"])
    assert len(seeds) == 3 and len(texts) >= 2


def test_a_run_with_other_thread_settings_runs_on_its_own(daemon):
    """OMP_NUM_THREADS is read when torch is imported: the daemon's import cannot serve
    it; the command runs as before, and `daemon status` says why."""
    env = {**daemon, "OMP_NUM_THREADS": "1"}
    before = served(daemon)
    result = genlab(env, "generate", *MODEL, "-n", "4", "Once")
    assert result.returncode == 0 and result.stdout == " upon a time,\n"
    assert served(daemon) == before
    status = genlab(env, "daemon", "status")
    assert status.returncode == 0
    assert "does not serve commands run from here: OMP_NUM_THREADS differs" in status.stdout


def test_the_environment_read_at_run_time_is_the_commands(daemon, tmp_path):
    """Variables genlab reads while it runs (here the presets folder) are the command's,
    not the daemon's."""
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "brief.yaml").write_text("max_new_tokens: 3\n")
    env = {**daemon, "GENLAB_PRESETS_DIR": str(presets)}
    before = served(daemon)
    result = genlab(env, "generate", *MODEL, "--preset", "brief", "--json", input="Once")
    assert served(daemon) == before + 1
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["outputs"][0]["token_ids"]) == 3


def test_switched_off_it_serves_nothing(daemon, cold):
    before = served(daemon)
    assert genlab(cold, "generate", *MODEL, "-n", "2", "Once").returncode == 0
    assert served(daemon) == before


def test_the_interactive_session_is_the_same_on_a_terminal(daemon, cold):
    def session(env: dict[str, str]) -> tuple[str, int]:
        pid, fd = pty.fork()
        if pid == 0:
            os.chdir(ROOT)
            os.execve(sys.executable, [sys.executable, "-m", "cli", "generate", "-m",
                                       str(CODE_TARGET), "-i", "-n", "5"], env)
        seen = b""

        def read_until(marker: bytes, count: int) -> None:
            nonlocal seen
            deadline = time.monotonic() + 120
            while seen.count(marker) < count and time.monotonic() < deadline:
                if select.select([fd], [], [], 0.1)[0]:
                    try:
                        seen += os.read(fd, 4096)
                    except OSError:
                        return

        read_until(b"genlab> ", 1)
        os.write(fd, b"def add(a, b):\n")
        read_until(b"genlab> ", 2)
        os.write(fd, b"\x04")
        read_until(b"\0", 1)  # to the end
        _, status = os.waitpid(pid, 0)
        return seen.decode(errors="replace"), os.waitstatus_to_exitcode(status)

    def steady(text: str) -> str:  # the timings differ
        return "\n".join(line for line in text.splitlines() if "tok/s" not in line)

    before = served(daemon)
    (ours, our_code), (theirs, their_code) = session(daemon), session(cold)
    assert served(daemon) == before + 1
    assert our_code == their_code == 0
    assert "\x1b[" in ours  # a terminal: styled, as for the command alone
    assert steady(ours) == steady(theirs)
    assert ours.count("genlab> ") == 2


def test_the_daemon_commands_documents_validate_and_say_what_runs(daemon):
    from tests.test_output import errors

    pid = ask(daemon, {"status": True})["pid"]
    started = json.loads(genlab(daemon, "daemon", "start", "--json").stdout)
    assert errors(started) == []
    assert (started["pid"], started["already_running"]) == (pid, True)
    result = genlab(daemon, "daemon", "status", "--json")
    assert result.returncode == 0
    status = json.loads(result.stdout)
    assert errors(status) == []
    assert status["daemon"]["pid"] == pid and status["daemon"]["differences"] == []
    assert status["daemon"]["running"] == 0 and status["daemon"]["resident_bytes"] > 50e6
    other = json.loads(genlab({**daemon, "OMP_NUM_THREADS": "1"}, "daemon", "status",
                              "--json").stdout)
    assert other["daemon"]["differences"] == ["OMP_NUM_THREADS"]


def test_start_twice_says_it_runs_and_status_shows_it(daemon):
    again = genlab(daemon, "daemon", "start")
    assert again.returncode == 0
    assert again.stdout.startswith("the genlab daemon is already running (pid ")
    status = genlab(daemon, "daemon", "status")
    assert status.returncode == 0
    assert status.stdout.startswith("the genlab daemon is running (pid ")
    assert "it serves commands run from here" in status.stdout
    before = served(daemon)
    document = json.loads(genlab(daemon, "daemon", "status", "--json").stdout)
    assert served(daemon) == before + 1  # the daemon served the status command too...
    assert document["daemon"]["served"] == before  # ...which counts the others alone


def test_stop_lets_running_commands_end_and_a_new_daemon_start_meanwhile(tmp_path):
    """An interactive session holds its run until its input ends: the daemon stopped
    under it lets it finish, and a new daemon starts in the meantime."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), protocol.SWITCH: "1"}
    assert genlab(env, "daemon", "start").returncode == 0
    session = subprocess.Popen([sys.executable, "-m", "cli", "generate", *MODEL, "-i", "-n",
                                "4"], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while ask(env, {"status": True})["running"] == 0 and session.poll() is None:
            time.sleep(0.01)
        stopped = genlab(env, "daemon", "stop", "--json")
        new = genlab(env, "daemon", "start", "--json")
        assert session.poll() is None  # the old daemon's run still goes on
        out, err = session.communicate("Once upon a time\n", timeout=120)
    finally:
        session.kill()
    assert stopped.returncode == 0
    document = json.loads(stopped.stdout)
    assert document["still_running"] == 1 and document["pid"] > 1
    assert session.returncode == 0, err
    alone = genlab({**env, protocol.SWITCH: "0"}, "generate", *MODEL, "-i", "-n", "4",
                   input="Once upon a time\n")
    assert out == alone.stdout and ", there" in out
    assert new.returncode == 0, new.stderr
    assert json.loads(new.stdout)["already_running"] is False
    assert json.loads(new.stdout)["pid"] != document["pid"]
    assert json.loads(genlab(env, "daemon", "stop", "--json").stdout)["still_running"] == 0
    status = genlab(env, "daemon", "status")
    assert status.returncode == 3
    assert status.stdout.startswith("no genlab daemon is running")
    assert genlab(env, "daemon", "stop").stdout == "no genlab daemon is running\n"


def test_code_changed_under_the_daemon_stops_it_and_the_command_runs_on_its_own(tmp_path):
    """The daemon runs cli/daemon_server.py and cli/daemon_protocol.py as they were when
    it started: a newer file on disk (an upgrade, an edit) stops it at the next command,
    which runs in a process of its own and says so."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), protocol.SWITCH: "1"}
    assert genlab(env, "daemon", "start").returncode == 0
    source = Path(protocol.__file__)
    before = source.stat()
    try:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
        result = genlab(env, "generate", *MODEL, "-n", "4", "Once")
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
        genlab(env, "daemon", "stop")
    assert result.returncode == 0 and result.stdout == " upon a time,\n"
    assert result.stderr == ("the start daemon stopped: a library the daemon imported has "
                             "changed on disk since it started; `genlab daemon start` "
                             "starts a new one\n")
    assert genlab(env, "daemon", "status").returncode == 3


def test_a_socket_folder_others_may_enter_is_refused(tmp_path):
    (tmp_path / "genlab").mkdir(mode=0o755)
    os.chmod(tmp_path / "genlab", 0o755)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), protocol.SWITCH: "1"}
    result = genlab(env, "daemon", "start")
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {tmp_path / 'genlab'} is not a folder only you")
    assert result.stderr.count("\n") == 1


def test_a_daemon_on_fewer_cpus_does_not_serve_and_status_says_why(tmp_path):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), protocol.SWITCH: "1"}
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no smaller set to start the daemon on")
    cpu = str(min(os.sched_getaffinity(0)))
    started = subprocess.run(["taskset", "-c", cpu, sys.executable, "-m", "cli", "daemon",
                              "start"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    try:
        assert started.returncode == 0, started.stderr
        before = served(env)
        result = genlab(env, "generate", *MODEL, "-n", "4", "Once")
        assert result.returncode == 0 and result.stdout == " upon a time,\n"
        assert served(env) == before
        status = json.loads(genlab(env, "daemon", "status", "--json").stdout)
        assert status["daemon"]["differences"] == [
            "this process's state (CPUs the daemon may not run on)"]
    finally:
        genlab(env, "daemon", "stop")
