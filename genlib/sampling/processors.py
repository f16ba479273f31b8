"""Logits processors: pure functions `(token_ids, logits) -> logits`, built once by
`build_processors` into an ordered list of named `Stage`s and run by `apply`.

The default order (`DEFAULT_ORDER`; EOS suppression and then a grammar's mask run before
it, per step):

    logit_bias -> penalties -> no_repeat_ngram -> dry -> temperature -> top_k -> top_p
    -> min_p -> typical_p -> epsilon_cutoff -> eta_cutoff -> top_n_sigma -> xtc -> mirostat

(transformers' `generate()` order for the processors it has, so distributions match it;
llama.cpp's samplers after them; Mirostat last, as llama.cpp runs it in place of the
final draw). `settings.samplers`
(`--samplers`) gives another order, as llama.cpp's `--samplers` does; stage names are that
option's vocabulary (`STAGE_NAMES`). Sampling-only stages (`SAMPLING_STAGES`) are skipped
for greedy and beam search, where they could not change the argmax anyway. `token_ids`
is the full context, prompt included, shape (batch, length); left-padding positions hold
-1 and are ignored. No processor modifies its input in place.

A stateful stage (Mirostat) keeps per-row state in `Stage.state`: its function only reads
that state, so a stage can be run again for inspection without effect; the loop calls
`observe` with the sampled tokens once per step (which updates the state) and `reorder`
when rows leave the batch.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from genlib.errors import ConfigError
from genlib.settings.config import DEFAULT_SAMPLERS, STAGE_ON, fresh_seed

if TYPE_CHECKING:
    from genlib.settings.config import GenerationSettings

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PAD = -1
NEG_INF = float("-inf")
GRAMMAR_STAGE = "grammar"  # the chain's first stage under --regex, --json-schema, --grammar

# Every stage name, in the default order (the `--samplers` vocabulary, genlib.settings.config).
DEFAULT_ORDER: tuple[str, ...] = DEFAULT_SAMPLERS
STAGE_NAMES = frozenset(DEFAULT_ORDER)
# Stages that only shape a distribution to sample from: skipped without sampling.
SAMPLING_STAGES = frozenset({"temperature", "top_k", "top_p", "min_p", "typical_p",
                             "epsilon_cutoff", "eta_cutoff", "top_n_sigma", "xtc", "mirostat"})


class RowState(Protocol):
    """Per-row state of a stateful stage (one entry per batch row)."""

    def observe(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Update from the logits sampled from (rows, vocab) and the tokens drawn (rows,)."""

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the rows at `index`, in that order (rows left the batch or beams moved)."""


@dataclass(frozen=True)
class Stage:
    """One named step of the chain: `fn(token_ids, logits) -> logits`, pure (it may read,
    never write, `state`)."""

    name: str
    fn: Processor
    state: RowState | None = None

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.fn(token_ids, logits)


class suppress_tokens:  # noqa: N801 (a processor, named as the others' factories are)
    """suppress: logit[id] = -inf for the given ids (min_new_tokens, ignore_eos). `ids`
    says which, so a step that only bans ids (a native greedy draft) takes them from the
    processor itself."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = tuple(ids)
        self.index = torch.tensor(list(ids), dtype=torch.long)

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, self.index.to(logits.device), NEG_INF)


def repetition_penalty(penalty: float) -> Processor:
    def repeat(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """repetition penalty (CTRL): seen token's logit l -> l/p if l > 0 else l*p."""
        ids = torch.where(token_ids < 0, token_ids[:, -1:], token_ids)
        seen = logits.gather(-1, ids)
        seen = torch.where(seen < 0, seen * penalty, seen / penalty)
        return logits.scatter(-1, ids, seen)

    return repeat


def no_repeat_ngram(n: int) -> Processor:
    def no_repeat(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """no-repeat-ngram: ban x if (last n-1 tokens, x) already occurs in the context."""
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, ids in enumerate(token_ids.tolist()):
            ids = [t for t in ids if t >= 0]
            if len(ids) + 1 < n:
                continue
            tail = tuple(ids[len(ids) - n + 1:]) if n > 1 else ()
            for start in range(len(ids) - n + 1):
                if tuple(ids[start:start + n - 1]) == tail:
                    banned_rows.append(row)
                    banned_ids.append(ids[start + n - 1])
        if not banned_rows:
            return logits
        out = logits.clone()
        out[banned_rows, banned_ids] = NEG_INF
        return out

    return no_repeat


def temperature(t: float) -> Processor:
    def scale(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """temperature: l -> l / T."""
        return logits / t

    return scale


def top_k(k: int, min_keep: int = 1) -> Processor:
    """`min_keep` (here and in the other transformers warpers): keep at least that many,
    transformers' `min_tokens_to_keep`, which beam sampling raises (`build_processors`)."""
    k = max(k, min_keep)

    def keep_top_k(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """top-k: drop tokens whose logit is below the k-th largest (ties kept)."""
        kth = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, NEG_INF)

    return keep_top_k


def top_p(p: float, min_keep: int = 1) -> Processor:
    def nucleus(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """top-p: keep the most probable tokens whose total probability reaches p."""
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - p)
        drop_sorted[..., -min_keep:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, NEG_INF)

    return nucleus


def min_p(p: float, min_keep: int = 1) -> Processor:
    def keep_min_p(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """min-p: drop tokens with p < min_p * p_max."""
        probs = logits.softmax(dim=-1)
        threshold = p * probs.amax(dim=-1, keepdim=True)
        drop = probs < threshold  # never the most probable
        if min_keep > 1:  # the first min_keep of topk, exactly (ties too), as transformers
            k = min(min_keep, probs.shape[-1])
            drop = drop.scatter(-1, torch.topk(probs, k, dim=-1).indices, False)
        return logits.masked_fill(drop, NEG_INF)

    return keep_min_p


def typical_p(mass: float, min_keep: int = 1) -> Processor:
    def typical(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """typical-p: keep tokens whose surprise is closest to the entropy, up to `mass`."""
        logp = logits.log_softmax(dim=-1)
        entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
        distance = (-logp - entropy).abs()
        sorted_distance, order = torch.sort(distance, descending=False)
        cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < mass).sum(dim=1).clamp(max=logits.shape[-1] - 1)
        drop_sorted = sorted_distance > sorted_distance.gather(1, last.view(-1, 1))
        drop_sorted[..., :min_keep] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        return logits.masked_fill(drop, NEG_INF)

    return typical


def logit_bias(biases: Mapping[tuple[int, ...], float]) -> Processor:
    """Sequence bias as transformers' `SequenceBiasLogitsProcessor` applies it; a
    one-token sequence is llama.cpp's `--logit-bias`."""
    singles = {seq[0]: b for seq, b in biases.items() if len(seq) == 1}
    longer = {seq: b for seq, b in biases.items() if len(seq) > 1}
    single_ids = torch.tensor(list(singles), dtype=torch.long)
    single_bias = torch.tensor(list(singles.values()))

    def bias(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """logit bias: l[x] += b for (prefix, x) whose prefix ends the context."""
        out = logits.clone()
        if singles:
            out[:, single_ids.to(out.device)] += single_bias.to(out)
        for seq, b in longer.items():
            prefix = torch.tensor(seq[:-1], device=out.device)
            if token_ids.shape[1] >= len(prefix):
                ends = (token_ids[:, token_ids.shape[1] - len(prefix):] == prefix).all(dim=1)
                out[:, seq[-1]] += ends.to(out.dtype) * b
        return out

    return bias


def presence_frequency(presence: float, frequency: float, prompt_width: int) -> Processor:
    """OpenAI/vLLM presence and frequency penalties over the generated tokens (the
    columns of `token_ids` from `prompt_width` on; the prompt is not counted)."""

    def penalize(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """presence/frequency: l[x] -= count(x) * frequency + (count(x) > 0) * presence."""
        generated = token_ids[:, prompt_width:]
        counts = torch.zeros_like(logits).scatter_add(
            -1, generated.clamp(min=0), (generated >= 0).to(logits.dtype))
        return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence

    return penalize


def dry(multiplier: float, base: float, allowed_length: int, breakers: frozenset[int],
        last_n: int) -> Processor:
    """DRY, "Don't Repeat Yourself", as llama.cpp's `llama_sampler_dry_apply`
    (src/llama-sampling.cpp, ported from koboldcpp): a token that would extend a
    repetition of length n >= allowed_length of an earlier part of the context loses
    multiplier * base**(n - allowed_length). Repetitions do not run across a sequence
    breaker token, and a breaker itself is never penalized; `last_n` limits the context
    looked at (-1: all of it). Breakers are single tokens here (see `breaker_ids`)."""
    max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0

    def penalize(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """DRY: l[x] -= multiplier * base**(n - allowed_length), n = repeat x would extend."""
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for row, context in enumerate(token_ids.tolist()):
            for token, n in _dry_repeats(context, allowed_length, breakers, last_n).items():
                exponent = n - allowed_length
                if max_exponent > 0:
                    exponent = min(exponent, max_exponent)
                rows.append(row)
                ids.append(token)
                values.append(multiplier * base ** exponent)
        if not rows:
            return logits
        out = logits.clone()
        out[rows, ids] -= torch.tensor(values, dtype=out.dtype, device=out.device)
        return out

    return penalize


def _dry_repeats(context: list[int], allowed_length: int, breakers: frozenset[int],
                 last_n: int) -> dict[int, int]:
    """token -> the longest repetition it would extend (>= allowed_length), by direct
    suffix matching (llama.cpp finds the same lengths with a reversed Z-algorithm)."""
    tokens = [t for t in context if t >= 0]
    if last_n >= 0:
        tokens = tokens[max(0, len(tokens) - last_n):] if last_n else []
    n = len(tokens)
    if n <= allowed_length:
        return {}
    limit = n  # a repetition stops at the last sequence breaker
    for i in range(n):
        if tokens[n - 1 - i] in breakers:
            limit = i
            break
    if limit < allowed_length:
        return {}
    best: dict[int, int] = {}
    for end in range(n - 1):  # the repeat ends at tokens[end]; tokens[end + 1] extends it
        length = 0
        while length < limit and length <= end and \
                tokens[end - length] == tokens[n - 1 - length]:
            length += 1
        nxt = tokens[end + 1]
        if length >= allowed_length and nxt not in breakers and length > best.get(nxt, 0):
            best[nxt] = length
    return best


def epsilon_cutoff(epsilon: float, min_keep: int = 1) -> Processor:
    """transformers' `EpsilonLogitsWarper` (Hewitt et al. 2022, truncation sampling)."""

    def cut(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """epsilon cutoff: drop tokens with p < epsilon (the most probable is kept)."""
        probs = logits.softmax(dim=-1)
        return logits.masked_fill((probs < epsilon) & ~_top(logits, min_keep), NEG_INF)

    return cut


def eta_cutoff(epsilon: float, min_keep: int = 1) -> Processor:
    """transformers' `EtaLogitsWarper` (Hewitt et al. 2022): an entropy-adaptive epsilon."""

    def cut(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """eta cutoff: drop p < min(eta, sqrt(eta) * exp(-entropy)) (the top one is kept)."""
        logp = logits.log_softmax(dim=-1)
        entropy = -(logp.exp() * logp).nan_to_num().sum(-1, keepdim=True)
        eta = torch.clamp(math.sqrt(epsilon) * torch.exp(-entropy), max=epsilon)
        return logits.masked_fill((logp.exp() < eta) & ~_top(logits, min_keep), NEG_INF)

    return cut


def _top(logits: torch.Tensor, n: int) -> torch.Tensor:
    """Whether each logit is >= the row's n-th largest (ties with it included, as
    transformers' epsilon and eta cutoffs compare)."""
    nth = torch.topk(logits, min(n, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits >= nth


def top_n_sigma(n: float) -> Processor:
    """top-nσ (Tang et al. 2024), as llama.cpp's `llama_sampler_top_n_sigma_apply`: the
    mean and population deviation are over the finite logits."""

    def keep(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """top-nσ: drop tokens with l < l_max - n * std(l)."""
        finite = torch.isfinite(logits)
        count = finite.sum(-1, keepdim=True).clamp(min=1)
        values = logits.masked_fill(~finite, 0.0)
        mean = values.sum(-1, keepdim=True) / count
        var = ((values - mean) ** 2).masked_fill(~finite, 0.0).sum(-1, keepdim=True) / count
        threshold = logits.amax(-1, keepdim=True) - n * var.sqrt()
        return logits.masked_fill(logits < threshold, NEG_INF)

    return keep


def xtc(threshold: float, probability: float, seed: int) -> Processor:
    """XTC, "exclude top choices", as llama.cpp's `llama_sample_xtc_apply`: with chance
    `probability`, every candidate with p >= threshold but one, the least probable of
    them, is removed (nothing happens unless at least two reach the threshold). The
    candidates are the tokens earlier stages left (llama.cpp's shrunken array), so a
    threshold of 0 keeps one of them, never none. Among tokens tied at that least
    probability llama.cpp keeps whichever its sort put last; here, the lowest id. The
    chance is drawn from `seed` and the row's context, so the stage stays pure."""

    def exclude(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """XTC: if u < probability, drop the candidates with p >= threshold but one."""
        probs = logits.softmax(dim=-1)
        above = (probs >= threshold) & torch.isfinite(logits)
        survivor = probs.masked_fill(~above, 2.0).argmin(-1, keepdim=True)
        fire = torch.tensor([_coin(seed, row) <= probability for row in token_ids.tolist()],
                            device=logits.device)[:, None]
        drop = above & fire & (above.sum(-1, keepdim=True) >= 2)
        return logits.masked_fill(drop.scatter(-1, survivor, False), NEG_INF)

    return exclude


def _coin(seed: int, context: list[int]) -> float:
    """A uniform draw in [0, 1) fixed by the seed and the context."""
    digest = hashlib.sha256(f"{seed}:{context}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0 ** 64


class MirostatState:
    """Mirostat's per-row target surprise mu, float32 as llama.cpp's `float mu` (starts
    at 2 * tau, as there; past float32's range, as there, at inf: nothing is cut)."""

    def __init__(self, tau: float, eta: float) -> None:
        self.tau = tau
        self.eta = eta
        self.mu: torch.Tensor | None = None  # (rows,), made by the first observe

    def current(self, rows: int, device: torch.device) -> torch.Tensor:
        if self.mu is None:
            # torch.full raises where 2 * tau overflows float32; torch.tensor rounds to inf.
            return torch.tensor([2.0 * self.tau] * rows, device=device)
        return self.mu.to(device)

    def observe(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """mu <- mu - eta * (surprise - tau), surprise = -log2 p(token) as sampled."""
        logp = logits.float().log_softmax(dim=-1).gather(-1, tokens.view(-1, 1)).squeeze(-1)
        surprise = -logp / math.log(2.0)
        self.mu = self.current(len(tokens), logits.device) - self.eta * (surprise - self.tau)

    def reorder(self, index: torch.Tensor) -> None:
        if self.mu is not None:
            self.mu = self.mu.index_select(0, index.to(self.mu.device))


def mirostat_v2(state: MirostatState) -> Processor:
    """Mirostat 2.0 (Basu et al. 2021), as llama.cpp's `llama_sampler_mirostat_v2_apply`:
    truncation to the tokens whose surprise is at most mu; `MirostatState.observe` adapts
    mu after each draw."""

    def truncate(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Mirostat v2: drop tokens with -log2 p > mu; if that drops all, keep the most
        probable alone (llama.cpp's `size = 1`; of tied ones, the lowest id)."""
        mu = state.current(logits.shape[0], logits.device)[:, None]
        surprise = -logits.log_softmax(dim=-1) / math.log(2.0)
        # The most probable has the least surprise: kept whenever any token is.
        drop = (surprise > mu).scatter(-1, logits.argmax(dim=-1, keepdim=True), False)
        return logits.masked_fill(drop, NEG_INF)

    return truncate


# The truncations that keep at least `min_keep` tokens, each named as its setting.
_TRUNCATIONS: dict[str, Callable[[Any, int], Processor]] = {
    "top_k": top_k, "top_p": top_p, "min_p": min_p, "typical_p": typical_p,
    "epsilon_cutoff": epsilon_cutoff, "eta_cutoff": eta_cutoff}


def _stage(name: str, s: GenerationSettings, ctx: _BuildContext) -> Stage:
    """Stage `name` under settings `s`, which turn it on (`config.STAGE_ON`)."""
    state: RowState | None = None
    fn: Processor
    if name == "logit_bias":
        fn = logit_bias(ctx.bias_sequences(s.logit_bias))
    elif name == "penalties":
        fn = _penalties(s, ctx.prompt_width)
    elif name == "no_repeat_ngram":
        fn = no_repeat_ngram(s.no_repeat_ngram_size)
    elif name == "dry":
        fn = dry(s.dry_multiplier, s.dry_base, s.dry_allowed_length,
                 ctx.breaker_ids(s.dry_sequence_breakers), s.dry_penalty_last_n)
    elif name == "temperature":
        fn = temperature(s.temperature)
    elif name in _TRUNCATIONS:
        fn = _TRUNCATIONS[name](getattr(s, name), ctx.min_keep)
    elif name == "top_n_sigma":
        fn = top_n_sigma(s.top_n_sigma)
    elif name == "xtc":
        fn = xtc(s.xtc_threshold, s.xtc_probability, ctx.seed)
    else:  # mirostat
        state = MirostatState(s.mirostat_tau, s.mirostat_eta)
        fn = mirostat_v2(state)
    return Stage(name, fn, state)


def _penalties(s: GenerationSettings, prompt_width: int) -> Processor:
    """The penalties stage: the CTRL repetition penalty, then presence and frequency
    (the ones the settings turn on; at least one is)."""
    parts: list[Processor] = []
    if s.repetition_penalty != 1.0:
        parts.append(repetition_penalty(s.repetition_penalty))
    if s.presence_penalty != 0.0 or s.frequency_penalty != 0.0:
        parts.append(presence_frequency(s.presence_penalty, s.frequency_penalty, prompt_width))
    if len(parts) == 1:
        return parts[0]

    def penalties(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """penalties: repetition penalty, then presence/frequency."""
        return parts[1](token_ids, parts[0](token_ids, logits))

    return penalties


@dataclass(frozen=True)
class _BuildContext:
    """What some stages need beyond the settings."""

    prompt_width: int
    tokenizer: Any
    seed: int
    vocab_size: int | None = None  # the logits' width, when known: ids are checked
    min_keep: int = 1  # the transformers warpers' min_tokens_to_keep

    def bias_sequences(self, biases: Sequence[tuple[int | str, float]]
                       ) -> dict[tuple[int, ...], float]:
        """logit_bias keys as token sequences: ids as they are, text encoded; ConfigError
        for an id outside the vocabulary (it would index no logit, or wrap around)."""
        out: dict[tuple[int, ...], float] = {}
        for token, bias in biases:
            if isinstance(token, int):
                self._check_id(token)
                out[(token,)] = bias
                continue
            if self.tokenizer is None:
                raise ConfigError(f"logit_bias {token!r} is text; give a token id")
            ids = tuple(self.tokenizer.encode(token, add_special_tokens=False))
            if not ids:
                raise ConfigError(f"logit_bias {token!r} encodes to no token")
            for token_id in ids:  # a tokenizer's added tokens may lie past the logits
                self._check_id(token_id)
            out[ids] = bias
        return out

    def _check_id(self, token: int) -> None:
        if token < 0 or (self.vocab_size is not None and token >= self.vocab_size):
            limit = f"0-{self.vocab_size - 1}" if self.vocab_size is not None else ">= 0"
            raise ConfigError(f"logit_bias token id {token} is outside the model's "
                              f"vocabulary ({limit}); give an id in it, or the token's text")

    def breaker_ids(self, breakers: Sequence[str]) -> frozenset[int]:
        """Tokens whose text holds a DRY sequence breaker."""
        if not breakers or self.tokenizer is None:
            return frozenset()
        return frozenset(i for i, text in enumerate(_token_texts(self.tokenizer))
                         if any(b in text for b in breakers))


# Held weakly: an entry goes with its tokenizer, so a later tokenizer that reuses a freed
# one's id() never reads its texts.
_TEXTS: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()


def _token_texts(tokenizer: Any) -> list[str]:
    """Each token id's text (decoded once per tokenizer)."""
    if tokenizer not in _TEXTS:
        _TEXTS[tokenizer] = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    return _TEXTS[tokenizer]


def stage_order(settings: GenerationSettings) -> tuple[str, ...]:
    """The order the chain runs in: `settings.samplers` if given, else `DEFAULT_ORDER`."""
    return tuple(settings.samplers) or DEFAULT_ORDER


def build_processors(settings: GenerationSettings, *, prompt_width: int = 0,
                     tokenizer: Any = None, constraint: Any = None,
                     vocab_size: int | None = None, min_keep: int = 1) -> list[Stage]:
    """The chain for `settings`: its active stages, in the order used (EOS suppression
    is added per step by the decode loop, not here).

    `prompt_width`: the columns of `token_ids` that hold the (left-padded) prompt, which
    presence/frequency penalties and the grammar do not count as generated. `tokenizer`
    encodes text in logit_bias and finds DRY's breakers. `constraint`: a grammar compiled
    by `genlib.sampling.grammar.compile_for`, run first as stage "grammar" (a mask has to come
    before truncation, or top-k could keep only tokens the grammar forbids).
    `vocab_size`: the logits' width, which logit_bias ids must fall in. `min_keep`: the
    fewest tokens top-k, top-p, min-p, typical-p and the epsilon and eta cutoffs leave
    (transformers' `min_tokens_to_keep`: 1, and more for beam sampling)."""
    seed = settings.seed if settings.seed is not None else fresh_seed()
    ctx = _BuildContext(prompt_width, tokenizer, seed, vocab_size, min_keep)
    chain: list[Stage] = []
    if constraint is not None:
        from genlib.sampling import grammar

        matchers = grammar.Matchers.start(constraint)
        chain.append(Stage(GRAMMAR_STAGE, grammar.mask_fn(matchers, prompt_width), matchers))
    for name in stage_order(settings):
        if (name in SAMPLING_STAGES and not settings.do_sample) \
                or not STAGE_ON[name](settings.__dict__):
            continue
        chain.append(_stage(name, settings, ctx))
    return chain


def check_for_model(settings: GenerationSettings, tokenizer: Any, vocab_size: int) -> None:
    """ConfigError for what a model rejects in settings that are valid on their own: a
    logit_bias id outside its vocabulary, or text that encodes to no token."""
    ctx = _BuildContext(0, tokenizer, 0, vocab_size)
    ctx.bias_sequences(settings.logit_bias)


def grammar_of(chain: Sequence[Processor]) -> Any:
    """The grammar stage's matchers (`genlib.sampling.grammar.Matchers`), or None."""
    for stage in chain:
        if getattr(stage, "name", None) == GRAMMAR_STAGE:
            return stage.state  # type: ignore[attr-defined]
    return None


def apply(chain: Sequence[Processor], token_ids: torch.Tensor, logits: torch.Tensor
          ) -> torch.Tensor:
    """Run the chain's stages in order."""
    for processor in chain:
        logits = processor(token_ids, logits)
    return logits


def observe(chain: Sequence[Processor], logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """After sampling: let stateful stages see the logits sampled from and the tokens."""
    for stage in chain:
        state = getattr(stage, "state", None)
        if state is not None:
            state.observe(logits, tokens)


def reorder(chain: Sequence[Processor], index: torch.Tensor) -> None:
    """Rows left the batch (or beams moved): keep stateful stages' rows at `index`."""
    for stage in chain:
        state = getattr(stage, "state", None)
        if state is not None:
            state.reorder(index)
