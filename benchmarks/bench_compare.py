"""compare() vs plain genlib.generate.generate() on the same strategies, in the same run (ratios).

Run from the repository root: python benchmarks/bench_compare.py
"""

import io
import time
from collections.abc import Callable

from rich.console import Console

from cli.compare import run_live
from genlib.generate import generate
from genlib.lab import compare as c
from genlib.models.loading import ModelSpec, load_model

PROMPT = "Once upon a time"


def best(run: Callable[[], object], repeats: int = 3) -> float:
    """Shortest wall time of `repeats` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    lm = load_model(ModelSpec("../shared/models/stories260K"))
    ids = lm.encode(PROMPT)
    strategies = c.sharing_seed(c.build_strategies(
        [], ["strategy=greedy", "top_p=0.9"], {"max_new_tokens": 200, "ignore_eos": True},
        samples=1), 0)
    generate(lm, [ids], strategies[0].settings)  # warm-up
    plain = best(lambda: [generate(lm, [ids], s.settings) for s in strategies])
    compared = best(lambda: c.compare(lm, ids, strategies))
    tty = Console(file=io.StringIO(), force_terminal=True, width=160)
    live = best(lambda: run_live(lm, PROMPT, ids, strategies, tty))
    print(f"plain generate: {plain:.2f}s  compare(): {compared:.2f}s "
          f"({compared / plain:.2f}x)  live view: {live:.2f}s ({live / plain:.2f}x)")


if __name__ == "__main__":
    main()
