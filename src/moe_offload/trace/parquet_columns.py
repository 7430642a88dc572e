"""How a trace's columns sit in its Parquet file (trace/format.py writes and reads the file): the types they are
stored in, the row groups they are written in, and their reading back a piece at a time, every value checked
against the metadata before it becomes an array of a Trace. A problem is a TraceError naming the file and, where
one row is to blame, the row."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moe_offload.errors import TraceError
from moe_offload.trace.phases import PHASES

if TYPE_CHECKING:  # annotations only: format.py imports this module
    from moe_offload.trace.format import Trace, TraceMeta


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned integer type that holds every expert id of a layer."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"{num_experts} experts per layer is more than any supported id type holds")


def int32_column(values, name: str, path) -> np.ndarray:
    """``values`` as int32, refusing fractions and values int32 cannot hold instead of wrapping them."""
    array = np.asarray(values)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if not np.issubdtype(array.dtype, np.number) or not np.all(np.mod(array, 1) == 0):
            raise TraceError(path, f"column {name} must hold integers")
    info = np.iinfo(np.int32)
    outside = np.flatnonzero((array < info.min) | (array > info.max)) if array.size else []
    if len(outside):
        raise TraceError(path, f"column {name} value {array[outside[0]]} does not fit in 32 bits",
                         row=int(outside[0]))
    return array.astype(np.int32)


REQUIRED_COLUMNS = ("request", "position", "phase", "iteration", "experts")
OPTIONAL_COLUMNS = ("weights", "probs", "embedding", "gate_prediction", "next_token_gate_prediction")


def stored_columns(trace: Trace) -> dict[str, np.ndarray]:
    """The columns as a file stores them and ``read_trace`` returns them, by name: what the checksum seals."""
    columns = {"request": trace.request.astype(np.int32, copy=False),
               "position": trace.position.astype(np.int32, copy=False),
               "phase": trace.phase.astype(np.uint8, copy=False),
               "iteration": trace.iteration.astype(np.int32, copy=False),
               "experts": trace.experts.astype(expert_dtype(trace.meta.num_experts), copy=False)}
    for name in OPTIONAL_COLUMNS:
        values = getattr(trace, name)
        if values is not None:
            columns[name] = values.astype(np.float16, copy=False)
    return columns


# Values decoded at a time (``read_columns``), over the columns read: Arrow's decoding of the nested expert
# column needs scratch memory of several times its values, and a million values' worth stays in the CPU's cache
# and is reused; at 6.3M values a piece (16,384 rows of 48 x 8), the whole command read 20M requests in 0.25 to
# 0.43 s, against 0.18 to 0.21 s a million at a time (2-core AMD EPYC), where memory touched anew costs most.
READ_VALUES = 1 << 20
ROW_GROUP_REQUESTS = 1 << 22  # expert requests of a row group that write_trace writes


def row_group_rows(meta: TraceMeta) -> int:
    """Rows of a row group as write_trace writes them: ROW_GROUP_REQUESTS expert requests at most, so that a
    reader decodes one at a time (read_columns)."""
    return max(1, ROW_GROUP_REQUESTS // (meta.num_layers * meta.top_k))


def read_columns(parquet, columns: list[str], meta: TraceMeta, path) -> dict[str, np.ndarray]:
    """The file's ``columns`` as the arrays of a Trace, decoded (``_decode``) READ_VALUES values at a time into
    arrays made once, then Arrow's freed memory given back: Parquet's decoding of the nested expert column
    takes about 10 bytes a request of its row group (0.4 GB for one group of 38.4M requests, which write_trace
    no longer writes), and the whole table at once needed 17 (0.7 GB), many times the trace's own size. A
    problem's row counts from the file's first row."""
    import pyarrow as pa

    total = parquet.metadata.num_rows
    schema = parquet.schema_arrow
    per_row = sum(schema.field(name).type.list_size if pa.types.is_fixed_size_list(schema.field(name).type) else 1
                  for name in columns)
    arrays, start = None, 0
    for batch in parquet.iter_batches(batch_size=max(1, READ_VALUES // per_row), columns=columns):
        try:
            piece = _decode(pa.Table.from_batches([batch]), meta, path)
        except TraceError as error:
            if error.row is None:
                raise
            raise TraceError(error.path, error.problem, row=start + error.row) from None
        if arrays is None:
            arrays = {name: np.empty((total, *values.shape[1:]), values.dtype) for name, values in piece.items()}
        for name, values in piece.items():
            arrays[name][start:start + len(values)] = values
        start += batch.num_rows
    if arrays is None:  # no rows: the empty table's columns, checked as any
        return _decode(parquet.read(columns=columns), meta, path)
    if start != total:
        raise TraceError(path, f"truncated: {start:,} rows read of the {total:,} its footer declares")
    pa.default_memory_pool().release_unused()
    return arrays


def _decode(table, meta: TraceMeta, path) -> dict[str, np.ndarray]:
    """The table's columns as the arrays of a Trace (the dtypes of ``stored_columns``), by name."""
    import pyarrow as pa

    n = table.num_rows
    L, J, K = meta.num_layers, meta.num_experts, meta.top_k

    def column(name):
        col = table.column(name)
        if col.null_count:
            first_null = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise TraceError(path, f"column {name} is empty (null)", row=first_null)
        return col.combine_chunks()

    def fixed_list(name, per_row: int | None, shape):
        col = column(name)
        if not pa.types.is_fixed_size_list(col.type):
            raise TraceError(path, f"column {name} has type {col.type}, expected a fixed-size list")
        if per_row is not None and col.type.list_size != per_row:
            raise TraceError(path, f"column {name} holds {col.type.list_size} values per row, "
                                   f"metadata (L={L}, J={J}, K={K}) implies {per_row}")
        # the rows' values as flatten() gives them (column() has refused null rows), without flatten()'s import
        # of pyarrow.compute, a tenth of a second of every command that reads a trace
        size = col.type.list_size
        values = col.values.slice(col.offset * size, len(col) * size)
        if values.null_count:
            raise TraceError(path, f"column {name} holds an empty (null) value")
        if shape is None:
            shape = (n, col.type.list_size)
        return values.to_numpy(zero_copy_only=False).reshape(shape)

    phase = column("phase")
    if not pa.types.is_dictionary(phase.type):
        phase = phase.dictionary_encode()
    labels = phase.dictionary.to_pylist()
    code_of_label = np.array([PHASES.index(label) if label in PHASES else 255 for label in labels] + [255],
                             np.uint8)
    indices = phase.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    indices[(indices < 0) | (indices >= len(labels))] = len(labels)  # out of the dictionary: corrupt
    phase_codes = code_of_label[indices]
    bad = np.flatnonzero(phase_codes == 255)
    if bad.size:
        label = labels[indices[bad[0]]] if indices[bad[0]] < len(labels) else "(none)"
        raise TraceError(path, f"phase {label!r} is neither 'prefill' nor 'decode'", row=int(bad[0]))

    def ints(name):
        col = column(name)
        if not pa.types.is_integer(col.type):
            raise TraceError(path, f"column {name} has type {col.type}, expected integers")
        return int32_column(col.to_numpy(), name, path)

    arrays = {"request": ints("request"), "position": ints("position"), "phase": phase_codes,
              "iteration": ints("iteration"), "experts": _ids(fixed_list("experts", L * K, (n, L, K)), J, path)}
    shapes = {"weights": (L * K, (n, L, K)), "probs": (L * J, (n, L, J)),
              "gate_prediction": ((L - 1) * J, (n, L - 1, J)), "next_token_gate_prediction": (J, (n, J)),
              "embedding": (None, None)}
    for name in OPTIONAL_COLUMNS:
        if name in table.column_names:
            values = fixed_list(name, *shapes[name])
            if not np.issubdtype(values.dtype, np.floating):
                raise TraceError(path, f"column {name} has type {values.dtype}, expected floats")
            arrays[name] = values.astype(np.float16, copy=False)
    return arrays


def _ids(values: np.ndarray, num_experts: int, path) -> np.ndarray:
    """Expert ids in the id type of ``num_experts`` (expert_dtype); a value that type cannot hold is refused,
    never wrapped around."""
    dtype = expert_dtype(num_experts)
    if values.dtype == dtype:
        return values
    if not np.issubdtype(values.dtype, np.integer):
        raise TraceError(path, f"expert ids must be integers, not {values.dtype}")
    converted = values.astype(dtype)
    beyond = np.flatnonzero((converted != values).reshape(values.shape[0], -1).any(axis=1))
    if beyond.size:
        row = int(beyond[0])
        raise TraceError(path, f"expert id {values[row][converted[row] != values[row]][0]} is beyond the ids of "
                               f"a model with {num_experts} experts per layer", row=row)
    return converted
