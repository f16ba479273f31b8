"""torch.compile for a decode step, called straight into inductor's code after the first
call.

A compiled function called through torch.compile first runs dynamo's frame hook: it
evaluates the guards of the cached graph (every tensor the step reads, ~70 for a small
Llama: dtype, shape, strides, ids of the objects holding them) and unpacks the inputs,
about 0.2 ms a call, a tenth of code-target's whole compiled step. A decode step is called
hundreds of times with inputs that only change in place (the KV buffers, the position), so
`DirectCompiled` compiles through dynamo once per `key` (the caller's name for the input
shapes), keeps the function inductor built and the inputs dynamo lifted, and calls that
function directly afterwards: what CUDA graphs do for a GPU's launch overhead.

    step = DirectCompiled(fn, options={"cpp_wrapper": True})
    out = step(key, token, position, buffers)   # fn(token, position, buffers)

Every tensor argument (in lists or tuples too) is passed again on each call; tensors `fn`
reads from elsewhere (a model's weights) are held by reference and must not be replaced.
A call whose arguments differ in shape, stride, dtype or device from the ones `key` was
compiled with, or a torch without inductor's `compile_fx`, goes through torch.compile as
usual (correct, with its guards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _flat_tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors among `args`, with those inside lists and tuples, in order."""
    out: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            out.append(arg)
        elif isinstance(arg, (list, tuple)):
            out.extend(_flat_tensors(arg))
    return out


def _single_output(graph: torch.fx.GraphModule) -> bool:
    outputs = [node.args[0] for node in graph.graph.nodes if node.op == "output"]
    return len(outputs) == 1 and isinstance(outputs[0], (tuple, list)) and len(outputs[0]) == 1


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], ...]:
    return tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


@dataclass(frozen=True)
class _Entry:
    """One compiled graph: inductor's function, its inputs as they were lifted (the
    tensors it reads from elsewhere stay as they are), and which of them are argument
    tensors, as (input index, argument tensor index) pairs."""

    fn: Callable[..., Any]
    inputs: tuple[Any, ...]
    from_args: tuple[tuple[int, int], ...]
    layout: tuple[tuple[Any, ...], ...]  # of the argument tensors it was compiled for

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        inputs = list(self.inputs)
        for i, j in self.from_args:
            inputs[i] = tensors[j]
        return self.fn(*inputs)[0]


class DirectCompiled:
    """`fn` under torch.compile (fullgraph, static shapes, inductor with `options`, and
    dynamo's `dynamo_config` while it traces), called without dynamo once compiled for a
    key (see the module doc)."""

    def __init__(self, fn: Callable[..., torch.Tensor], options: dict[str, Any],
                 dynamo_config: dict[str, Any] | None = None) -> None:
        self.options = options
        self.dynamo_config = dynamo_config or {}
        self._entries: dict[Any, _Entry] = {}
        self._built: tuple[Callable[..., Any], list[Any]] | None = None
        try:
            from torch._inductor.compile_fx import compile_fx
        except ImportError:  # another torch: plain torch.compile, guards and all
            self._compile_fx = None
            self._compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
        else:
            self._compile_fx = compile_fx
            self._compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                                           backend=self._backend)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # dynamo's graph takes every tensor the step reads, lifted in the order it met them;
        # example_inputs are the real tensors of this call.
        assert self._compile_fx is not None
        fn = self._compile_fx(graph, example_inputs, config_patches=self.options)
        if _single_output(graph):  # what _Entry returns
            self._built = (fn, list(example_inputs))
        return fn

    @property
    def direct_keys(self) -> list[Any]:
        """The keys whose calls skip dynamo."""
        return list(self._entries)

    def __call__(self, key: Any, *args: Any) -> torch.Tensor:
        tensors = _flat_tensors(args)
        entry = self._entries.get(key)
        if entry is not None and entry.layout == _layout(tensors):
            return entry(tensors)
        self._built = None
        with torch._dynamo.config.patch(**self.dynamo_config):
            out = self._compiled(*args)
        if self._built is not None and entry is None:
            self._entries[key] = self._entry(*self._built, tensors)
        return out

    @staticmethod
    def _entry(fn: Callable[..., Any], example_inputs: list[Any],
               tensors: list[torch.Tensor]) -> _Entry:
        index = {id(t): j for j, t in enumerate(tensors)}
        from_args = tuple((i, index[id(x)]) for i, x in enumerate(example_inputs)
                          if id(x) in index)
        inputs = list(example_inputs)
        for i, _ in from_args:
            inputs[i] = None  # filled on each call; holding them would keep old buffers alive
        return _Entry(fn, tuple(inputs), from_args, _layout(tensors))
