"""Measurement: latency harness, isolated memory probe, roofline peaks, the benchmark suite and the attention
scaling sweep. Results are records (xdeploy.core.records)."""
