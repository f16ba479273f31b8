"""genlib.backends.direct.DirectCompiled: compiled once per key through dynamo, then
called straight into inductor's function, with the current argument tensors."""

import pytest
import torch

from genlib.backends.direct import DirectCompiled


class Step:
    """A decode-step-like function: a weight read from an attribute, a buffer (an
    argument) written in place at a position held in a 0-d tensor."""

    def __init__(self) -> None:
        self.weight = torch.arange(12.0).view(3, 4)

    def __call__(self, x: torch.Tensor, position: torch.Tensor,
                 buffers: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        y = x @ self.weight
        buffers[0].index_copy_(0, position.view(1), y)
        return buffers[0].sum(0) + y * scale


def reference(step: Step, x, position, buffer, scale: float = 1.0):
    """The eager result, and the buffer as the step leaves it (on a copy)."""
    copy = buffer.clone()
    return step(x, position, [copy], scale), copy


def refuse_dynamo(*args):
    raise AssertionError("went through dynamo")


@pytest.fixture
def compiled():
    torch._dynamo.reset()
    step = Step()
    return step, DirectCompiled(step, options={})


@torch.inference_mode()
def test_later_calls_skip_dynamo_and_see_the_current_inputs(compiled):
    step, direct = compiled
    buffer = torch.zeros(5, 4)
    x, position = torch.ones(1, 3), torch.tensor(0)
    expected, _ = reference(step, x, position, buffer)
    assert torch.equal(direct("five", x, position, [buffer]), expected)
    assert direct.direct_keys == ["five"]
    direct._compiled = refuse_dynamo  # from here on, a call through dynamo fails
    for i in range(1, 4):
        x = torch.full((1, 3), float(i + 1))
        position = torch.tensor(i)  # a new tensor each time: the one passed is the one used
        expected, after = reference(step, x, position, buffer)
        assert torch.equal(direct("five", x, position, [buffer]), expected)
        assert torch.equal(buffer, after)  # the in-place write happened
    # New buffer objects of the same layout (a reallocated cache) are the ones used.
    fresh = torch.full((5, 4), 2.0)
    expected, after = reference(step, x, position, fresh)
    assert torch.equal(direct("five", x, position, [fresh]), expected)
    assert torch.equal(fresh, after)


@torch.inference_mode()
def test_arguments_of_another_layout_go_through_dynamo(compiled):
    step, direct = compiled
    x, position = torch.ones(1, 3), torch.tensor(0)
    direct("five", x, position, [torch.zeros(5, 4)])
    with pytest.raises(AssertionError, match="went through dynamo"):
        saved, direct._compiled = direct._compiled, refuse_dynamo
        direct("five", x, position, [torch.zeros(4, 5).t()])  # same shape, other strides
    direct._compiled = saved
    bigger = torch.zeros(7, 4)
    expected, _ = reference(step, x, position, bigger)
    assert torch.equal(direct("seven", x, position, [bigger]), expected)
    assert direct.direct_keys == ["five", "seven"]


@torch.inference_mode()
def test_other_arguments_must_be_equal_to_run_directly(compiled):
    step, direct = compiled
    buffer, x, position = torch.zeros(5, 4), torch.ones(1, 3), torch.tensor(1)
    direct("five", x, position, [buffer], 1.0)
    expected, _ = reference(step, x, position, buffer, 3.0)
    assert torch.equal(direct("five", x, position, [buffer], 3.0), expected)
    saved, direct._compiled = direct._compiled, refuse_dynamo
    with pytest.raises(AssertionError, match="went through dynamo"):
        direct("five", x, position, [buffer], 3.0)  # only the first call's 1.0 is direct
    with pytest.raises(AssertionError, match="went through dynamo"):
        direct("five", x, position, {"buffers": buffer})  # a dict is never run directly
    direct._compiled = saved


@torch.inference_mode()
def test_more_keys_than_dynamos_default_limit_of_eight(compiled):
    """dynamo stops after 8 versions of a function (and fails, with fullgraph)."""
    step, direct = compiled
    x, position = torch.ones(1, 3), torch.tensor(0)
    for rows in range(2, 12):
        buffer = torch.zeros(rows, 4)
        expected, _ = reference(step, x, position, buffer)
        assert torch.equal(direct(rows, x, position, [buffer]), expected)
    assert direct.direct_keys == list(range(2, 12))


def test_importing_the_decode_path_does_not_import_dynamo():
    """Importing dynamo takes about a second: only a compile should pay it."""
    import subprocess
    import sys

    modules = ("genlib.generate", "genlib.decoding.loop", "genlib.backends.choose",
               "genlib.backends.llama", "genlib.backends.lean", "genlib.backends.native",
               "genlib.backends.compiled", "genlib.backends.direct", "genlib.models.quickload")
    code = f"import sys, {', '.join(modules)}; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
