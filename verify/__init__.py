"""Numerical verification: per-output parity against the PyTorch fp32 reference and the layerwise bisection
that finds the first divergent node. Imports deploy/, export/, models/ and core/ only."""
