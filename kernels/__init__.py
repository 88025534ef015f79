"""GEMM kernels for the runner (installed as `quantlab.kernels`).

Triton kernels and their torch reference paths land here with the runner work; the package
exists now so the layout is fixed and imports resolve.
"""
