"""Rich output for `genlab beam`: the n-best table (with the greedy result for contrast)
and the search tree. Printed to stdout: they are the command's result."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from cli.render import out

if TYPE_CHECKING:
    from genlib.decoding.beam import BeamResult, Hypothesis, TreeCandidate, TreeStep
    from genlib.events import Finish

STATUS_STYLE = {"kept": "green", "finished": "bold cyan", "pruned": "dim strike",
                "rejected": "red dim"}
STATUS_MARK = {"kept": "kept", "finished": "done", "pruned": "pruned", "rejected": "rejected"}


def nbest_table(prompt: str, hypotheses: Sequence[Hypothesis], greedy: Finish | None,
                length_penalty: float) -> None:
    """The n-best hypotheses, best first, and the greedy output below them."""
    constrained = any(h.constraints_satisfied is not None for h in hypotheses)
    table = Table(title=f"beam search: {prompt!r}", title_justify="left", show_lines=True)
    for name, justify in (("#", "right"), ("score", "right"), ("logprob", "right"),
                          ("tokens", "right"), ("end", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    if constrained:
        table.add_column("forced", no_wrap=True)
    table.add_column("text", overflow="fold")
    for rank, hyp in enumerate(hypotheses, 1):
        row = [str(rank), f"{hyp.score:.4f}", f"{hyp.sum_logprob:.3f}",
               str(len(hyp.token_ids)), hyp.finish_reason]
        if constrained:
            row.append("met" if hyp.constraints_satisfied else "[red]NOT met[/]")
        table.add_row(*row, Text(hyp.text))
    if greedy is not None:
        from genlib.decoding.beam import length_score

        total = sum(greedy.logprobs)
        score = length_score(total, greedy.new_tokens, length_penalty)
        row = ["greedy", f"{score:.4f}", f"{total:.3f}", str(greedy.new_tokens), greedy.reason]
        if constrained:
            row.append("-")
        table.add_row(*row, Text(greedy.text), style="dim")
    out.print(table)


def _label(c: TreeCandidate) -> Text:
    # One line a node, cut with "…" where the tree's indent leaves it too little room.
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(repr(c.token), style=STATUS_STYLE[c.status])
    text.append(f"  p={c.prob:.3f}  cum logprob={c.score:.3f} (P={math.exp(c.score):.2e})  ",
                style="dim" if c.status == "pruned" else "")
    text.append(STATUS_MARK[c.status], style=STATUS_STYLE[c.status])
    return text


def search_tree(result: BeamResult, prompt: str, max_steps: int, max_children: int) -> None:
    """Each kept beam's node lists the continuations considered from it at the next step
    (kept, finished, pruned, rejected) with p and the cumulative log-probability."""
    steps = result.tree or []
    out.print(tree_view(steps, prompt, max_steps, max_children), soft_wrap=False)
    tree_notes(steps, max_steps, max_children)


def tree_view(steps: Sequence[TreeStep], prompt: str, max_steps: int, max_children: int
              ) -> Tree:
    """The search tree of `steps` so far (drawn live as the search runs, then once more
    with its notes)."""
    root = Tree(Text(f"prompt {prompt!r}", style="bold", no_wrap=True, overflow="ellipsis"))
    groups = sorted({c.group for s in steps for c in s.candidates})
    shown = [s for s in steps if s.step < max_steps]
    for group in groups:
        top = root.add(Text(f"group {group}", style="bold")) if len(groups) > 1 else root
        _grow(top, [s for s in shown if s.candidates and s.candidates[0].group == group],
              max_children)
    return root


def tree_notes(steps: Sequence[TreeStep], max_steps: int, max_children: int) -> None:
    total = max((s.step for s in steps), default=-1) + 1
    if total > max_steps:
        out.print(Text(f"(tree cut after {max_steps} of {total} steps; --tree-steps N shows "
                       f"more)", style="dim"), soft_wrap=False)
    out.print(Text(f"(each beam shows at most {max_children} of the candidates considered "
                   f"from it; the rest are counted in its '... N more not kept' line)",
                   style="dim"), soft_wrap=False)


def _grow(top: Tree, steps: Sequence[TreeStep], max_children: int) -> None:
    previous: dict[int, Tree] = {}
    for tree_step in steps:
        current: dict[int, Tree] = {}
        by_parent: dict[int, list[TreeCandidate]] = {}
        for c in tree_step.candidates:
            by_parent.setdefault(c.parent, []).append(c)
        for parent, cands in by_parent.items():
            node = top if tree_step.step == 0 else previous.get(parent)
            if node is None:
                continue
            for c in cands[:max_children]:
                child = node.add(_label(c))
                if c.slot is not None:
                    current[c.slot] = child
            for c in cands[max_children:]:
                if c.slot is not None:
                    current[c.slot] = node.add(_label(c))
            hidden = sum(1 for c in cands[max_children:] if c.slot is None)
            if hidden:
                node.add(Text(f"... {hidden} more not kept", style="dim"))
        previous = current


def tree_json(result: BeamResult) -> list[dict[str, Any]]:
    return [{"step": s.step, "candidates": [
        {"group": c.group, "parent": c.parent, "token_id": c.token_id, "token": c.token,
         "prob": c.prob, "cum_logprob": c.score, "status": c.status, "slot": c.slot}
        for c in s.candidates]} for s in result.tree or []]
