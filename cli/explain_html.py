"""`explain --html`: one self-contained page (inline CSS and script, no network). Each
generated token is a <span class="tok"> coloured by its processed probability; a click
shows that step's waterfall (the candidates' probability after each stage), as does
opening the page at `#step-N`."""

from __future__ import annotations

import html
import json
from typing import Any

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>genlab explain</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 60em; }}
#text {{ font-family: ui-monospace, monospace; font-size: 1.1em; line-height: 1.8;
        white-space: pre-wrap; border: 1px solid #ccc; padding: 1em; }}
.prompt {{ color: #777; }}
.tok {{ cursor: pointer; border-radius: 3px; padding: 1px 0; }}
.tok.sel {{ outline: 2px solid #333; }}
.tok.forced {{ text-decoration: underline wavy; }}
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
likely). Click a token to see its step.</p>
<div id="text"><span class="prompt">{prompt}</span>{tokens}</div>
<div id="step"><p>Click a token.</p></div>
<script>
const STEPS = {steps};
function pct(p) {{ return p === 0 ? "0" : (p * 100).toFixed(p >= 0.001 ? 1 : 3) + "%"; }}
const ENT = {{"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}};
function esc(s) {{ return s.replace(/[&<>"]/g, c => ENT[c]); }}
function cells(s, f) {{ return s.stages.map(x => "<td>" + f(x) + "</td>").join(""); }}
function show(i) {{
  document.querySelectorAll(".tok.sel").forEach(e => e.classList.remove("sel"));
  document.querySelector('.tok[data-step="' + i + '"]').classList.add("sel");
  const s = STEPS[i], names = s.stages.map(x => x.name);
  let rows = s.candidates.slice();
  if (!rows.some(c => c.id === s.chosen.id)) rows.push(s.chosen);
  let h = "<h2>step " + s.step + ": " + esc(JSON.stringify(s.chosen.token)) +
          (s.forced ? " (forced by the branch)" : "") + "</h2><table><tr><th>token</th>" +
          names.map(n => "<th>" + n + "</th>").join("") + "<th>removed by</th></tr>";
  for (const c of rows) {{
    const cls = c.id === s.chosen.id ? "chosen" : (c.removed_by ? "removed" : "");
    h += '<tr class="' + cls + '"><td>' + esc(JSON.stringify(c.token)) + "</td>" +
      names.map(n => '<td><span class="bar" style="width:' + (c.stage_probs[n] * 60) +
                "px\"></span> " + pct(c.stage_probs[n]) + "</td>").join("") +
      "<td>" + (c.removed_by || "") + "</td></tr>";
  }}
  h += "<tr><td>mass removed</td>" + cells(s, x => pct(x.removed_mass)) + "<td></td></tr>";
  h += "<tr><td>entropy (nats)</td>" + cells(s, x => Math.abs(x.entropy).toFixed(2)) +
       "<td></td></tr></table>";
  h += s.draw === null ? "<p>greedy: the most probable token after the chain</p>" :
       "<p>draw u = " + s.draw.toFixed(4) + "; chosen span [" + s.interval[0].toFixed(4) + ", " +
       s.interval[1].toFixed(4) + ")</p>";
  document.getElementById("step").innerHTML = h;
}}
document.querySelectorAll(".tok").forEach(
  e => e.addEventListener("click", () => show(+e.dataset.step)));
const linked = location.hash.match(/^#step-(\d+)$/);  // page.html#step-3 opens step 3
if (linked && STEPS[+linked[1]]) show(+linked[1]);
</script></body></html>
"""


def colour(p: float) -> str:
    """Red (p = 0) through yellow to green (p = 1), as an HSL background."""
    return f"hsl({round(120 * p)}, 75%, 78%)"


def page(record: dict[str, Any]) -> str:
    """The whole page for an `explain --json` record."""
    steps = record["original"]["steps"]
    spans = []
    for i, s in enumerate(steps):
        lp = s["chosen"]["processed_logprob"]
        p = 0.0 if lp is None else 2.718281828459045 ** lp
        forced = " forced" if s["forced"] else ""
        spans.append(f'<span class="tok{forced}" data-step="{i}" style="background:'
                     f'{colour(p)}" title="p={p:.3f}">{html.escape(s["token"]) or "&#8203;"}'
                     f'</span>')
    meta = html.escape(f"model {record['model']} · strategy {record['settings']['strategy']}"
                       f" · seed {record['settings'].get('seed')}")
    data = json.dumps(steps).replace("</", "<\\/")  # no "</script>" inside the script
    return PAGE.format(meta=meta, prompt=html.escape(record["prompt"]), tokens="".join(spans),
                       steps=data)
