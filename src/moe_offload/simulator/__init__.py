"""Simulators that drive the cache and the policies: the access-level replay (paper 001's model)."""
