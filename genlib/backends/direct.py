"""torch.compile for a decode step, called straight into inductor's code after the first
call.

A compiled function called through torch.compile first runs dynamo's frame hook: it
evaluates the guards of the cached graph (every tensor the step reads, ~70 for a small
Llama: dtype, shape, strides, ids of the objects holding them) and unpacks the inputs,
a cost of the same order as a small model's whole compiled step. A decode step is called
hundreds of times with inputs that only change in place (the KV buffers, the position), so
`DirectCompiled` compiles through dynamo once per `key` (the caller's name for the input
shapes), keeps the function inductor built and the inputs dynamo lifted, and calls that
function directly afterwards: what CUDA graphs do for a GPU's launch overhead.

    step = DirectCompiled(fn, options={"cpp_wrapper": True})
    out = step(key, token, position, buffers)   # fn(token, position, buffers) -> Tensor

What a direct call checks, and what it does not:
- The arguments: tensors (alone or in lists and tuples) are passed again on each call and
  must have the shape, stride, dtype and device they had when `key` was compiled; other
  arguments (numbers, strings, None) must be equal to theirs. A call that differs, or
  whose arguments hold anything else (a dict, an object), goes through torch.compile as
  usual, guards and all.
- Not checked: tensors `fn` reads from elsewhere (a model's weights) are held by
  reference as they were when compiled and must not be replaced; grad mode, autocast
  and other global state must stay as they were (the caller runs under inference mode).
- A function returning anything but one tensor, and a torch without inductor's
  `compile_fx`, always go through torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from genlib.errors import CompileError

_PLAIN = (int, float, bool, str, type(None))


@contextmanager
def compile_errors(dtype: torch.dtype, device: torch.device, uncompiled: str
                   ) -> Iterator[None]:
    """torch.compile failing to compile a step (this torch, dtype and device; dynamo's
    exceptions) -> one CompileError line naming the backend `uncompiled` that runs the
    same forward without compiling; anything else as it is."""
    try:
        yield
    except Exception as exc:
        from torch._dynamo.exc import TorchDynamoException  # loaded by the compile

        if not isinstance(exc, TorchDynamoException):
            raise
        why = str(exc).strip().split("\n")[0]
        raise CompileError(
            f"torch {torch.__version__} could not compile the step in "
            f"{str(dtype).removeprefix('torch.')} on {device.type} "
            f"({type(exc).__name__}: {why}); --backend {uncompiled} runs the same "
            f"forward uncompiled") from exc


def _flatten(args: Sequence[Any]) -> tuple[list[torch.Tensor], Any]:
    """The tensors among `args` (inside lists and tuples too), in order, and a signature
    of the call: the tensors' layouts, the other values and the nesting; None when an
    argument is of another kind (such a call is never run directly)."""
    tensors: list[torch.Tensor] = []

    def signature(arg: Any) -> Any:
        if isinstance(arg, torch.Tensor):
            tensors.append(arg)
            return (arg.shape, arg.stride(), arg.dtype, arg.device)
        if isinstance(arg, (list, tuple)):
            parts = tuple([signature(a) for a in arg])  # a list is faster than a generator
            return None if None in parts else (type(arg), parts)
        return (type(arg), arg) if isinstance(arg, _PLAIN) else None

    parts = tuple([signature(a) for a in args])
    return tensors, (None if None in parts else parts)


def _single_output(graph: torch.fx.GraphModule) -> bool:
    # dynamo's graphs return a tuple of outputs; a direct call returns its one element
    # (fn's tensor), so other functions keep going through torch.compile, which rebuilds
    # their results.
    outputs = [node.args[0] for node in graph.graph.nodes if node.op == "output"]
    return len(outputs) == 1 and isinstance(outputs[0], (tuple, list)) and len(outputs[0]) == 1


@dataclass(frozen=True)
class _Entry:
    """One compiled graph: inductor's function, its inputs as they were lifted (the
    tensors `fn` reads from elsewhere; None where an argument tensor goes), and which are
    argument tensors, as (input index, argument tensor index) pairs."""

    fn: Callable[..., Any]
    inputs: tuple[Any, ...]
    from_args: tuple[tuple[int, int], ...]
    signature: Any  # of the call it was compiled for (`_flatten`)

    @classmethod
    def of(cls, fn: Callable[..., Any], example_inputs: Sequence[Any],
           tensors: Sequence[torch.Tensor], signature: Any) -> _Entry:
        index = {id(t): j for j, t in enumerate(tensors)}
        from_args = tuple((i, index[id(x)]) for i, x in enumerate(example_inputs)
                          if id(x) in index)
        inputs = list(example_inputs)
        for i, _ in from_args:
            inputs[i] = None  # filled on each call; holding them would keep old buffers alive
        return cls(fn, tuple(inputs), from_args, signature)

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
        # Each key is one more compiled version of `fn` for dynamo, which by default stops
        # at 8 per function (counting every instance's) and then fails, with fullgraph.
        # Versions already run directly are never looked up again: allow many.
        # (torch before 2.7 calls it cache_size_limit.) Imported here: importing dynamo
        # takes about a second, which a command that never compiles should not pay.
        import torch._dynamo

        limit = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
                 else "cache_size_limit")
        self.dynamo_config = {limit: 1024, **(dynamo_config or {})}
        self._entries: dict[Any, _Entry] = {}
        # What `_backend` built during the current call through dynamo: the backend is
        # called from inside dynamo, so it leaves its result here for `__call__`.
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
        if _single_output(graph):
            self._built = (fn, list(example_inputs))
        return fn

    @property
    def direct_keys(self) -> list[Any]:
        """The keys whose calls skip dynamo."""
        return list(self._entries)

    def __call__(self, key: Any, *args: Any) -> torch.Tensor:
        tensors, signature = _flatten(args)
        entry = self._entries.get(key)
        if entry is not None and signature is not None and entry.signature == signature:
            return entry(tensors)
        try:
            with torch._dynamo.config.patch(**self.dynamo_config):
                out = self._compiled(*args)
            if self._built is not None and entry is None and signature is not None:
                self._entries[key] = _Entry.of(*self._built, tensors, signature)
        finally:
            self._built = None  # it holds this call's tensors
        return out
