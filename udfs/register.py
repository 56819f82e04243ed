"""The tile UDFs and their registration on a DuckDB connection.

Every UDF takes a constant JSON ``meta`` argument that describes the step (index strings,
full sizes and tile sizes per index, dtypes, operand names), so one registered function
serves every einsum of its arity:

- ``tra_einsum_<n>(meta, out_keys, keys_0, tile_0, ..., keys_n-1, tile_n-1)``: one output
  tile per joined row;
- ``tra_einsum_agg_<n>(meta, out_keys, list({keys0, tile0, ..., keys<n-1>, tile<n-1>}))``:
  one output tile per group, aggregating the group's joined rows inside the kernel (fused
  join + aggregate);
- ``tra_attention_<n>(meta, out_keys, list({keys0, tile0, ...}))``: fused attention over
  Q, K, V (and a mask), see ``tra_sql.udfs.attention``;
- ``tra_chain_<n>(meta, out_keys, keys_0, tile_0, ...)``: one output tile per joined row,
  computed through a chain of steps (einsums reading the previous one's result);
- ``tra_reduce(meta, out_keys, list(tile))``: one output tile per group, the aggregate of
  the partial results ``tra_einsum_<n>`` computed per joined row;
- with a prologue (row statistics of the operands, ``meta["prologue"]``), those operands are
  not arguments: the kernel computes them first from the others;
- with an epilogue (an element-wise einsum fused into the step, ``meta["epilogue"]``), its
  other operands follow as (keys, tile) pairs: ``tra_einsum_<n+k>``,
  ``tra_einsum_agg_<n>_<k>(..., keys, tile, ...)`` and ``tra_reduce_<k>`` (one value per group);
- operands and results with ``meta["layouts"]`` / ``meta["out_layout"]`` ``csr`` are CSR
  tiles (``tra_sql.udfs.sparse``); ``tra_pack_csr`` packs them from a relation's rows;
- ``tra_place(meta, out_keys, list({origin, shape, part, tile}))``: one output tile of a
  re-tiling, slice, concatenation or reshape, assembled from the source pieces that overlap
  it (origins in output element coordinates; row-major flat ones for a reshape);
- ``tra_fill(meta, out_keys)``: one tile of a constant tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache

import duckdb
import numpy as np
import pyarrow as pa
from duckdb.sqltypes import BIGINT, BLOB, DOUBLE, INTEGER, VARCHAR

from tra_sql.errors import CorruptTileError
from tra_sql.udfs import sparse
from tra_sql.udfs.arrowio import binary_array, binary_views, first_string, key_matrix, list_views
from tra_sql.udfs.contract import TileEinsum
from tra_sql.udfs.expr import join_code
from tra_sql.udfs.sparse import CSRTile

BATCH_ELEMENTS = 1 << 22  # the most partial-result elements a batched group step may hold
REDUCE = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def tile_shapes(keys: np.ndarray, sizes: np.ndarray, tiles: np.ndarray) -> np.ndarray:
    """Per-row tile shapes (ragged at the boundary) for an (n, rank) key matrix."""
    return np.minimum(tiles, sizes - keys * tiles)


@dataclass(frozen=True)
class Operand:
    """How to read one operand's tiles: its name, dtype, full sizes, tile sizes and layout
    (``dense`` or ``csr``, see ``tra_sql.udfs.sparse``)."""

    name: str
    dtype: np.dtype
    sizes: np.ndarray
    tiles: np.ndarray
    layout: str = "dense"

    def check(self, offsets, valid, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The shapes of the tiles at ``rows``; a tile whose bytes disagree with the catalog's
        geometry raises ``CorruptTileError``."""
        shapes = tile_shapes(keys, self.sizes, self.tiles)
        expected = np.prod(shapes, axis=1, dtype=np.int64) * self.dtype.itemsize
        held = offsets[rows + 1] - offsets[rows]
        bad = ~valid[rows] | (held != expected)
        if bad.any():
            i = int(np.argmax(bad))
            what = "is NULL" if not valid[rows[i]] else f"holds {held[i]} bytes"
            raise CorruptTileError(
                f"tile {tuple(int(k) for k in keys[i])} of tensor '{self.name}' {what}; its shape "
                f"{tuple(int(n) for n in shapes[i])} and dtype {self.dtype} need {expected[i]}"
            )
        return shapes

    def views(self, data, offsets, valid, rows: np.ndarray, keys: np.ndarray) -> list[np.ndarray | CSRTile]:
        """Zero-copy NumPy views of the tiles at ``rows`` (CSR tiles over views of their bytes)."""
        if self.layout == "csr":
            return [self.csr(data, offsets, valid, r, key) for r, key in zip(rows, keys)]
        shapes = self.check(offsets, valid, rows, keys)
        return [data[offsets[r] : offsets[r + 1]].view(self.dtype).reshape(shape) for r, shape in zip(rows, shapes)]

    def stacked(self, data, offsets, valid, rows: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
        """The tiles at ``rows`` as one ``(len(rows), *shape)`` array when they all have one
        shape (a view when they lie back to back in the Arrow buffer), else ``None``."""
        if self.layout == "csr":
            return None
        shapes = self.check(offsets, valid, rows, keys)
        if not len(rows) or (shapes != shapes[0]).any():
            return None
        nbytes = int(np.prod(shapes[0])) * self.dtype.itemsize
        starts = offsets[rows]
        if (np.diff(starts) == nbytes).all():
            flat = data[starts[0] : starts[0] + nbytes * len(rows)]
        else:
            flat = np.concatenate([data[start : start + nbytes] for start in starts])
        return flat.view(self.dtype).reshape(len(rows), *shapes[0])

    def csr(self, data, offsets, valid, row: int, key: np.ndarray) -> CSRTile:
        """The CSR tile at ``row``."""
        shape = tile_shapes(key, self.sizes, self.tiles)
        if not valid[row]:
            raise CorruptTileError(f"tile {tuple(int(k) for k in key)} of tensor '{self.name}' is NULL")
        return sparse.check(self.name, key, data[offsets[row] : offsets[row + 1]], shape, self.dtype)


@dataclass(frozen=True)
class StepMeta:
    """The parsed ``meta`` argument of an einsum UDF."""

    inputs: tuple[str, ...]
    output: str
    sizes: dict[str, int]
    tiles: dict[str, int]
    dtypes: tuple[str, ...]
    out_dtype: str
    names: tuple[str, ...]
    join: str | None
    agg: str
    epilogue: StepMeta | None = None  # an element-wise einsum applied to the result
    position: int = 0  # an epilogue: where the result enters its operands; a prologue step: its operand
    layouts: tuple[str, ...] = ()  # per operand; empty: all dense
    out_layout: str = "dense"
    prologue: tuple[StepMeta, ...] = ()  # operands the kernel computes first, from its other operands
    sources: tuple[int, ...] = ()  # a prologue step: the operands it reads

    @staticmethod
    @lru_cache(maxsize=256)
    def parse(text: str) -> StepMeta:
        return StepMeta.from_dict(json.loads(text))

    @staticmethod
    def from_dict(m: dict) -> StepMeta:
        epilogue = StepMeta.from_dict(m["epilogue"]) if m.get("epilogue") else None
        return StepMeta(
            tuple(m["inputs"]), m["output"], m["sizes"], m["tiles"], tuple(m["dtypes"]),
            m["out_dtype"], tuple(m["names"]), m.get("join"), m.get("agg", "sum"),
            epilogue, m.get("position", 0), tuple(m.get("layouts", ())), m.get("out_layout", "dense"),
            tuple(StepMeta.from_dict(step) for step in m.get("prologue", ())), tuple(m.get("sources", ())),
        )

    @property
    def present(self) -> list[int]:
        """The operands whose tiles come in as arguments (the others: see ``prologue``)."""
        computed = {step.position for step in self.prologue}
        return [m for m in range(len(self.inputs)) if m not in computed]

    @property
    def others(self) -> list[int]:
        """The operands other than the one at ``position`` (an epilogue's own inputs)."""
        return [m for m in range(len(self.inputs)) if m != self.position]

    @cached_property
    def operands(self) -> list[Operand]:
        layouts = self.layouts or ("dense",) * len(self.inputs)
        return [
            Operand(name, np.dtype(dt), self._vec(self.sizes, sub), self._vec(self.tiles, sub), layout)
            for name, dt, sub, layout in zip(self.names, self.dtypes, self.inputs, layouts)
        ]

    @cached_property
    def result(self) -> Operand:
        return Operand("result", np.dtype(self.out_dtype), self._vec(self.sizes, self.output),
                       self._vec(self.tiles, self.output), self.out_layout)

    @cached_property
    def pattern(self) -> int:
        """The CSR operand whose entries a CSR result has."""
        return next(m for m, (sub, op) in enumerate(zip(self.inputs, self.operands))
                    if op.layout == "csr" and sub == self.output)

    @cached_property
    def kernel(self) -> TileEinsum:
        code = join_code(self.join, len(self.inputs)) if self.join else None
        return TileEinsum(self.inputs, self.output, code, self.agg)

    @cached_property
    def batched(self) -> TileEinsum:
        """The kernel over a leading batch index: one call for a stack of tile sets."""
        return self.kernel.batched()

    @staticmethod
    def _vec(table: dict[str, int], sub: str) -> np.ndarray:
        return np.array([table[c] for c in sub], dtype=np.int64)


def allocate_tiles(result: Operand, out_keys: np.ndarray):
    """A byte buffer for one output tile per row, with offsets and per-row shapes."""
    shapes = tile_shapes(out_keys, result.sizes, result.tiles)
    nbytes = np.prod(shapes, axis=1, dtype=np.int64) * result.dtype.itemsize
    offsets = np.zeros(len(out_keys) + 1, dtype=np.int64)
    np.cumsum(nbytes, out=offsets[1:])
    return np.empty(int(offsets[-1]), dtype=np.uint8), offsets, shapes


def out_view(buf, offsets, row, shape, dtype) -> np.ndarray:
    """Row ``row``'s tile in an output buffer of ``allocate_tiles``, as an array."""
    return buf[offsets[row] : offsets[row + 1]].view(dtype).reshape(shape)


def operand_tiles(meta: StepMeta, columns, elements: np.ndarray, stack: bool, which: list[int] | None = None):
    """Tiles at ``elements`` of the operands ``which`` (default: all), read from (keys, tile)
    column pairs: stacked into one array per operand when ``stack`` and each operand's tiles
    share a shape, else lists of views. Returns (tiles, stacked?)."""
    which = list(range(len(meta.inputs))) if which is None else which
    operands = [meta.operands[m] for m in which]
    sources = [(binary_views(columns[2 * i + 1]), key_matrix(columns[2 * i], len(meta.inputs[m])))
               for i, m in enumerate(which)]
    if stack:
        stacked = [op.stacked(*views, elements, keys) for op, (views, keys) in zip(operands, sources)]
        if all(t is not None for t in stacked):
            return stacked, True
    return [op.views(*views, elements, keys) for op, (views, keys) in zip(operands, sources)], False


def _finish(meta: StepMeta, out_keys: np.ndarray, buf, offsets, shapes, columns) -> pa.Array:
    """The UDF's result: the computed tiles, or, with an epilogue, the epilogue's join
    applied to each of them and to its other operands' tiles (``columns``). The epilogue
    overwrites the computed tiles when its result has their dtype and it has no CSR operand
    (it is element-wise and laid out as they are, so each element is read before it is
    written; a CSR operand's kernel clears its output first)."""
    epilogue = meta.epilogue
    if epilogue is None:
        return binary_array(buf, offsets)
    if epilogue.result.dtype == meta.result.dtype and "csr" not in epilogue.layouts:
        out_buf, out_offsets = buf, offsets
    else:
        out_buf, out_offsets, _ = allocate_tiles(epilogue.result, out_keys)
    rows = np.arange(len(out_keys))
    others, stacked = operand_tiles(epilogue, columns, rows, _uniform(shapes), epilogue.others)
    if stacked:
        tiles = others[: epilogue.position] + [buf.view(meta.result.dtype).reshape(len(rows), *shapes[0])] \
            + others[epilogue.position :]
        out = out_buf.view(epilogue.result.dtype).reshape(len(rows), *shapes[0])
        _stacked_call(epilogue, out, tiles)
        return binary_array(out_buf, out_offsets)
    for row in rows:
        inner = out_view(buf, offsets, row, shapes[row], meta.result.dtype)
        tiles = [t[row] for t in others]
        tiles.insert(epilogue.position, inner)
        out = out_view(out_buf, out_offsets, row, shapes[row], epilogue.result.dtype)
        epilogue.kernel.compute(out, tiles)
    return binary_array(out_buf, out_offsets)


def _stacked_call(meta: StepMeta, out: np.ndarray, tiles: list[np.ndarray]) -> None:
    """``out`` (stacked output tiles) computed from stacked operand tiles in one kernel call;
    a stack of one runs the plain kernel, whose loops can then be threaded."""
    if len(out) == 1:
        meta.kernel.compute(out[0, ...], [t[0, ...] for t in tiles])
    else:
        meta.batched.compute(out, tiles)


def _computed(step: StepMeta, sources: list, stacked: bool, count: int):
    """``step``'s result for each of ``count`` rows from its operands' tiles ``sources``
    (stacked arrays, or lists of per-row tiles), in the same form."""
    dtype = step.result.dtype
    if stacked:
        extent = {c: n for sub, t in zip(step.inputs, sources) for c, n in zip(sub, t.shape[1:])}
        out = np.empty((count, *(extent[c] for c in step.output)), dtype=dtype)
        _stacked_call(step, out, sources)
        return out
    results = []
    for row in range(count):
        tiles = [t[row] for t in sources]
        extent = {c: n for sub, t in zip(step.inputs, tiles) for c, n in zip(sub, t.shape)}
        results.append(np.empty([extent[c] for c in step.output], dtype=dtype))
        step.kernel.compute(results[-1], tiles)
    return results


def _computed_into(step: StepMeta, buf, offsets, shapes, tiles: list, stacked: bool) -> None:
    """``step``'s result for each row written into the output buffer ``buf`` (one tile per
    row at ``offsets``, of ``shapes``), from its operands' tiles (stacked, or per row)."""
    if stacked:
        _stacked_call(step, buf.view(step.result.dtype).reshape(len(shapes), *shapes[0]), tiles)
        return
    for row in range(len(shapes)):
        out = out_view(buf, offsets, row, shapes[row], step.result.dtype)
        step.kernel.compute(out, [t[row] for t in tiles])


def _with_prologue(meta: StepMeta, tiles: list, stacked: bool, count: int) -> list:
    """Every operand's tiles, in operand order: the ``present`` ones (``tiles``) and the
    prologue's, computed from them (stacked, or per row)."""
    if not meta.prologue:
        return tiles
    full: list = [None] * len(meta.inputs)
    for m, operand in zip(meta.present, tiles):
        full[m] = operand
    for step in meta.prologue:
        full[step.position] = _computed(step, [full[s] for s in step.sources], stacked, count)
    return full


def _uniform(shapes: np.ndarray) -> bool:
    return len(shapes) > 0 and bool((shapes == shapes[0]).all())


def einsum_rows(meta_col, out_keys_col, *operand_cols):
    """``tra_einsum_<n>``: one output tile per joined row. When all tiles of an operand (and
    of the output) share a shape, the whole batch is one kernel call over stacked tiles."""
    meta = StepMeta.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.output))
    rows = np.arange(len(out_keys))
    own = 2 * len(meta.present)
    if meta.result.layout == "csr":
        tiles, _ = operand_tiles(meta, operand_cols[:own], rows, False)
        results = []
        for row in rows:
            buf, out = sparse.like(tiles[meta.pattern][row], meta.result.dtype)
            meta.kernel.compute(out, [t[row] for t in tiles])
            results.append(buf)
        return sparse.concat(results)
    buf, offsets, shapes = allocate_tiles(meta.result, out_keys)
    tiles, stacked = operand_tiles(meta, operand_cols[:own], rows, _uniform(shapes), meta.present)
    tiles = _with_prologue(meta, tiles, stacked, len(rows))
    _computed_into(meta, buf, offsets, shapes, tiles, stacked)
    return _finish(meta, out_keys, buf, offsets, shapes, operand_cols[own:])


@dataclass(frozen=True)
class ChainMeta:
    """The parsed ``meta`` of ``tra_chain_<n>``: the joined relations (``leaves``: their
    subscripts in the chain's letters, and the result's) and the steps, each reading leaves
    and earlier steps' results (``sources``: leaf ``m``, or ``-1 - k`` for step ``k``)."""

    leaves: StepMeta
    steps: tuple[StepMeta, ...]

    @staticmethod
    @lru_cache(maxsize=64)
    def parse(text: str) -> ChainMeta:
        m = json.loads(text)
        return ChainMeta(StepMeta.from_dict(m["leaves"]), tuple(StepMeta.from_dict(step) for step in m["steps"]))


def chain_rows(meta_col, out_keys_col, *operand_cols):
    """``tra_chain_<n>``: per joined row, the chain's steps one after another (see
    ``tra_sql.sqlgen.Chain``); only the last one's tile is returned."""
    meta = ChainMeta.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.leaves.output))
    rows = np.arange(len(out_keys))
    buf, offsets, shapes = allocate_tiles(meta.leaves.result, out_keys)
    leaves, stacked = operand_tiles(meta.leaves, operand_cols, rows, _uniform(shapes))
    results: list = []

    def operands(step: StepMeta) -> list:
        return [leaves[s] if s >= 0 else results[-1 - s] for s in step.sources]

    for step in meta.steps[:-1]:
        results.append(_computed(step, operands(step), stacked, len(rows)))
    _computed_into(meta.steps[-1], buf, offsets, shapes, operands(meta.steps[-1]), stacked)
    return binary_array(buf, offsets)


def einsum_groups(meta_col, out_keys_col, rows_col, *epilogue_cols):
    """``tra_einsum_agg_<n>``: one output tile per group of joined rows. Batches of small
    uniform tiles are computed in one kernel call and reduced per group (``ufunc.reduceat``)."""
    meta = StepMeta.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.output))
    buf, offsets, shapes = allocate_tiles(meta.result, out_keys)
    group_offsets, rows = list_views(rows_col)
    elements = np.arange(len(rows))
    sizes = np.diff(group_offsets)
    small = _uniform(shapes) and len(rows) * int(np.prod(shapes[0])) <= BATCH_ELEMENTS and (sizes > 0).all()
    tiles, stacked = operand_tiles(meta, rows.flatten(), elements, small)
    if stacked:
        partial = np.empty((len(rows), *shapes[0]), dtype=meta.result.dtype)
        _stacked_call(meta, partial, tiles)
        out = buf.view(meta.result.dtype).reshape(len(out_keys), *shapes[0])
        REDUCE[meta.agg].reduceat(partial, group_offsets[:-1], axis=0, out=out)
    else:
        for row in range(len(out_keys)):
            out = out_view(buf, offsets, row, shapes[row], meta.result.dtype)
            group = range(group_offsets[row], group_offsets[row + 1])
            if not group:
                meta.kernel.init(out)
            for n, element in enumerate(group):
                (meta.kernel.accumulate if n else meta.kernel.compute)(out, [t[element] for t in tiles])
    return _finish(meta, out_keys, buf, offsets, shapes, epilogue_cols)


def reduce_partials(meta_col, out_keys_col, partials_col, *epilogue_cols):
    """``tra_reduce[_<k>]``: one output tile per group, the aggregate of its joined rows'
    partial results (each the einsum over one row's tiles, from ``tra_einsum_<n>``)."""
    meta = StepMeta.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.output))
    group_offsets, partials = list_views(partials_col)
    counts = np.diff(group_offsets)
    keys = np.repeat(out_keys, counts, axis=0)
    elements = np.arange(len(keys))
    views = binary_views(partials)
    combine = REDUCE[meta.agg]
    if meta.result.layout == "csr":  # a group's partial results share their entries
        tiles = meta.result.views(*views, elements, keys)
        results = []
        for row in range(len(out_keys)):
            group = tiles[group_offsets[row] : group_offsets[row + 1]]
            buf, out = sparse.like(group[0], meta.result.dtype)
            combine.reduce(np.stack([t.data for t in group]), axis=0, out=out)
            results.append(buf)
        return sparse.concat(results)
    buf, offsets, shapes = allocate_tiles(meta.result, out_keys)
    stacked = meta.result.stacked(*views, elements, keys) if _uniform(shapes) and (counts > 0).all() else None
    if stacked is not None:
        combine.reduceat(stacked, group_offsets[:-1], axis=0,
                         out=buf.view(meta.result.dtype).reshape(len(out_keys), *shapes[0]))
    else:
        tiles = meta.result.views(*views, elements, keys)
        for row in range(len(out_keys)):
            out = out_view(buf, offsets, row, shapes[row], meta.result.dtype)
            meta.kernel.init(out)
            for element in range(group_offsets[row], group_offsets[row + 1]):
                combine(out, tiles[element], out=out)
    return _finish(meta, out_keys, buf, offsets, shapes, epilogue_cols)


def _check_pieces(names, dtypes, parts, origins, extents, offsets, valid) -> None:
    """Every piece's bytes must match its shape and its source's dtype."""
    itemsize = np.array([d.itemsize for d in dtypes], dtype=np.int64)[parts]
    expected = np.prod(extents, axis=1, dtype=np.int64) * itemsize
    held = np.diff(offsets)
    bad = ~valid | (held != expected)
    if bad.any():
        i = int(np.argmax(bad))
        what = "is NULL" if not valid[i] else f"holds {held[i]} bytes"
        raise CorruptTileError(
            f"the tile of tensor '{names[parts[i]]}' at element {tuple(int(o) for o in origins[i])} {what}; "
            f"its shape {tuple(int(n) for n in extents[i])} and dtype {dtypes[parts[i]]} need {expected[i]}")


def place(meta_col, out_keys_col, pieces_col):
    """``tra_place``: assemble each output tile from the source pieces that overlap it."""
    m = json.loads(first_string(meta_col))
    shape, tile = np.array(m["shape"], dtype=np.int64), np.array(m["tile"], dtype=np.int64)
    target = Operand("result", np.dtype(m["dtype"]), shape, tile)
    out_keys = key_matrix(out_keys_col, len(shape))
    buf, offsets, shapes = allocate_tiles(target, out_keys)
    starts, flat = list_views(pieces_col)
    origin_col, shape_col, part_col, tile_col = flat.flatten()
    rank = 1 if m["flat"] else len(shape)
    origins, extents = key_matrix(origin_col, rank), key_matrix(shape_col, rank)
    parts = part_col.to_numpy(zero_copy_only=False)
    data, data_offsets, valid = binary_views(tile_col)
    dtypes = [np.dtype(d) for d in m["dtypes"]]
    _check_pieces(m["names"], dtypes, parts, origins, extents, data_offsets, valid)
    flat_tile = int(tile[0] * np.prod(shape[1:])) if len(shape) else 1
    for row in range(len(out_keys)):
        out = out_view(buf, offsets, row, shapes[row], target.dtype)
        out[...] = 0
        if m["flat"]:
            out, origin = out.reshape(-1), out_keys[row][:1] * flat_tile
        else:
            origin = out_keys[row] * tile
        for e in range(starts[row], starts[row + 1]):
            piece = data[data_offsets[e] : data_offsets[e + 1]].view(dtypes[parts[e]]).reshape(extents[e])
            lo = np.maximum(origin, origins[e])
            hi = np.minimum(origin + out.shape, origins[e] + extents[e])
            if np.any(hi <= lo):
                continue
            region = tuple(slice(a, b) for a, b in zip(lo - origin, hi - origin))
            cut = piece[tuple(slice(a, b) for a, b in zip(lo - origins[e], hi - origins[e]))]
            if m["add"]:
                out[region] += cut
            else:
                out[region] = cut
    return binary_array(buf, offsets)


def fill(meta_col, out_keys_col):
    """``tra_fill``: one constant tile per row of output keys."""
    m = json.loads(first_string(meta_col))
    target = Operand("result", np.dtype(m["dtype"]), np.array(m["shape"], np.int64), np.array(m["tile"], np.int64))
    out_keys = key_matrix(out_keys_col, len(target.sizes))
    buf, offsets, shapes = allocate_tiles(target, out_keys)
    for row in range(len(out_keys)):
        out_view(buf, offsets, row, shapes[row], target.dtype)[...] = m["value"]
    return binary_array(buf, offsets)


def _rows_type(arity: int):
    """``list({keys0, tile0, ..., keys<arity-1>, tile<arity-1>})``: a group's joined rows."""
    keys = duckdb.list_type(BIGINT)
    return duckdb.list_type(duckdb.struct_type(
        {f"{what}{m}": typ for m in range(arity) for what, typ in (("keys", keys), ("tile", BLOB))}))


def _signature(name: str):
    """(Python function, parameter types, result type) of a UDF name."""
    from tra_sql.udfs import elements, pack

    keys = duckdb.list_type(BIGINT)
    fixed = {
        "tra_place": (place, [VARCHAR, keys, duckdb.list_type(duckdb.struct_type(
            {"origin": keys, "shape": keys, "part": INTEGER, "tile": BLOB}))], BLOB),
        "tra_fill": (fill, [VARCHAR, keys], BLOB),
        "tra_tile_values": (elements.tile_values, [BLOB, VARCHAR], duckdb.list_type(DOUBLE)),
        "tra_tile_ints": (elements.tile_ints, [BLOB, VARCHAR], duckdb.list_type(BIGINT)),
        "tra_random_tile": (elements.random_tiles, [VARCHAR, keys], BLOB),
        "tra_pack_tile": (elements.pack_tiles, [VARCHAR, keys, duckdb.list_type(keys), duckdb.list_type(DOUBLE)],
                          BLOB),
        "tra_pack_csr": (sparse.pack_csr, [VARCHAR, keys, keys, keys, duckdb.list_type(DOUBLE)], BLOB),
        "tra_pack": (pack.pack, [DOUBLE], BLOB),
        "tra_pack_f32": (pack.pack_f32, [DOUBLE], BLOB),
    }
    if name in fixed:
        return fixed[name]
    reduce = re.fullmatch(r"tra_reduce(?:_(\d+))?", name)
    if reduce:  # with k epilogue operands: k (keys, tile) pairs after the list of partials
        return reduce_partials, [VARCHAR, keys, duckdb.list_type(BLOB)] + [keys, BLOB] * int(reduce.group(1) or 0), BLOB
    attention = re.fullmatch(r"tra_attention_(\d+)", name)
    if attention:  # (keys, tile) of Q, K, V and the mask, if any, per joined row
        from tra_sql.udfs.attention import attention_groups
        return attention_groups, [VARCHAR, keys, _rows_type(int(attention.group(1)))], BLOB
    chain = re.fullmatch(r"tra_chain_(\d+)", name)
    if chain:  # (keys, tile) of each joined relation
        return chain_rows, [VARCHAR, keys] + [keys, BLOB] * int(chain.group(1)), BLOB
    match = re.fullmatch(r"tra_einsum(_agg)?_(\d+)(?:_(\d+))?", name)
    if not match or (match.group(3) and not match.group(1)):
        raise ValueError(f"no tile UDF is named {name!r}")
    arity = int(match.group(2))
    if match.group(1):  # with k epilogue operands: k (keys, tile) pairs after the list
        extra = int(match.group(3) or 0)
        return einsum_groups, [VARCHAR, keys, _rows_type(arity)] + [keys, BLOB] * extra, BLOB
    return einsum_rows, [VARCHAR, keys] + [keys, BLOB] * arity, BLOB


def _with_arity(function, arity: int):
    """``function`` behind a wrapper with exactly ``arity`` named parameters, since DuckDB
    counts a UDF's parameters and does not accept ``*args``."""
    params = ", ".join(f"a{i}" for i in range(arity))
    scope = {"function": function, "__name__": __name__}
    exec(f"def udf({params}):\n    return function({params})\n", scope)
    return scope["udf"]


def register_kernels(con: duckdb.DuckDBPyConnection, names) -> None:
    """Register the named UDFs (see the module docstring and ``udfs.elements``) on ``con``."""
    for name in names:
        function, params, result = _signature(name)
        con.create_function(
            name, _with_arity(function, len(params)), params, result, type="arrow",
            null_handling="special", exception_handling="default",
        )
