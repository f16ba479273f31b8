"""Per-token views of `generate`: tokens coloured by probability, entropy or rank as
they stream (--color-by, plain text when stdout is not a terminal), and the
--logprobs table (on stderr for generate and the REPL; compare shows one per output)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from cli.errors import fail
from cli.render import err, out, stream_text
from genlib.errors import not_one_of

if TYPE_CHECKING:
    from genlib.events import Token
    from genlib.models.loading import LoadedModel
    from genlib.settings.config import GenerationSettings

COLOR_BY = ("prob", "entropy", "rank")
# Five bins, from "the model was sure of it" to "the model hardly expected it".
PALETTE = ("green", "chartreuse3", "yellow", "dark_orange", "red")
BINS: dict[str, tuple[tuple[float, str], ...]] = {
    # (upper edge of the bin, its label); a value past the last edge takes the last bin.
    "prob": ((0.9, "p ≥ 0.9"), (0.5, "≥ 0.5"), (0.2, "≥ 0.2"), (0.05, "≥ 0.05"),
             (0.0, "< 0.05")),
    "entropy": ((0.5, "H < 0.5"), (1.0, "< 1"), (2.0, "< 2"), (3.0, "< 3"),
                (math.inf, "≥ 3 nats")),
    "rank": ((0, "rank 1"), (1, "2"), (4, "3-5"), (9, "6-10"), (math.inf, "> 10")),
}


def check_color_by(value: str | None) -> None:
    if value is not None and value not in COLOR_BY:
        raise fail(not_one_of("--color-by", value, COLOR_BY))


def style_for(mode: str, detail: Any) -> str:
    """The colour of a token under `mode`: prob (processed probability, high = green),
    entropy of the distribution sampled from (low = green), rank under the raw model."""
    bins = BINS[mode]
    if mode == "prob":
        value = math.exp(detail.chosen.processed_logprob)
        index = next((i for i, (edge, _) in enumerate(bins) if value >= edge), len(bins) - 1)
    else:
        value = detail.entropy if mode == "entropy" else detail.chosen.rank
        index = next((i for i, (edge, _) in enumerate(bins)
                      if (value < edge if mode == "entropy" else value <= edge)),
                     len(bins) - 1)
    return PALETTE[index]


def legend(mode: str) -> None:
    """The colours' meaning, on stderr (only when the text itself is coloured)."""
    if not out.is_terminal:
        return
    text = Text(f"--color-by {mode}: ")
    for (_, label), colour in zip(BINS[mode], PALETTE):
        text.append(f" {label} ", style=f"black on {colour}")
    err.print(text)


def stream_token(event: Token, mode: str | None) -> None:
    """Print one token's text, coloured when asked for and stdout is a terminal."""
    if mode is None or event.detail is None or not out.is_terminal:
        stream_text(event.text)
        return
    stream_text(event.text, f"black on {style_for(mode, event.detail)}")


def logprobs_title(settings: GenerationSettings) -> str:
    """The --logprobs table's title: what its `logprob` is under (docs/strategies.md,
    docs/combining.md: the scores DoLa or a combination of models made, where one
    did, else the raw model's distribution), then the processed distribution."""
    if settings.dola_layers is not None:
        scores = "DoLa's scores"
    elif settings.cd_beta is not None:
        scores = "contrastive decoding's scores"
    elif settings.ensemble_mode is not None:
        scores = "the ensemble"
    else:
        scores = "raw model"
    return f"logprobs ({scores} / processed)"


def logprobs_table(lm: LoadedModel, tokens: Sequence[Token],
                   settings: GenerationSettings) -> None:
    """--logprobs in text mode: one line per token on stderr (raw and processed
    logprob, then the alternatives)."""
    from genlib.lab.explain import logprobs_content

    err.print(logprobs_view(logprobs_content(lm, tokens), logprobs_title(settings)))


def logprobs_view(logprobs: Mapping[str, Any], title: str) -> Table:
    """An OpenAI/vLLM `logprobs` object (`genlib.lab.explain.logprobs_content`) as a table:
    one line per token, its raw and processed logprob, then the raw top alternatives."""
    table = Table(show_edge=False, title=title, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("token")
    table.add_column("logprob", justify="right")
    table.add_column("processed", justify="right")
    table.add_column("top alternatives (logprob)")
    for index, entry in enumerate(logprobs["content"]):
        alts = "  ".join(f"{c['token']!r} {_logprob(c['logprob'], 2)}"
                         for c in entry["top_logprobs"])
        table.add_row(str(index), repr(entry["token"]), _logprob(entry["logprob"], 3),
                      _logprob(entry["processed_logprob"], 3), alts)
    return table


def _logprob(value: float | None, digits: int) -> str:
    """A logprob as the table shows it; None (probability 0 in the JSON) as -inf."""
    return "-inf" if value is None else f"{value:.{digits}f}"
