"""A fast start for Llama checkpoints in a local folder: the weights straight from
`model.safetensors` into the lean forward (genlib/backends/llama.py), and the tokenizer through
transformers' own tokenizer class imported directly, without importing transformers'
config and model modules or AutoTokenizer's config lookup (that import chain costs more
than everything else `genlab generate` does for a small model).

    lm = quick_load(spec, folder, device, full)  # None when the checkpoint does not qualify

Only what is known to load exactly as transformers loads it qualifies: a plain `llama`
config (`lean.eligible_config`) holding only keys in CONFIG_KEYS, each of a type and
range LlamaConfig accepts; one unsharded safetensors file holding exactly the tensors the
config implies; a CPU device, no quantization but the native kernel's (`--quantize` on a
CPU: the model loads in float32), no adapter; and a tokenizer config that
AutoTokenizer would resolve to `LlamaTokenizer` or `TokenizersBackend` without remote
code. Anything else (or any error on the way) returns None and the caller loads the model
through transformers, which also reports whatever is wrong with the checkpoint.
The transformers model follows on the first read of `LoadedModel.model` (batches, beam
search, ...), so every feature keeps working, and exactly as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from fnmatch import fnmatch
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from genlib.models.info import LoadedModel, ModelSpec
    from genlib.models.qformat import Stored

WEIGHTS = "model.safetensors"
TOKENIZER_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast", "TokenizersBackend",
                     "PreTrainedTokenizerFast")
# LlamaConfig's defaults for the fields genlab reads and a config.json may leave out.
LLAMA_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
                  "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                  "pretraining_tp": 1}
REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_attention_heads",
                 "num_hidden_layers", "max_position_embeddings", "vocab_size")
# Every config.json key the quick path knows transformers reads no further than it does;
# any other key (transformers_weights, model_name, adapters, sub-configs, ...) sends the
# checkpoint through transformers.
CONFIG_KEYS = {*LLAMA_DEFAULTS, *REQUIRED_INTS, "model_type", "architectures",
               "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
               "rope_parameters", "rope_theta", "rope_scaling", "attention_dropout",
               "initializer_range", "use_cache", "dtype", "torch_dtype",
               "transformers_version", "_name_or_path"}
DTYPE_NAMES = ("float32", "bfloat16", "float16")
MAX_ROTARY_ELEMENTS = 1 << 26  # the lean forward's cos/sin tables: positions x head_dim


def quick_load(spec: ModelSpec, folder: str, device: torch.device,
               full: Callable[[], Any], stored: Stored | None = None) -> LoadedModel | None:
    """The model in `folder` with a lean forward and transformers' tokenizer, or None
    when it does not qualify (see the module doc). `full()` loads the transformers
    model, on the first read of `LoadedModel.model`. `stored`: the folder is genlab's
    quantized checkpoint (genlib.models.qformat, checked): its matrices dequantize on first
    read, and the native kernel packs their codes as stored."""
    path = Path(folder)
    from genlib.backends.choose import lean_allowed, native_quantization
    from genlib.errors import ConfigError

    if not lean_allowed() or device.type != "cpu" or spec.trust_remote_code:
        return None
    try:  # a model this loads is Llama-style: the native kernel quantizes, or none does
        native = native_quantization(spec.quantize, device.type, spec.dtype, spec.backend,
                                     llama_style=True)
    except ConfigError:
        return None  # the full load says why
    if spec.quantize != "none" and native is None:
        return None  # bitsandbytes: transformers' load
    if native is not None:
        spec = replace(spec, dtype="float32")
    if (path / "adapter_config.json").exists():
        return None  # transformers would apply the adapter
    try:
        lm = _quick_load(spec, path, device, full, stored)
    except Exception:  # noqa: BLE001  (whatever it is, transformers' load reports it)
        return None
    if lm is not None:
        lm.weights = native
    return lm


def _quick_load(spec: ModelSpec, path: Path, device: torch.device, full: Callable[[], Any],
                stored: Stored | None) -> LoadedModel | None:
    from genlib.backends.llama import LeanLlama
    from genlib.models.info import LoadedModel, eos_ids_of, pad_id_of, pick_dtype

    config = stored.float_config if stored is not None else _read_json(path / "config.json")
    model_config = _model_config(config) if config is not None else None
    generation = _generation_config(path / "generation_config.json")
    if model_config is None or generation is None:
        return None
    dtype = pick_dtype(spec.dtype, device)
    tensors = _load_tensors(path / WEIGHTS, model_config, dtype) if stored is None else \
        _checked(stored, dtype, model_config)
    tokenizer = _tokenizer(path) if tensors is not None else None
    if tensors is None or tokenizer is None:
        return None
    lean = LeanLlama(model_config, tensors, _inv_freq(model_config))
    if stored is None:
        lean.weights_file = path / WEIGHTS  # the native kernel's packed copy is cached by it
    lean.stored = stored
    facts = SimpleNamespace(config=model_config, generation_config=SimpleNamespace(**generation))
    return LoadedModel(model=None, tokenizer=tokenizer, ref=spec.ref, device=device,
                       dtype=dtype, eos_ids=eos_ids_of(facts, tokenizer),
                       pad_id=pad_id_of(facts, tokenizer),
                       max_positions=model_config.max_position_embeddings,
                       quantize=spec.quantize, lean=lean,
                       deferred=full)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _generation_config(path: Path) -> dict[str, Any] | None:
    """generation_config.json's fields ({} without one), or None unless every value is
    plain and its end and pad ids are ids (transformers refuses or reads others)."""
    if not path.exists():
        return {}
    fields = _read_json(path)
    if fields is None or any(isinstance(v, dict) for v in fields.values()):
        return None
    ok = _token_ids(fields.get("eos_token_id")) and _token_id(fields.get("pad_token_id")) \
        and _token_id(fields.get("bos_token_id"))
    return fields if ok else None


def _tokenizer(path: Path) -> Any | None:
    """The tokenizer AutoTokenizer would load for a llama checkpoint in `path`, through
    the same class and `from_pretrained` (kept between starts by
    genlib.models.tokenizer_cache), or None when its choice would take more than the
    tokenizer config (remote code, other classes)."""
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    if tokenizer_config is None or "auto_map" in tokenizer_config:
        return None
    declared = tokenizer_config.get("tokenizer_class")
    if declared not in TOKENIZER_CLASSES or not (path / "tokenizer.json").is_file():
        return None
    from genlib.models.tokenizer_cache import cached_tokenizer

    return cached_tokenizer(path, partial(_transformers_tokenizer, path, declared))


def _transformers_tokenizer(path: Path, declared: str) -> Any | None:
    """transformers' tokenizer for `path`, whose tokenizer config declares `declared`."""
    from genlib.models.info import quiet_transformers

    quiet_transformers()
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    # AutoTokenizer's rules for a llama config: a declared LlamaTokenizer whose
    # tokenizer.json is byte-level, or a checkpoint on its list, gets TokenizersBackend.
    # The list is looked at last: importing it imports transformers' model registry.
    try:
        cls: Any = TokenizersBackend
        if declared.removesuffix("Fast") == "LlamaTokenizer" and \
                not TokenizersBackend._tokenizer_json_has_byte_level(str(path)) and \
                not _listed_for_tokenizers_backend(path):
            from transformers.models.llama.tokenization_llama import LlamaTokenizer

            cls = LlamaTokenizer
        return cls.from_pretrained(str(path))
    except Exception:  # noqa: BLE001  (any failure: transformers' own load explains it)
        return None


def _listed_for_tokenizers_backend(path: Path) -> bool:
    """Whether AutoTokenizer's list of checkpoints that need TokenizersBackend holds
    `path`."""
    from transformers.models.auto.tokenization_auto import MODEL_IDS_TO_TOKENIZERS_BACKEND

    return any(fnmatch(str(path).lower(), pattern)
               for pattern in MODEL_IDS_TO_TOKENIZERS_BACKEND)


def _model_config(config: dict[str, Any]) -> SimpleNamespace | None:
    """config.json as the LlamaConfig fields LeanLlama reads, or None unless it is a
    plain llama config that states them all validly (transformers' defaults applied only
    to the token ids and flags in LLAMA_DEFAULTS)."""
    from genlib.backends.llama import eligible_config

    if not set(config) <= CONFIG_KEYS or config.get("rope_scaling") is not None:
        return None
    fields = {**LLAMA_DEFAULTS, **config}
    for key in ("num_key_value_heads", "head_dim", "rope_parameters"):
        if fields.get(key) is None:
            fields.pop(key, None)  # None means "derive it", as LlamaConfig does
    if fields.get("model_type") != "llama":  # eligible_config checks the rest of the math
        return None
    architectures = fields.get("architectures") or ["LlamaForCausalLM"]
    if not isinstance(architectures, list) or len(architectures) != 1:
        return None
    if not all(_positive_int(fields.get(key)) for key in REQUIRED_INTS):
        return None
    if fields["hidden_size"] % fields["num_attention_heads"]:
        return None  # LlamaConfig refuses it; let transformers say so
    if not _plain_values(fields):
        return None
    rope = _default_rope(fields)
    if rope is None:
        return None
    fields["rope_parameters"] = rope
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    if not all(_positive_int(fields[key]) for key in ("num_key_value_heads", "head_dim")):
        return None
    if fields["num_attention_heads"] % fields["num_key_value_heads"] or fields["head_dim"] % 2:
        return None
    if fields["max_position_embeddings"] * fields["head_dim"] > MAX_ROTARY_ELEMENTS:
        return None
    model_config = SimpleNamespace(**fields)
    return model_config if eligible_config(model_config) else None


def _default_rope(fields: dict[str, Any]) -> dict[str, Any] | None:
    """The rope parameters when they are the default rope's and nothing more (the v4
    spelling, a top-level `rope_theta` or none, included); else None."""
    rope = fields.get("rope_parameters")
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": fields.get("rope_theta", 10000.0)}
    if not isinstance(rope, dict) or set(rope) != {"rope_type", "rope_theta"} \
            or rope["rope_type"] != "default" or not isinstance(rope["rope_theta"], (int, float)) \
            or not rope["rope_theta"] > 0:  # NaN or not above 0: transformers' load says so
        return None
    return rope


def _plain_values(fields: dict[str, Any]) -> bool:
    """The types and ranges LlamaConfig's strict validation accepts, for the fields the
    quick path lets through (so it never loads what transformers would refuse)."""
    number = (int, float)
    return (isinstance(fields.get("rms_norm_eps"), float) and fields["rms_norm_eps"] > 0
            and all(isinstance(fields.get(k), bool) for k in
                    ("tie_word_embeddings", "attention_bias", "mlp_bias"))
            and isinstance(fields.get("use_cache", True), bool)
            and _token_ids(fields["eos_token_id"]) and _token_id(fields["bos_token_id"])
            and _token_id(fields["pad_token_id"])
            and isinstance(fields.get("initializer_range", 0.02), number)
            and 0 <= fields.get("initializer_range", 0.02) <= 1
            and isinstance(fields.get("attention_dropout", 0.0), number)
            and fields.get("dtype", "float32") in DTYPE_NAMES
            and fields.get("torch_dtype", "float32") in DTYPE_NAMES)


def _token_id(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _token_ids(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(v is not None and _token_id(v) for v in value)
    return _token_id(value)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _expected_shapes(c: SimpleNamespace) -> dict[str, tuple[int, ...]]:
    # Llama with no biases: the only configs the quick path accepts (model_type llama,
    # attention_bias and mlp_bias false).
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    layer = {"input_layernorm.weight": (c.hidden_size,),
             "post_attention_layernorm.weight": (c.hidden_size,),
             "self_attn.q_proj.weight": (q, c.hidden_size),
             "self_attn.k_proj.weight": (kv, c.hidden_size),
             "self_attn.v_proj.weight": (kv, c.hidden_size),
             "self_attn.o_proj.weight": (c.hidden_size, q),
             "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
             "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
             "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)}
    for i in range(c.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def _load_tensors(path: Path, config: SimpleNamespace, dtype: torch.dtype
                  ) -> dict[str, torch.Tensor] | None:
    """Every tensor the forward needs, in `dtype`, or None when the file is missing or
    does not hold exactly the expected ones (transformers then explains)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    shapes = _expected_shapes(config)
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError):
        return None
    if set(tensors) != set(shapes) or any(tuple(tensors[name].shape) != shape
                                          for name, shape in shapes.items()):
        return None  # (tied embeddings with an lm_head of their own included)
    if not all(t.is_floating_point() for t in tensors.values()):
        return None
    return {name: t.to(dtype) for name, t in tensors.items()}


def _checked(stored: Stored, dtype: torch.dtype, config: SimpleNamespace
             ) -> Mapping[str, torch.Tensor] | None:
    """A quantized checkpoint's float tensors (dequantized as each is first read), or
    None unless they are exactly those the config implies, of the shapes it implies
    (from the file's header: the native kernel reads the codes unchecked)."""
    if stored.shapes != _expected_shapes(config):
        return None
    return stored.dequantized_tensors(dtype)


def _inv_freq(config: SimpleNamespace) -> torch.Tensor:
    """The rotary frequencies as transformers' default rope computes them."""
    import torch

    base, dim = config.rope_parameters["rope_theta"], config.head_dim
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
