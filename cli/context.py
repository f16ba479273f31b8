"""What every generating subcommand does first: read the prompt, read the preset, merge
settings (flag > preset > defaults), load the model once and encode the prompt."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cli.errors import fail
from genlib.settings.config import GenerationSettings, resolve_settings, seeded
from genlib.settings.presets import Preset, load_preset

if TYPE_CHECKING:
    from genlib.models.loading import LoadedModel


@dataclass
class ModelFlags:
    model: str | None
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"
    trust_remote_code: bool = False
    backend: str = "auto"
    ensemble: tuple[str, ...] = ()  # --ensemble MODEL[:WEIGHT] each
    amateur: str | None = None  # --amateur MODEL

    @property
    def combined(self) -> bool:
        """Whether the run loads models to combine with the main one."""
        return bool(self.ensemble or self.amateur)


@dataclass(frozen=True)
class PromptFlags:
    """How a command makes its prompt: --chat, --system, --truncate-prompt."""

    chat: bool = False
    system: str | None = None
    truncate: bool = False


def combination_defaults(model_flags: ModelFlags, flags: Mapping[str, Any]) -> dict[str, Any]:
    """The settings --ensemble and --amateur imply where neither a flag nor the preset
    sets them (a mean ensemble; contrastive decoding at beta 0.5), to go under the
    preset; an input error for the numbers of a combination whose models are not given,
    or for both combinations at once."""
    from genlib.sampling.combine import DEFAULT_CD_BETA, parse_member

    for text in model_flags.ensemble:
        parse_member(text)  # a bad weight is refused before any model loads
    if model_flags.ensemble and model_flags.amateur:
        raise fail("give --ensemble (an ensemble) or --amateur (contrastive decoding), "
                   "not both")
    if "ensemble_mode" in flags and not model_flags.ensemble:
        raise fail("--ensemble-mode needs --ensemble MODEL[:WEIGHT], the models to combine "
                   "with -m")
    for flag, key in (("--cd-beta", "cd_beta"), ("--cd-alpha", "cd_alpha")):
        if key in flags and not model_flags.amateur:
            raise fail(f"{flag} needs --amateur MODEL, the model contrastive decoding "
                       f"scores against")
    if model_flags.ensemble:
        return {"ensemble_mode": "mean"}
    return {"cd_beta": DEFAULT_CD_BETA} if model_flags.amateur else {}


def settings_for(preset_ref: str | None, flags: dict[str, Any],
                 defaults: Mapping[str, Any] | None = None, seed: int | None = None
                 ) -> tuple[GenerationSettings, Preset | None]:
    """A run's settings, flag > preset > `defaults` (a command's own, explain's 20 new
    tokens) > genlab's defaults, with the seed policy applied (settings that sample and
    name no seed get `seed`, else a fresh one, to report); and the preset."""
    preset = load_preset(preset_ref) if preset_ref else None
    own = preset.settings if preset else {}
    # The command's defaults go under the preset, as a batch run's flags go under a
    # line's preset; only the preset counts as one (for beam sampling's inference).
    settings = resolve_settings(flags, {**(defaults or {}), **own}, presets=[own])
    from cli.render import warn_unused

    warn_unused(settings)
    return seeded(settings, seed), preset


def presets_model(refs: Sequence[str], alternative: str = "") -> str | None:
    """The model the presets `refs` name, for a command that runs several presets on one
    model (compare, bench): --model's default there, as one preset's model is elsewhere;
    None when none names one. They must agree: an input error names them otherwise,
    ending with the command's `alternative` to picking one with -m."""
    named = list(dict.fromkeys(m for m in (load_preset(ref).model for ref in refs) if m))
    if len(named) > 1:
        raise fail(f"the presets name different models ({', '.join(named)}); pick one "
                   f"with -m/--model{alternative}")
    return named[0] if named else None


def load(flags: ModelFlags, preset: Preset | None = None, quick: bool = True,
         weights: tuple[str, ...] = ("float32",)) -> LoadedModel:
    """The model the flags and preset name; `quick` starts without transformers where
    the checkpoint allows (genlib.models.quickload: transformers' model loads on first use,
    where a backend needs it), for every command that decodes on genlab's own backends;
    `weights`: the native kernels it may run (`kernel.WEIGHTS`: a draft's bfloat16).
    The heap it leaves is frozen (`models.freeze_heap`)."""
    from genlib.backends.choose import check_name
    from genlib.models.loading import ModelSpec, freeze_heap, load_model, resolve_model_ref

    ref = resolve_model_ref(flags.model, preset.model if preset else None)
    spec = ModelSpec(ref=ref, device=flags.device, dtype=flags.dtype, quantize=flags.quantize,
                     trust_remote_code=flags.trust_remote_code, backend=check_name(flags.backend))
    with loading(ref):
        lm = load_model(spec, quick=quick)
    build_native_kernel(lm, spec.backend, weights)
    lm.partners = load_partners(flags, lm, quick)
    freeze_heap()  # no pause of the collector's over what loading made, mid-decode
    return lm


def load_partners(flags: ModelFlags, lm: LoadedModel, quick: bool) -> tuple[Any, ...]:
    """The --ensemble and --amateur models, loaded as `lm` was (device, dtype, backend)
    and checked to combine with it (one device, one tokenizer)."""
    from genlib.backends.choose import check_name
    from genlib.models.loading import ModelSpec, load_model
    from genlib.sampling.combine import AMATEUR, ENSEMBLE, Partner, check_partner, parse_member

    wanted = [(*parse_member(text), ENSEMBLE, "--ensemble") for text in flags.ensemble]
    wanted += [(flags.amateur, 1.0, AMATEUR, "--amateur")] if flags.amateur else []
    partners = []
    for ref, weight, role, flag in wanted:
        spec = ModelSpec(ref=ref, device=flags.device, dtype=flags.dtype,
                         quantize=flags.quantize, trust_remote_code=flags.trust_remote_code,
                         backend=check_name(flags.backend))
        with loading(ref):
            other = load_model(spec, quick=quick)
        check_partner(lm, other, flag)
        build_native_kernel(other, spec.backend)
        partners.append(Partner(other, role, weight))
    return tuple(partners)


def build_native_kernel(lm: LoadedModel, backend: str = "auto",
                        weights: tuple[str, ...] = ("float32",)) -> None:
    """Build the native kernel now, where a generation on `lm` under the user's `backend`
    may run it, so its one-off
    build (a few seconds, once per machine) is announced and timed apart: one line on
    stderr, with a spinner while it compiles on a terminal. `weights`: which builds
    (`kernel.WEIGHTS`). A model mapped from its file (genlib.models.quickload) has its float32
    matrices packed now too, through the weight cache (`kernel.packed_weights`), and a
    quantized checkpoint (genlib.models.qformat) its stored codes."""
    import torch

    from genlib.backends import kernel
    from genlib.backends.choose import native_allowed, stored_format
    from genlib.backends.native import native_step

    stored = stored_format(lm)
    if lm.weights is not None:  # --quantize on the native kernel: the format's build
        weights = (lm.weights,)
    elif backend not in ("auto", "native") or lm.device.type != "cpu" \
            or lm.dtype != torch.float32 or lm.quantize != "none":
        return
    elif stored:  # a quantized checkpoint: the kernel that reads its codes
        weights = (stored,)
    if backend == "auto" and not native_allowed():
        return
    from cli.render import building, warn

    with building() as notify:
        kernel.ensure_built(notify, weights=weights)
    packs = stored if stored in weights else "float32"
    if lm.lean is not None and (lm.lean.weights_file is not None or stored) \
            and packs in weights:
        # The packed weights now, mapped from the cache (or packed and cached), so a
        # cache that cannot be written is said once, before any output.
        native_step(lm.lean, packs, warn)
    for kind in kernel.builds_for(weights):  # each build ran once above; read what it said
        notice = kernel.build_for(kind).notice
        if notice:
            _warn_once(notice)


@functools.cache
def _warn_once(message: str) -> None:
    """A kernel build's notice, once a process (speculate loads two models)."""
    from cli.render import warn

    warn(message)


def prepare_grammar(lm: LoadedModel, settings: GenerationSettings) -> None:
    """Compile the settings' grammar now (or read it from the cache), so that a slow
    compile is announced: a spinner on a terminal, one line elsewhere, from half a
    second on. Generation then finds it compiled."""
    from cli.render import compiling
    from genlib.sampling import grammar

    if grammar.kind_of(settings) is None:
        return
    with compiling() as notify:
        grammar.compile_for(lm.tokenizer, lm.vocab_size, lm.eos_ids, settings, notify)


MAX_STDIN_BYTES = 64 << 20  # far beyond any model's context; more is a mistaken pipe


def read_prompt(prompt: str | None) -> str:
    """The prompt argument, or stdin for `-` / no argument with piped input; either must
    be UTF-8 text."""
    if prompt is not None and prompt != "-":
        return text_of(prompt, "the prompt argument")
    if prompt is None and sys.stdin.isatty():
        raise fail("no prompt: pass one as an argument, pipe it on stdin, or use -i")
    data = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)
    if len(data) > MAX_STDIN_BYTES:
        raise fail(f"the prompt on stdin is larger than {MAX_STDIN_BYTES >> 20} MiB, far "
                   f"more than a model's context holds; send a shorter one")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"stdin is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                   f"{exc.start}); genlab reads prompts as UTF-8") from None
    # The line end `echo` or a Windows editor leaves (CRLF too), not the prompt's own.
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise fail("the prompt read from stdin is empty")
    return text


def text_of(text: str, what: str) -> str:
    """`text`, if it is valid Unicode: arguments that were not UTF-8 bytes reach Python
    as lone surrogates, which no tokenizer takes."""
    from genlib.jsonl import first_surrogate

    bad = first_surrogate(text)
    if bad is not None:
        raise fail(f"{what} is not valid UTF-8 text (character {bad[0] + 1}); genlab "
                   f"reads text as UTF-8")
    return text


def chat_messages(prompt: str, flags: PromptFlags) -> list[dict[str, str]] | None:
    """The messages --chat applies the chat template to, a --system message first (the
    documents' `messages`); None without --chat."""
    if not flags.chat:
        return None
    return ([{"role": "system", "content": flags.system}] if flags.system else []) + \
        [{"role": "user", "content": prompt}]


def encode_prompt(lm: LoadedModel, prompt: str, flags: PromptFlags,
                  max_new_tokens: int) -> list[int]:
    """The prompt's token ids: through the chat template with --chat, cut to its last
    tokens with --truncate-prompt, refused when it cannot fit."""
    chat, system, truncate = flags.chat, flags.system, flags.truncate
    if chat:
        if system:
            text_of(system, "--system")
        ids = lm.encode_chat(chat_messages(prompt, flags) or [])
    else:
        if system:
            raise fail("--system needs --chat")
        if not truncate:  # a prompt that cannot fit is refused before tokenizing it
            lm.check_prompt_chars(prompt, max_new_tokens)
        ids = lm.encode(prompt)
    if truncate and lm.max_positions is not None:
        lm.check_room(max_new_tokens)
        kept = keep_last_tokens(lm, ids, lm.max_positions - max_new_tokens)
        if len(kept) < len(ids):
            from cli import render

            render.info(f"--truncate-prompt: kept the prompt's last {len(kept)} of its "
                        f"{len(ids)} tokens, so that it and {max_new_tokens} new tokens "
                        f"fit the model's {lm.max_positions} positions")
        ids = kept
    return ids


def keep_last_tokens(lm: LoadedModel, ids: list[int], room: int) -> list[int]:
    """--truncate-prompt: the prompt's last `room` tokens, a leading BOS kept in front;
    the prompt as it is when it fits, or when no prompt could (room < 1: the length
    check that follows names the limit)."""
    if room < 1 or len(ids) <= room:
        return ids
    if lm.tokenizer.bos_token_id == ids[0]:
        return ids[:1] + ids[len(ids) - room + 1:]
    return ids[len(ids) - room:]


@contextmanager
def loading(ref: str) -> Iterator[None]:
    """A "loading MODEL" spinner on stderr while a model loads (seconds), where stderr
    is a terminal; nothing in pipes and logs."""
    from cli.render import err

    if not err.is_terminal:
        yield
        return
    from rich.errors import LiveError
    from rich.markup import escape

    status = err.status(f"loading {escape(ref)}", spinner="dots")
    try:
        status.start()
    except LiveError:  # Rich before 14 draws one live display at a time (bench's bar)
        yield
        return
    try:
        yield
    finally:
        status.stop()


def load_scorer(flags: ModelFlags, settings: GenerationSettings) -> LoadedModel | None:
    """The model a `--rerank MODEL` scores with, loaded as the generating model is (device,
    dtype); None for logprob, mbr or no rerank. An unknown rerank name fails here, before
    any model loads."""
    from dataclasses import replace

    from genlib.decoding.rerank import method_kind

    if settings.rerank is None or method_kind(settings.rerank) != "model":
        return None
    return load(replace(flags, model=settings.rerank, quantize="none", backend="auto"),
                quick=False)  # it scores with transformers' forward
