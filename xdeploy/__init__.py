"""xdeploy: export, optimize, run and benchmark transformer models."""

__version__ = "0.1.0"
