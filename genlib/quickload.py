"""A fast start for Llama-style checkpoints in a local folder: the weights straight from
`model.safetensors` into the lean forward (genlib/lean.py) and the tokenizer straight
from `tokenizer.json` through the `tokenizers` library, without importing transformers'
model, config and tokenizer modules (their import chain costs more than a second and a
half here: more than everything else `genlab generate` does for a small model).

    lm = quick_load(spec, folder, device)    # None when the checkpoint does not qualify

Only what is known to behave exactly like transformers qualifies: a plain Llama /
Mistral / Qwen2 config (`lean.eligible_config`), one unsharded safetensors file whose
tensors have the shapes the config implies, a CPU device, no quantization, and a
tokenizer whose config holds nothing that transformers would use to change
`tokenizer.json`'s pipeline. Anything else returns None and the caller loads the model
through transformers. Whatever the fast objects do not provide themselves (transformers'
forward for batches or beam search, chat templates, the vocabulary) is loaded from
transformers on first use (`LoadedModel.model`, `FastTokenizer`), so every feature keeps
working, and exactly as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from genlib.models import LoadedModel, ModelSpec

WEIGHTS = "model.safetensors"
# Tokenizer classes that load tokenizer.json as it is, and the tokenizer_config.json
# keys that do not alter its pipeline (special-token names, lengths, bookkeeping).
TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizer",
                     "LlamaTokenizerFast")
INERT_TOKENIZER_KEYS = {
    "backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
    "model_max_length", "extra_special_tokens", "is_local", "local_files_only",
    "use_default_system_prompt", "chat_template", "padding_side", "truncation_side",
    "model_input_names",
}


def quick_load(spec: ModelSpec, folder: str, device: torch.device) -> LoadedModel | None:
    """The model in `folder` with a lean forward and a `tokenizers` tokenizer, or None
    when it does not qualify (see the module doc)."""
    from genlib.models import LoadedModel, eos_ids_of, load_model, pick_dtype

    path = Path(folder)
    if (os.environ.get("GENLAB_LEAN", "1") == "0" or device.type != "cpu"
            or spec.quantize != "none" or spec.trust_remote_code):
        return None
    config = _read_json(path / "config.json")
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    if config is None or tokenizer_config is None or not _tokenizer_qualifies(
            path, tokenizer_config):
        return None
    model_config = _model_config(config)
    if model_config is None:
        return None
    dtype = pick_dtype(spec.dtype, device)
    tensors = _load_tensors(path / WEIGHTS, model_config, dtype)
    if tensors is None:
        return None
    from genlib.lean import LeanLlama

    lean = LeanLlama(model_config, tensors, _inv_freq(model_config))
    tokenizer = FastTokenizer(path, tokenizer_config)
    generation = _read_json(path / "generation_config.json") or {}
    facts = SimpleNamespace(config=model_config, generation_config=SimpleNamespace(**generation))
    eos = eos_ids_of(facts, tokenizer)
    pad = next((v for v in (tokenizer.pad_token_id, generation.get("pad_token_id"),
                            config.get("pad_token_id")) if isinstance(v, int)),
               eos[0] if eos else 0)
    return LoadedModel(model=None, tokenizer=tokenizer, ref=spec.ref, device=device,
                       dtype=dtype, eos_ids=eos, pad_id=pad,
                       max_positions=model_config.max_position_embeddings,
                       lean=lean, deferred=lambda: load_model(spec).model)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _tokenizer_qualifies(path: Path, tokenizer_config: dict[str, Any]) -> bool:
    if not (path / "tokenizer.json").is_file():
        return False
    if tokenizer_config.get("tokenizer_class") not in TOKENIZER_CLASSES:
        return False
    if tokenizer_config.get("clean_up_tokenization_spaces", False) is not False:
        return False
    if tokenizer_config.get("add_prefix_space") is not None:
        return False
    ignored = {"clean_up_tokenization_spaces", "add_prefix_space"}
    return set(tokenizer_config) <= INERT_TOKENIZER_KEYS | ignored


REQUIRED = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_hidden_layers", "rms_norm_eps", "max_position_embeddings", "vocab_size",
            "hidden_act")


def _model_config(config: dict[str, Any]) -> SimpleNamespace | None:
    """config.json as the attributes LeanLlama reads, or None when it is not a plain
    Llama-style model or leaves a field to transformers' defaults."""
    from genlib.lean import eligible_config

    if any(config.get(key) is None for key in REQUIRED):
        return None
    if config.get("architectures") and len(config["architectures"]) != 1:
        return None
    fields = dict(config)
    if "rope_parameters" not in fields:  # the transformers 4 spelling
        if fields.get("rope_scaling") is not None:
            return None
        fields["rope_parameters"] = {"rope_type": "default",
                                     "rope_theta": fields.get("rope_theta", 10000.0)}
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.setdefault("tie_word_embeddings", False)  # transformers' default for all three
    if not fields.get("head_dim"):
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    model_config = SimpleNamespace(**fields)
    return model_config if eligible_config(model_config) else None


def _expected_shapes(c: SimpleNamespace) -> dict[str, tuple[int, ...]]:
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
    if c.model_type == "qwen2" or getattr(c, "attention_bias", False):
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)})
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
    extra = set(tensors) - set(shapes) - {"lm_head.weight"}
    if extra or any(name not in tensors or tuple(tensors[name].shape) != shape
                    for name, shape in shapes.items()):
        return None
    if not all(t.is_floating_point() for t in tensors.values()):
        return None
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return {name: t.to(dtype) for name, t in tensors.items()}


def _inv_freq(config: SimpleNamespace) -> torch.Tensor:
    """The rotary frequencies as transformers' default rope computes them."""
    import torch

    base, dim = config.rope_parameters["rope_theta"], config.head_dim
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class FastTokenizer:
    """transformers' tokenizer API over `tokenizers.Tokenizer` for what the decode loop
    calls each generation (encode, decode, special ids); everything else (chat templates,
    the vocabulary, ...) goes to transformers' tokenizer, loaded on first use."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self._folder = folder
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._full: Any = None
        self.bos_token_id = self._special_id(config.get("bos_token"))
        self.eos_token_id = self._special_id(config.get("eos_token"))
        self.pad_token_id = self._special_id(config.get("pad_token"))
        template = folder / "chat_template.jinja"
        self.chat_template = config.get("chat_template") or (
            template.read_text(encoding="utf-8") if template.is_file() else None)

    def _special_id(self, token: Any) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self._tokenizer.token_to_id(token) if isinstance(token, str) else None

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any
                 ) -> dict[str, list[int]]:
        if kwargs or not isinstance(text, str):
            return self._transformers()(text, add_special_tokens=add_special_tokens, **kwargs)
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask}

    def decode(self, ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        if kwargs or clean_up_tokenization_spaces:
            return self._transformers().decode(
                ids, skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _transformers(self) -> Any:
        if self._full is None:
            from transformers import AutoTokenizer

            from genlib.models import quiet_transformers

            quiet_transformers()
            self._full = AutoTokenizer.from_pretrained(str(self._folder))
        return self._full

    def __len__(self) -> int:
        return len(self._transformers())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_folder", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self._transformers(), name)
