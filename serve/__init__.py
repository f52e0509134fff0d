"""Serving beside the data path: Triton model repositories, the PyTriton server, its Python-backend models
and the bounded loopback load test."""
