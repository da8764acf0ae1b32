"""Triton kernels (installed as `kvtool.kernels`): shared codec helpers in `codecs.py`, then store, dequantize,
index scoring, top-k and sparse attention. Each launcher checks its arguments and returns the torch path's types."""
