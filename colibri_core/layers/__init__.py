"""Shared building blocks every architecture's layer graph is made of (NumPy orchestration over the
C kernels). Tensors are float32; shapes are given as (T, ...) where T is the number of tokens."""
