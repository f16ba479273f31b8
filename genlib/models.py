"""Load a causal language model and its tokenizer: hub id or local folder, device,
dtype and bitsandbytes quantization. Every failure a user can cause becomes a
`ModelLoadError` whose message says how to fix it.
"""

from __future__ import annotations

import logging as std_logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genlib.errors import ChatTemplateError, ContextLengthError, ModelLoadError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "8bit", "4bit")
ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_MODEL = ASSETS / "code-small"
DEFAULT_DRAFT = ASSETS / "code-tiny"
# The models shipped inside the package, by the name users give and see (a site-packages
# path in banners and JSON says nothing and differs between installs).
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = {"builtin:code-small": DEFAULT_MODEL, "builtin:code-tiny": DEFAULT_DRAFT}
DEFAULT_MODEL_NAME = "builtin:code-small"
DEFAULT_DRAFT_NAME = "builtin:code-tiny"
HUB_PROBE_TIMEOUT_S = 2.0  # one request; huggingface_hub itself retries for ~30 s offline


@dataclass(frozen=True)
class ModelSpec:
    """What to load. `ref` is a hub id or a local folder."""

    ref: str
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"
    trust_remote_code: bool = False


@dataclass
class LoadedModel:
    """A model ready for genlib's decode loop, with the facts the loop needs.

    `model` is the transformers model. A model loaded by genlib.quickload has none yet
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
    lean: Any = None  # a LeanLlama built without transformers (genlib.quickload)
    deferred: Callable[[], Any] | None = field(default=None, repr=False, compare=False)

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
    def vocab_size(self) -> int:
        if self.lean is not None:
            return int(self.lean.lm_head.w.shape[1])
        return int(self.model.get_output_embeddings().weight.shape[0])

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a plain prompt, with the tokenizer's own special tokens (BOS)."""
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(f"{self.ref} has no chat template, so --chat cannot be "
                                    f"used; drop --chat to give the prompt as plain text")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def check_fits(self, prompt_len: int, max_new_tokens: int, *, whose: str = "the model's",
                   remedy: str = "shorten the prompt (generate --truncate-prompt keeps its "
                                 "last tokens)") -> None:
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


def resolve_model_ref(flag: str | None, preset_model: str | None = None) -> str:
    """Which model to use: --model > the preset's model > $GENLAB_MODEL > built-in default."""
    for ref in (flag, preset_model, os.environ.get("GENLAB_MODEL")):
        if ref:
            return display_name(ref)
    return DEFAULT_MODEL_NAME


def display_name(ref: str) -> str:
    """How a model is shown: `builtin:NAME` for a built-in model (given by name or by
    its folder), else the reference as given."""
    if ref.startswith(BUILTIN_PREFIX) or not _is_local_ref(ref):
        return ref
    try:
        path = Path(ref).expanduser().resolve()
    except OSError:
        return ref
    return next((name for name, folder in BUILTIN_MODELS.items() if folder.resolve() == path),
                ref)


def model_source(ref: str) -> str:
    """Where to load `ref` from: a built-in model's folder, a local folder with `~`
    expanded, or the hub id itself."""
    if ref.startswith(BUILTIN_PREFIX):
        if ref not in BUILTIN_MODELS:
            raise ModelLoadError(f"unknown built-in model {ref!r}; the built-in models are "
                                 f"{', '.join(BUILTIN_MODELS)}")
        return str(BUILTIN_MODELS[ref])
    return str(Path(ref).expanduser()) if _is_local_ref(ref) else ref


def _is_local_ref(ref: str) -> bool:
    return (ref.startswith(BUILTIN_PREFIX) or os.path.exists(ref)
            or ref.startswith((".", "/", "~")) or "\\" in ref or ref.count("/") > 1)


def pick_device(name: str) -> torch.device:
    import torch

    if name not in DEVICES:
        raise ModelLoadError(f"unknown device {name!r}; use one of {', '.join(DEVICES)}")
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
        raise ModelLoadError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
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


def _quantization_config(quantize: str, device: torch.device) -> Any:
    if quantize not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantize!r}; use one of "
                             f"{', '.join(QUANTIZATIONS)}")
    if quantize == "none":
        return None
    if device.type == "mps":
        raise ModelLoadError("bitsandbytes quantization does not run on MPS; use --device cpu "
                             "or --quantize none")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError(f"--quantize {quantize} needs bitsandbytes ({exc}); "
                             f"pip install bitsandbytes") from None
    import torch
    from transformers import BitsAndBytesConfig

    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    # NF4 with double quantization and a bfloat16 compute dtype (seed notes, 4-bit).
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def _check_quantizable(config: Any, quantize: str, device: torch.device,
                       trust_remote_code: bool) -> None:
    """bitsandbytes' CPU 4-bit kernels need every quantized linear layer's widths divisible
    by 32: check the architecture (built on the meta device, no weights) before loading."""
    if quantize != "4bit" or device.type != "cpu":
        return
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    output = skeleton.get_output_embeddings()
    bad = [f"{name} ({m.in_features}x{m.out_features})"
           for name, m in skeleton.named_modules()
           if isinstance(m, torch.nn.Linear) and m is not output
           and (m.in_features % 32 or m.out_features % 32)]
    if bad:
        more = f" and {len(bad) - 2} more" if len(bad) > 2 else ""
        raise ModelLoadError(f"--quantize 4bit on CPU needs layer widths divisible by 32, but "
                             f"this model has {', '.join(bad[:2])}{more}; use --quantize 8bit "
                             f"or none")


def hub_files_only(ref: str) -> bool:
    """Whether a hub id must load from the local cache alone: the hub cannot be reached
    (one request, HUB_PROBE_TIMEOUT_S) and the model is cached. ModelLoadError at once
    when it is reachable by neither, instead of huggingface_hub's half-minute of retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or _hub_reachable():
        return False
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(ref, "config.json"), str):
        return True
    raise ModelLoadError(f"cannot reach the Hugging Face hub ({constants.ENDPOINT}) to fetch "
                         f"{ref}; set HF_HUB_OFFLINE=1 to use the local cache, or give a "
                         f"local folder with --model")


def _hub_reachable() -> bool:
    """One request to the hub with a short timeout (proxies in the environment apply)."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    request = urllib.request.Request(constants.ENDPOINT, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True  # an answer, even an error status, means the hub is there
    except (OSError, ValueError):  # URLError, timeouts, refused connections
        return False


def _load_config(ref: str, spec: ModelSpec, files_only: bool = False) -> Any:
    from transformers import AutoConfig

    local = _is_local_ref(ref)
    if local:
        path = Path(ref).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model folder {ref} does not exist; give a local folder in "
                                 f"Hugging Face layout or a hub id like 'org/name'")
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelLoadError(f"{ref} is not a Hugging Face model folder (no config.json); "
                                 f"point --model at the folder holding config.json")
    try:
        return AutoConfig.from_pretrained(ref if not local else str(Path(ref).expanduser()),
                                          trust_remote_code=spec.trust_remote_code,
                                          local_files_only=files_only)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(_hub_message(ref, exc)) from None


def _hub_message(ref: str, exc: Exception) -> str:
    from huggingface_hub import constants

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "trust_remote_code" in str(exc):
        return (f"{ref} needs custom code from the hub; pass --trust-remote-code if you "
                f"trust it")
    if constants.HF_HUB_OFFLINE:
        return (f"{ref} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                f"download it once with network access, or give a local folder")
    return (f"cannot load {ref!r}: not a local folder, and the hub gave no model ({text}); "
            f"check the id, your network, or set HF_HUB_OFFLINE=1 to use the cache only")


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


def load_model(spec: ModelSpec, quick: bool = False) -> LoadedModel:
    """Load model and tokenizer for genlib's decode loop (eval mode, on the device).

    `quick`: a local Llama-style checkpoint that qualifies is loaded without transformers
    (genlib.quickload: a second and a half faster to start), transformers' model and
    tokenizer following on first use of anything the lean path does not provide."""
    ref = model_source(spec.ref)
    # Before importing torch and transformers (seconds): an unreachable hub fails at once.
    files_only = not _is_local_ref(spec.ref) and hub_files_only(ref)
    device = pick_device(spec.device)
    spec = replace(spec, ref=display_name(spec.ref))
    if quick and _is_local_ref(spec.ref) and Path(ref).is_dir():
        from genlib.quickload import quick_load

        lm = quick_load(spec, ref, device)
        if lm is not None:
            return lm
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    config = _load_config(ref, spec, files_only)
    quant = _quantization_config(spec.quantize, device)
    _check_quantizable(config, spec.quantize, device, spec.trust_remote_code)
    dtype = torch.bfloat16 if spec.quantize == "4bit" and spec.dtype == "auto" else \
        pick_dtype(spec.dtype, device)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": spec.trust_remote_code,
                              "local_files_only": files_only}
    if quant is not None:
        kwargs["quantization_config"] = quant
        if device.type != "cpu":
            kwargs["device_map"] = {"": str(device)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=spec.trust_remote_code,
                                                  local_files_only=files_only)
        model = AutoModelForCausalLM.from_pretrained(ref, **kwargs)
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if spec.quantize != "none":
            raise ModelLoadError(f"--quantize {spec.quantize} failed for {spec.ref}: {first}; "
                                 f"try --quantize none") from None
        if isinstance(exc, OSError):
            raise ModelLoadError(_hub_message(spec.ref, exc)) from None
        raise ModelLoadError(f"cannot load {spec.ref}: {first}") from None
    if quant is None:
        model.to(device)
    model.eval()
    return LoadedModel(
        model=model, tokenizer=tokenizer, ref=spec.ref, device=device, dtype=dtype,
        eos_ids=eos_ids_of(model, tokenizer),
        pad_id=pad_id_of(model, tokenizer),
        max_positions=max_positions_of(config), quantize=spec.quantize,
    )


def wrap_model(model: Any, tokenizer: Any, ref: str = "<in memory>") -> LoadedModel:
    """A LoadedModel around objects already in memory (tests, notebooks)."""
    import torch

    model.eval()
    param = next(model.parameters())
    return LoadedModel(model=model, tokenizer=tokenizer, ref=ref, device=param.device,
                       dtype=param.dtype if param.is_floating_point() else torch.float32,
                       eos_ids=eos_ids_of(model, tokenizer), pad_id=pad_id_of(model, tokenizer),
                       max_positions=max_positions_of(model.config))


def pad_id_of(model: Any, tokenizer: Any) -> int:
    """A token id to fill padded positions with; the attention mask hides it, so any
    valid id works when the model defines no pad token."""
    for value in (tokenizer.pad_token_id, getattr(model.generation_config, "pad_token_id", None),
                  model.config.pad_token_id if hasattr(model.config, "pad_token_id") else None):
        if isinstance(value, int):
            return value
    eos = eos_ids_of(model, tokenizer)
    return eos[0] if eos else 0
