"""What is wrong with a local model folder's files, found before transformers loads them,
in words that say how to fix it: config.json (a JSON object, sizes of at least 1), its
safetensors weights against the model config.json describes (shapes read from the file
headers and the model built on the meta device: nothing allocated), and the tokenizer
files. `genlib.models.loading` raises these as ModelLoadErrors; a folder transformers would
refuse for another reason is left to it, which says why.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from genlib import jsonl
from genlib.errors import ModelLoadError

# Checkpoint tensors transformers drops without a word whatever the model (besides each
# model's own `_keys_to_ignore_on_load_unexpected`): rotary tables and position ids.
IGNORED_UNEXPECTED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")

FIX_CONFIG = "fix config.json or restore it from the model's source"
# The generation_config.json token ids genlab reads (eos_token_id: or a list of them).
GENERATION_TOKEN_IDS = ("eos_token_id", "pad_token_id")
# Config fields that count something (tokens, widths, layers, positions; aliases such as
# GPT-2's n_embd read through them): 0 or less makes a model that cannot run.
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim",
                   "max_position_embeddings")
# Norm epsilons: a number that is not above 0 makes every logit NaN.
POSITIVE_SCALES = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps")
# The JSON files AutoTokenizer reads, and the files one of which holds a vocabulary.
TOKENIZER_JSON = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                  "added_tokens.json", "chat_template.json")
VOCABULARY_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")


def check_folder(ref: str) -> None:
    """ModelLoadError unless `ref` is a folder holding a config.json that is a JSON object,
    and a generation_config.json that is one if it holds any (transformers passes over
    one that is not JSON, and fails on one that is JSON but not an object)."""
    path = Path(ref).expanduser()
    if path.is_symlink() and not path.exists():
        raise ModelLoadError(f"model folder {ref} is a symbolic link that leads nowhere (its "
                             f"target is missing, or links lead back to it); point --model "
                             f"at the model folder itself")
    if not path.exists():
        raise ModelLoadError(f"model folder {ref} does not exist; give a local folder in "
                             f"Hugging Face layout or a hub id like 'org/name'")
    if path.is_file():
        hint = f": --model {path.parent}" if (path.parent / "config.json").is_file() else ""
        raise ModelLoadError(f"{ref} is a file, not a model folder; point --model at the "
                             f"folder holding config.json and the weights{hint}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{ref} is not a Hugging Face model folder (no config.json); "
                             f"point --model at the folder holding config.json")
    problem = json_problem(path / "config.json")
    if problem is not None:
        raise ModelLoadError(f"cannot load {ref}: config.json {problem}; {FIX_CONFIG}")
    generation = path / "generation_config.json"
    if generation.is_file():
        problem = json_problem(generation) or _token_ids_problem(generation)
        if problem is not None:
            raise ModelLoadError(f"cannot load {ref}: generation_config.json {problem}; fix "
                                 f"it, or remove it (it holds the model's default settings "
                                 f"only)")


def _token_ids_problem(path: Path) -> str | None:
    """What is wrong with the token ids in generation_config.json (a JSON object), in
    words; None when each is an integer (eos_token_id: or a list of them) or absent.
    transformers fails on another type with a TypeError that says nothing of the file."""
    fields = json.loads(path.read_bytes(), parse_int=jsonl.read_integer)
    for name in GENERATION_TOKEN_IDS:
        value = fields.get(name)
        listed = name == "eos_token_id" and isinstance(value, list)
        if value is None or all(_is_id(v) for v in (value if listed else [value])):
            continue
        either = "an integer or a list of integers" if name == "eos_token_id" else "an integer"
        return f"sets {name} to {jsonl.excerpt(value, 30)}, which must be a token id ({either})"
    return None


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_problem(path: Path) -> str | None:
    """What keeps the file at `path` from being a JSON object, in words; None if it is one."""
    try:
        value = json.loads(path.read_bytes(), parse_int=jsonl.read_integer)
    except json.JSONDecodeError as exc:
        return (f"is not valid JSON ({jsonl.syntax_error(exc)} at line {exc.lineno} column "
                f"{exc.colno})")
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    except RecursionError:
        return "is nested too deeply to read"
    except jsonl.LongInteger as exc:
        return f"holds an integer of {exc.digits:,} digits, more than Python reads"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if isinstance(value, dict):
        return None
    return f"holds {jsonl.excerpt(value, 30)}, not a JSON object"


def check_sizes(ref: str, config: Any) -> None:
    """ModelLoadError for a size in config.json below 1 (a model with no positions, say,
    loads and then fails at the first token)."""
    aliases = getattr(config, "attribute_map", None) or {}
    for name in POSITIVE_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ModelLoadError(f"cannot load {ref}: config.json sets "
                                 f"{aliases.get(name, name)} to {value}, which must be at "
                                 f"least 1; {FIX_CONFIG}")
    rope = getattr(config, "rope_parameters", None)
    scales = {name: getattr(config, name, None) for name in POSITIVE_SCALES}
    scales["rope_theta"] = rope.get("rope_theta") if isinstance(rope, dict) else \
        getattr(config, "rope_theta", None)
    for name, value in scales.items():  # NaN, 0 or less: a model that writes nothing
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and not (math.isfinite(value) and value > 0):
            raise ModelLoadError(f"cannot load {ref}: config.json sets {name} to {value}, "
                                 f"which must be a finite number above 0; {FIX_CONFIG}")


def skeleton(config: Any, trust_remote_code: bool) -> Any:
    """The model `config` describes, built on the meta device: every shape, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def check_weights(name: str, folder: Path, config: Any, trust_remote_code: bool) -> None:
    """ModelLoadError when config.json does not describe the folder's weights, found from
    the safetensors headers and the model built on the meta device (neither allocates)
    before transformers builds the model for real: it would allocate the size config.json
    gives first (a bare {"model_type": "llama"} is a 7B model, tens of GB) and only then
    refuse, or fill in what the weights lack with random values. Quantized checkpoints,
    adapters and formats other than safetensors (.bin) are left to transformers."""
    _check_index(name, folder)
    if getattr(config, "quantization_config", None) is not None \
            or (folder / "adapter_config.json").exists():
        return
    stored = _checkpoint_shapes(folder)
    if stored is None:
        return
    try:
        model = skeleton(config, trust_remote_code)
    except Exception:  # noqa: BLE001  (what stops it stops from_pretrained, which says why)
        return
    problem = _weights_problem(model, stored)
    if problem is not None:
        raise ModelLoadError(f"cannot load {name}: config.json does not match the weights "
                             f"({problem}); fix config.json or use the folder the weights "
                             f"came from")


def _check_index(name: str, folder: Path) -> None:
    """ModelLoadError for a sharded checkpoint's index that is not a JSON object."""
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file() or not index.is_file():
        return
    problem = json_problem(index)
    if problem is not None:
        raise ModelLoadError(f"cannot load {name}: {index.name} {problem}; restore it from "
                             f"the model's source")


def _checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape in the folder's safetensors weights (model.safetensors, or the
    shards model.safetensors.index.json names), read from the file headers alone; None
    without such weights or when a file cannot be read (transformers then says why)."""
    from safetensors import SafetensorError, safe_open

    files = _safetensors_files(folder)
    if files is None:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as weights:
                shapes.update({key: tuple(weights.get_slice(key).get_shape())
                               for key in weights.keys()})
    except (OSError, SafetensorError):
        return None
    return shapes


def _safetensors_files(folder: Path) -> list[Path] | None:
    """The safetensors files transformers loads from `folder`, or None if there are none."""
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(weight_map, dict) or \
            not all(isinstance(file, str) for file in weight_map.values()):
        return None
    return [folder / file for file in sorted(set(weight_map.values()))]


def _weights_problem(model: Any, stored: dict[str, tuple[int, ...]]) -> str | None:
    """Where the weights (`stored`: name -> shape) and the model config.json describes
    (`model`) part, in words: a tensor of another shape, one the model needs that the
    weights lack, or layers the weights have beyond the model's; None where they agree.
    Names are matched as transformers matches them where no renaming applies (a missing
    base-model prefix added): where one may apply, only shapes are compared."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", "")
    stored = {_model_key(key, expected, prefix): shape for key, shape in stored.items()}
    for name, shape in expected.items():
        if name in stored and stored[name] != shape:
            return (f"{name} is {_dims(stored[name])} in the weights, {_dims(shape)} by "
                    f"config.json")
    unmatched = sorted(stored.keys() - expected.keys(), key=_natural)
    missing = _missing(model, stored)
    if missing and not unmatched:
        return f"the weights lack {missing[0]}, which config.json's model needs"
    kinds = {_kind(name) for name in expected}
    ignored = [re.compile(p) for p in (*IGNORED_UNEXPECTED, *(
        getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()))]
    beyond = [key for key in unmatched if _kind(key) in kinds
              and not any(p.search(key) for p in ignored)]
    if beyond and not missing:
        return f"the weights hold {beyond[0]}, which config.json's model has no place for"
    return None


def _model_key(key: str, expected: dict[str, Any], prefix: str) -> str:
    """A checkpoint's tensor name as the model names it: a checkpoint of the base model
    lacks the prefix (`model.`) its causal-LM class puts before the names."""
    if key in expected or not prefix or f"{prefix}.{key}" not in expected:
        return key
    return f"{prefix}.{key}"


def _missing(model: Any, stored: dict[str, Any]) -> list[str]:
    """The model's parameters the weights lack, but for tied ones (an output layer that
    shares the input embedding) and those transformers expects to be missing."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    excused = set(tied) | {source for target, source in tied.items() if target in stored}
    ignored = [re.compile(p) for p in
               getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    return [name for name, _ in model.named_parameters(remove_duplicate=False)
            if name not in stored and name not in excused
            and not any(p.search(name) for p in ignored)]


def _kind(name: str) -> str:
    """A tensor's name with its layer (and expert) numbers left out."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def _natural(name: str) -> list[tuple[int, int, str]]:
    """Sort key: numbered layers in numeric order (layers.2 before layers.10)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _dims(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})"


def tokenizer_files_problem(folder: Path) -> str | None:
    """What is wrong with the tokenizer files in `folder`, with the fix; None when they
    look whole."""
    return _broken_tokenizer_json(folder) or _no_vocabulary_file(folder)


def _broken_tokenizer_json(folder: Path) -> str | None:
    for file in TOKENIZER_JSON:
        problem = json_problem(folder / file) if (folder / file).is_file() else None
        if problem is not None:
            return f"{file} {problem}; restore it from the model's source"
    return None


def _no_vocabulary_file(folder: Path) -> str | None:
    if any(next(folder.glob(pattern), None) for pattern in VOCABULARY_FILES):
        return None
    return ("the folder has no tokenizer file (tokenizer.json or tokenizer.model); copy "
            "the model's tokenizer files into it from the model's source")
