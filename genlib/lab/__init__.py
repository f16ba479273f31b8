"""Seeing how decoding behaves: compare, bench, explain, metrics, fidelity."""
