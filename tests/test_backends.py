"""Every backend against transformers: greedy tokens identical to `generate()`, extend(k)
equal to k steps, crop-then-extend equal to a fresh prefill, reorder equal to
transformers' own cache reorder; what each backend refuses, and with which message; and
the choice `auto` makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from genlib.backends.choose import BACKENDS, Request, choose_backend
from genlib.backends.transformers import cache_keyword, cache_kwargs
from genlib.errors import ConfigError
from genlib.generate import generate
from genlib.settings.config import GenerationSettings
from tests.conftest import transformers_backend

NAMED = [b for b in BACKENDS if b != "auto"]


def backend_or_skip(lm, name: str, **request):
    """The named backend over `lm`, or a skip saying why it cannot serve (that refusal is
    checked by the refusal tests below)."""
    try:
        return choose_backend(lm, Request(backend=name, **request))
    except ConfigError as error:
        pytest.skip(str(error))


def hf_greedy(lm, ids: list[int], n: int) -> list[int]:
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                            eos_token_id=list(lm.eos_ids), pad_token_id=lm.pad_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["auto", *NAMED])
def test_greedy_tokens_equal_transformers_on_every_backend(tiny, name):
    if name == "compiled" and tiny.ref != "tiny-llama":
        pytest.skip("torch.compile of every tiny architecture would take minutes; the "
                    "compiled backend is checked on the lean-eligible tiny llama")
    backend_or_skip(tiny, name)
    ids = [1, 37, 99, 4, 250]
    [ours] = generate(tiny, [ids], GenerationSettings(max_new_tokens=24), backend=name)
    assert list(ours.token_ids) == hf_greedy(tiny, ids, 24)[:len(ours.token_ids)]


@pytest.mark.parametrize("name", ["auto", "lean", "native", "transformers"])
def test_greedy_tokens_equal_transformers_on_the_shared_models(stories, code_target, name):
    for lm, prompt in ((stories, "Once upon a time"), (code_target, "def fibonacci(n):")):
        ids = lm.encode(prompt)
        [ours] = generate(lm, [ids], GenerationSettings(max_new_tokens=60), backend=name)
        assert list(ours.token_ids) == hf_greedy(lm, ids, 60)[:len(ours.token_ids)]


@pytest.mark.parametrize("name", NAMED)
def test_extend_k_equals_k_steps_and_crop_then_extend_equals_a_fresh_prefill(tiny, name):
    if name == "compiled" and tiny.ref != "tiny-llama":
        pytest.skip("torch.compile of every tiny architecture would take minutes")
    ids, more = [1, 37, 99, 4], [250, 7, 300]
    a = backend_or_skip(tiny, name, crop=True)
    b = choose_backend(tiny, Request(backend=name, crop=True))
    a.prefill([ids], 32)
    b.prefill([ids], 32)
    together = a.extend(torch.tensor([more]))[0]
    one_by_one = torch.stack([b.step(torch.tensor([t]))[0] for t in more])
    # The same arithmetic where a backend feeds k tokens as k steps; another order of
    # sums otherwise (lean/native: one product over k rows).
    torch.testing.assert_close(together, one_by_one, atol=1e-4, rtol=1e-4)
    assert a.length == b.length == len(ids) + len(more)
    a.crop(len(ids) + 1)  # roll back past the last two
    cropped = a.extend(torch.tensor([[7, 300]]))[0]
    fresh = transformers_backend(tiny.model).prefill_ids(
        torch.tensor([ids + [250, 7, 300]]), torch.ones(1, 7, dtype=torch.long),
        all_logits=True)[0, -2:]
    torch.testing.assert_close(cropped, fresh, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["transformers", "native"])
def test_reorder_matches_transformers_own_cache_reorder(tiny, name):
    """Rows reordered (and duplicated) in our cache give the logits of transformers' own
    `reorder_cache` on its cache of the same prompts: bit for bit on transformers' forward,
    to float32 rounding on the native kernel (its sums run in another order)."""
    prompts = [[1, 37, 99, 4], [1, 5, 6, 7]]
    ours = backend_or_skip(tiny, name, rows=2, reorder=True)
    theirs = transformers_backend(tiny.model)
    ours.prefill(prompts, 16)
    theirs.prefill_ids(torch.tensor(prompts), torch.ones(2, 4, dtype=torch.long))
    order = torch.tensor([1, 1, 0])
    ours.reorder(order)
    theirs.cache.reorder_cache(order)
    token = torch.tensor([42, 43, 44])
    out = tiny.model(input_ids=token[:, None], use_cache=True,
                     **cache_kwargs(tiny.model, theirs.cache))
    expected = out.logits[:, -1].float()
    if name == "transformers":
        assert torch.equal(ours.step(token), expected)
    else:
        torch.testing.assert_close(ours.step(token), expected, atol=1e-4, rtol=1e-4)


def test_native_rows_give_each_row_its_own_bits(stories):
    """A batch on the native backend, rows of different lengths, gives every row the
    logits of that row alone, bit for bit: a row's tokens do not depend on its
    batch-mates (so seeds reproduce across batch sizes)."""
    prompts = [stories.encode("Once upon a time"), stories.encode("The cat"),
               stories.encode("Lily and Tom went to the park")]
    batch = backend_or_skip(stories, "native", rows=3)
    first = batch.prefill(prompts, 64)
    steps = [batch.step(torch.tensor([42, 7, 300]))]
    for row, prompt in enumerate(prompts):
        alone = choose_backend(stories, Request(backend="native"))
        assert torch.equal(alone.prefill([prompt], 64)[0], first[row])
        assert torch.equal(alone.step(torch.tensor([[42, 7, 300][row]]))[0], steps[0][row])


@pytest.mark.parametrize("name", ["lean", "compiled"])
def test_one_row_backends_refuse_several_rows_and_reorder_naming_what_works(stories, name):
    with pytest.raises(ConfigError, match=f"the {name} backend runs one row, and this "
                                          f"generation needs beam search; use --backend "
                                          f"native or transformers"):
        choose_backend(stories, Request(rows=4, reorder=True, backend=name))
    with pytest.raises(ConfigError, match=f"the {name} backend runs one row, and this "
                                          f"generation needs 3 rows at once"):
        choose_backend(stories, Request(rows=3, backend=name))


@pytest.mark.parametrize("name", ["lean", "native"])
def test_lean_backends_refuse_models_that_are_not_plain_llama(tiny, name):
    if tiny.ref in ("tiny-llama", "tiny-qwen2", "tiny-gpt2"):
        pytest.skip("an architecture the lean forward runs")
    arch = tiny.ref.removeprefix("tiny-")
    with pytest.raises(ConfigError, match=f"the {name} backend runs the lean forward, which "
                                          f"cannot run {tiny.ref}: model_type '{arch}' is "
                                          f"not one the lean forward runs \\(llama, mistral, "
                                          f"qwen2, qwen3, granite, phi3, gemma2, gemma3_text, "
                                          f"gpt2\\)"
                                          f"; use --backend compiled or transformers "
                                          f"\\(or auto\\)$"):
        choose_backend(tiny, Request(backend=name))


def test_the_operations_a_backend_lacks_raise_a_config_error_naming_it(stories):
    lean = choose_backend(stories, Request(backend="lean"))
    lean.prefill([[1, 2]], 8)
    with pytest.raises(ConfigError, match="the lean backend cannot reorder its cache rows"):
        lean.reorder(torch.tensor([0]))
    with pytest.raises(ConfigError, match="the lean backend runs 1 row at a time, not 2"):
        lean.prefill([[1, 2], [1, 3]], 8)


def test_a_refusal_names_only_backends_that_can_serve(stories, monkeypatch):
    """Following a refusal's advice never meets a second refusal: no native backend
    offered where it cannot run (bfloat16, no kernel), no lean one for several rows, and a
    quantized Llama is refused for what it is, not as another architecture."""
    import dataclasses

    from genlib.backends import native
    from genlib.models.loading import ModelSpec, load_model

    half = load_model(ModelSpec(stories.ref, dtype="bfloat16"))
    for request in (Request(rows=2, backend="lean"), Request(rows=4, reorder=True,
                                                             backend="compiled")):
        with pytest.raises(ConfigError, match=r"needs .*; use --backend transformers \(or"):
            choose_backend(half, request)
    with pytest.raises(ConfigError, match=r"float32 on the CPU; use --backend transformers"):
        choose_backend(half, Request(rows=2, backend="native"))
    quantized = dataclasses.replace(stories, quantize="8bit")
    with pytest.raises(ConfigError, match=r"^the native backend does not run quantized "
                                          r"models; use --backend transformers \(or auto\)$"):
        choose_backend(quantized, Request(backend="native"))
    monkeypatch.setattr(native, "kernel_applies", lambda lean, weights=None: "no C compiler found")
    with pytest.raises(ConfigError, match=r"no C compiler found; use --backend lean or "
                                          r"compiled or transformers \(or auto\)$"):
        choose_backend(stories, Request(backend="native"))
    with pytest.raises(ConfigError, match=r"no C compiler found; use --backend transformers "
                                          r"\(or auto\)$"):
        choose_backend(stories, Request(rows=3, backend="native"))
    with pytest.raises(ConfigError, match=r"beam search; use --backend transformers \(or"):
        choose_backend(stories, Request(rows=4, reorder=True, backend="lean"))


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_auto_gives_speculation_in_bfloat16_a_cache_that_rolls_back(
        arch, stories_tokenizer, monkeypatch):
    """In bfloat16 on a CPU one row gets the lean forward, exact; with no lean forward
    (another architecture, GENLAB_LEAN=0) it gets transformers, speculation included
    (a compiled static cache could not roll back), and its tokens are plain greedy's."""
    from transformers import AutoModelForCausalLM

    from genlib.decoding.speculative import Drafting
    from genlib.models.loading import wrap_model
    from tests.conftest import tiny_config

    if arch == "llama":
        monkeypatch.setenv("GENLAB_LEAN", "0")  # keeps the compiled step off the lean forward
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).to(torch.bfloat16)
    lm = wrap_model(model, stories_tokenizer, ref=f"tiny-{arch}")
    backend = choose_backend(lm, Request(crop=True))
    assert backend.name == "transformers"
    assert backend.reason == (
        "transformers' forward; GENLAB_LEAN=0 keeps auto off the lean forward"
        if arch == "llama" else
        "transformers' forward; the native backend runs the lean forward, which cannot run "
        "tiny-gpt_neox: model_type 'gpt_neox' is not one the lean forward runs (llama, "
        "mistral, qwen2, qwen3, granite, phi3, gemma2, gemma3_text, gpt2)")
    ids, settings = [1, 37, 99, 4, 250], GenerationSettings(max_new_tokens=12)
    [plain] = generate(lm, [ids], settings, backend="transformers")
    [drafted] = generate(lm, [ids], settings, drafter=Drafting(prompt_lookup=2))
    assert drafted.token_ids == plain.token_ids


def test_an_unknown_backend_name_is_refused():
    with pytest.raises(ConfigError, match="--backend must be one of auto, transformers"):
        choose_backend(None, Request(backend="fast"))  # type: ignore[arg-type]


def test_auto_picks_native_lean_or_transformers_and_says_why(stories, tiny, monkeypatch):
    from genlib.backends import kernel

    native = kernel.build().library is not None
    backend = choose_backend(stories, Request())
    assert backend.name == ("native" if native else "lean")
    assert backend.reason == ("a float32 llama model on the CPU" if native else
                              f"the lean forward; the native backend cannot run here: "
                              f"{kernel.build().reason}")
    many = "native" if native else "transformers"
    assert choose_backend(stories, Request(rows=2)).name == many
    assert choose_backend(stories, Request(rows=4, reorder=True)).name == many
    assert choose_backend(tiny, Request(rows=2)).name == \
        ("transformers" if tiny.ref == "tiny-gpt_neox" else many)
    monkeypatch.setenv("GENLAB_NATIVE", "0")
    off = "GENLAB_NATIVE=0 keeps auto off the native kernel"
    assert (choose_backend(stories, Request()).name,
            choose_backend(stories, Request()).reason) == ("lean", f"the lean forward; {off}")
    assert choose_backend(stories, Request(rows=4, reorder=True)).reason == \
        f"transformers' forward; {off}"
    monkeypatch.setenv("GENLAB_LEAN", "0")
    assert choose_backend(stories, Request()).name == "transformers"


def test_the_cli_announces_the_kernel_build_once_on_stderr(tmp_path, monkeypatch):
    """A fresh cache: the first generation says it builds the kernel (stderr, the text on
    stdout untouched), the second finds it built and says nothing."""
    from typer.testing import CliRunner

    from cli.main import app
    from genlib.backends import kernel
    from tests.conftest import STORIES

    if kernel._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel.build.cache_clear()
    try:
        runs = [CliRunner().invoke(app, ["generate", "Once upon a time", "-m", str(STORIES),
                                         "-n", "8", "--stats"]) for _ in range(2)]
    finally:
        kernel.build.cache_clear()
    assert [r.exit_code for r in runs] == [0, 0]
    assert kernel.BUILDING in runs[0].stderr and kernel.BUILDING not in runs[1].stderr
    assert runs[0].stdout == runs[1].stdout and kernel.BUILDING not in runs[0].stdout
    assert "backend native" in runs[1].stderr


def test_a_batch_file_on_a_backend_that_cannot_run_is_refused_once(tmp_path):
    """--input with a backend that cannot run this model at all (native in bfloat16): one
    line and exit 2 before any line, not an error record written for every line."""
    from typer.testing import CliRunner

    from cli.main import app
    from tests.conftest import STORIES

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "Once"}\n{"prompt": "The cat"}\n')
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", "-m", str(STORIES), "--dtype", "bfloat16",
                                      "--backend", "native", "-n", "4", "--input",
                                      str(lines), "-o", str(out)])
    assert result.exit_code == 2
    assert result.stderr.count("the native backend cannot run here") == 1
    assert out.read_text() == ""


def test_the_cache_goes_to_the_forward_by_the_name_it_takes(tiny):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name
    warns on every call): a forward that takes `cache` gets it so, one that only takes
    `past_key_values` (earlier releases, remote code) gets that, and no step warns."""
    import warnings

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    backend = choose_backend(tiny, Request(rows=2, backend="transformers"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        backend.prefill([[1, 5, 9], [4, 2]], 8)  # a padded row: the masked path too
        backend.step(torch.tensor([7, 8]))
        backend.extend(torch.tensor([[3, 4], [5, 6]]))


def test_a_static_step_torch_cannot_compile_names_the_uncompiled_backend(tiny, monkeypatch):
    """The compiled backend over transformers' forward (a model with no lean forward):
    a step torch.compile refuses is a CompileError naming --backend transformers, which
    runs that forward uncompiled."""
    import torch._dynamo

    from genlib.backends import compiled
    from genlib.errors import CompileError

    if tiny.ref != "tiny-gpt_neox":
        pytest.skip("one architecture without a lean forward is enough")

    def step_with_a_graph_break(*args):
        torch._dynamo.graph_break()  # fullgraph: dynamo refuses it

    monkeypatch.setattr(compiled, "_one_token_step", step_with_a_graph_break)
    monkeypatch.setattr(compiled, "_compiled_steps", {})
    backend = choose_backend(tiny, Request(backend="compiled"))
    assert type(backend).__name__ == "CompiledStaticBackend"
    backend.prefill([[1, 37, 99]], 16)
    with pytest.raises(CompileError, match=r"could not compile the step in float32 on cpu "
                                           r"\(Unsupported: .*\); --backend transformers "
                                           r"runs the same forward uncompiled$"):
        backend.step(torch.tensor([4]))


def test_compile_errors_leaves_other_failures_as_they_are():
    from genlib.backends.direct import compile_errors

    with pytest.raises(ValueError, match="not a compile failure"):
        with compile_errors(torch.float32, torch.device("cpu"), uncompiled="lean"):
            raise ValueError("not a compile failure")


def test_auto_keeps_bfloat16_on_a_gpu_to_the_exact_lean_forward(stories):
    """On an H100 in bfloat16 the compiled step parted from transformers' greedy tokens
    on 2 of 4 code prompts while the lean forward kept them all (docs/performance.md), as
    on a CPU: auto gives one row in bfloat16 the lean forward on any device, and keeps the
    compiled step for float32 on a GPU, where it gave transformers' tokens."""
    import dataclasses

    from genlib.backends.choose import backend_name
    from genlib.models.loading import ModelSpec, load_model

    half = load_model(ModelSpec(stories.ref, dtype="bfloat16"))
    gpu = torch.device("cuda")
    assert backend_name(dataclasses.replace(half, device=gpu), Request()) == "lean"
    assert backend_name(dataclasses.replace(stories, device=gpu), Request()) == "compiled"
    assert backend_name(half, Request()) == "lean"


@pytest.mark.parametrize("request_", [Request(), Request(rows=3), Request(rows=4, reorder=True),
                                      Request(crop=True), Request(hidden="DoLa"),
                                      Request(rows=2, hidden="DoLa")],
                         ids=["one", "rows", "beam", "crop", "hidden", "hidden-rows"])
def test_auto_and_each_refusal_come_from_the_backends_own_answers(stories, request_,
                                                                   monkeypatch):
    """auto takes the first backend in `order()` that serves and is not passed over; a
    backend asked for that cannot serve is refused with its own answer and the names of
    exactly the backends that answer that they serve, each of which then builds."""
    from genlib.backends import choose

    for native_off in ("1", "0"):
        monkeypatch.setenv("GENLAB_NATIVE", native_off)
        answers = {kind.name: (kind.supports(stories, request_),
                               kind.passed_over(stories, request_)) for kind in choose.order()}
        takers = [name for name, (no, passed) in answers.items() if no is None and passed is None]
        if takers:
            assert choose.backend_name(stories, request_) == takers[0]
        else:
            with pytest.raises(ConfigError) as refused:
                choose.backend_name(stories, request_)
            assert str(refused.value) == answers["lean"][0]
        serving = [name for name, (no, _) in answers.items() if no is None]
        assert choose.serving(stories, request_) == serving
        for name, (no, _) in answers.items():
            asked = dataclasses.replace(request_, backend=name)
            if no is None:
                assert choose_backend(stories, asked).name == name
                continue
            with pytest.raises(ConfigError) as refused:
                choose_backend(stories, asked)
            others = [other for other in serving if other != name]
            assert str(refused.value) == (f"{no}; use --backend {' or '.join(others)} (or auto)"
                                          if others else
                                          f"{no}; no backend serves this generation here")
