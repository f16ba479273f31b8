"""The no-cache backend (the naive decoder) gives the tokens of the cached backends on
the same decode loop: batches of unequal prompts, beam search's reorder, and
speculative decoding's rollback."""

from __future__ import annotations

import torch

from genlib.backends.nocache import NoCacheBackend
from genlib.backends.transformers import TransformersBackend
from genlib.decoding import beam, loop
from genlib.events import Finish
from genlib.settings.config import GenerationSettings


def _tokens(events) -> list[tuple[int, ...]]:
    done = sorted((e for e in events if isinstance(e, Finish)), key=lambda f: f.row)
    return [f.token_ids for f in done]


def test_a_batch_of_unequal_prompts_gets_the_cached_tokens(stories):
    prompts = [stories.encode("Once upon a time"), stories.encode("The dog ran")]
    settings = GenerationSettings(max_new_tokens=24)
    naive = _tokens(loop.decode(stories, prompts, settings, NoCacheBackend(stories)))
    cached = _tokens(loop.decode(stories, prompts, settings, TransformersBackend(stories)))
    assert naive == cached
    assert len(set(naive[0])) > 3  # the tokens vary: the check means something


def test_beam_search_reorders_its_rows(stories):
    prompt = [stories.encode("Once upon a time")]
    settings = GenerationSettings(strategy="beam", num_beams=3, max_new_tokens=16)
    naive = _tokens(beam.search_events(stories, prompt, settings, NoCacheBackend(stories)))
    cached = _tokens(beam.search_events(stories, prompt, settings, TransformersBackend(stories)))
    assert naive == cached


def test_crop_and_extend_give_the_logits_of_a_fresh_run(stories):
    ids = stories.encode("Once upon a time there was")
    backend = NoCacheBackend(stories)
    backend.prefill([ids[:3]], 64)
    backend.extend(torch.tensor([ids[3:]]))
    backend.crop(4)
    logits = backend.extend(torch.tensor([ids[4:6]]))
    fresh = NoCacheBackend(stories)
    expected = fresh.prefill([ids[:6]], 64)
    assert backend.length == 6
    assert torch.allclose(logits[:, -1], expected, atol=1e-5)
