"""Triton kernels for the TriZone cache (installed as ``rdkv.kernels``)."""
