"""Where a model loads in a process that is genlab's alone (the CLI's, a Ray worker's),
the heap loading made is frozen (`genlib.models.loading.freeze_heap`), so a full collection
mid-decode walks what decoding made, not the ~400,000 objects of loading. A library
caller's process is left alone."""

from __future__ import annotations

import gc
import sys

import pytest
from typer.testing import CliRunner

import genlib.models.loading
from cli.context import ModelFlags, load
from cli.main import app
from genlib.generate import stream
from genlib.lab.compare import Strategy, compare_models
from genlib.models.loading import ModelSpec
from genlib.settings.config import resolve_settings
from tests.conftest import STORIES, shared_model


def frozen(obj: object) -> bool:
    """Whether the collector tracks `obj` in its permanent generation, out of reach of
    every collection (`gc.get_objects` lists the other generations only)."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


@pytest.fixture
def loads(monkeypatch):
    """The models `genlib.models.loading.load_model` returns meanwhile (its callers import it
    when they run), each with its tokenizer."""
    if not STORIES.is_dir():
        pytest.skip(f"{STORIES} is not present")
    loaded = []
    real = genlib.models.loading.load_model

    def recorded(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(genlib.models.loading, "load_model", recorded)
    gc.unfreeze()
    return loaded


def test_the_clis_load_freezes_the_model_and_what_loading_made_not_what_decoding_makes():
    gc.unfreeze()
    lm = load(ModelFlags(str(STORIES)))  # the quick load: no transformers model
    assert frozen(lm) and frozen(lm.lean) and frozen(lm.tokenizer) and not lm.model_loaded
    gc.unfreeze()
    full = load(ModelFlags(str(STORIES)), quick=False)
    assert frozen(full) and frozen(full.model) and frozen(full.tokenizer)
    finish = list(stream(full, [full.encode("Once upon a time")],
                         resolve_settings({"max_new_tokens": 4})))[-1]
    assert not frozen(finish)  # decoding's objects stay the collector's


def test_a_library_load_leaves_the_callers_heap_alone():
    gc.unfreeze()
    lm = shared_model(STORIES)
    assert not frozen(lm) and gc.get_freeze_count() == 0


def test_compare_across_models_freezes_each_loaded_model_where_the_cli_asks_only(loads):
    strategy = Strategy("greedy", resolve_settings({"max_new_tokens": 4}), "default")
    compare_models([ModelSpec(str(STORIES))], "Once upon a time", strategy)
    assert not frozen(loads[0].lean) and gc.get_freeze_count() == 0
    compare_models([ModelSpec(str(STORIES))], "Once upon a time", strategy, freeze=True)
    assert len(loads) == 2 and not loads[1].model_loaded  # quick loads, nothing deferred ran
    assert frozen(loads[1].lean) and frozen(loads[1].tokenizer)


def test_the_clis_compare_across_models_freezes_each_model_it_loads(loads):
    result = CliRunner().invoke(app, ["compare", "Once upon a time", "--models",
                                      f"{STORIES},{STORIES}", "-n", "4"])
    assert result.exit_code == 0, result.output
    assert len(loads) == 2 and not any(lm.model_loaded for lm in loads)
    assert all(frozen(lm.lean) and frozen(lm.tokenizer) for lm in loads)


def test_a_ray_worker_freezes_once_its_model_has_loaded(monkeypatch):
    from genlib.batch.ray_engine import GenerateWorker
    from tests.test_ray_engine import plan_for

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # the worker sends it to stderr
    gc.unfreeze()
    worker = GenerateWorker(plan_for(1))
    assert worker.load_error is None
    assert frozen(worker.lm) and frozen(worker.lm.lean) and not worker.lm.model_loaded
