"""`explain --html`: one self-contained page (inline CSS and script, no network). Each
generated token is a <span class="tok"> coloured by its processed probability; a click
shows that step's waterfall (the candidates' probability after each stage), as does
opening the page at `#step-N` (`#branch-step-N` for the branch's). With `--branch` the
branch's text is under the original's, its forced token and the tokens from the
divergence on marked; with `--steps` only the steps chosen are coloured and clickable."""

from __future__ import annotations

import html
import json
import math
from typing import Any

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>genlab explain</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 60em; }}
.text {{ font-family: ui-monospace, monospace; font-size: 1.1em; line-height: 1.8;
        white-space: pre-wrap; border: 1px solid #ccc; padding: 1em; }}
.prompt, .skip {{ color: #777; }}
.tok {{ cursor: pointer; border-radius: 3px; padding: 1px 0; }}
.tok.sel {{ outline: 2px solid #333; }}
.tok.forced {{ text-decoration: underline wavy; }}
.tok.diverged {{ box-shadow: inset 0 3px 0 #333; }}
.tok.newline::before {{ content: "\21B5"; color: #555; }}
.tok.empty::before {{ content: "\00B7"; color: #555; }}
table {{ border-collapse: collapse; margin-top: 1em; }}
td, th {{ border: 1px solid #ddd; padding: 2px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
.chosen {{ background: #d8f5d8; font-weight: bold; }}
.removed {{ color: #b33; }}
.bar {{ display: inline-block; height: 0.7em; background: #4a7; vertical-align: middle; }}
</style></head><body>
<h1>genlab explain</h1>
<p>{meta}</p>
<p>Tokens are coloured by the probability the sampler gave them (red: unlikely, green:
likely). Click a token to see its step.{note}</p>
{texts}
<div id="step"><p>Click a token.</p></div>
<script>
const STEPS = {steps};  // run -> step number -> step
const BRANCHED = "branch" in STEPS;
function pct(p) {{
  return p === 0 ? "0" : (p >= 0.001 ? (p * 100).toFixed(1) : (p * 100).toPrecision(2)) + "%";
}}
const ENT = {{"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}};
function esc(s) {{ return s.replace(/[&<>"]/g, c => ENT[c]); }}
function cells(s, f) {{ return s.stages.map(x => "<td>" + f(x) + "</td>").join(""); }}
function show(run, i) {{
  document.querySelectorAll(".tok.sel").forEach(e => e.classList.remove("sel"));
  document.querySelector('.tok[data-run="' + run + '"][data-step="' + i + '"]')
    .classList.add("sel");
  const s = STEPS[run][i], names = s.stages.map(x => x.name);
  let rows = s.candidates.slice();
  if (!rows.some(c => c.id === s.chosen.id)) rows.push(s.chosen);
  let h = "<h2>" + (BRANCHED ? run + ", " : "") + "step " + s.step + ": " +
          esc(JSON.stringify(s.chosen.token)) + (s.forced ? " (forced by the branch)" : "") +
          "</h2><table><tr><th>token</th>" +
          names.map(n => "<th>" + n + "</th>").join("") + "<th>removed by</th></tr>";
  for (const c of rows) {{
    const cls = c.id === s.chosen.id ? "chosen" : (c.removed_by ? "removed" : "");
    h += '<tr class="' + cls + '"><td>' + esc(JSON.stringify(c.token)) + "</td>" +
      names.map(n => '<td><span class="bar" style="width:' + (c.stage_probs[n] * 60) +
                "px\"></span> " + pct(c.stage_probs[n]) + "</td>").join("") +
      "<td>" + (c.removed_by || "") + "</td></tr>";
  }}
  h += "<tr><td>mass removed</td>" + cells(s, x => pct(x.removed_mass)) + "<td></td></tr>";
  h += "<tr><td>entropy (nats)</td>" + cells(s, x => x.entropy.toFixed(2)) +
       "<td></td></tr></table>";
  h += s.draw === null ? "<p>greedy: the most probable token after the chain</p>" :
       "<p>draw u = " + s.draw.toFixed(4) +
       (s.forced ? " (ignored: the branch forced this token)" : "") +
       "; chosen span [" + s.interval[0].toFixed(4) + ", " + s.interval[1].toFixed(4) + ")</p>";
  document.getElementById("step").innerHTML = h;
}}
document.querySelectorAll(".tok").forEach(
  e => e.addEventListener("click", () => show(e.dataset.run, +e.dataset.step)));
// page.html#step-3 opens the original's step 3, #branch-step-3 the branch's
const linked = location.hash.match(/^#(branch-)?step-(\d+)$/);
const linkedRun = linked && linked[1] ? "branch" : "original";
if (linked && STEPS[linkedRun] && STEPS[linkedRun][+linked[2]]) show(linkedRun, +linked[2]);
</script></body></html>
"""


def colour(p: float) -> str:
    """Red (p = 0) through yellow to green (p = 1), as an HSL background."""
    return f"hsl({round(120 * p)}, 75%, 78%)"


def token_span(run: str, step: dict[str, Any], diverged: bool) -> str:
    """One generated token, coloured by its probability, that shows its step when clicked.
    A token that is only line breaks, or whose text is still pending (a byte piece of a
    character the next tokens complete), would have nothing to see or click: it gets a
    mark drawn by the stylesheet, outside the text."""
    lp = step["chosen"]["processed_logprob"]
    p = 0.0 if lp is None else math.exp(lp)
    text = step["token"]
    classes = " ".join(["tok", *(["forced"] if step["forced"] else []),
                        *(["diverged"] if diverged else []), *invisible(text)])
    return (f'<span class="{classes}" data-run="{run}" data-step="{step["step"]}" '
            f'style="background:{colour(p)}" title="p={p:.3f}">{html.escape(text)}</span>')


def invisible(text: str) -> list[str]:
    """The class that marks a token with nothing visible: `empty` for no text,
    `newline` for whitespace with a line break; none otherwise."""
    if not text:
        return ["empty"]
    return ["newline"] if "\n" in text and not text.strip() else []


def script_json(data: Any) -> str:
    """`data` as a literal for the page's script, with no `<`, `>` or `&`: a token's
    text could otherwise end the script (`</script>`) or, with `<!--` and `<script`,
    put the parser where the page's own `</script>` no longer ends it."""
    return (json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


def run_text(run: str, steps: list[dict[str, Any]], prompt: str, shown: range | None,
             at: int | None) -> str:
    """A run's text: the prompt, then its tokens; those outside `shown` (--steps) plain
    grey, those from the divergence `at` on marked."""
    spans = []
    for s in steps:
        if shown is None or s["step"] in shown:
            spans.append(token_span(run, s, at is not None and s["step"] >= at))
        else:
            spans.append(f'<span class="skip">{html.escape(s["token"])}</span>')
    return (f'<div class="text" id="{run}"><span class="prompt">{html.escape(prompt)}</span>'
            f'{"".join(spans)}</div>')


def branch_note(branch: dict[str, Any]) -> str:
    """What the page says of the branch: where it diverges and how that is marked."""
    from genlib.lab.explain import branch_outcome

    step, outcome = branch["step"], branch_outcome(branch)
    if outcome == "ended":
        return (f" The run ended after {len(branch['steps'])} steps, before step {step}: "
                f"the branch forced nothing, the two runs are the same.")
    forced = html.escape(repr(branch["steps"][step]["token"]))
    if outcome == "same":
        return (f" The branch forced {forced} at step {step} (wavy underline), the token the "
                f"original chose there: no divergence, the two runs are the same.")
    return (f" The branch forced {forced} at step {step} (wavy underline) and "
            f"continued with the same random draws; the runs diverge at step "
            f"{branch['diverges_at']}: from there on tokens have a bar above.")


def page(record: dict[str, Any], first: int = 0, last: int | None = None) -> str:
    """The whole page for an `explain --json` record: the original run and, with a
    branch, the branch below it; only steps first to last - 1 (--steps) clickable."""
    from genlib.lab.explain import runs_of

    runs = runs_of(record)
    at = record["branch"]["diverges_at"] if "branch" in record else None
    longest = max(len(run["steps"]) for run in runs.values())
    shown = None if first == 0 and last is None else \
        range(first, longest if last is None else last)
    texts, data = [], {}
    for name, run in runs.items():
        if "branch" in runs:
            texts.append(f"<h3>{name}</h3>")
        texts.append(run_text(name, run["steps"], record["prompt"], shown, at))
        data[name] = {s["step"]: s for s in run["steps"] if shown is None or s["step"] in shown}
    note = branch_note(record["branch"]) if "branch" in record else ""
    if shown is not None:
        which = f"step {first}" if len(shown) == 1 else \
            f"steps {first} on" if last is None else f"steps {first} to {last - 1}"
        note += f" Only {which} (--steps) can be clicked; the other tokens are grey."
    meta = html.escape(f"model {record['model']} · strategy {record['settings']['strategy']}"
                       f" · seed {record['settings'].get('seed')}")
    return PAGE.format(meta=meta, note=note, texts="\n".join(texts), steps=script_json(data))
