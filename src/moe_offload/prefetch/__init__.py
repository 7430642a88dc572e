"""Prefetchers, one file each, behind moe_offload.prefetch.base.Prefetcher."""
