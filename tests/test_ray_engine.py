"""--engine ray on a local Ray cluster this module starts once (2 CPUs, loopback only):
every id's text is the local engine's, each id is written exactly once after a worker is
killed mid-run (Ray runs its batch again) and after the driver is killed and the run
resumed. Skipped when ray is not installed; CI installs the ray extra."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from genlib.batch import jobs as gb
from genlib.batch.ray_cluster import RayEngineError, check_reachable, private_cluster_env
from genlib.batch.ray_engine import (
    SETTINGS_DIFFER,
    GenerateWorker,
    WorkerPlan,
    first_of_each,
    run_on_ray,
)
from genlib.models.loading import ModelSpec
from tests.conftest import ROOT, STORIES, wait_for_lines
from tests.test_batch import RUN, mixed_prompts, read_results

# A private cluster on the loopback address that reports nothing and keeps its token in
# this process's environment, not in ~/.ray (read at ray's import and at ray.init).
private_cluster_env()

MODEL = ["-m", str(STORIES)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 2-CPU Ray cluster for the whole module (starting one takes seconds); its
    workers import genlab from this checkout. Yields (its address, a scratch folder)."""
    ray = pytest.importorskip("ray", reason='ray is not installed: pip install ".[ray]"')
    pytest.importorskip("ray.data", reason='Ray Data is not installed: pip install ".[ray]"')
    scratch = tmp_path_factory.mktemp("ray")
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False,
             logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT),
                                       "GENLAB_TEST_SCRATCH": str(scratch)}})
    # Workers cannot import this file by name (tests/ is no package): send it by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield ray.get_runtime_context().gcs_address, scratch
    finally:
        ray.shutdown()


def plan_for(batch_size: int, device: str = "auto") -> WorkerPlan:
    return WorkerPlan(spec=ModelSpec(str(STORIES), device=device), run=RUN,
                      batch_size=batch_size)


def local_outcomes(lm, lines: list[str]) -> dict[object, tuple]:
    jobs = gb.parse_lines(lines, RUN)
    for job in jobs:
        gb.encode(lm, job, RUN)
    return {job.id: (f.text, f.reason, f.token_ids) for job, f in gb.generate_jobs(lm, jobs, 4)}


def ray_outcomes(lines: list[str], batch_size: int, workers: int, **kw) -> list[tuple]:
    jobs = gb.parse_lines(lines, RUN)
    return [(job.id, (f.text, f.reason, f.token_ids))
            for job, f in run_on_ray(jobs, lines, plan_for(batch_size), workers, **kw)]


def test_ray_texts_are_the_local_engines(cluster, stories):
    lines = mixed_prompts(8)
    local = local_outcomes(stories, lines)
    got = ray_outcomes(lines, batch_size=3, workers=2)
    assert sorted(i for i, _ in got) == sorted(local)  # each id once
    assert dict(got) == local  # texts, finish reasons and token ids, sampled lines too
    assert local["p0"][0] == ", there was a little girl named Lily. She loved to play"


class DiesOnce(GenerateWorker):
    """A worker that, given line 6, generates its batch and then kills its own process
    (SIGKILL, as the OOM killer would) before returning it: once per test run."""

    def __call__(self, batch):
        out = super().__call__(batch)
        marker = Path(os.environ["GENLAB_TEST_SCRATCH"]) / "died"
        if 6 in [int(n) for n in batch["line"]] and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return out


def test_a_killed_worker_is_replaced_and_every_id_comes_once(cluster, stories):
    _, scratch = cluster
    lines = mixed_prompts(10)
    got = ray_outcomes(lines, batch_size=2, workers=1, worker=DiesOnce)
    assert (scratch / "died").exists(), "the worker should have been killed"
    assert sorted(i for i, _ in got) == sorted(f"p{i}" for i in range(10))
    assert dict(got) == local_outcomes(stories, lines)


def test_rows_of_a_retried_batch_that_came_back_already_are_dropped():
    rows = [{"line": 1, "outcome": "a"}, {"line": 2, "outcome": "b"},
            {"line": 1, "outcome": "a again"}, {"line": 3, "outcome": "c"}]
    assert list(first_of_each(rows)) == [(1, "a"), (2, "b"), (3, "c")]


@pytest.mark.slow
def test_driver_killed_mid_run_then_resumed_writes_every_id_once(cluster, stories, tmp_path):
    address, _ = cluster
    lines = mixed_prompts(12, ignore_eos=True, max_new_tokens=48)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "cli", "generate", *MODEL, "--input", str(src),
               "--output", str(out), "--seed", "7", "--batch-size", "2", "--engine", "ray",
               "--ray-address", address]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_lines(out, 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(read_results(out))
    assert 2 <= partial < 12, "the driver should have been killed midway"

    resumed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {partial} results already in" in resumed.stderr
    records = read_results(out)
    assert sorted(r["id"] for r in records) == sorted(f"p{i}" for i in range(12))
    # the local engine's whole records: texts, token counts, settings with seeds, and
    # the fingerprints the CLI's run computes (its model named as the CLI names it)
    run = gb.RunDefaults({}, {}, seed=7, model=gb.model_identity(str(STORIES)))
    jobs = gb.parse_lines(lines, run)
    for job in jobs:
        gb.encode(stories, job, run)
    expected = {job.id: gb.result_record(job, f) for job, f in gb.generate_jobs(stories, jobs, 4)}
    assert {r["id"]: r for r in records} == expected


# ---------------------------------------------------------------- a cluster that cannot serve


def test_a_gpu_worker_on_a_cluster_without_gpus_is_refused_at_once(cluster):
    lines = mixed_prompts(2)
    start = time.monotonic()
    with pytest.raises(RayEngineError) as caught:
        list(run_on_ray(gb.parse_lines(lines, RUN), lines, plan_for(2, device="cuda")))
    assert str(caught.value) == (
        "no node of the Ray cluster has room for one worker, which needs 1 CPU and 1 GPU; "
        "the cluster has 2 CPUs and 0 GPUs: add a node that has (`ray start --address "
        "HEAD:6379` on it), or run without --device cuda")
    assert time.monotonic() - start < 10  # not Ray Data waiting for a GPU for ever


def test_a_busy_cluster_is_waited_for_with_a_note_then_served(cluster, stories):
    import ray

    @ray.remote(num_cpus=2)
    class Hog:  # another job holding every CPU of the cluster
        def ready(self):
            return True

    hog = Hog.remote()
    ray.get(hog.ready.remote())
    deadline = time.monotonic() + 30  # until the cluster's view of what is free shows it
    while ray.available_resources().get("CPU", 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    notes = []

    def note(message):  # the run is waiting: the other job ends
        notes.append(message)
        ray.kill(hog)

    lines = mixed_prompts(2)
    got = ray_outcomes(lines, batch_size=2, workers=1, note=note)
    assert notes == ["waiting for room on the Ray cluster: each worker needs 1 CPU, and other "
                     "jobs hold them all now (`ray status` shows them); the run starts when "
                     "they are free"]
    assert dict(got) == local_outcomes(stories, lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_nothing_answers_is_an_error_at_once():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RayEngineError) as given:
        check_reachable(f"127.0.0.1:{port}", f"127.0.0.1:{port}")
    with pytest.raises(RayEngineError) as found:  # a stopped cluster's address, for auto
        check_reachable("auto", f"127.0.0.1:{port}")
    assert time.monotonic() - start < 10  # ray.init would retry for many minutes
    assert str(given.value) == (
        f"no Ray cluster answers at 127.0.0.1:{port} (Connection refused); check the address "
        f"`ray start --head` printed, and that the cluster still runs (`ray status` on the head)")
    assert str(found.value) == (
        f"--ray-address auto found 127.0.0.1:{port}, but nothing answers there (Connection "
        f"refused): the cluster `ray start` started on this machine has stopped; start it "
        f"again with `ray start --head`")


# A cluster started without token authentication, as `ray start --head` starts one where
# no token exists yet; it lives as long as this script's stdin stays open.
NO_AUTH_CLUSTER = """
import sys, ray
ray.init(address="local", num_cpus=1, num_gpus=0, include_dashboard=False,
         logging_level="ERROR")
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.mark.slow
def test_auto_with_a_token_against_a_cluster_without_says_so_and_disabled_joins(tmp_path):
    """Ray turns token authentication on for `--ray-address auto` when it finds a token
    (~/.ray/auth_token, or RAY_AUTH_TOKEN here), also for a cluster that runs without:
    every worker is then cancelled before it starts. auto finds this test's cluster as it
    finds the one `ray start` runs, by the file `ray start` writes, in a temp dir of the
    test's own (RAY_TMPDIR), not the machine's."""
    pytest.importorskip("ray.data", reason='Ray Data is not installed: pip install ".[ray]"')
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    base.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0",
                RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    head = subprocess.Popen([sys.executable, "-c", NO_AUTH_CLUSTER], cwd=ROOT, text=True,
                            env={**base, "RAY_AUTH_MODE": "disabled"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        address = head.stdout.readline().strip()
        assert address, "the test cluster did not start"
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text(address)
        src = tmp_path / "in.jsonl"
        src.write_text("\n".join(mixed_prompts(2)) + "\n")

        def generate(out: str, **env: str) -> subprocess.CompletedProcess:
            command = [sys.executable, "-m", "cli", "generate", *MODEL, "--input", str(src),
                       "--output", str(tmp_path / out), "--engine", "ray",
                       "--ray-address", "auto"]
            return subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                  env={**base, "RAY_TMPDIR": str(tmp_path), **env}, timeout=120)

        token = generate("token.jsonl", RAY_AUTH_TOKEN="a" * 64)
        assert token.returncode == 1, token.stderr
        assert (f"error: no worker can start on the Ray cluster at {address}: it runs without "
                f"token authentication and this run uses it (Ray turns it on for --ray-address "
                f"auto when it finds a token, in ~/.ray/auth_token or RAY_AUTH_TOKEN); run "
                f"genlab with RAY_AUTH_MODE=disabled, or start the cluster with "
                f"RAY_AUTH_MODE=token") in token.stderr
        assert "Traceback" not in token.stderr
        joined = generate("disabled.jsonl", RAY_AUTH_TOKEN="a" * 64, RAY_AUTH_MODE="disabled")
        assert joined.returncode == 0, joined.stderr
        assert sorted(r["id"] for r in read_results(tmp_path / "disabled.jsonl")) == ["p0", "p1"]
    finally:
        head.stdin.close()  # the script shuts its cluster down
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


# ---------------------------------------------------------------- the CLI's checks

runner = CliRunner()


def test_ray_results_carry_the_local_fingerprints_and_a_local_rerun_keeps_them(
        cluster, tmp_path):
    address, _ = cluster
    lines = mixed_prompts(4)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    args = ["generate", *MODEL, "--input", str(src), "--output", str(out), "--seed", "7",
            "--batch-size", "2"]
    first = runner.invoke(app, [*args, "--engine", "ray", "--ray-address", address])
    assert first.exit_code == 0, first.stderr
    written = out.read_bytes()
    run = gb.RunDefaults({}, {}, seed=7, model=gb.model_identity(str(STORIES)))
    prints = {job.id: job.fingerprint for job in gb.parse_lines(lines, run)}
    assert {r["id"]: r["fingerprint"] for r in read_results(out)} == prints
    again = runner.invoke(app, args)  # the local engine resumes the Ray engine's file
    assert again.exit_code == 0, again.stderr
    assert "resuming: 4 results already in" in again.stderr
    assert "0 generated" in again.stderr
    assert out.read_bytes() == written


def test_ray_results_carry_the_local_engines_logprobs(cluster, tmp_path):
    """--logprobs and per-line logprobs through the workers: each record, its logprobs
    object included, is the local engine's; a bad value is its line's error alone."""
    address, _ = cluster
    lines = [*mixed_prompts(3), '{"id": "own", "prompt": "The cat", "logprobs": 4}',
             '{"id": "bad", "prompt": "The cat", "logprobs": 21}']
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    records = {}
    for engine, extra in (("ray", ["--engine", "ray", "--ray-address", address]),
                          ("local", [])):
        out = tmp_path / f"{engine}.jsonl"
        result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output",
                                     str(out), "--seed", "7", "--batch-size", "2",
                                     "--logprobs", "2", "-n", "6", *extra])
        assert result.exit_code == 1, result.stderr  # the bad line
        assert "line 5: logprobs must be 0 <= logprobs <= 20, got 21" in result.stderr
        records[engine] = {r["id"]: r for r in read_results(out)}
    # Workers run one torch thread each, this process more: the sums are ordered
    # differently, so logprobs may differ in the last of their 6 digits; all else is equal.
    assert same_but_float_noise(records["ray"], records["local"])
    assert not same_but_float_noise({"a": [1.0]}, {"a": [1.0001]})  # and it can tell
    ray = records["ray"]
    assert [len(ray[f"p{i}"]["logprobs"]["content"][0]["top_logprobs"]) for i in range(3)] \
        == [2, 2, 2]
    assert len(ray["own"]["logprobs"]["content"][0]["top_logprobs"]) == 4
    assert "logprobs" not in ray["bad"] and "error" in ray["bad"]


def same_but_float_noise(a: object, b: object) -> bool:
    """Equal JSON values, floats within 1e-5."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and \
            abs(a - b) <= 1e-5
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_but_float_noise(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_but_float_noise(x, y) for x, y in zip(a, b))
    return a == b


def test_engine_ray_loads_the_model_on_the_backend_asked_for(monkeypatch, tmp_path):
    import genlib.batch.ray_engine as re_mod

    seen = []

    def fake_run_on_ray(jobs, lines, plan, workers=None, address=None, note=None):
        seen.append(plan)
        return iter(())

    monkeypatch.setattr(re_mod, "require_ray", lambda *a, **k: None)
    monkeypatch.setattr(re_mod, "run_on_ray", fake_run_on_ray)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Once"}\n')
    runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output",
                        str(tmp_path / "out.jsonl"), "--engine", "ray", "--backend", "lean"])
    assert [plan.spec.backend for plan in seen] == ["lean"]
    assert seen[0].run.model == gb.model_identity(str(STORIES))


def test_engine_ray_refuses_an_unknown_backend_before_starting(monkeypatch, tmp_path):
    import genlib.batch.ray_engine as re_mod

    monkeypatch.setattr(re_mod, "require_ray", lambda *a, **k: None)
    monkeypatch.setattr(re_mod, "run_on_ray", lambda *a, **k: pytest.fail("ran"))
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Once"}\n')
    result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output",
                                 str(tmp_path / "out.jsonl"), "--engine", "ray",
                                 "--backend", "warp"])
    assert result.exit_code == 2
    assert "warp" in result.stderr and "Traceback" not in result.output


def test_engine_ray_without_ray_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Once"}\n')
    result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output",
                                 str(tmp_path / "out.jsonl"), "--engine", "ray"])
    assert result.exit_code == 2
    assert 'pip install "genlab[ray]"' in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--input", "x", "--output", "o", "--workers", "2"],
     "--workers only applies with --engine ray"),
    (["--input", "x", "--output", "o", "--ray-address", "auto"],
     "--ray-address only applies with --engine ray"),
    (["--engine", "ray"], "--engine only applies with --input FILE"),
    (["hello", "--engine", "ray"], "--engine only applies with --input FILE"),
    (["--input", "x", "--output", "o", "--engine", "spark"], "--engine must be one of"),
    (["--input", "x", "--output", "o", "--engine", "ray", "--workers", "0"],
     "--workers must be >= 1, got 0"),
    *[(["--input", "x", "--output", "o", "--engine", "ray", "--ray-address", address],
       f"--ray-address must be auto or the head's HOST:PORT (`ray start --head` prints "
       f"it), got {address!r}; leave it out to start a private cluster on this machine")
      for address in ("", "local", ":6379", "head", "head:port", "head:65536",
                      "ray://head:10001")],
])
def test_cli_refuses_engine_flags_that_cannot_apply(args: list[str], message: str):
    result = runner.invoke(app, ["generate", *MODEL, *args])
    assert result.exit_code == 2
    assert message in result.stderr, result.stderr


def ray_cli(address: str, *args: str) -> list[str]:
    """`genlab generate ... --engine ray` joining the test cluster, as a command line."""
    return [sys.executable, "-m", "cli", "generate", "--engine", "ray", "--ray-address",
            address, *args]


def cli_env() -> dict[str, str]:
    """The environment of a command joining the test cluster (ray.init set some of it)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_a_worker_that_cannot_load_the_model_ends_the_run_in_genlabs_one_line(
        cluster, tmp_path):
    """Raised in the worker's constructor, the error reached the user as Ray's: two
    tracebacks and a message naming neither the model nor the cause."""
    address, _ = cluster
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    src = tmp_path / "in.jsonl"
    src.write_text("not json\n" + "\n".join(mixed_prompts(2)) + "\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run(ray_cli(address, "-m", str(folder), "--input", str(src),
                                  "--output", str(out)),
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr
    assert (f"error: a Ray worker cannot load the model: {folder} is not a Hugging Face "
            f"model folder (no config.json); point --model at the folder holding "
            f"config.json\n") in done.stderr
    assert "Traceback" not in done.stderr and "ActorDiedError" not in done.stderr
    assert [r["id"] for r in read_results(out)] == [1]  # the bad line's error, kept


@pytest.mark.slow
def test_sigterm_stops_a_ray_run_as_it_stops_a_local_one(cluster, tmp_path):
    """ray.init replaced genlab's SIGTERM handler: the run ended with status 15, a C++
    stack dump and no summary, instead of TERMINATED (143) and the note to rerun."""
    address, _ = cluster
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(mixed_prompts(12, ignore_eos=True, max_new_tokens=48)) + "\n")
    proc = subprocess.Popen(ray_cli(address, *MODEL, "--input", str(src), "--output",
                                    str(out), "--batch-size", "2"),
                            cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_for_lines(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "interrupted: rerun the same command to finish" in stderr
    assert "SIGTERM received" not in stderr
    assert 2 <= len(read_results(out)) < 12


class OtherPresets(GenerateWorker):
    """A worker on a node whose presets folder holds another `mine` than the driver's."""

    def __init__(self, plan):
        os.environ["GENLAB_PRESETS_DIR"] = str(Path(os.environ["GENLAB_TEST_SCRATCH"])
                                               / "worker-presets")
        super().__init__(plan)


def test_a_line_whose_preset_differs_on_the_worker_fails_alone(cluster, tmp_path,
                                                                 monkeypatch):
    """The worker parses each line again: with a preset of the same name but other
    settings there, it generated with its own settings while the record named the
    driver's settings and fingerprint."""
    _, scratch = cluster
    (scratch / "worker-presets").mkdir(exist_ok=True)
    (scratch / "worker-presets" / "mine.yaml").write_text("max_new_tokens: 5\n")
    (tmp_path / "mine.yaml").write_text("max_new_tokens: 3\n")
    monkeypatch.setenv("GENLAB_PRESETS_DIR", str(tmp_path))
    lines = [json.dumps({"id": "mine", "prompt": "Once upon a time", "preset": "mine"}),
             *mixed_prompts(2)]
    jobs = gb.parse_lines(lines, RUN)
    by_id = {job.id: outcome
             for job, outcome in run_on_ray(jobs, lines, plan_for(2), 1, worker=OtherPresets)}
    assert by_id["mine"] == SETTINGS_DIFFER
    assert all(not isinstance(by_id[f"p{i}"], str) for i in range(2))


def test_reasons_are_the_first_line_of_rays_message():
    from genlib.batch.ray_engine import _reason

    assert _reason(RuntimeError("ray::MapWorker.__init__() (pid=1)\n  File ...")) == \
        "ray::MapWorker.__init__() (pid=1)"


def test_a_workers_genlab_warnings_are_the_clis_warning_lines(capsys, monkeypatch):
    """A Ray worker's stderr reaches the driver's as it is: xgrammar's warnings there read
    as the CLI's own `warning:` lines, without Python's file and line, once the worker
    has started."""
    import warnings

    from genlib.batch.ray_engine import GenerateWorker
    from genlib.errors import GenlabWarning

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # the worker sends it to stderr
    with warnings.catch_warnings():  # and puts its own showwarning, undone on leaving
        warnings.simplefilter("always")
        GenerateWorker(plan_for(1))
        capsys.readouterr()
        warnings.warn(GenlabWarning("regex: xgrammar warns: '$' is ignored"), stacklevel=1)
        warnings.warn("not genlab's", UserWarning, stacklevel=1)  # Python's to show
    assert capsys.readouterr().err == "warning: regex: xgrammar warns: '$' is ignored\n"


def test_a_run_stopped_midway_waits_a_moment_for_the_threads_it_started():
    """Before ray.shutdown() a stopped run lets the threads Ray Data started finish (one
    left in a ray.get after the shutdown ends the process with status 1), for at most
    the grace given, whatever they do."""
    import threading
    import time

    from genlib.batch.ray_engine import let_threads_end

    before = set(threading.enumerate())
    stop = threading.Event()
    brief = threading.Thread(target=time.sleep, args=(0.3,), daemon=True)
    stuck = threading.Thread(target=stop.wait, daemon=True)
    brief.start()
    start = time.monotonic()
    let_threads_end(before, grace=5.0)
    assert not brief.is_alive() and time.monotonic() - start < 4.0
    stuck.start()
    start = time.monotonic()
    let_threads_end(before, grace=0.5)
    waited = time.monotonic() - start
    assert stuck.is_alive() and 0.4 < waited < 2.0
    stop.set()
