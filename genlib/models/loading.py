"""Load a causal language model and its tokenizer: hub id or local folder, device,
dtype and bitsandbytes quantization. Every failure a user can cause becomes a
`ModelLoadError` whose message says how to fix it.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genlib.errors import ModelLoadError, not_one_of
from genlib.models import checkpoint
from genlib.models.info import (  # noqa: F401  (LoadedModel, ModelSpec: the loading API's types)
    DEVICES,
    DTYPES,
    LoadedModel,
    ModelSpec,
    eos_ids_of,
    max_positions_of,
    pad_id_of,
    pick_device,
    pick_dtype,
    quiet_transformers,
)

if TYPE_CHECKING:
    import torch

    from genlib.models.qformat import Stored

# 8bit and 4bit: the native kernel's q8_0 and 4-bit format on a CPU, else bitsandbytes'
# (genlib.backends.choose.native_quantization); q8_0, nf4, q4_0: the native kernel's.
QUANTIZATIONS = ("none", "8bit", "4bit", "q8_0", "nf4", "q4_0")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL = ASSETS / "code-small"
DEFAULT_DRAFT = ASSETS / "code-tiny"
# The models shipped inside the package, by the name users give and see (a site-packages
# path in banners and JSON says nothing and differs between installs).
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = {"builtin:code-small": DEFAULT_MODEL, "builtin:code-tiny": DEFAULT_DRAFT}
DEFAULT_MODEL_NAME = "builtin:code-small"
DEFAULT_DRAFT_NAME = "builtin:code-tiny"
HUB_PROBE_TIMEOUT_S = 2.0  # one request; huggingface_hub itself retries for ~30 s offline
# What loading a model raises for a model that cannot load as asked.
LOAD_ERRORS = (OSError, ValueError, ImportError, RuntimeError, KeyError)


def resolve_model_ref(flag: str | None, preset_model: str | None = None) -> str:
    """Which model to use: --model > the preset's model > $GENLAB_MODEL > built-in default."""
    if flag is not None and not flag.strip():
        raise ModelLoadError("--model is empty; give a model folder or hub id, or leave "
                             "--model out for the default model")
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
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop, before Python 3.13
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
    # As given, `~` expanded: Path() would drop a leading `./`, and a folder that does
    # not exist would then read as a hub id.
    if _is_local_ref(ref):
        folder = os.path.expanduser(ref)
        if folder.startswith("~"):
            raise ModelLoadError(f"model folder {ref} names a user this machine does not "
                                 f"know; give the folder's full path")
        return folder
    _check_hub_id(ref)
    return ref


def _check_hub_id(ref: str) -> None:
    """ModelLoadError for a name that is neither a local folder nor a possible hub id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError:
        raise ModelLoadError(
            f"{ref!r} is neither a local folder nor a hub id (letters, digits, '-', '_' "
            f"and '.', 'org/name', at most 96 characters); give a local folder in Hugging "
            f"Face layout or a hub id like 'org/name'") from None


def _is_local_ref(ref: str) -> bool:
    return (ref.startswith(BUILTIN_PREFIX) or os.path.exists(ref)
            or ref.startswith((".", "/", "~")) or "\\" in ref or ref.count("/") > 1)


def _quantization_config(quantize: str, device: torch.device) -> Any:
    if quantize not in QUANTIZATIONS:
        raise ModelLoadError(not_one_of("--quantize", quantize, QUANTIZATIONS))
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

    skeleton = checkpoint.skeleton(config, trust_remote_code)
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
                         f"local folder in its place")


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
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    local = _is_local_ref(ref)
    if local:
        checkpoint.check_folder(ref)
    try:
        config = AutoConfig.from_pretrained(ref if not local else str(Path(ref).expanduser()),
                                            trust_remote_code=spec.trust_remote_code,
                                            local_files_only=files_only)
    except StrictDataclassError as exc:  # a value of the wrong type, or values that clash
        raise ModelLoadError(f"cannot load {spec.ref}: config.json is invalid "
                             f"({_cause(exc)}); {checkpoint.FIX_CONFIG}") from None
    except ArithmeticError as exc:  # its own checks divide by a size of 0
        raise ModelLoadError(f"cannot load {spec.ref}: config.json is invalid "
                             f"({_zero_size(ref) or _first_line(exc)}); "
                             f"{checkpoint.FIX_CONFIG}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(_load_message(ref, exc)) from None
    checkpoint.check_sizes(spec.ref, config)
    return config


def _unknown_option(ref: str, exc: BaseException) -> str | None:
    """For a KeyError of transformers' tables (activations, rope types), the config.json
    key that names the unknown value, in words; None where it is not found there."""
    if not isinstance(exc, KeyError) or not exc.args or not isinstance(exc.args[0], str):
        return None
    try:
        raw = json.loads((Path(ref).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", raw)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{key}" if path else str(key), item)
                         for key, item in value.items())
        elif value == exc.args[0]:
            import transformers

            return (f"config.json sets {path} to {value!r}, which transformers "
                    f"{transformers.__version__} does not know")
    return None


def _zero_size(ref: str) -> str | None:
    """The first of a local config.json's sizes (`checkpoint.POSITIVE_FIELDS`, as the file
    names them) that is below 1, in words; None if none."""
    try:
        raw = json.loads((Path(ref).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    for name in checkpoint.POSITIVE_FIELDS:
        value = raw.get(name) if isinstance(raw, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            return f"it sets {name} to {value}, which must be at least 1"
    return None


def _cause(exc: BaseException) -> str:
    """The first line of what caused `exc` (huggingface_hub's validation errors put it
    on their second line), without a closing full stop."""
    return _first_line(exc.__cause__ or exc).rstrip(".")


def _load_message(ref: str, exc: BaseException) -> str:
    """Why `ref` did not load, in words that fit where it is: a local folder is never
    "not in the cache", and a model type transformers does not know is said as such."""
    text = _first_line(exc)
    model_type = _unknown_model_type(ref)
    if model_type is not None:
        import transformers

        return (f"{ref}: model type {model_type!r} is not an architecture transformers "
                f"{transformers.__version__} knows; use a supported model, or upgrade "
                f"transformers (or pass --trust-remote-code if the folder ships its code)")
    if "trust_remote_code" in str(exc):
        return (f"{ref} needs custom code from the hub; pass --trust-remote-code if you "
                f"trust it")
    if _is_local_ref(ref):
        return f"cannot load the model in {ref}: {text}"
    return _hub_message(ref, exc)


def _check_readable(name: str, folder: Path) -> None:
    """ModelLoadError for a model folder, or a file in it, that this user may not read
    (the loaders would say "unexpected", or that a file there does not exist)."""
    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"cannot read {what} (permission denied); give yourself read "
                              f"access (chmod -R u+rX {name})")

    try:
        entries = list(folder.iterdir())
    except PermissionError:
        raise refuse(f"model folder {name}") from None
    for path in entries:
        try:
            if path.is_file():
                with open(path, "rb"):
                    pass
        except PermissionError:
            raise refuse(f"{path.name} in model folder {name}") from None
        except OSError:
            pass  # the loaders say what else is wrong with it


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unknown_model_type(ref: str) -> str | None:
    """The `model_type` of a local folder's config.json when transformers lacks it."""
    config = Path(ref).expanduser() / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(model_type, str):
        return None
    from transformers import CONFIG_MAPPING

    return None if model_type in CONFIG_MAPPING else model_type


def _hub_message(ref: str, exc: BaseException) -> str:
    from huggingface_hub import constants

    text = _first_line(exc)
    if "trust_remote_code" in str(exc):
        return (f"{ref} needs custom code from the hub; pass --trust-remote-code if you "
                f"trust it")
    if constants.HF_HUB_OFFLINE:
        return (f"{ref} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                f"download it once with network access, or give a local folder")
    return (f"cannot load {ref!r}: not a local folder, and the hub gave no model ({text}); "
            f"check the id, your network, or set HF_HUB_OFFLINE=1 to use the cache only")


def _load_tokenizer(ref: str, spec: ModelSpec, files_only: bool) -> Any:
    """AutoTokenizer's tokenizer for the model; in a local folder, a ModelLoadError that
    names the tokenizer file at fault."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=spec.trust_remote_code,
                                                  local_files_only=files_only)
    except Exception as exc:
        error = _tokenizer_error(spec.ref, ref, exc)
        if error is None:
            raise
        raise error from None
    if _is_local_ref(spec.ref) and len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        # transformers builds an empty tokenizer where the vocabulary file is missing
        problem = checkpoint.tokenizer_files_problem(Path(ref)) or (
            "its tokenizer has no vocabulary beyond its special tokens; restore "
            "tokenizer.json from the model's source")
        raise ModelLoadError(f"cannot load {spec.ref}: {problem}")
    return tokenizer


# transformers' words when it finds neither a fast tokenizer's file nor a slow one to convert
NO_TOKENIZER_FILE = "Couldn't instantiate the backend tokenizer"


def _tokenizer_error(name: str, source: str, exc: Exception) -> ModelLoadError | None:
    """The ModelLoadError for a tokenizer that did not load (None: a fault of genlab's).
    Any failure to read a local folder's tokenizer files is the files' fault."""
    local = _is_local_ref(name)
    problem = checkpoint.tokenizer_files_problem(Path(source)) if local else None
    if problem is not None:
        return ModelLoadError(f"cannot load {name}: {problem}")
    if isinstance(exc, OSError) or "trust_remote_code" in str(exc):
        return ModelLoadError(_load_message(name, exc))
    if isinstance(exc, ImportError) or "pip install" in str(exc):  # a library, not the files
        return ModelLoadError(f"cannot load the tokenizer of {name}: {_first_line(exc)}")
    if not local and NO_TOKENIZER_FILE in str(exc):  # a snapshot cached in part, say
        return ModelLoadError(
            f"cannot load the tokenizer of {name}: its files have no tokenizer.json, nor a "
            f"slow tokenizer this install can convert (that needs sentencepiece or "
            f"tiktoken); download the model again in full, or give a local folder")
    if local:
        return ModelLoadError(f"cannot load the tokenizer of {name} ({_first_line(exc)}); "
                              f"restore its tokenizer files (tokenizer.json, "
                              f"tokenizer_config.json) from the model's source")
    if isinstance(exc, LOAD_ERRORS):
        return ModelLoadError(f"cannot load {name}: {_first_line(exc)}")
    return None


def _load_weights(ref: str, spec: ModelSpec, kwargs: dict[str, Any]) -> Any:
    """transformers' model from `ref`, its failures as ModelLoadErrors; and weights that
    lack a tensor the model needs (which transformers fills with random values, a model
    that runs and writes nonsense) too."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(ref, output_loading_info=True,
                                                           **kwargs)
    except LOAD_ERRORS as exc:
        first = _first_line(exc)
        if spec.quantize != "none":
            raise ModelLoadError(f"--quantize {spec.quantize} failed for {spec.ref}: {first}; "
                                 f"try --quantize none") from None
        if isinstance(exc, OSError):
            raise ModelLoadError(_load_message(spec.ref, exc)) from None
        unknown = _unknown_option(ref, exc)
        if unknown is not None:
            raise ModelLoadError(f"cannot load {spec.ref}: {unknown}; "
                                 f"{checkpoint.FIX_CONFIG}") from None
        raise ModelLoadError(f"cannot load {spec.ref}: {first}") from None
    except pickle.UnpicklingError:  # torch.load's weights_only refusal: its advice is unsafe
        raise ModelLoadError(f"the .bin weights of {spec.ref} are not plain tensors: the "
                             f"pickle holds other Python objects (which genlab never runs) "
                             f"or is damaged; use the model's safetensors weights, or "
                             f"download it again from a source you trust") from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "safetensors":
            raise
        raise ModelLoadError(f"the weights of {spec.ref} cannot be read ({_first_line(exc)}); "
                             f"the file is damaged or incomplete: copy or download it "
                             f"again") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        unexpected = sorted(info.get("unexpected_keys") or ())
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        beside = f", and hold {unexpected[0]}, which it has no place for" if unexpected else ""
        raise ModelLoadError(
            f"cannot load {spec.ref}: config.json does not match the weights (they lack "
            f"{missing[0]}{more}, which config.json's model needs{beside}); fix config.json "
            f"or use the folder the weights came from")
    return model


def load_model(spec: ModelSpec, quick: bool = False) -> LoadedModel:
    """Load model and tokenizer for genlib's decode loop (eval mode, on the device).

    `quick`: a local Llama-style checkpoint that qualifies is loaded without transformers
    (genlib.models.quickload: no import of transformers' model modules), transformers' model and
    tokenizer following on first use of anything the lean path does not provide."""
    ref = model_source(spec.ref)
    # Before importing torch and transformers (seconds): an unreachable hub fails at once.
    files_only = not _is_local_ref(spec.ref) and hub_files_only(ref)
    device = pick_device(spec.device)
    spec = replace(spec, ref=display_name(spec.ref))
    if spec.quantize not in QUANTIZATIONS:
        raise ModelLoadError(not_one_of("--quantize", spec.quantize, QUANTIZATIONS))
    local_folder = _is_local_ref(spec.ref) and Path(ref).is_dir()
    if local_folder:
        _check_readable(spec.ref, Path(ref))
    stored = _stored_checkpoint(ref, spec) if local_folder else None
    if quick and local_folder:
        from genlib.models.quickload import quick_load

        lm = quick_load(spec, ref, device, lambda: load_model(spec).model, stored)
        if lm is not None:
            return _with_files(lm, ref, stored)
    import torch

    quiet_transformers()
    config = _load_config(ref, spec, files_only)
    if _is_local_ref(spec.ref) and stored is None:
        checkpoint.check_weights(spec.ref, Path(ref), config, spec.trust_remote_code)
    native = _native_format(spec, device, config)
    if native is not None:  # the native kernel quantizes the float32 model it packs
        spec = replace(spec, dtype="float32")
    quant = None if native is not None else _quantization_config(spec.quantize, device)
    if quant is not None:
        _check_quantizable(config, spec.quantize, device, spec.trust_remote_code)
    dtype = torch.bfloat16 if quant is not None and spec.quantize == "4bit" \
        and spec.dtype == "auto" else \
        pick_dtype(spec.dtype, device)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": spec.trust_remote_code,
                              "local_files_only": files_only}
    if quant is not None:
        kwargs["quantization_config"] = quant
        if device.type != "cpu":
            kwargs["device_map"] = {"": str(device)}
    tokenizer = _load_tokenizer(ref, spec, files_only)
    model = _load_weights(ref, spec, kwargs) if stored is None else \
        _load_dequantized(stored, spec, config, dtype)
    if quant is None:
        model.to(device)
    model.eval()
    lm = LoadedModel(
        model=model, tokenizer=tokenizer, ref=spec.ref, device=device, dtype=dtype,
        eos_ids=eos_ids_of(model, tokenizer),
        pad_id=pad_id_of(model, tokenizer),
        max_positions=max_positions_of(config), quantize=spec.quantize,
        weights=native)
    return _with_files(lm, ref, stored) if local_folder else lm


def _stored_checkpoint(ref: str, spec: ModelSpec) -> Stored | None:
    """The folder's genlab quantized checkpoint (genlib.models.qformat), checked, or None; a
    ModelLoadError for a broken one, or for --quantize on one."""
    from genlib.models import qformat

    stored = qformat.open_folder(ref)
    if stored is not None and spec.quantize != "none":
        raise ModelLoadError(f"{spec.ref} is stored quantized already ({stored.format}); "
                             f"drop --quantize {spec.quantize}")
    return stored


def _with_files(lm: LoadedModel, folder: str, stored: Stored | None) -> LoadedModel:
    """`lm` with what its folder's files hold: their format and bytes, the checkpoint."""
    from genlib.models import qformat

    lm.storage, lm.disk_bytes = qformat.describe_folder(folder)
    lm.stored = stored
    return lm


def _load_dequantized(stored: Stored, spec: ModelSpec, config: Any, dtype: torch.dtype
                      ) -> Any:
    """transformers' model of a genlab quantized checkpoint, over its dequantized float
    weights: transformers does not know the format, and would read the codes raw."""
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a float model now: no quantizer to look for
    model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                             trust_remote_code=spec.trust_remote_code)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    try:
        missing, unexpected = model.load_state_dict(stored.state_dict(dtype), strict=False)
    except RuntimeError as exc:  # a shape that is not the config's
        raise ModelLoadError(f"cannot load {spec.ref}: its weights do not fit config.json "
                             f"({_first_line(exc)}); {checkpoint.FIX_CONFIG}") from None
    if set(missing) - tied or unexpected:
        names = sorted(set(missing) - tied) or sorted(unexpected)
        raise ModelLoadError(f"cannot load {spec.ref}: its weights do not fit config.json "
                             f"({'missing' if set(missing) - tied else 'unexpected'} "
                             f"{names[0]}); {checkpoint.FIX_CONFIG}")
    if (stored.folder / "generation_config.json").is_file():  # as from_pretrained reads it
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(stored.folder)
    return model


def _native_format(spec: ModelSpec, device: torch.device, config: Any) -> str | None:
    """The native kernel's format that runs spec.quantize (None: bitsandbytes does);
    its refusal as a ModelLoadError."""
    from genlib.backends.choose import native_quantization
    from genlib.backends.llama import eligible_config
    from genlib.errors import ConfigError

    try:
        return native_quantization(spec.quantize, device.type, spec.dtype, spec.backend,
                                   eligible_config(config))
    except ConfigError as error:
        raise ModelLoadError(str(error)) from None


def wrap_model(model: Any, tokenizer: Any, ref: str = "<in memory>") -> LoadedModel:
    """A LoadedModel around objects already in memory (tests, notebooks)."""
    import torch

    model.eval()
    param = next(model.parameters())
    return LoadedModel(model=model, tokenizer=tokenizer, ref=ref, device=param.device,
                       dtype=param.dtype if param.is_floating_point() else torch.float32,
                       eos_ids=eos_ids_of(model, tokenizer), pad_id=pad_id_of(model, tokenizer),
                       max_positions=max_positions_of(model.config))


def freeze_heap() -> None:
    """Take every object the process holds now out of the cycle collector's reach
    (`gc.freeze`): for a process that is genlab's alone (the CLI's, a Ray worker's), once
    its model has loaded. Loading leaves hundreds of thousands of tracked objects
    (modules, tokenizer, model); a full collection, which Python starts on its own,
    walks them all, and one that falls inside a decode stalls that step many times
    over. Frozen objects are still freed by reference counting, as a dropped model is.
    There is no collection first (vLLM, SGLang and Ray Serve run one): it would add a
    full walk to every start, to free the few objects it finds."""
    gc.freeze()
