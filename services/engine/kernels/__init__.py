"""Triton kernels for the GPU path, each beside a pure-torch reference it is tested against (on the
CPU under ``TRITON_INTERPRET=1``).
The paged decode kernel shares its reference with the CPU one: ``cpu_kernels.paged_decode.paged_decode_ref``.
"""
