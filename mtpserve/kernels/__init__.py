"""Triton kernels, one per file, each beside the plain-torch reference that is the CPU path and test oracle."""
