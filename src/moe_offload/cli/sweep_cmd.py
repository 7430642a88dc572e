"""`moe-offload sweep SWEEP.toml`: the product of traces x policies x cache sizes x prefetchers x hardware
profiles x seeds, replayed or timed, in processes or as Ray tasks, into one Parquet file that a rerun resumes."""

from __future__ import annotations

import os
import sys
from collections import defaultdict

from moe_offload.errors import ConfigError

PLOT_SUFFIXES = (".png", ".pdf", ".svg")
FULL_TABLES_UP_TO = 60  # cells; a larger sweep prints a summary unless --tables asks for every table


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep", help="run a sweep file's grid of replays or timed runs into one Parquet file (resumable, Ray)",
        description="Run every cell of a sweep file (docs/sweep-format.md): traces x policies x cache sizes x "
                    "prefetchers x hardware profiles x seeds, replayed or timed, each as `simulate` would run it. "
                    "Results stream into one Parquet file of RunResult rows with the sweep's parameters; a rerun "
                    "runs only the cells the file does not hold yet. Prints the tables of `simulate`, or for a "
                    f"sweep of more than {FULL_TABLES_UP_TO} cells a summary (--tables prints every table).")
    parser.add_argument("sweep", metavar="SWEEP.toml", help="the sweep file")
    parser.add_argument("-o", "--output", metavar="FILE.parquet",
                        help="the results file (default: the sweep file's `output`, else SWEEP.parquet beside it)")
    parser.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS|auto|local",
                        help="run the cells as Ray tasks: on a Ray started for the sweep on this machine (local, the "
                             "default), on the cluster this machine belongs to (auto), or on the cluster at ADDRESS; "
                             "needs the `ray` extra. Without it the cells run in --jobs processes")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="worker processes, or the CPUs of a local Ray (default: up to 2)")
    parser.add_argument("--tables", action="store_true",
                        help=f"print every table of `simulate` (the default up to {FULL_TABLES_UP_TO} cells; above, "
                             "a summary line per trace)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot the replay's misses against cache size")
    parser.add_argument("--plot-cdf", metavar="FILE.png", help="plot the timed runs' token latency and TTFT CDFs")
    parser.add_argument("--plot-timeline", metavar="FILE.png", help="plot one iteration of every timed run")
    parser.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console

    from moe_offload.outputs import check_output
    from moe_offload.reporting.progress import progress_bar
    from moe_offload.sweep.run import RAY_HINT, ray_available, run_cells
    from moe_offload.sweep.spec import read_sweep
    from moe_offload.sweep.store import ResultStore

    if args.ray is not None and not ray_available():
        raise ConfigError(RAY_HINT)
    if args.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    sweep = read_sweep(args.sweep, args.output)
    inputs = [args.sweep] + [trace.path for trace in sweep.traces.values()]
    check_output(sweep.output, inputs=inputs, suffixes=(".parquet",), what="results file")
    for figure in (args.plot, args.plot_cdf, args.plot_timeline):
        if figure:
            check_output(figure, inputs=inputs + [sweep.output], suffixes=PLOT_SUFFIXES, what="plot")
    modes = {cell.mode for cell in sweep.cells}
    if args.plot and "replay" not in modes:
        raise ConfigError("--plot draws the replay's misses; this sweep replays nothing")
    if (args.plot_cdf or args.plot_timeline) and "timed" not in modes:
        raise ConfigError("--plot-cdf and --plot-timeline draw timed runs; this sweep has none")
    stderr = Console(stderr=True, soft_wrap=True)
    with ResultStore(sweep.output, sweep.cells) as store:  # locked: one sweep at a time writes the file
        todo = [cell for cell in sweep.cells if not store.done(cell)]
        stderr.print(f"{args.sweep}: {len(sweep.cells)} cells, {len(sweep.cells) - len(todo)} already in "
                     f"{sweep.output}, {len(todo)} to run" + (f" on Ray ({args.ray})" if args.ray and todo else ""),
                     markup=False, highlight=False)
        try:
            with progress_bar() as bar:
                task = bar.add_task("sweep cells", total=len(todo))
                run_cells(sweep, todo, store, jobs=args.jobs, ray_address=args.ray,
                          progress=lambda: bar.advance(task))
        except KeyboardInterrupt:
            saved = sum(store.done(cell) for cell in sweep.cells)
            stderr.print(f"interrupted: {saved} of {len(sweep.cells)} cells saved in {sweep.output}; the same "
                         f"command runs the other {len(sweep.cells) - saved}", markup=False, highlight=False)
            raise
    stderr.print(f"results written to {sweep.output}", markup=False, highlight=False)

    rows = [store.rows[cell.key] for cell in sweep.cells]
    full = args.tables or len(rows) <= FULL_TABLES_UP_TO
    print_tables(sweep, rows, full)
    if not full:
        stderr.print(f"a summary of {len(rows)} cells: --tables prints every table, {sweep.output} holds every row",
                     markup=False, highlight=False)
    if rows:
        plot(args, rows, stderr)
    return 0


def print_tables(sweep, rows, full: bool = True) -> None:
    """`simulate`'s tables (``full``) or a line per trace: the replay's per seed, the timed runs' per hardware
    profile and seed. A replay row without a seed (a policy that draws no random number, run once) is shown
    at every seed."""
    from rich.console import Console

    from moe_offload.reporting.tables import (print_replay_summary, print_replay_tables, print_timed_summary,
                                              print_timed_tables)
    from moe_offload.simulator.timed import Arrivals

    out = Console()
    if not out.is_terminal:
        out.width = 150
    groups, unseeded = defaultdict(list), []
    for row in rows:
        if row.cell.mode == "replay" and row.cell.policy == "belady" and "belady" not in sweep.policies:
            continue  # the reference of the others, shown as their misses / OPT (as simulate does)
        if row.cell.seed is None:
            unseeded.append(row.result)
        else:
            groups[(row.cell.mode, row.cell.hardware, row.cell.seed)].append(row.result)
    replay_seeds = {seed for mode, _, seed in groups if mode == "replay"}
    if unseeded:  # beside every seed's randomized runs, or alone
        for seed in replay_seeds or [None]:
            groups[("replay", None, seed)] = unseeded + groups.get(("replay", None, seed), [])
    seeds = {seed for *_, seed in groups if seed is not None}
    for (mode, hardware, seed), results in sorted(groups.items(), key=lambda item: (item[0][0] != "replay",
                                                                                   item[0][2] or 0)):
        if len(seeds) > 1 and seed is not None:
            out.print(f"[bold]seed {seed}[/]")
        if mode == "replay":
            (print_replay_tables if full else print_replay_summary)(results, out)
        else:
            timed = sweep.timed
            if full:
                arrivals = Arrivals.parse(timed.arrivals, timed.max_batch, seed).describe()
                print_timed_tables(results, out, hardware=timed.hardware[hardware], arrivals=arrivals)
            else:
                print_timed_summary(results, out, hardware=timed.hardware[hardware])
    for line in sweep.skipped:
        out.print(f"skipped: {line}")
    sys.stdout.flush()


def plot(args, rows, stderr) -> None:
    """simulate's plots, of the first seed (and for the timed plots, the first hardware profile)."""
    from moe_offload.reporting.plots import plot_latency_cdf, plot_misses, plot_timeline

    first_seed = next((row.cell.seed for row in rows if row.cell.seed is not None), None)
    replayed = [row.result for row in rows if row.cell.mode == "replay" and row.cell.seed in (None, first_seed)]
    timed = [row for row in rows if row.cell.mode == "timed" and row.cell.seed == first_seed]
    timed = [row.result for row in timed if row.cell.hardware == timed[0].cell.hardware] if timed else []
    for path, draw, results in ((args.plot, plot_misses, replayed), (args.plot_cdf, plot_latency_cdf, timed),
                                (args.plot_timeline, plot_timeline, timed)):
        if path:
            stderr.print(f"plot written to {draw(results, path)}")
