"""Routing traces: the on-disk format, importers of public traces, synthetic generators, flattening."""

from moe_offload.trace.format import DECODE, PREFILL, Trace, TraceMeta, read_trace, write_trace

__all__ = ["Trace", "TraceMeta", "read_trace", "write_trace", "PREFILL", "DECODE"]
