"""The start daemon's parts that need no daemon running: message framing, a daemon's
check of its own code, and the command's relay of signals before its run is ready."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

from cli import daemon_protocol as protocol


def test_two_messages_sent_together_are_read_one_at_a_time():
    left, right = socket.socketpair()
    with left, right:
        protocol.send(left, {"pid": 7})
        protocol.send(left, {"status": 0})
        assert protocol.receive(right) == ({"pid": 7}, [])
        assert protocol.receive(right) == ({"status": 0}, [])
        left.close()
        assert protocol.receive(right) == (None, [])


def test_a_library_changed_on_disk_stops_the_daemon(tmp_path):
    from cli.daemon_server import Daemon

    daemon = Daemon(tmp_path / "d.sock")
    try:
        daemon.preloaded = {str(tmp_path / "gone.py"): (1, 1)}
        refusal = daemon._refusal({"identity": daemon.identity}, [])
        assert refusal == "a library the daemon imported has changed on disk since it started"
        assert daemon.stopping
    finally:
        daemon.selector.close()
        os.close(daemon.wake_read)
        os.close(daemon.wake_write)


def test_signals_before_the_run_is_ready_wait_for_it_then_reach_it():
    """A Ctrl-C between handing the command over and the run's `ready` is kept, and
    sent to the run once its pid is known; the handlers are the command's again after."""
    from cli.daemon_client import Relay

    before = signal.getsignal(signal.SIGTERM)
    target = subprocess.Popen(["sleep", "30"])
    relay = Relay()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # to this process: kept for the run
        assert relay.pending == [signal.SIGTERM] and target.poll() is None
        relay.to(target.pid)
        assert target.wait(timeout=30) == -signal.SIGTERM
    finally:
        target.kill()
        relay.pending = []
        relay.release()
    assert signal.getsignal(signal.SIGTERM) is before
