"""What genlib knows about a loaded model: the request (`ModelSpec`), the loaded model
with the facts the decode loops need (`LoadedModel`: end ids, pad id, positions, device,
dtype), and how those facts are read from a model's configs. genlib.models.loading and
genlib.models.quickload both build `LoadedModel`s from here.
"""

from __future__ import annotations

import functools
import logging as std_logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from genlib.errors import (
    ChatRenderError,
    ChatTemplateError,
    ContextLengthError,
    ModelLoadError,
    not_one_of,
)

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelSpec:
    """What to load. `ref` is a hub id or a local folder."""

    ref: str
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"
    trust_remote_code: bool = False
    backend: str = "auto"  # genlib.backends.choose.BACKENDS


@dataclass
class LoadedModel:
    """A model ready for genlib's decode loop, with the facts the loop needs.

    `model` is the transformers model. A model loaded by genlib.models.quickload has none yet
    (`model=None` with `deferred` set): it decodes single rows through `lean`, and the
    first read of `model` loads the transformers model with `deferred()`."""

    model: Any = field(repr=False, compare=False)
    tokenizer: Any = field(repr=False, compare=False)
    ref: str
    device: torch.device
    dtype: torch.dtype
    eos_ids: tuple[int, ...]
    pad_id: int
    max_positions: int | None
    quantize: str = "none"
    # The native kernel's quantized format (genlib.backends.quant) where --quantize on a
    # CPU runs there (the model itself stays float32); None: the model's own weights.
    weights: str | None = None
    lean: Any = None  # a LeanLlama built without transformers (genlib.models.quickload)
    # A local folder's files: how they store the weights (a quantized checkpoint's format,
    # genlib.models.qformat, else the matrices' dtype) and their bytes; None for a hub model.
    storage: str | None = None
    disk_bytes: int | None = None
    stored: Any = None  # genlib.models.qformat.Stored: the folder is genlab's quantized checkpoint
    deferred: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    # The models combined with this one token by token (`genlib.sampling.combine.Partner`: an
    # ensemble's members, contrastive decoding's amateur); the settings say which runs.
    partners: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model is None and self.deferred is not None:
            del self.model  # so the first read of it reaches __getattr__

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes that are not set: `model` while it is deferred.
        deferred = self.__dict__.get("deferred")
        if name != "model" or deferred is None:
            raise AttributeError(name)
        self.model = deferred()
        return self.model

    def load_model_now(self) -> None:
        """Load a deferred transformers model now (a generation about to need it calls
        this before its clock starts, so its timings hold no model load)."""
        if not self.model_loaded:
            self.model  # noqa: B018 - the deferred load (__getattr__) sets it

    @property
    def model_loaded(self) -> bool:
        """Whether the transformers model is in memory."""
        return "model" in self.__dict__

    @property
    def dtype_name(self) -> str:
        """The dtype as a flag names it: float32, bfloat16, float16."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        if self.lean is not None:
            return int(self.lean.vocab)
        return int(self.model.get_output_embeddings().weight.shape[0])

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a plain prompt, with the tokenizer's own special tokens (BOS)."""
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(f"{self.ref} has no chat template, so --chat cannot be "
                                    f"used; drop --chat to give the prompt as plain text")
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
        except TemplateError as exc:
            reason = template_reason(exc)
            raise ChatRenderError(chat_refusal(self.ref, messages, reason), reason) from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def check_room(self, max_new_tokens: int) -> None:
        """ContextLengthError when max_new_tokens alone fills the model's positions: no
        prompt fits, however short or truncated."""
        if self.max_positions is not None and max_new_tokens >= self.max_positions:
            raise ContextLengthError(
                f"max_new_tokens ({max_new_tokens}) leaves no room for the prompt in the "
                f"model's {self.max_positions} positions; lower it so that the prompt's "
                f"tokens and it fit in {self.max_positions}")

    def check_prompt_chars(self, text: str, max_new_tokens: int) -> None:
        """ContextLengthError, before tokenizing, for a prompt too long to fit however it
        tokenizes: no token stands for more than the vocabulary's longest token string
        (x4, for normalizers that merge characters), so a prompt needs at least
        len(text) / that many tokens. Tokenizing megabytes would take minutes first."""
        if self.max_positions is None:
            return
        self.check_room(max_new_tokens)
        room = self.max_positions - max_new_tokens
        most = room * self.longest_token * 4
        if len(text) > most:
            raise ContextLengthError(
                f"the prompt ({len(text):,} characters) cannot fit in the model's "
                f"{self.max_positions} positions with max_new_tokens {max_new_tokens} "
                f"(at most {most:,} characters could); shorten it")

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters in the vocabulary's longest token string (at least 1)."""
        try:
            vocab = self.tokenizer.get_vocab()
        except (AttributeError, NotImplementedError):
            return 64  # no vocabulary to read: a bound longer than real tokens
        return max((len(t) for t in vocab), default=1) or 1

    def check_token_ids(self, ids: list[int] | tuple[int, ...]) -> None:
        """ModelLoadError for a prompt id the model has no embedding for: a tokenizer
        larger than the model's vocabulary (a model folder holding another model's
        tokenizer), which would otherwise fail inside the forward."""
        bad = max(ids, default=0)
        if bad >= self.vocab_size:
            raise ModelLoadError(
                f"the prompt holds token id {bad}, but {self.ref} has only "
                f"{self.vocab_size} embeddings (ids 0-{self.vocab_size - 1}): its tokenizer "
                f"({len(self.tokenizer)} tokens) is not the model's; use the tokenizer "
                f"files the model was trained with")

    def check_fits(self, prompt_len: int, max_new_tokens: int, *, whose: str = "the model's",
                   remedy: str = "shorten the prompt (generate, beam, speculate and explain "
                                 "take --truncate-prompt, which keeps its last tokens)") -> None:
        """ContextLengthError unless prompt + new tokens fit in the model's positions,
        naming the model (`whose`) and what else to change (`remedy`, for a draft model:
        another draft)."""
        limit = self.max_positions
        if limit is None or prompt_len + max_new_tokens <= limit:
            return
        if prompt_len >= limit:
            raise ContextLengthError(
                f"the prompt alone ({prompt_len} tokens) fills {whose} {limit} positions; "
                f"{remedy}")
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"{whose} {limit} positions; lower max_new_tokens to {limit - prompt_len} or "
            f"{remedy}")


def template_reason(exc: Exception) -> str:
    """A chat template's error (its own `raise_exception` text, or a template that does
    not render) in one line, as every error message."""
    said = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return " ".join(said.split()).rstrip(".")


def chat_refusal(ref: str, messages: list[dict[str, str]], reason: str) -> str:
    """What a chat template's refusal means for a user of --chat, and what to change."""
    if any(m.get("role") == "system" for m in messages):
        remedy = "drop the system message (--system) and put its text in the prompt"
    else:
        remedy = "drop --chat to give the prompt as plain text"
    return f"the chat template of {ref} cannot render this conversation ({reason}); {remedy}"


def pick_device(name: str) -> torch.device:
    import torch

    if name not in DEVICES:
        raise ModelLoadError(not_one_of("--device", name, DEVICES))
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: no CUDA GPU is available here; use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("--device mps: Apple MPS is not available here; use --device cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (exact, and fastest for small models here), bfloat16 on a GPU
    that supports it, else float16. An explicit dtype is probed on the device first."""
    import torch

    if name not in DTYPES:
        raise ModelLoadError(not_one_of("--dtype", name, DTYPES))
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device.type == "mps" else torch.float32
    dtype = getattr(torch, name)
    try:
        probe = torch.ones(2, 2, dtype=dtype, device=device)
        (probe @ probe).sum().item()
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"--dtype {name} is not supported on {device.type} ({exc}); "
                             f"use --dtype float32") from None
    return dtype


def eos_ids_of(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every end id: generation_config's (it can be a list), else config's, else tokenizer's."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids = [value] if isinstance(value, int) else list(value)
            break
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return tuple(dict.fromkeys(int(i) for i in ids))


def max_positions_of(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def quiet_transformers() -> None:
    """No loading progress bars or advice on the user's terminal: genlab reports itself."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    # bitsandbytes on CPU announces optional kernels and fp16 casts it falls back from.
    std_logging.getLogger("bitsandbytes").setLevel(std_logging.ERROR)
    warnings.filterwarnings("ignore", message=".*inputs will be cast from.*")


def pad_id_of(model: Any, tokenizer: Any) -> int:
    """A token id to fill padded positions with; the attention mask hides it, so any
    valid id works when the model defines no pad token."""
    for value in (tokenizer.pad_token_id, getattr(model.generation_config, "pad_token_id", None),
                  model.config.pad_token_id if hasattr(model.config, "pad_token_id") else None):
        if isinstance(value, int):
            return value
    eos = eos_ids_of(model, tokenizer)
    return eos[0] if eos else 0
