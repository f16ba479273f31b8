"""Sample and rerank: draw `samples` outputs of a prompt as one batch (one row each, on
one backend: the native kernel steps every row in one call), score each, keep the best.

    settings = resolve_settings({"samples": 8, "rerank": "mbr", "temperature": 0.8})
    for event in genlib.generate.stream(lm, [ids], settings): ...

Scores (higher is better):
- `logprob`: the sample's mean token log-probability under the generating model's raw
  distribution, before any processor (the `Token.logprob` the loop records). The
  processed distribution would judge a sample by the settings that drew it: under top-k
  or top-p every kept token of a peaked step has probability near 1, and a temperature
  rescales every score; the raw one is the model's own judgement, the same for any
  sampling settings, and what a forward of prompt + sample gives.
- a scoring model (`rerank` = its folder or hub id): the same mean under that model,
  from one teacher-forced forward of prompt + sample per row. It must share the
  generating model's tokenizer (`check_same_tokenizer`).
- `mbr`: minimum Bayes risk (Kumar and Byrne, 2004; Freitag et al., 2022, with the
  samples as their own pseudo-references): the mean utility of a sample against every
  other sample, the utility chrF (Popović, 2015) as sacrebleu computes it: character
  n-grams up to 6, beta 2, whitespace ignored, on a 0-100 scale. The kept sample is the
  medoid, the one most like the rest.

Ties go to the lowest sample; an empty sample (no token) scores None and is kept only
when every sample is empty. The stream (`reranked`) holds a prompt's Token events back
until its samples are scored, then yields a `Rerank` event, the chosen sample's Token
events and its Finish, renumbered as the prompt's output row: consumers of one output
per prompt need nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from genlib.decoding.step import interrupt
from genlib.errors import ConfigError
from genlib.events import Event, Finish, Rerank, Token
from genlib.lab import metrics
from genlib.settings import config
from genlib.settings.config import GenerationSettings, shown

if TYPE_CHECKING:
    from genlib.models.loading import LoadedModel

METHODS = ("logprob", "mbr")
SCORES = {  # what a score means, by method_kind (the JSON output's rerank.score)
    "logprob": "mean token logprob (nats) under the generating model, before any processor",
    "model": "mean token logprob (nats) under the scoring model (teacher-forced)",
    "mbr": "mean chrF (0-100) against the other samples (minimum Bayes risk)",
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def method_kind(rerank: str) -> str:
    """"logprob", "mbr", or "model" for a scoring model's folder, `builtin:NAME` or hub
    id (OWNER/NAME). ConfigError for anything else, before any model loads."""
    if rerank in METHODS:
        return rerank
    path = os.path.expanduser(rerank)
    if rerank.startswith("builtin:") or os.path.isdir(path):
        return "model"
    if rerank.startswith((".", "/", "~")) or os.path.exists(path):
        raise ConfigError(f"rerank {shown(rerank)}: no model folder there; give logprob, "
                          f"mbr, or the folder of a scoring model")
    if _HUB_ID.fullmatch(rerank):
        return "model"
    raise ConfigError(f"unknown rerank {shown(rerank)}: give logprob, mbr, or a scoring "
                      f"model (a folder, builtin:NAME or a hub id OWNER/NAME)")


def sampling_settings(settings: GenerationSettings) -> GenerationSettings:
    """The settings of the sampling batch: `samples` rows per prompt, no rerank."""
    return dataclasses.replace(settings, num_return_sequences=settings.samples, samples=None,
                               rerank=None)


def sample_seeds(seeds: Sequence[int] | None, samples: int) -> list[int] | None:
    """Each prompt's seed spread over its samples (`config.row_seeds`): sample 0 uses the
    prompt's seed, so a prompt draws the same samples in any batch."""
    if seeds is None:
        return None
    return [s for seed in seeds for s in config.row_seeds(seed, samples)]


def check_same_tokenizer(lm: LoadedModel, scorer: LoadedModel) -> None:
    """ConfigError naming the first token id whose token differs between the two
    tokenizers: a score over another tokenizer's ids would judge other text."""
    ours, theirs = lm.tokenizer.get_vocab(), scorer.tokenizer.get_vocab()
    if ours == theirs:
        return
    ours_by_id = {i: t for t, i in ours.items()}
    theirs_by_id = {i: t for t, i in theirs.items()}
    first = min(i for i in set(ours_by_id) | set(theirs_by_id)
                if ours_by_id.get(i) != theirs_by_id.get(i))
    raise ConfigError(f"rerank model {scorer.ref} has another tokenizer than {lm.ref}: "
                      f"token id {first} is {shown(theirs_by_id.get(first))} there and "
                      f"{shown(ours_by_id.get(first))} here; score with a model of the same "
                      f"tokenizer, or use --rerank logprob or mbr")


def prepare(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
            scorer: LoadedModel | None) -> str:
    """Check, before any work, that the samples can be scored; return the method's name
    as events and outputs show it (logprob, mbr, or the scoring model's)."""
    assert settings.rerank is not None  # resolve_settings sets logprob with samples
    kind = method_kind(settings.rerank)
    if kind != "model":
        return kind
    if scorer is None:
        raise ConfigError(f"rerank names the model {settings.rerank}, which this run did not "
                          f"load to score with; give it as --rerank when the run starts")
    check_same_tokenizer(lm, scorer)
    for prompt in prompts:
        scorer.check_fits(len(prompt), settings.max_new_tokens,
                          whose=f"the rerank model {scorer.ref}'s",
                          remedy="rerank with a model of a longer context")
    return scorer.ref


# --- scores ---------------------------------------------------------------------------

def chrf(hypothesis: str, reference: str) -> float:
    """chrF of `hypothesis` against `reference` (0-100), sacrebleu's defaults: character
    n-grams of 1-6, beta 2, whitespace removed, effective order (orders the hypothesis
    has no n-gram of are left out)."""
    return _chrf_metric().sentence_score(hypothesis, [reference]).score


_CHRF: list[Any] = []


def _chrf_metric() -> Any:
    """sacrebleu's CHRF, built once (its import and set-up take a few milliseconds)."""
    if not _CHRF:
        from sacrebleu.metrics import CHRF

        _CHRF.append(CHRF())
    return _CHRF[0]


def mbr_scores(texts: Sequence[str]) -> list[float | None]:
    """Each text's mean chrF against every other text (the MBR expected utility); None
    for an empty text, which no utility can favour."""
    out: list[float | None] = []
    for i, text in enumerate(texts):
        others = [other for j, other in enumerate(texts) if j != i]
        out.append(math.fsum(chrf(text, other) for other in others) / len(others)
                   if text and others else None)
    return out


def model_scores(scorer: LoadedModel, prompt_ids: Sequence[int],
                 samples: Sequence[Sequence[int]]) -> list[float | None]:
    """Each sample's mean token logprob under `scorer`: one teacher-forced forward of the
    rows prompt + sample, right-padded (a causal model's earlier positions never see the
    padding)."""
    import torch

    rows = [list(prompt_ids) + list(s) for s in samples]
    ids = torch.full((len(rows), max(map(len, rows))), scorer.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    with torch.inference_mode():
        logits = scorer.model(input_ids=ids.to(scorer.device),
                              attention_mask=mask.to(scorer.device)).logits
    start = len(prompt_ids) - 1  # the position that predicts the first new token
    out: list[float | None] = []
    for i, sample in enumerate(samples):
        if not sample:
            out.append(None)
            continue
        logp = logits[i, start:start + len(sample)].float().log_softmax(dim=-1)
        picked = logp.gather(-1, torch.tensor(sample, device=logp.device)[:, None])
        out.append(float(picked.double().mean()))
    return out


def scores(method: str, scorer: LoadedModel | None, prompt_ids: Sequence[int],
           samples: Sequence[Finish]) -> list[float | None]:
    """The samples' scores under `method` (logprob, mbr, or a scoring model's name)."""
    if method == "logprob":
        return [metrics.mean_logprob(s.logprobs) for s in samples]
    if method == "mbr":
        return mbr_scores([s.text for s in samples])
    assert scorer is not None
    return model_scores(scorer, prompt_ids, [s.token_ids for s in samples])


def choose(values: Sequence[float | None]) -> int:
    """The index of the highest score (the first of equals; None counts as lowest)."""
    best = 0
    for i, value in enumerate(values):
        if value is not None and (values[best] is None or value > values[best]):
            best = i
    return best


# --- the stream -----------------------------------------------------------------------

def reranked(events: Iterator[Event], prompts: Sequence[Sequence[int]],
           settings: GenerationSettings, method: str, scorer: LoadedModel | None
           ) -> Iterator[Event]:
    """Rerank the sampling batch's `events` (`settings.samples` rows per prompt): each
    prompt's Tokens are held until its samples end, then its Rerank event, the chosen
    sample's Tokens and Finish (row = prompt index). Ctrl-C (thrown in by
    `step.interrupt`) ends the samples as "interrupted"; they are reranked all the same."""
    held: dict[int, list[Token]] = {}
    ended: dict[int, list[Finish]] = {}

    def take(event: Event) -> Iterator[Event]:
        if isinstance(event, Token):
            held.setdefault(event.row, []).append(event)
        elif isinstance(event, Finish):
            group = ended.setdefault(event.prompt_index, [])
            group.append(event)
            if len(group) == settings.samples:
                yield from _chosen(group, held, prompts, method, scorer)
        else:
            yield event

    try:
        for event in events:
            yield from take(event)
    except KeyboardInterrupt:
        for event in interrupt(events):
            yield from take(event)


def _chosen(group: list[Finish], held: dict[int, list[Token]],
            prompts: Sequence[Sequence[int]], method: str, scorer: LoadedModel | None
            ) -> Iterator[Event]:
    """One prompt's Rerank event, then its chosen sample as the prompt's output row."""
    samples = sorted(group, key=lambda f: f.row)
    index = samples[0].prompt_index
    start = time.perf_counter()
    values = scores(method, scorer, prompts[index], samples)
    pick = choose(values)
    now = time.perf_counter()
    yield Rerank(index, method, tuple(samples), tuple(values), pick, now - start, now)
    best = samples[pick]
    for token in held.get(best.row, []):
        yield dataclasses.replace(token, row=index)
    for sample in samples:
        held.pop(sample.row, None)
    yield dataclasses.replace(best, row=index, score=values[pick])
