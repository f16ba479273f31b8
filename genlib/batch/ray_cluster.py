"""The Ray cluster of a `--engine ray` run: start a private one, or join the one at an
address, and size the worker pool to what its nodes hold.

Every way found for such a run to wait for ever, or to fail with a message that does not
say why, ends here in one error line that says what to do instead:

- nothing answers at the address (a typo, or the address a stopped cluster left behind
  for `auto`): Ray itself would retry for many minutes;
- token authentication on one side only: with Ray 2.60 a driver joining with `auto` turns
  it on whenever it finds a token (~/.ray/auth_token), while a cluster `ray start` began
  before that token existed runs without it; the cluster then cannot call back into the
  driver and cancels every worker before it starts;
- no node with room for one worker (a GPU worker on a cluster without GPUs): Ray Data
  would wait for one for ever, without a word.

A cluster that has room but none free (other jobs hold it) is waited for, with a note.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

from genlib.errors import GenlabError, UserInputError

INSTALL_HINT = 'install it with: pip install "genlab[ray]" (in a checkout: pip install ".[ray]")'
AUTH_MODE = "RAY_AUTH_MODE"  # Ray's switch for token authentication: "token" or "disabled"
PROBE_TIMEOUT_S = 10.0  # for a TCP connection to the cluster's address
# What --ray-address takes: auto, HOST:PORT (an IPv6 host in brackets). Not Ray Client's
# ray://, which Ray's docs advise against for ML workloads and genlab does not test.
ADDRESS = re.compile(r"auto|(?:\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]@]+):(?P<port>\d{1,5})")


class RayMissingError(UserInputError):
    """--engine ray was asked for but Ray (with Ray Data) is not installed."""


class RayEngineError(GenlabError):
    """The Ray cluster could not be reached or the distributed run failed."""


def private_cluster_env() -> None:
    """The settings a private one-machine cluster starts with (Ray reads them when it is
    imported or started): loopback only, no usage report anywhere, and a token of its
    own in this process's environment, which the cluster's processes inherit. Token
    authentication stays on, as Ray's default for a new cluster is; but left to itself
    Ray would save a token to ~/.ray/auth_token, and that file turns token authentication
    on for every later `ray start` and `--ray-address auto` on this machine, so a cluster
    started before the file existed could no longer be joined with `auto`."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


def require_ray(private_cluster: bool = False) -> Any:
    """The ray module, or RayMissingError saying how to install it. `private_cluster`:
    the run will start its own cluster (no --ray-address): see private_cluster_env."""
    if private_cluster:
        private_cluster_env()
    try:
        import ray
        import ray.data  # noqa: F401 - the "data" extra: pyarrow, pandas
    except ImportError as exc:
        raise RayMissingError(f"--engine ray needs Ray with Ray Data ({exc.name} is not "
                              f"installed); {INSTALL_HINT}") from None
    return ray


# ---------------------------------------------------------------- starting or joining


def connect(address: str | None, cpus: int | None = None) -> bool:
    """Join the cluster at `address` ("auto": the one `ray start` runs here), or start a
    private one on this machine (loopback only) when there is none. True if this call
    started Ray (the caller shuts it down). A Ray already initialised is used as it is."""
    if address is not None:
        check_address(address)
    ray = require_ray(private_cluster=address is None)
    if ray.is_initialized():
        return False
    found = resolve(address) if address is not None else None
    if address is not None:
        check_reachable(address, found)
    auth_asked = os.environ.get(AUTH_MODE)
    failures: tuple[type[BaseException], ...] = (ConnectionError, RuntimeError, ValueError,
                                                 ray.exceptions.RayError)
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        # "local": a new cluster even where `ray start` runs one (ray.init's default
        # would join that), so a run without --ray-address never lands on another's.
        ray.init(address=address or "local", num_cpus=cpus if address is None else None,
                 include_dashboard=False, logging_level="ERROR", log_to_driver=True)
    except failures as exc:
        raise RayEngineError(_init_failed(address, exc)) from None
    finally:
        keep_sigterm(on_sigterm)
    if address is not None and os.environ.get(AUTH_MODE) == "token":
        try:
            check_workers_start(ray, found or address, auto_enabled=auth_asked is None)
        except RayEngineError:
            ray.shutdown()
            raise
    return True


def check_address(address: str) -> None:
    """UserInputError unless `address` is one that --ray-address takes: `auto` or the
    head's HOST:PORT. Ray would take others (`local`,
    or an empty one, starts a cluster that is not private; a malformed one prints a
    traceback) or answer them with a message about something else."""
    match = ADDRESS.fullmatch(address)
    port = match.group("port") if match else None
    if match is None or (port is not None and not 1 <= int(port) <= 65535):
        raise UserInputError(
            f"--ray-address must be auto or the head's HOST:PORT (`ray start --head` "
            f"prints it), got {address!r}; leave it out to start a private cluster on "
            f"this machine")


def keep_sigterm(handler: Any) -> None:
    """Put back the process's SIGTERM handler, which ray.init replaces with an exit(15)
    behind a C++ handler that prints a stack dump: a run stopped by `kill` or `timeout`
    then ended without its summary, and with the wrong status."""
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def resolve(address: str) -> str | None:
    """The HOST:PORT that ray.init will join for `address`, found as Ray finds it
    (RAY_ADDRESS first; for "auto", the cluster `ray start` last started here), or None
    where this Ray has no such lookup."""
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:
        return None if address == "auto" else address
    try:
        return get_ray_address_from_environment(address, None)
    except ConnectionError:
        raise RayEngineError("--ray-address auto found no Ray cluster on this machine; start "
                             "one with `ray start --head`, or give the head's HOST:PORT") from None


def check_reachable(address: str, found: str | None) -> None:
    """RayEngineError at once if nothing listens at `found` (HOST:PORT), where ray.init
    would retry for many minutes."""
    host, _, port = (found or "").rpartition(":")
    if not host or not port.isdigit() or "/" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        if address == "auto":
            raise RayEngineError(
                f"--ray-address auto found {found}, but nothing answers there ({why}): the "
                f"cluster `ray start` started on this machine has stopped; start it again "
                f"with `ray start --head`") from None
        raise RayEngineError(f"no Ray cluster answers at {found} ({why}); check the address "
                             f"`ray start --head` printed, and that the cluster still runs "
                             f"(`ray status` on the head)") from None


def check_workers_start(ray: Any, address: str, auto_enabled: bool) -> None:
    """This driver uses token authentication: make sure the cluster does too, by starting
    one actor that asks for no CPU. A cluster without it cannot call back into a driver
    that uses it, and cancels every actor before it starts; Ray Data would report that as
    a worker that died (or wait), naming neither side's setting."""

    class Probe:
        def ready(self) -> bool:
            return True

    probe = ray.remote(num_cpus=0)(Probe).remote()
    try:
        ray.get(probe.ready.remote())
    except ray.exceptions.RayActorError:
        why = ("Ray turns it on for --ray-address auto when it finds a token, in "
               "~/.ray/auth_token or RAY_AUTH_TOKEN" if auto_enabled else f"{AUTH_MODE}=token")
        raise RayEngineError(
            f"no worker can start on the Ray cluster at {address}: it runs without token "
            f"authentication and this run uses it ({why}); run genlab with "
            f"{AUTH_MODE}=disabled, or start the cluster with {AUTH_MODE}=token") from None
    finally:
        ray.kill(probe)


def _init_failed(address: str | None, exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if address is None:
        return f"cannot start a local Ray cluster ({first})"
    return (f"cannot join the Ray cluster at {address} ({first}); if it uses token "
            f"authentication (Ray's default when `ray start` finds a token), run genlab with "
            f"{AUTH_MODE}=token and the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN")


# ---------------------------------------------------------------- room for workers


def pool_size(ray: Any, needs: Mapping[str, float], workers: int | None,
              note: Callable[[str], None] | None = None) -> int:
    """How many workers to start: `workers`, or as many as the cluster's nodes hold.
    RayEngineError if no node can ever hold one (Ray Data would wait for it for ever);
    `note` says so when the cluster could, but has no room free now (the run waits)."""
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    fits = sum(room(resources, needs) for resources in nodes)
    if fits == 0:
        raise RayEngineError(
            f"no node of the Ray cluster has room for one worker, which needs "
            f"{describe(needs)}; the cluster has {describe(_totals(nodes, needs))}: add a "
            f"node that has (`ray start --address HEAD:6379` on it)"
            + ("" if "GPU" not in needs else ", or run without --device cuda"))
    if note is not None and room(ray.available_resources(), needs) == 0:
        note(f"waiting for room on the Ray cluster: each worker needs {describe(needs)}, and "
             f"other jobs hold them all now (`ray status` shows them); the run starts when "
             f"they are free")
    return workers or fits


def room(resources: Mapping[str, float], needs: Mapping[str, float]) -> int:
    """How many workers asking for `needs` fit in `resources` ({"CPU": 2.0, ...})."""
    return min(int(resources.get(name, 0.0) // amount) for name, amount in needs.items())


def describe(amounts: Mapping[str, float]) -> str:
    """{"CPU": 1.0, "GPU": 0.0} -> "1 CPU and 0 GPUs"."""
    return " and ".join(f"{amount:g} {name}{'' if amount == 1 else 's'}"
                        for name, amount in amounts.items())


def _totals(nodes: list[Mapping[str, float]], needs: Mapping[str, float]) -> dict[str, float]:
    return {name: sum(node.get(name, 0.0) for node in nodes) for name in needs}
