"""Sweeps: a TOML file's grid of replays and timed runs, run in processes or on Ray, into one results file.

spec.py   the sweep file read, checked and expanded into cells (docs/sweep-format.md)
run.py    one cell as `simulate` runs it; the cells in this process, in worker processes or as Ray tasks
store.py  the results file: one Parquet row per finished cell, rewritten atomically; what a rerun resumes from
"""
