"""The decode loop against transformers' own generate(), on real and tiny random models."""

from __future__ import annotations

import pytest
import torch

from genlib import generate
from genlib.backends.transformers import TransformersBackend
from genlib.decoding import step
from genlib.errors import ContextLengthError
from genlib.events import Finish, Prefill, Token
from genlib.settings.config import resolve_settings

STORY_PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the", "One day,"]


def hf_greedy(lm, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(), the reference: new token ids only."""
    inputs = torch.tensor([ids])
    out = lm.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                            max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=lm.pad_id)
    return out[0, len(ids):].tolist()


def greedy(max_new_tokens: int, **extra):
    return resolve_settings({"max_new_tokens": max_new_tokens, **extra})


@pytest.mark.parametrize("prompt", STORY_PROMPTS)
def test_greedy_matches_transformers_on_stories260k(stories, prompt):
    ids = stories.encode(prompt)
    [ours] = generate.generate(stories, [ids], greedy(80))
    assert list(ours.token_ids) == hf_greedy(stories, ids, 80)


@pytest.mark.parametrize("prompt", STORY_PROMPTS[:3])
def test_greedy_matches_transformers_on_llama2xs(llama2xs, prompt):
    ids = llama2xs.encode(prompt)
    [ours] = generate.generate(llama2xs, [ids], greedy(60))
    assert list(ours.token_ids) == hf_greedy(llama2xs, ids, 60)


def test_greedy_matches_transformers_on_tiny_architectures(tiny):
    ids = tiny.encode("Once upon a time there was")
    [ours] = generate.generate(tiny, [ids], greedy(30))
    reference = hf_greedy(tiny, ids, 30)
    assert list(ours.token_ids) == reference
    assert len(reference) > 1


def test_golden_story_ends_at_bos(stories):
    """The story's end token is BOS (id 1): a loop that honours every eos id stops there."""
    [out] = generate.generate(stories, [stories.encode("Once upon a time")], greedy(500))
    assert out.text.startswith(", there was a little girl named Lily. She loved to play "
                               "outside in the park.")
    assert out.reason == "eos"
    assert out.token_ids[-1] == 1
    assert out.new_tokens < 500


def test_batched_greedy_equals_unbatched_row_by_row(stories):
    prompts = [stories.encode(p) for p in STORY_PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # really different lengths: left padding
    batched = generate.generate(stories, prompts, greedy(40))
    for prompt, row in zip(prompts, batched):
        [alone] = generate.generate(stories, [prompt], greedy(40))
        assert row.token_ids == alone.token_ids
        assert row.text == alone.text


def test_batched_greedy_on_tiny_architectures(tiny):
    prompts = [tiny.encode(p) for p in STORY_PROMPTS[:3]]
    batched = generate.generate(tiny, prompts, greedy(12))
    for prompt, row in zip(prompts, batched):
        assert list(row.token_ids) == hf_greedy(tiny, prompt, 12)[:len(row.token_ids)]


def test_kv_cache_logits_equal_full_recompute(stories):
    ids = stories.encode("Once upon a time, there was a dog")
    backend = TransformersBackend(stories)
    backend.prefill([ids[:4]], len(ids))
    cached = backend.extend(torch.tensor([ids[4:]]))
    with torch.no_grad():
        full = stories.model(torch.tensor([ids])).logits.float()
    torch.testing.assert_close(cached[0], full[0, 4:], atol=1e-4, rtol=1e-4)


def test_streamed_pieces_join_to_final_text_and_keep_spaces(stories):
    ids = stories.encode("Once upon a time")
    pieces, finish = [], None
    for event in generate.stream(stories, [ids], greedy(60)):
        if isinstance(event, Token):
            pieces.append(event.text)
        elif isinstance(event, Finish):
            finish = event
    streamed = "".join(pieces) + finish.tail
    assert streamed == finish.text
    whole = stories.tokenizer.decode(ids + list(finish.token_ids), skip_special_tokens=True)
    prompt_text = stories.tokenizer.decode(ids, skip_special_tokens=True)
    assert prompt_text + streamed == whole
    assert streamed.startswith(", there was")


def test_stop_string_spanning_tokens_is_not_printed(stories):
    settings = greedy(80, stop_strings=["named Lily"])
    pieces, finish = [], None
    for event in generate.stream(stories, [stories.encode("Once upon a time")], settings):
        if isinstance(event, Token):
            pieces.append(event.text)
        elif isinstance(event, Finish):
            finish = event
    assert finish.reason == "stop"
    assert finish.text == ", there was a little girl "
    assert "".join(pieces) + finish.tail == finish.text


def test_max_new_tokens_and_max_time(stories):
    [out] = generate.generate(stories, [stories.encode("Once")], greedy(7))
    assert out.reason == "length" and out.new_tokens == 7
    [timed] = generate.generate(stories, [stories.encode("Once")],
                              greedy(300, max_time=0.001, ignore_eos=True))
    assert timed.reason == "time" and timed.new_tokens < 300


def test_ignore_eos_runs_to_the_budget(stories):
    [out] = generate.generate(stories, [stories.encode("Once upon a time")],
                            greedy(400, ignore_eos=True))
    assert out.new_tokens == 400 and out.reason == "length"
    assert 1 not in out.token_ids and 2 not in out.token_ids


def test_context_limit_is_a_clear_error(llama2xs):
    with pytest.raises(ContextLengthError, match="256 positions"):
        list(generate.stream(llama2xs, [llama2xs.encode("Once upon a time")], greedy(300)))


def test_events_carry_prefill_and_timings(stories):
    events = list(generate.stream(stories, [stories.encode("Once upon a time")], greedy(10)))
    assert isinstance(events[0], Prefill) and events[0].prompt_tokens == (5,)
    tokens = [e for e in events if isinstance(e, Token)]
    assert [t.index for t in tokens] == list(range(10))
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.ttft is not None and finish.ttft > 0
    assert finish.tokens_per_second > 0
    assert [t.token_id for t in tokens] == list(finish.token_ids)


def test_model_logprobs_are_log_softmax_of_raw_logits(stories):
    ids = stories.encode("Once upon a time")
    [out] = generate.generate(stories, [ids], greedy(3))
    with torch.no_grad():
        logits = stories.model(torch.tensor([ids + list(out.token_ids)])).logits[0].float()
    expected = logits.log_softmax(-1)[len(ids) - 1:-1].gather(
        -1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_same_seed_same_sample_and_rows_differ(stories):
    settings = resolve_settings({"temperature": 1.0, "seed": 7, "max_new_tokens": 20,
                                 "num_return_sequences": 3})
    ids = stories.encode("Once upon a time")
    first = generate.generate(stories, [ids], settings)
    again = generate.generate(stories, [ids], settings)
    assert [f.token_ids for f in first] == [f.token_ids for f in again]
    assert len({f.token_ids for f in first}) > 1
    [single] = generate.generate(stories, [ids], settings.replace(num_return_sequences=1))
    assert single.token_ids == first[0].token_ids  # row 0 uses the seed itself


def test_interrupt_finishes_rows_as_interrupted(stories):
    events = generate.stream(stories, [stories.encode("Once upon a time")],
                           greedy(200, ignore_eos=True))
    seen = [next(events) for _ in range(6)]  # prefill + 5 tokens
    rest = list(step.interrupt(events))
    assert isinstance(seen[0], Prefill)
    [finish] = [e for e in rest if isinstance(e, Finish)]
    assert finish.reason == "interrupted" and finish.new_tokens == 5


def test_a_one_row_backend_with_beam_search_is_refused_not_ignored(stories):
    """An explicit backend that cannot hold beam search's rows is refused, naming what
    would work, in genlib and on the command line; --compile names its replacement."""
    from typer.testing import CliRunner

    from cli.main import app
    from genlib.errors import ConfigError

    settings = resolve_settings({"strategy": "beam", "max_new_tokens": 5})
    with pytest.raises(ConfigError, match="the lean backend runs one row.*beam search; "
                                          "use --backend native or transformers"):
        list(generate.stream(stories, [stories.encode("Hi")], settings, backend="lean"))
    result = CliRunner().invoke(app, ["generate", "Hi", "-m", stories.ref, "-s", "beam",
                                      "--backend", "lean", "-n", "5"])
    assert result.exit_code == 2
    assert "the lean backend runs one row" in result.output
    result = CliRunner().invoke(app, ["generate", "Hi", "-m", stories.ref, "--compile"])
    assert result.exit_code == 2
    assert "--compile was replaced by --backend" in result.output
