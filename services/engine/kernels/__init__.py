"""Triton kernels for the GPU path, each beside a pure-torch reference it is tested against (on the
CPU under ``TRITON_INTERPRET=1``)."""
