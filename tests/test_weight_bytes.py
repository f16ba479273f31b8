"""The bytes of weights a decode step reads, as the backend that ran holds them
(`Backend.weight_bytes`): what compare's weights row shows and bench's bandwidth bound
divides by. A quantized run reads its packed codes and scales, not the float model."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from genlib.backends.quant import FORMATS, OUTPUT_FORMAT
from genlib.backends.sizes import step_bytes
from tests.conftest import CODE_TARGET


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


@pytest.mark.parametrize("tied", [True, False])
def test_a_step_reads_every_matrix_once_and_an_untied_input_table_not_at_all(tied):
    model = tiny_llama(tied)
    every = {p.data_ptr(): p.numel() * 4 for p in model.parameters()}
    table = model.get_input_embeddings().weight.numel() * 4
    assert step_bytes(model) == sum(every.values()) - (0 if tied else table)


def packed_bytes(weights: str) -> int:
    """code-target's matrices in `weights` as quant's module doc lays them out: per block
    its codes and one float32 scale; a 4-bit format's output matrix in q8_0."""
    config = json.loads((CODE_TARGET / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    layer = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden + \
        3 * hidden * inner
    output = config["vocab_size"] * hidden  # tied to the embeddings

    def size(count: int, name: str) -> float:
        if name == "float32":
            return 4 * count
        fmt = FORMATS[name]
        return count * fmt.bits / 8 + count / fmt.block * 4

    return int(size(config["num_hidden_layers"] * layer, weights) +
               size(output, OUTPUT_FORMAT.get(weights, weights)))


@pytest.fixture(scope="module")
def quantized_runs():
    if not CODE_TARGET.is_dir():
        pytest.skip("shared models missing")
    result = CliRunner().invoke(app, [
        "compare", "def main():", "-m", str(CODE_TARGET), "--quantize", "none,8bit,4bit",
        "-p", "greedy", "-n", "4", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["runs"]


def test_compare_shows_the_bytes_each_format_reads(quantized_runs):
    """Before, every column showed the float32 model's 69 MB."""
    assert [(run["quantize"], run["weight_bytes"]) for run in quantized_runs] == [
        ("none", packed_bytes("float32")), ("8bit", packed_bytes("q8_0")),
        ("4bit", packed_bytes("nf4"))]
    assert [run["backend"] for run in quantized_runs] == [
        {"name": "native", "reason": "a float32 llama model on the CPU"},
        {"name": "native", "reason": "--quantize 8bit: weights q8_0"},
        {"name": "native", "reason": "--quantize 4bit: weights nf4, output matrix q8_0"}]


def test_bench_bounds_each_row_by_the_bytes_its_backend_reads():
    """A built-in nf4 model: genlab's native rows read the packed codes, the transformers
    baseline its dequantized float parameters; each row's bound is bandwidth / its own
    bytes."""
    result = CliRunner().invoke(app, [
        "bench", "--runs", "1", "--warmup", "0", "--prompt-len", "4", "--new-tokens", "3",
        "--baseline", "transformers", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rows = {r["engine"]: r for r in doc["results"]}
    native, baseline = rows["genlab"], rows["transformers"]
    assert native["backend"] == "native" and native["weights"] == "nf4"
    assert native["weight_bytes"] < baseline["weight_bytes"] / 4
    for row in (native, baseline):
        assert row["bandwidth_bound_tps"] == pytest.approx(
            row["read_bandwidth_gbs"] * 1e9 / row["weight_bytes"])
    assert sorted(doc["machine"]["weight_bytes"].values()) == sorted(
        [native["weight_bytes"], baseline["weight_bytes"]])


@pytest.mark.parametrize("settings", [{"dola_layers": "high"},
                                      {"penalty_alpha": 0.6, "top_k": 4}])
def test_a_figure_never_loads_transformers_model(settings):
    """DoLa's backend asked the base class, which loaded transformers' model inside the
    timed decode (a first token of 2.6 s on a 260K model)."""
    from genlib.events import Prefill
    from genlib.generate import stream
    from genlib.models.loading import ModelSpec, load_model
    from genlib.settings.config import resolve_settings
    from tests.conftest import STORIES

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    lm = load_model(ModelSpec(str(STORIES)), quick=True)
    events = list(stream(lm, [lm.encode("Once upon")],
                         resolve_settings({"max_new_tokens": 3, **settings})))
    [prefill] = [e for e in events if isinstance(e, Prefill)]
    assert not lm.model_loaded
    assert prefill.weight_bytes == lm.lean.weight_bytes > 0
