"""Kernels. Each module: jit kernels first, then the launcher, then the entry point.

Kernels import neither the API nor the reference; they assume validated input.
"""
