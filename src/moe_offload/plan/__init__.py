"""One plan per run: everything that decides it (plan.py), made and checked once from the user's options
(make.py). The runtime engine, the timed simulator and the report's recommendation are built from it; it
imports neither of them, nor PyTorch."""

from moe_offload.plan.make import make_plan
from moe_offload.plan.plan import PAPER_TAU, PLACEMENTS, Plan, Reconfiguration

__all__ = ["PAPER_TAU", "PLACEMENTS", "Plan", "Reconfiguration", "make_plan"]
