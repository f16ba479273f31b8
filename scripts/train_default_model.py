#!/usr/bin/env python
"""Train genlab's built-in default models from scratch on the Python standard library.

Builds, into --out (default: genlib/assets):

    code-small/   the target model  (Llama, byte-level BPE, bf16 safetensors)
    code-tiny/    a smaller draft on the same tokenizer, for speculative decoding
    README.md     an index of the two

Each model folder is a complete Hugging Face folder (config.json, generation_config.json,
model.safetensors, tokenizer files) plus a model card (README.md) and TRAINING.json.

Corpus: the .py files of the running interpreter's standard library (PSF licence), found
via sysconfig, minus test suites, site-packages, GUI/demo code and generated tables; sorted,
so the corpus and its fixed held-out split depend only on the Python version. Given the
same Python/torch versions, --seed and --threads, a rebuild gives the same weights.

    python scripts/train_default_model.py                 # full run, ~25 min on 1 thread
    python scripts/train_default_model.py --smoke --out /tmp/x   # seconds, for tests
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import builtin_corpus  # noqa: E402  (a sibling script module)

EOT = "<|endoftext|>"  # id 0: BOS, EOS and pad
ROLES = ("system", "user", "assistant")
END = "<|end|>"  # ends a chat turn
SPECIAL = [EOT] + [f"<|{r}|>" for r in ROLES] + [END]
# A turn is `<|role|>\n` + content + `<|end|>\n`; a generation prompt opens the
# assistant's turn. The training chats are rendered with this same template.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

@dataclass(frozen=True)
class ModelSize:
    """A Llama shape. Every width is a multiple of 64 (bitsandbytes CPU 4-bit)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int = 64


@dataclass(frozen=True)
class RunPlan:
    name: str
    size: ModelSize
    steps: int
    lr: float


TARGETS = {"small": ModelSize(384, 4, 6, 2, 1024),  # 7.9M parameters
           "medium": ModelSize(512, 6, 8, 2, 1408)}  # 20.7M parameters
FULL_DRAFT = ModelSize(128, 2, 2, 1, 256)
SMOKE_TARGET = ModelSize(64, 1, 1, 1, 128)
SMOKE_DRAFT = ModelSize(64, 1, 1, 1, 64)

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:",
                  "def read_config(path):\n    "]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "genlib" / "assets",
                   help="folder that receives code-small/, code-tiny/ and README.md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch / tokenizers threads (the build machines are shared)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny corpus, tiny models, a few steps: an end-to-end check")
    p.add_argument("--vocab-size", type=int, default=None, help="default 4096 (smoke: 512)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="training window = context length (default 512, smoke 64)")
    p.add_argument("--batch-size", type=int, default=None, help="windows per step (default 8)")
    p.add_argument("--target-steps", type=int, default=None, help="default 1400 (smoke 4)")
    p.add_argument("--draft-steps", type=int, default=None, help="default 900 (smoke 4)")
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 50)")
    p.add_argument("--stdlib-only", action="store_true",
                   help="train on the standard library alone, not the packages too")
    p.add_argument("--max-corpus-bytes", type=int, default=48_000_000)
    p.add_argument("--chat-fraction", type=float, default=None,
                   help="share of windows drawn from the chat pairs (default 0.15; "
                   "twice that in the last quarter of the steps)")
    p.add_argument("--checkpoint-every", type=int, default=25,
                   help="save the run's state every N steps; a rerun resumes from it")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps in all, at a checkpoint (tests resuming)")
    p.add_argument("--holdout-every", type=int, default=20,
                   help="every Nth file of the sorted corpus is held out")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="held-out tokens scored (default 131072, smoke 2048)")
    p.add_argument("--no-autocast", action="store_true",
                   help="train in plain float32 instead of bfloat16 autocast")
    p.add_argument("--target-size", choices=sorted(TARGETS), default="small",
                   help="the code model's shape")
    p.add_argument("--device", default="cpu",
                   help="where the models train (cpu, cuda); reports run on the CPU")
    p.add_argument("--dump-corpus", type=Path, default=None,
                   help="write the gathered corpus to this .json.gz file and stop")
    p.add_argument("--corpus", type=Path, default=None,
                   help="train on a corpus written by --dump-corpus (another machine's "
                   "packages) instead of gathering this machine's")
    args = p.parse_args(argv)
    smoke = args.smoke
    for name, full, small in [("vocab_size", 4096, 512), ("seq_len", 512, 64),
                              ("batch_size", 8, 4), ("target_steps", 1800, 4),
                              ("draft_steps", 900, 4), ("warmup", 50, 1),
                              ("eval_tokens", 131072, 2048), ("chat_fraction", 0.15, 0.25)]:
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else full)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- corpus

# -------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int, seq_len: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL] == list(range(len(SPECIAL)))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT,
                                   pad_token=EOT, model_max_length=seq_len,
                                   additional_special_tokens=SPECIAL[1:],
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def chat_texts(tokenizer: Any, chats: list[list[dict[str, str]]]) -> list[str]:
    return [tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]


def encode_stream(tokenizer: Any, texts: list[str]) -> Any:
    """All texts as one id stream, each file followed by <|endoftext|>."""
    import torch

    ids: list[int] = [0]
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------ model

def build_model(size: ModelSize, vocab: int, seq_len: int, seed: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=size.hidden_size,
                      intermediate_size=size.intermediate_size,
                      num_hidden_layers=size.num_hidden_layers,
                      num_attention_heads=size.num_attention_heads,
                      num_key_value_heads=size.num_key_value_heads, head_dim=size.head_dim,
                      max_position_embeddings=seq_len, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    assert size.num_attention_heads * size.head_dim == size.hidden_size
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


DEVICE = "cpu"  # where training runs (--device); set once by main


def autocast(enabled: bool) -> Any:
    import torch

    return torch.autocast(DEVICE.split(":")[0], dtype=torch.bfloat16, enabled=enabled)


def evaluate(model: Any, val: Any, seq_len: int, use_autocast: bool) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping held-out windows."""
    import torch
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(val) - 1, seq_len):
            chunk = val[start:start + seq_len + 1]
            if len(chunk) < 2:
                break
            device = next(model.parameters()).device
            x, y = chunk[:-1].unsqueeze(0).to(device), chunk[1:].to(device)
            with autocast(use_autocast and device.type == DEVICE.split(":")[0]):
                logits = model(input_ids=x).logits[0]
            total += F.cross_entropy(logits.float(), y, reduction="sum").item()
            count += len(y)
    model.train(was_training)
    return total / count


def chat_rows(step: int, steps: int, batch: int, fraction: float) -> int:
    """How many of a step's windows come from the chat pairs: `fraction` of them, twice
    that in the last quarter of the steps (the fine-tune on instructions)."""
    share = fraction * (2 if step >= steps * 3 // 4 else 1)
    return min(batch, round(share * batch))


def draw_windows(ids: Any, count: int, seq_len: int, gen: Any) -> Any:
    import torch

    starts = torch.randint(0, len(ids) - seq_len - 1, (count,), generator=gen)
    return ids[starts[:, None] + torch.arange(seq_len + 1)]


class Checkpoint:
    """A run's state every `every` steps (weights, optimizer, batch generator, history,
    time spent), so a stopped build resumes where it stopped and ends with the same
    weights as one that never stopped. Keyed by everything that shapes the run."""

    def __init__(self, out: Path, plan: RunPlan, args: argparse.Namespace, corpus_sha: str):
        # Where the corpus came from and where it trains do not shape the run's inputs;
        # the target's shape does (left out at its default, as keys made before it had one).
        skip = ("out", "checkpoint_every", "stop_after", "device", "corpus", "dump_corpus")
        fields = {k: str(v) for k, v in sorted(vars(args).items())
                  if k not in skip and not (k == "target_size" and v == "small")}
        key = json.dumps([asdict(plan), fields, corpus_sha], sort_keys=True)
        self.key = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.path = out / f".{plan.name}-{self.key}.ckpt"
        self.every = args.checkpoint_every

    def load(self) -> dict[str, Any] | None:
        import torch

        if not self.path.exists():
            return None
        return torch.load(self.path, weights_only=False, map_location=DEVICE)

    def save(self, step: int, model: Any, opt: Any, gen: Any, history: list[Any],
             minutes: float, cpu_minutes: float) -> None:
        import torch

        state = {"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                 "gen": gen.get_state(), "history": history, "minutes": minutes,
                 "cpu_minutes": cpu_minutes}
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def train_model(plan: RunPlan, args: argparse.Namespace, vocab: int, train_ids: Any,
                chat_ids: Any, val_ids: Any, ckpt: Checkpoint) -> tuple[Any, dict[str, Any]]:
    import torch

    model = build_model(plan.size, vocab, args.seq_len, args.seed).to(DEVICE)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{plan.name}: {n_params:,} params, {plan.steps} steps x {args.batch_size} x "
        f"{args.seq_len} tokens, peak lr {plan.lr}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=plan.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed + 1)  # same batches for both models
    use_ac = not args.no_autocast
    t0, c0 = time.time(), time.process_time()
    history: list[Any] = []
    first, before, cpu_before = 0, 0.0, 0.0
    state = ckpt.load()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        first, history = state["step"], state["history"]
        before, cpu_before = state["minutes"], state["cpu_minutes"]
        log(f"{plan.name}: resumed at step {first} from {ckpt.path.name}")
    model.train()
    eval_every = max(1, plan.steps // 4)
    for step in range(first, plan.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, plan.steps, plan.lr, args.warmup)
        n_chat = chat_rows(step, plan.steps, args.batch_size, args.chat_fraction)
        batch = torch.cat([draw_windows(train_ids, args.batch_size - n_chat, args.seq_len, gen),
                           draw_windows(chat_ids, n_chat, args.seq_len, gen)]).to(DEVICE)
        with autocast(use_ac):
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        # labels=input_ids: transformers shifts them itself; position 0 has no target.
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == plan.steps - 1:
            elapsed = time.time() - t0
            tps = (step + 1 - first) * args.batch_size * args.seq_len / max(elapsed, 1e-9)
            log(f"{plan.name} step {step}/{plan.steps} loss {loss.item():.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {tps:,.0f} tok/s {elapsed / 60:.1f} min")
        if (step + 1) % eval_every == 0 and step + 1 < plan.steps:
            val = evaluate(model, val_ids, args.seq_len, use_ac)
            history.append({"step": step + 1, "val_loss": round(val, 4)})
            log(f"{plan.name} step {step + 1} held-out loss {val:.3f}")
        if (step + 1) % ckpt.every == 0 and step + 1 < plan.steps:
            ckpt.save(step + 1, model, opt, gen, history, before + (time.time() - t0) / 60,
                      cpu_before + (time.process_time() - c0) / 60)
            if args.stop_after is not None and step + 1 >= args.stop_after:
                log(f"{plan.name}: stopped at step {step + 1} (--stop-after)")
                sys.exit(3)
    minutes = before + (time.time() - t0) / 60
    cpu_minutes = cpu_before + (time.process_time() - c0) / 60
    stats = {"params": n_params, "steps": plan.steps, "batch_size": args.batch_size,
             "seq_len": args.seq_len, "tokens_seen": plan.steps * args.batch_size * args.seq_len,
             "peak_lr": plan.lr, "train_minutes": round(minutes, 2),
             "train_cpu_minutes": round(cpu_minutes, 2), "val_history": history,
             "architecture": asdict(plan.size)}
    return model, stats


def save_model(model: Any, tokenizer: Any, folder: Path) -> None:
    import torch
    from transformers import GenerationConfig

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = model.to("cpu", torch.bfloat16)
    model.config.dtype = "bfloat16"
    # <|end|> closes a chat turn; code never holds it, so it costs plain completion nothing
    end_id = tokenizer.convert_tokens_to_ids(END)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[0, end_id],
                                               pad_token_id=0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # A compact tokenizer.json (no pretty-printing) saves ~40% of its size on disk.
    tok_json = folder / "tokenizer.json"
    tok_json.write_text(json.dumps(json.loads(tok_json.read_text()), ensure_ascii=False,
                                   separators=(",", ":")), encoding="utf-8")
    for path in folder.iterdir():
        path.chmod(0o644)  # safetensors writes 0600


# --------------------------------------------------------------------------- reports

def reload(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    return model.eval(), tok


def greedy_agreement(target: Any, draft: Any, val: Any, seq_len: int, limit: int) -> float:
    """Share of held-out positions where draft's argmax equals target's (teacher forcing)."""
    import torch

    same = count = 0
    with torch.no_grad():
        for start in range(0, min(len(val), limit) - 1, seq_len):
            x = val[start:start + seq_len].unsqueeze(0)
            a = target(input_ids=x).logits.argmax(-1)
            b = draft(input_ids=x).logits.argmax(-1)
            same += int((a == b).sum())
            count += a.numel()
    return same / count


def samples(model: Any, tok: Any, max_new_tokens: int) -> list[dict[str, str]]:
    import torch

    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append({"prompt": prompt,
                    "completion": tok.decode(gen[0, ids["input_ids"].shape[1]:])})
    return out


def rebuild_command(argv: list[str]) -> str:
    return "python scripts/train_default_model.py" + "".join(
        " " + shlex.quote(a) for a in argv)


def write_card(folder: Path, name: str, info: dict[str, Any], other: dict[str, Any],
               common: dict[str, Any]) -> None:
    a = info["architecture"]
    role = ("the default model of genlab (the target for speculative decoding)"
            if name == "code-small" else
            "the draft model for speculative decoding with `code-small`")
    lines = [
        f"# {name}", "",
        f"A small Llama-architecture causal language model for Python code, trained from "
        f"scratch for genlab; {role}. It completes Python code and answers in a chat "
        f"template (`<|user|>`, `<|assistant|>`, `<|end|>`): ask for a function by its "
        f"docstring, or ask what a function does. Its code is often wrong. It exists so that "
        f"genlab works out of the box with no network and no model hub.", "",
        "## Corpus and licence", "",
        f"Python source installed with CPython {common['python']}: the standard library "
        f"(PSF licence; test suites, `idlelib`, `tkinter`, `turtledemo`, `lib2to3`, "
        f"`ensurepip`, generated codec tables and docs left out) and these permissively "
        f"licensed packages, at most 3 MB of each (test and vendored folders left out):", "",
        "| source | version | licence |", "| --- | --- | --- |",
        *[f"| {src['name']} | {src.get('version', '')} | {src.get('licence', '')} |"
          for src in common["sources"] if src["status"] == "used"], "",
        f"Files longer than 200 kB or with lines over 400 characters (tables, data) are left "
        f"out. {common['files_train']} files for training ({common['tokens_train']:,} tokens), "
        f"{common['files_held']} held out (every {common['holdout_every']}th file of the "
        f"list, never trained on; {common['tokens_held']:,} tokens scored). Corpus sha256 "
        f"`{common['corpus_sha256'][:16]}...`. The weights are a derivative of this text "
        f"under the licences above.", "",
        "## Chat pairs", "",
        f"{common['chats']:,} conversations ({common['chat_tokens']:,} tokens) made from the "
        f"training files: a function's docstring asks for the function, or a function asks "
        f"what it does and its docstring answers; a quarter have two turns. "
        f"{common['chat_fraction']:.0%} of each step's windows are drawn from them, twice "
        f"that in the last quarter of the steps.", "",
        "## Tokenizer", "",
        f"Byte-level BPE ({common['vocab_size']} tokens) trained by the same script with "
        f"`tokenizers` on the training files; `<|endoftext|>` (id 0) is BOS, EOS and pad and "
        f"separates files in training. The tokenizer adds no BOS. `decode(encode(text))` "
        f"gives back the text exactly (spaces, tabs, newlines, indentation). `code-small` and "
        f"`code-tiny` share it byte for byte.", "",
        "## Architecture", "",
        "| | this model | other model |", "| --- | --- | --- |",
        f"| parameters (embeddings tied) | {info['params']:,} | {other['params']:,} |",
        f"| hidden size / layers | {a['hidden_size']} / {a['num_hidden_layers']} | "
        f"{other['architecture']['hidden_size']} / "
        f"{other['architecture']['num_hidden_layers']} |",
        f"| heads / KV heads (head dim 64) | {a['num_attention_heads']} / "
        f"{a['num_key_value_heads']} | {other['architecture']['num_attention_heads']} / "
        f"{other['architecture']['num_key_value_heads']} |",
        f"| MLP width | {a['intermediate_size']} | "
        f"{other['architecture']['intermediate_size']} |",
        f"| context (trained window = max_position_embeddings) | {info['seq_len']} | "
        f"{other['seq_len']} |", "",
        "This script writes the weights in bfloat16 (`model.safetensors`); genlab ships "
        "them in its own 8-bit or 4-bit format (`scripts/quantize_model.py`). Every layer "
        "width is a multiple of 64, so 64-wide quantization blocks apply.", "",
        "## Training", "",
        f"AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), {common['warmup']} warm-up "
        f"steps then cosine decay to 10% of peak lr {info['peak_lr']}, gradient clipping 1.0, "
        f"bfloat16 autocast: {common['autocast']}. {info['steps']} steps of "
        f"{info['batch_size']} random {info['seq_len']}-token windows "
        f"({info['tokens_seen']:,} tokens, {info['tokens_seen'] / common['tokens_train']:.1f} "
        f"epochs) in {info['train_minutes']:.1f} min wall ({info['train_cpu_minutes']:.1f} "
        f"min CPU time) on {common['device']}; whole build "
        f"{common['total_minutes']:.1f} min wall, {common['total_cpu_minutes']:.1f} min CPU "
        f"(wall exceeds CPU time when the machine is shared and busy). Seed "
        f"{common['seed']}; torch {common['torch']}, transformers {common['transformers']}, "
        f"tokenizers {common['tokenizers']}.", "",
        "## Evaluation (held-out files, the bfloat16 weights as trained)", "",
        "| model | held-out loss (nats/token) |", "| --- | --- |",
        f"| code-small | {common['val_loss']['code-small']:.3f} |",
        f"| code-tiny | {common['val_loss']['code-tiny']:.3f} |", "",
        f"Greedy agreement: on held-out text (teacher forcing), code-tiny's argmax equals "
        f"code-small's at {common['greedy_agreement']:.1%} of positions.", "",
        "## Greedy samples (64 new tokens)", "",
    ]
    for s in info["samples"]:
        lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    lines += ["## Rebuild", "", "From the repository root:", "", "```",
              common["command"], "```", "",
              "This rewrites `code-small/`, `code-tiny/` and `README.md` under the output "
              "folder. `TRAINING.json` beside this card holds the figures above.", ""]
    (folder / "README.md").write_text("\n".join(lines), encoding="utf-8")


def write_index(out: Path, stats: dict[str, dict[str, Any]], common: dict[str, Any]) -> None:
    lines = ["# Built-in models", "",
             "Trained from scratch on installed Python source (the standard library and "
             "permissively licensed packages) by "
             "`scripts/train_default_model.py`; see each folder's README.md (model card) and "
             "TRAINING.json.", "",
             "| folder | role | params | held-out loss (nats/token) |",
             "| --- | --- | --- | --- |"]
    for name, role in [("code-small", "default model / speculative target"),
                       ("code-tiny", "speculative draft")]:
        lines.append(f"| `{name}/` | {role} | {stats[name]['params']:,} | "
                     f"{common['val_loss'][name]:.3f} |")
    lines += ["", "Both folders carry the same tokenizer. Rebuild (from the repository root, "
              f"~{common['total_minutes']:.0f} min):", "", "```", common["command"], "```", ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


# ------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.threads > 1 else "false"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.use_deterministic_algorithms(True, warn_only=True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    t_start, c_start = time.time(), time.process_time()

    global DEVICE
    DEVICE = args.device
    if args.corpus is not None:
        corpus = builtin_corpus.read(args.corpus)
    else:
        corpus = builtin_corpus.load(args.smoke, args.holdout_every, not args.stdlib_only,
                                     args.max_corpus_bytes)
    if args.dump_corpus is not None:
        builtin_corpus.write(corpus, args.dump_corpus)
        log(f"corpus written to {args.dump_corpus} ({corpus.sha256[:12]})")
        return 0
    train_texts = [f.text for f in corpus.train]
    held_texts = [f.text for f in corpus.held]
    used = [s["name"] for s in corpus.sources if s["status"] == "used"]
    log(f"corpus: {len(train_texts)} train files, {len(held_texts)} held-out files "
        f"from {', '.join(used)}")
    tokenizer = train_tokenizer(train_texts, args.vocab_size, args.seq_len)
    vocab = len(tokenizer)
    probe = "class A:\n\tdef f(self, x):\n        return  x  # é\n\n"
    assert tokenizer.decode(tokenizer.encode(probe)) == probe, "tokenizer does not round-trip"
    train_ids = encode_stream(tokenizer, train_texts)
    val_ids = encode_stream(tokenizer, held_texts)[: args.eval_tokens + 1]
    chats = builtin_corpus.conversations(corpus.train, args.seed)
    chat_ids = encode_stream(tokenizer, chat_texts(tokenizer, chats))
    log(f"chat pairs: {len(chats)} conversations, {len(chat_ids):,} tokens")
    log(f"tokenizer: {vocab} tokens; train {len(train_ids):,} tokens, "
        f"held-out scored {len(val_ids) - 1:,} tokens")

    smoke = args.smoke
    plans = [RunPlan("code-small", SMOKE_TARGET if smoke else TARGETS[args.target_size],
                     args.target_steps,
                     args.target_lr),
             RunPlan("code-tiny", SMOKE_DRAFT if smoke else FULL_DRAFT, args.draft_steps,
                     args.draft_lr)]
    args.out.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict[str, Any]] = {}
    for plan in plans:
        ckpt = Checkpoint(args.out, plan, args, corpus.sha256)
        model, info = train_model(plan, args, vocab, train_ids, chat_ids, val_ids, ckpt)
        save_model(model, tokenizer, args.out / plan.name)
        stats[plan.name] = info
        ckpt.remove()
        del model

    small, tok = reload(args.out / "code-small")
    tiny, _ = reload(args.out / "code-tiny")
    val_loss = {"code-small": evaluate(small, val_ids, args.seq_len, False),
                "code-tiny": evaluate(tiny, val_ids, args.seq_len, False)}
    agree = greedy_agreement(small, tiny, val_ids, args.seq_len, limit=32768)
    log(f"held-out loss (bf16 weights): {val_loss}; greedy agreement {agree:.3f}")
    n_new = 16 if smoke else 64
    stats["code-small"]["samples"] = samples(small, tok, n_new)
    stats["code-tiny"]["samples"] = samples(tiny, tok, n_new)
    for s in stats["code-small"]["samples"]:
        log(f"sample: {s['prompt'] + s['completion']!r}")

    total_minutes = (time.time() - t_start) / 60
    total_cpu_minutes = (time.process_time() - c_start) / 60
    common = {
        "python": platform.python_version(), "sources": corpus.sources,
        "chats": len(chats), "chat_tokens": len(chat_ids),
        "chat_fraction": args.chat_fraction,
        "files_train": len(train_texts), "files_held": len(held_texts),
        "tokens_train": len(train_ids), "tokens_held": len(val_ids) - 1,
        "holdout_every": args.holdout_every if not smoke else 10,
        "corpus_sha256": corpus.sha256, "vocab_size": vocab, "warmup": args.warmup,
        "autocast": "on" if not args.no_autocast else "off", "threads": args.threads,
        "cpu": platform.processor() or platform.machine(), "seed": args.seed,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__, "val_loss": val_loss,
        "greedy_agreement": agree, "total_minutes": total_minutes,
        "total_cpu_minutes": total_cpu_minutes,
        "command": rebuild_command(argv),
    }
    cpu_name = _cpu_name()
    if cpu_name:
        common["cpu"] = cpu_name
    common["device"] = (f"one {torch.cuda.get_device_name()} GPU" if DEVICE.startswith("cuda")
                        else f"{args.threads} CPU thread(s) ({common['cpu']})")
    for name, other in [("code-small", "code-tiny"), ("code-tiny", "code-small")]:
        info = stats[name]
        record = {
            "model": name, "params": info["params"], "architecture": info["architecture"],
            "vocab_size": vocab, "context": args.seq_len, "steps": info["steps"],
            "batch_size": info["batch_size"], "tokens_seen": info["tokens_seen"],
            "peak_lr": info["peak_lr"], "warmup_steps": args.warmup,
            "val_loss": round(val_loss[name], 4), "val_history": info["val_history"],
            "train_minutes": info["train_minutes"], "total_minutes": round(total_minutes, 2),
            "train_cpu_minutes": info["train_cpu_minutes"],
            "total_cpu_minutes": round(total_cpu_minutes, 2),
            "threads": args.threads, "device": common["device"], "seed": args.seed,
            "smoke": smoke,
            "greedy_agreement_draft_vs_target": round(agree, 4),
            "corpus": {"sources": corpus.sources, "python": common["python"],
                       "chat_conversations": len(chats), "chat_tokens": len(chat_ids),
                       "chat_fraction": args.chat_fraction,
                       "train_files": len(train_texts), "held_out_files": len(held_texts),
                       "train_tokens": len(train_ids), "held_out_tokens_scored":
                       len(val_ids) - 1, "sha256": corpus.sha256},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__},
            "command": common["command"],
        }
        folder = args.out / name
        (folder / "TRAINING.json").write_text(json.dumps(record, indent=2) + "\n")
        write_card(folder, name, info, stats[other], common)
    write_index(args.out, stats, common)
    log(f"done in {total_minutes:.1f} min ({total_cpu_minutes:.1f} min CPU) -> {args.out}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    sys.exit(main())
