"""What turns the result record (moe_offload/results.py) into tables, JSON, plots and the report."""
