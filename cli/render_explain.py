"""Rich views of `genlab explain`: one panel per step (the top candidates' probability
after each stage of the chain, which stage removed each, the mass each stage removed,
the entropy, the chosen token and where the random draw fell), and a branch beside the
original."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from cli.render import counted, out

CHOSEN_STYLE = "bold green"
REMOVED_STYLE = "dim red"


def _pct(p: float) -> str:
    return "0" if p == 0 else f"{p * 100:.1f}%" if p >= 0.001 else f"{p * 100:.2g}%"


def step_tables(step: dict[str, Any], width: int) -> list[Table]:
    """One step as one table or, where its stages do not fit in `width` columns with
    every number whole, as several tables of consecutive stages (token and id in each,
    the step's title over the first, `removed by` and the draw under the last)."""
    names = [s["name"] for s in step["stages"]]
    tables: list[Table] = []
    for per_table in range(len(names), 0, -1):
        groups = [names[i:i + per_table] for i in range(0, len(names), per_table)]
        tables = [step_table(step, group, first=i == 0, last=i == len(groups) - 1)
                  for i, group in enumerate(groups)]
        if all(_natural_width(table) <= width for table in tables):
            break
    return tables


def _natural_width(table: Table) -> int:
    return Measurement.get(out, out.options.update_width(10_000), table).maximum


def step_table(step: dict[str, Any], names: Sequence[str] | None = None,
               first: bool = True, last: bool = True) -> Table:
    """A step as a table: a row per candidate, a column per stage (of `names`, default
    all); the title if `first`, the `removed by` column and the draw if `last`."""
    stages = [s for s in step["stages"] if names is None or s["name"] in names]
    names = [s["name"] for s in stages]
    title = f"step {step['step']}: chose {step['chosen']['token']!r} (id {step['chosen']['id']})"
    if step["forced"]:
        title += " [forced: branch]"
    table = Table(title=title if first else None, title_justify="left", show_edge=False)
    table.add_column("token")
    table.add_column("id", justify="right", no_wrap=True)
    models = list(step["chosen"].get("model_probs", {})) if first else []
    for ref in models:  # combined models: each one's own probability, then the stages
        table.add_column(model_label(ref), justify="right", no_wrap=True)
    label = {"raw": "combined"} if step["chosen"].get("model_probs") else {}
    for name in names:
        table.add_column(label.get(name, name), justify="right", no_wrap=True)
    if last:
        table.add_column("removed by", no_wrap=True)
    removed_by = [""] if last else []
    chosen_id = step["chosen"]["id"]
    rows = list(step["candidates"])
    if all(c["id"] != chosen_id for c in rows):
        rows.append(step["chosen"])
    for c in rows:
        style = CHOSEN_STYLE if c["id"] == chosen_id else (
            REMOVED_STYLE if c.get("removed_by") else None)
        probs = [_pct(c["stage_probs"][n]) for n in names]
        own = [_pct(c["model_probs"][ref]) for ref in models]
        table.add_row(repr(c["token"]), str(c["id"]), *own, *probs,
                      *([label.get(c.get("removed_by") or "", c.get("removed_by") or "")]
                        if last else []), style=style)
    blank = [""] * len(models)
    table.add_row("mass removed", "", *blank, *[_pct(s["removed_mass"]) if s["removed_mass"] else ""
                                       for s in stages], *removed_by, style="dim")
    table.add_row("entropy (nats)", "", *blank, *[f"{s['entropy']:.2f}" for s in stages],
                  *removed_by, style="dim")
    table.add_row("tokens left", "", *blank, *[str(s["kept"]) for s in stages], *removed_by,
                  style="dim")
    if last:
        table.caption = draw_caption(step)
        table.caption_justify = "left"
    return table


def model_label(ref: str) -> str:
    """A combined model's column: its folder's name (`raw` is the combined one)."""
    from pathlib import PurePath

    return PurePath(ref).name or ref


def draw_caption(step: dict[str, Any]) -> str:
    """Where the random draw fell in the processed distribution's CDF."""
    lo, hi = step["interval"]
    if step["draw"] is None:
        return "greedy: the most probable token after the chain"
    note = " (ignored: the branch forced this token)" if step["forced"] else ""
    return (f"draw u = {step['draw']:.4f}{note}; the chosen token spans "
            f"[{lo:.4f}, {hi:.4f}) of the cumulative distribution (vocabulary order)")


def show_steps(steps: Sequence[dict[str, Any]], first: int, last: int | None) -> None:
    for step in steps:
        if step["step"] >= first and (last is None or step["step"] < last):
            for table in step_tables(step, out.width):
                out.print(table, soft_wrap=False)  # the caption wraps at words
            out.print()


def show_branch(original: dict[str, Any], branch: dict[str, Any]) -> None:
    """The original and the branch (the two runs of an explain document) side by side;
    tokens from the divergence on marked."""
    from genlib.lab.explain import branch_outcome

    at = branch["diverges_at"]
    table = Table(show_edge=False)
    table.add_column("original")
    table.add_column("branch")
    table.add_row(_marked(original["steps"], at), _marked(branch["steps"], at))
    out.print(table)
    step, outcome = branch["step"], branch_outcome(branch)
    stopped = [name for name, run in (("original", original), ("branch", branch))
               if run["finish_reason"] == "interrupted"]
    if outcome == "ended" and "branch" in stopped:
        note = (f"interrupted (Ctrl-C) after {counted(len(branch['steps']), 'step')}, "
                f"before step {step}: nothing was forced")
    elif outcome == "ended":
        note = (f"no divergence: the run ended after {len(branch['steps'])} steps, before "
                f"step {step}, so nothing was forced and the two runs are the same")
    elif outcome == "same":
        note = (f"no divergence: the token forced at step {step} is the one the original "
                f"chose there, so the two runs are the same")
    else:
        note = f"they diverge at step {at} (marked); steps after it used the same random draws"
    if stopped and not note.startswith("interrupted"):
        note += f"; the {' and the '.join(stopped)} stopped early (Ctrl-C, finish: interrupted)"
    out.print(Text(note, style="dim"))


def _marked(steps: Sequence[dict[str, Any]], at: int | None) -> Text:
    text = Text()
    for s in steps:
        diverged = at is not None and s["step"] >= at
        text.append(s["token"], style="reverse" if diverged else None)
    return text
