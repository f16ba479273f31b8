"""Where a model loads in a process that is genlab's alone (the CLI's, a Ray worker's),
the heap loading made is frozen (`genlib.models.freeze_heap`), so a full collection
mid-decode walks what decoding made, not the ~400,000 objects of loading. A library
caller's process is left alone."""

from __future__ import annotations

import gc
import sys

from typer.testing import CliRunner

from cli.context import ModelFlags, load
from cli.main import app
from genlib.compare import Strategy, compare_models
from genlib.config import resolve_settings
from genlib.models import ModelSpec, load_model
from tests.conftest import STORIES


def frozen(obj: object) -> bool:
    """Whether the collector tracks `obj` in its permanent generation, out of reach of
    every collection (`gc.get_objects` lists the other generations only)."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_the_clis_load_freezes_the_model_and_what_loading_made():
    gc.unfreeze()
    lm = load(ModelFlags(str(STORIES)))
    assert frozen(lm) and frozen(lm.model) and frozen(lm.tokenizer)
    assert gc.get_freeze_count() > 10_000
    made_after = [object.__new__(type("Later", (), {}))]
    assert not frozen(made_after)  # what decoding makes stays the collector's


def test_a_library_load_leaves_the_callers_heap_alone():
    gc.unfreeze()
    lm = load_model(ModelSpec(str(STORIES)))
    assert not frozen(lm) and gc.get_freeze_count() == 0


def test_compare_across_models_freezes_where_the_cli_asks_only():
    strategy = Strategy("greedy", resolve_settings({"max_new_tokens": 4}), "default")
    gc.unfreeze()
    compare_models([ModelSpec(str(STORIES))], "Once upon a time", strategy)
    assert gc.get_freeze_count() == 0
    compare_models([ModelSpec(str(STORIES))], "Once upon a time", strategy, freeze=True)
    assert gc.get_freeze_count() > 10_000


def test_the_clis_compare_across_models_freezes_after_loading():
    gc.unfreeze()
    result = CliRunner().invoke(app, ["compare", "Once upon a time", "--models",
                                      f"{STORIES},{STORIES}", "-n", "4"])
    assert result.exit_code == 0, result.output
    assert gc.get_freeze_count() > 10_000


def test_a_ray_worker_freezes_once_its_model_has_loaded(monkeypatch):
    from genlib.ray_engine import GenerateWorker
    from tests.test_ray_engine import plan_for

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # the worker sends it to stderr
    gc.unfreeze()
    worker = GenerateWorker(plan_for(1))
    assert worker.load_error is None
    assert frozen(worker.lm) and frozen(worker.lm.model)
