"""Verification: structure, recompute of every value, the behaviour check layer by layer."""
