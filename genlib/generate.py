"""genlib's one public way to generate: `stream` routes a request to the plain decode
loop, beam search or speculative decoding, each on the backend `genlib.backends.choose`
picks for it, and yields one event stream (`genlib.events`) whichever runs.

    for event in stream(lm, [lm.encode("Once upon a time")], settings): ...
    for event in stream(lm, [ids], settings, drafter=Drafting(prompt_lookup=3)): ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from genlib import beam, contrastive, decode, speculative
from genlib.backends.base import Backend
from genlib.backends.choose import Request, choose_backend
from genlib.config import GenerationSettings
from genlib.dola import dola_backend
from genlib.errors import ConfigError
from genlib.events import Event, Finish
from genlib.models import LoadedModel
from genlib.speculative import Drafting
from genlib.step import check_prompts
from genlib.stepdetail import Detail


def stream(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
           *, drafter: Drafting | None = None, backend: str | None = None,
           seeds: Sequence[int] | None = None, record_tree: bool = False,
           detail: Detail | None = None) -> Iterator[Event]:
    """Generate for `prompts` with `settings`; yield events. `drafter` decodes
    speculatively (one prompt); beam search runs for strategy beam (`record_tree` adds
    its tree to the BeamStep events); the plain loop otherwise. `backend` is the user's
    choice, default the model's (`LoadedModel.backend`, from --backend; auto: the fastest
    exact one). `seeds`: one per output row. `detail` (plain loop only) adds a
    per-step record to each Token event and can ask for inverse-CDF sampling with common
    random numbers or a branch's forced tokens (`genlib.stepdetail.Detail`)."""
    if detail is not None and settings.strategy == "beam":
        raise ConfigError("per-token detail (--logprobs, explain, --crn) needs strategy "
                          "greedy or sample, not beam search")
    if detail is not None and drafter is not None and (detail.inverse_cdf or detail.force
                                                       or detail.stages):
        raise ConfigError("speculative decoding records --logprobs only: its tokens come "
                          "from the accept/reject step, not one draw per step")
    _check_layer_methods(settings, drafter, detail)
    if drafter is not None:
        yield from speculative.stream(lm, prompts, settings, drafter, backend or lm.backend,
                                      detail)
    elif settings.strategy == "beam":
        request = beam.backend_request(prompts, settings, backend or lm.backend)
        check_prompts(lm, prompts, settings)
        yield from beam.stream(lm, prompts, settings, choose_backend(lm, request),
                               seeds=seeds, record_tree=record_tree)
    else:
        check_prompts(lm, prompts, settings)
        request = Request(rows=len(prompts) * settings.num_return_sequences,
                          backend=backend or lm.backend)
        if settings.penalty_alpha is not None:
            searcher = choose_backend(lm, replace(request, hidden="contrastive search"))
            yield from contrastive.stream(lm, prompts, settings, searcher, seeds=seeds)
            return
        yield from decode.stream(lm, prompts, settings, _plain_backend(lm, settings, request),
                                 seeds=seeds, detail=detail)


def _plain_backend(lm: LoadedModel, settings: GenerationSettings, request: Request
                   ) -> Backend:
    """The plain loop's backend: DoLa's scores over the lean forward for dola_layers."""
    if settings.dola_layers is not None:
        return dola_backend(lm, settings, request)
    return choose_backend(lm, request)


def _check_layer_methods(settings: GenerationSettings, drafter: Drafting | None,
                         detail: Detail | None) -> None:
    """ConfigError for what contrastive search and DoLa cannot be combined with."""
    method = "contrastive search (penalty_alpha)" if settings.penalty_alpha is not None \
        else "DoLa (dola_layers)" if settings.dola_layers is not None else None
    if method is None:
        return
    if drafter is not None:
        raise ConfigError(f"{method} cannot decode speculatively: drop the draft model or "
                          f"prompt lookup, or {method.split()[-1].strip('()')}")
    if detail is not None and settings.penalty_alpha is not None:
        raise ConfigError("per-token detail (--logprobs, explain, --crn) needs strategy "
                          "greedy or sample, not contrastive search")


def generate(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
             *, drafter: Drafting | None = None, backend: str | None = None,
             seeds: Sequence[int] | None = None) -> list[Finish]:
    """Run `stream` to the end; the Finish events in row order."""
    events = stream(lm, prompts, settings, drafter=drafter, backend=backend, seeds=seeds)
    finished = [e for e in events if isinstance(e, Finish)]
    return sorted(finished, key=lambda f: f.row)
