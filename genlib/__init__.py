"""genlab's generation core: settings, loading, the backends, the decode loops and the
one event stream they share. Nothing here imports cli/."""


def _keep_triton_away_from_cpu_torch() -> None:
    """Mark triton missing when torch is a CPU build. torch imports triton wherever it is
    installed (xgrammar, genlab's grammar extra, requires it on Linux), where a CPU build
    can run none of it, and its extension then prints nanobind leak warnings on every
    exit; it also costs ~0.4 s of start-up. Must run before torch is imported."""
    import sys

    if "triton" in sys.modules or "torch" in sys.modules:
        return
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("torch")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return
    try:
        version = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return
    if "+cpu" in version:
        sys.modules["triton"] = None  # type: ignore[assignment]  # import triton -> ImportError


_keep_triton_away_from_cpu_torch()
