"""The offloaded inference runtime: packed checkpoints, tiers, transfer workers and the engine.

Needs the ``models`` extra. ``moe_offload.load(...)`` is the entry point for programs."""
