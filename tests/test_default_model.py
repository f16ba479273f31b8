"""The built-in models in genlib/assets and the script that builds them
(scripts/train_default_model.py, then scripts/quantize_model.py): they ship in genlab's
quantized format (docs/models.md), so they load through genlib's loader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "genlib" / "assets"
SCRIPT = ROOT / "scripts" / "train_default_model.py"
MODELS = ("code-small", "code-tiny")
MAX_ASSET_BYTES = 16 * 1024 * 1024
FORMATS = {"code-small": "nf4", "code-tiny": "q8_0"}  # as shipped
END_ID = 4  # <|end|>, which closes a chat turn

# Spaces, a tab, blank lines, a trailing double space, non-ASCII and a docstring.
CODE = (
    "import os\n\n\n"
    "class Stack:\n"
    '    """A LIFO stack."""\n\n'
    "    def __init__(self):\n"
    "        self.items = []  \n"
    "\n"
    "    def push(self, x):\n"
    "        if x  is None:\n"
    "\t\traise ValueError('naïve — no None')\n"
    "        self.items.append(x)\n"
    "        return   len(self.items)\n"
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _load_folder(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, tok


def _greedy_matches_argmax(model, tok, prompt: str, n: int) -> str:
    """model.generate's greedy tokens equal a hand-written argmax loop; returns the text."""
    import torch

    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)
        manual = ids
        for _ in range(n):
            nxt = model(input_ids=manual).logits[0, -1].argmax()
            manual = torch.cat([manual, nxt.view(1, 1)], dim=1)
    assert out.shape[1] > ids.shape[1]
    assert out[0].tolist() == manual[0, : out.shape[1]].tolist()
    return tok.decode(out[0, ids.shape[1]:])


def _load(name: str, quick: bool = True):
    from genlib.models.loading import ModelSpec, load_model, model_source

    return load_model(ModelSpec(model_source(f"builtin:{name}")), quick=quick)


@pytest.mark.parametrize("name", MODELS)
def test_shipped_model_loads_offline_in_its_quantized_format(name: str) -> None:
    lm = _load(name)
    assert lm.stored is not None and lm.stored.format == FORMATS[name]
    config = json.loads((ASSETS / name / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]
    for width in ("hidden_size", "intermediate_size", "head_dim"):
        assert config[width] % 64 == 0, f"{name}: {width} breaks 64-wide quantization blocks"
    generation = json.loads((ASSETS / name / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"],
            generation["pad_token_id"]) == ([0, END_ID], 0, 0)
    tok = lm.tokenizer
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids("<|end|>") == END_ID
    assert config["vocab_size"] == len(tok)
    record = json.loads((ASSETS / name / "TRAINING.json").read_text())
    assert record["smoke"] is False and record["context"] == config["max_position_embeddings"]
    assert (ASSETS / name / "README.md").is_file()


@pytest.mark.parametrize("name", MODELS)
def test_the_stored_codes_give_the_dequantized_forwards_greedy_tokens(name: str) -> None:
    """genlab's native kernel over the shipped codes against transformers' generate() on
    the dequantized float32 weights (transformers never reads the codes): 32 tokens."""
    import torch

    from genlib.events import Finish, Prefill
    from genlib.generate import stream
    from genlib.settings.config import GenerationSettings

    lm = _load(name)
    ids = lm.encode("def fibonacci(n):\n")
    events = list(stream(lm, [ids], GenerationSettings(max_new_tokens=32, min_new_tokens=32)))
    [prefill] = [e for e in events if isinstance(e, Prefill)]
    [ours] = [e for e in events if isinstance(e, Finish)]
    assert prefill.backend == "native" and f"{FORMATS[name]} as stored" in prefill.backend_reason
    reference = _load(name, quick=False).model
    assert reference.dtype == torch.float32
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert list(ours.token_ids) == out[0, len(ids):].tolist()
    assert len(set(ours.token_ids)) > 4  # words, not one token over and over


def test_the_chat_template_renders_two_turns_as_the_training_data() -> None:
    """The shipped template renders a two-turn conversation exactly as the training
    script rendered its chat pairs, and asks for the assistant's turn."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_default_model import chat_texts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS / "code-small")
    chat = [{"role": "user", "content": "Write a function that adds."},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
            {"role": "user", "content": "What does it return?"},
            {"role": "assistant", "content": "The sum."}]
    trained = ("<|user|>\nWrite a function that adds.<|end|>\n<|assistant|>\n"
               "def add(a, b):\n    return a + b<|end|>\n<|user|>\nWhat does it return?"
               "<|end|>\n<|assistant|>\nThe sum.<|end|>\n")
    assert chat_texts(tok, [chat]) == [trained]
    asked = tok.apply_chat_template(chat[:3], tokenize=False, add_generation_prompt=True)
    assert asked == trained[:trained.index("The sum.")]
    tiny = AutoTokenizer.from_pretrained(ASSETS / "code-tiny")
    assert tiny.apply_chat_template(chat, tokenize=False) == trained


def test_target_learned_more_than_draft() -> None:
    small = json.loads((ASSETS / "code-small" / "TRAINING.json").read_text())
    tiny = json.loads((ASSETS / "code-tiny" / "TRAINING.json").read_text())
    assert small["params"] > 2 * tiny["params"]
    assert small["val_loss"] < tiny["val_loss"] < 5.0  # uniform over 4096 tokens is 8.3


def test_assets_fit_size_budget() -> None:
    files = [p for p in ASSETS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    total = sum(p.stat().st_size for p in files)
    assert total <= MAX_ASSET_BYTES, f"genlib/assets holds {total:,} bytes > {MAX_ASSET_BYTES:,}"


def test_tokenizer_round_trips_code_exactly() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS / "code-small")
    ids = tok.encode(CODE)
    assert 0 not in ids, "the tokenizer should add no BOS/EOS of its own"
    assert tok.decode(ids) == CODE
    assert tok.decode(ids + [0], skip_special_tokens=True) == CODE


def test_draft_and_target_share_tokenizer() -> None:
    for filename in ("tokenizer.json", "tokenizer_config.json"):
        a = (ASSETS / "code-small" / filename).read_bytes()
        b = (ASSETS / "code-tiny" / filename).read_bytes()
        assert a == b, f"{filename} differs between code-small and code-tiny"
    cfgs = [json.loads((ASSETS / m / "config.json").read_text()) for m in MODELS]
    assert cfgs[0]["vocab_size"] == cfgs[1]["vocab_size"]


def test_weights_are_not_git_ignored() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for name in MODELS:
        rel = f"genlib/assets/{name}/model.safetensors"
        res = subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT)
        assert res.returncode == 1, f"{rel} is git-ignored"


def _smoke(out: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smoke")
    _smoke(out)
    return out


@pytest.mark.slow
def test_training_script_smoke_builds_loadable_folders(smoke_out: Path) -> None:
    for name in MODELS:
        folder = smoke_out / name
        for filename in ("config.json", "generation_config.json", "model.safetensors",
                         "tokenizer.json", "tokenizer_config.json", "TRAINING.json",
                         "README.md"):
            assert (folder / filename).is_file(), f"{name}/{filename} missing"
        model, tok = _load_folder(folder)
        _greedy_matches_argmax(model, tok, "def f(x):", 4)
        assert json.loads((folder / "TRAINING.json").read_text())["smoke"] is True
    assert (smoke_out / "README.md").is_file()


@pytest.mark.slow
def test_training_script_is_deterministic(smoke_out: Path, tmp_path: Path) -> None:
    _smoke(tmp_path)
    for name in MODELS:
        for filename in ("model.safetensors", "tokenizer.json"):
            assert (tmp_path / name / filename).read_bytes() == \
                (smoke_out / name / filename).read_bytes(), f"{name}/{filename} differs"
