"""Hardware profiles for the timed simulator: memory tiers, links between them, compute costs; presets."""

from moe_offload.hardware.profile import (DEFAULT_PRESET, ComputeModel, HardwareProfile, LinearCost, Link, Roofline,
                                          Tier, load_profile, preset_names, resolve_profile)

__all__ = ["DEFAULT_PRESET", "ComputeModel", "HardwareProfile", "LinearCost", "Link", "Roofline", "Tier",
           "load_profile", "preset_names", "resolve_profile"]
