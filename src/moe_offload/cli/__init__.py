"""The `moe-offload` command line."""
