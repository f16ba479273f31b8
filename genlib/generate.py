"""genlib's one public way to generate: `stream` routes a request to the plain decode
loop, beam search or speculative decoding, each on the backend `genlib.backends.choose`
picks for it, and yields one event stream (`genlib.events`) whichever runs.

    for event in stream(lm, [lm.encode("Once upon a time")], settings): ...
    for event in stream(lm, [ids], settings, drafter=Drafting(prompt_lookup=3)): ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from genlib.backends.base import Backend
from genlib.backends.choose import Request, choose_backend
from genlib.backends.combined import for_generation
from genlib.decoding import beam, contrastive, loop, rerank, speculative
from genlib.decoding.detail import Detail
from genlib.decoding.dola import dola_backend
from genlib.decoding.speculative import Drafting
from genlib.decoding.step import check_prompts
from genlib.errors import ConfigError
from genlib.events import Event, Finish
from genlib.models.loading import LoadedModel
from genlib.sampling.combine import combination_of
from genlib.settings.config import GenerationSettings


def stream(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
           *, drafter: Drafting | None = None, backend: str = "auto",
           seeds: Sequence[int] | None = None, record_tree: bool = False,
           detail: Detail | None = None, scorer: LoadedModel | None = None
           ) -> Iterator[Event]:
    """Generate for `prompts` with `settings`; yield events. `drafter` decodes
    speculatively (one prompt); beam search runs for strategy beam (`record_tree` adds
    its tree to the BeamStep events); the plain loop otherwise. `backend` is the user's
    choice of backend (--backend; auto: the fastest exact one for the request). `seeds`:
    one per output row. `detail` (plain loop only) adds a per-step record to each Token
    event and can ask for inverse-CDF sampling with common random numbers or a branch's
    forced tokens (`genlib.decoding.detail.Detail`).
    `settings.samples` draws that many samples per prompt as one batch and keeps one
    (`genlib.decoding.rerank`; `seeds` then one per prompt); `scorer` is the model a `rerank`
    that names one scores with."""
    if settings.samples is not None:
        yield from _reranked(lm, prompts, settings, drafter=drafter, backend=backend,
                             seeds=seeds, detail=detail, scorer=scorer)
        return
    if detail is not None and settings.strategy == "beam":
        raise ConfigError("per-token detail (--logprobs, explain, --crn) needs strategy "
                          "greedy or sample, not beam search")
    if detail is not None and drafter is not None and (detail.inverse_cdf or detail.force
                                                       or detail.stages):
        raise ConfigError("speculative decoding records --logprobs only: its tokens come "
                          "from the accept/reject step, not one draw per step")
    if drafter is not None and combination_of(lm, settings) is not None:
        raise ConfigError("speculative decoding runs one target model; an ensemble or "
                          "contrastive decoding cannot be its target: drop one of them")
    _check_layer_methods(lm, settings, drafter, detail)
    if drafter is not None:
        yield from speculative.speculate(lm, prompts, settings, drafter, backend, detail)
    elif settings.strategy == "beam":
        request = beam.backend_request(prompts, settings, backend)
        check_prompts(lm, prompts, settings)
        yield from beam.search_events(lm, prompts, settings,
                               for_generation(lm, prompts, settings, request),
                               seeds=seeds, record_tree=record_tree)
    else:
        check_prompts(lm, prompts, settings)
        request = Request(rows=len(prompts) * settings.num_return_sequences,
                          backend=backend)
        if settings.penalty_alpha is not None:
            searcher = choose_backend(lm, replace(request, hidden="contrastive search"))
            yield from contrastive.search(lm, prompts, settings, searcher, seeds=seeds)
            return
        yield from loop.decode(lm, prompts, settings,
                               _plain_backend(lm, prompts, settings, request),
                               seeds=seeds, detail=detail)


def _plain_backend(lm: LoadedModel, prompts: Sequence[Sequence[int]],
                   settings: GenerationSettings, request: Request) -> Backend:
    """The plain loop's backend: DoLa's scores over the lean forward for dola_layers,
    the combined models' for an ensemble or an amateur, else the one `choose` picks."""
    if settings.dola_layers is not None:
        return dola_backend(lm, settings, request)
    return for_generation(lm, prompts, settings, request)


def _check_layer_methods(lm: LoadedModel, settings: GenerationSettings,
                         drafter: Drafting | None, detail: Detail | None) -> None:
    """ConfigError for what contrastive search and DoLa cannot be combined with."""
    method = "contrastive search (penalty_alpha)" if settings.penalty_alpha is not None \
        else "DoLa (dola_layers)" if settings.dola_layers is not None else None
    if method is None:
        return
    if combination_of(lm, settings) is not None:
        raise ConfigError(f"{method} reads one model's hidden states; it cannot run on an "
                          f"ensemble or with an amateur: drop one of them")
    if drafter is not None:
        raise ConfigError(f"{method} cannot decode speculatively: drop the draft model or "
                          f"prompt lookup, or {method.split()[-1].strip('()')}")
    if detail is not None and settings.penalty_alpha is not None:
        raise ConfigError("per-token detail (--logprobs, explain, --crn) needs strategy "
                          "greedy or sample, not contrastive search")


def _reranked(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
              *, drafter: Drafting | None, backend: str, seeds: Sequence[int] | None,
              detail: Detail | None, scorer: LoadedModel | None) -> Iterator[Event]:
    """Sample and rerank: the plain loop's batch of samples, reranked per prompt."""
    if drafter is not None:
        raise ConfigError("samples draws a batch of samples; speculative decoding runs one "
                          "row: drop samples or the draft")
    method = rerank.prepare(lm, prompts, settings, scorer)
    events = stream(lm, prompts, rerank.sampling_settings(settings), backend=backend,
                    seeds=rerank.sample_seeds(seeds, settings.samples or 1), detail=detail)
    yield from rerank.reranked(events, prompts, settings, method, scorer)


def generate(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
             *, drafter: Drafting | None = None, backend: str = "auto",
             seeds: Sequence[int] | None = None, scorer: LoadedModel | None = None
             ) -> list[Finish]:
    """Run `stream` to the end; the Finish events in row order."""
    events = stream(lm, prompts, settings, drafter=drafter, backend=backend, seeds=seeds,
                    scorer=scorer)
    finished = [e for e in events if isinstance(e, Finish)]
    return sorted(finished, key=lambda f: f.row)
