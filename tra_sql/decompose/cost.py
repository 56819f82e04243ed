"""The cost model: predicted seconds and memory of one einsum op under a partition vector
(tiles per index), and of repartitioning a tensor between two tilings.

Everything is vectorized over a matrix of partition vectors, since the search prices every
state of an op at once. The constants are measured by ``calibrate``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from math import ceil

import numpy as np

from tra_sql.decompose.problem import Op
from tra_sql.errors import SpecError
from tra_sql.udfs.contract import gemm_form


@dataclass(frozen=True)
class Constants:
    """Engine constants (seconds, bytes, flop/s). The defaults were measured by ``calibrate()``
    on the 2-core development machine (shared with other jobs: expect 2x noise);
    ``Session.calibrate()`` re-measures them and keeps them in the database."""

    stmt: float = 4.3e-3        # per statement (one CTE / one SQL step)
    row: float = 7.4e-7         # per joined row (one tile-kernel call)
    group: float = 7.4e-7       # per group of a split aggregation (one list per output tile)
    blas_call: float = 2.6e-4   # per BLAS tile-kernel call inside the engine (threads woken, copies)
    join_byte: float = 8.6e-10  # per byte carried through a join
    list_byte: float = 3.2e-10  # per byte carried through list() aggregation
    out_byte: float = 8.6e-10   # per byte of output tiles written
    piece: float = 1.35e-5      # per piece of a repartition (a source tile cut for a target tile)
    place_byte: float = 1.3e-9  # per byte the pieces of a repartition carry
    scan_byte: float = 8.6e-10  # per byte re-read when an op runs in bands
    copy_byte: float = 7.1e-11  # per byte of partial-aggregate traffic in the kernel
    peak_flops: float = 7.1e10  # BLAS flop/s on large float32 tiles, all threads
    half_flops: float = 2.5e5   # tile flops at which BLAS runs at half its peak
    elem: float = 2.3e-10       # per element and operand of a loop (non-BLAS) kernel
    mem_list: float = 3.3       # memory bytes held per byte in list() aggregation
    mem_join: float = 2.0       # memory bytes held per byte of a hash-join build side
    list_block: float = 262144  # under memory pressure DuckDB 2.0 keeps each list() element of blobs in
    #                             a 256 KiB block of its own (measured: 489 tiles of 32 KiB need 128 MB)
    threads: int = 2
    fused: int = 0  # 1: split sums of BLAS products run as the fused contraction aggregate (``fusible``)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, float]) -> Constants:
        known = {f.name: f.type for f in fields(cls)}
        kw = {k: (int(v) if k in ("threads", "fused") else float(v)) for k, v in values.items() if k in known}
        return cls(**kw)


#: The published objective: bytes moved (joins, aggregation, repartitions), nothing else.
BYTES_ONLY = Constants(stmt=0, row=0, group=0, blas_call=0, join_byte=1, list_byte=0, out_byte=0, piece=0, place_byte=1,
                       scan_byte=0, copy_byte=1, peak_flops=float("inf"), half_flops=0, elem=0,
                       mem_list=2.2, mem_join=1.5)

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int | float) -> float:
    """``"2GB"``, ``"512 MiB"``, ``1e9`` as bytes (DuckDB's units: GB = 1000^3, GiB = 1024^3)."""
    if isinstance(value, (int, float)):
        return float(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise SpecError(f"cannot read {value!r} as a memory size: write e.g. '2GB' or '512MiB'")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


@dataclass(frozen=True)
class Budget:
    """``workers`` running tile kernels at once, ``memory`` bytes each; one statement may use
    all of it (workers × memory) before it must run in bands, unless the engine ``spills``
    (Spark: scans stream, shuffles, sorts and joins go to disk), where only a worker's piece
    of an op must fit."""

    workers: int
    memory: float
    spills: bool = False

    @property
    def statement(self) -> float:
        return float("inf") if self.spills else self.workers * self.memory


COMPONENTS = ("statements", "rows", "join", "list", "output", "kernel", "partial", "bands", "repartition")


@dataclass
class OpCost:
    """Per state: total seconds, the components, memory of one statement and of one worker's
    piece, and the number of statements (bands) the op runs in."""

    total: np.ndarray
    parts: dict[str, np.ndarray]
    working_set: np.ndarray
    piece: np.ndarray
    bands: np.ndarray
    agg_bands: np.ndarray


VECTOR = 2048  # rows per DuckDB vector
#: A band's predicted working set may fill this share of the statement budget: DuckDB's own
#: accounting (hash tables, vectors, allocator) is only approximated by the model.
BAND_FILL = 0.5


def scan_memory(tile_bytes, rows):
    """Memory a scan of a stored tile table holds: DuckDB 2.0 loads the blobs of every
    2048-row vector it touches, whatever the key filter selects (measured: reading two 32 KiB
    tiles of a 3920-row table loaded 62 MB)."""
    return np.minimum(rows, VECTOR) * np.asarray(tile_bytes, dtype=np.float64)


#: Constants that price the linear features of an op (see ``features``).
LINEAR = ("stmt", "row", "group", "blas_call", "join_byte", "list_byte", "out_byte")


def fusible(op: Op) -> bool:
    """Whether a split sum of ``op`` runs as the fused contraction aggregate where the engine
    has it (``Constants.fused``): a plain BLAS product of dense tiles (``contract.gemm_form``
    of the step the compiler writes), each joined row's product added into its group's state,
    no partial product written and nothing in a list()."""
    return op.node.layout == "dense" and gemm_form(op.node.step()) is not None


def features(op: Op, Q: np.ndarray, fused: bool = False) -> dict[str, np.ndarray]:
    """What an op does under each partition vector (row of ``Q``), in units the constants
    price: statements, joined rows (kernel calls), groups of a split aggregation, bytes
    through the join, bytes through list() (none where the op is ``fused``: see ``fusible``),
    output bytes; plus what the kernel and memory terms need."""
    n = np.array(op.sizes, dtype=np.float64)
    Qf = Q.astype(np.float64)
    joins = np.prod(Qf, axis=1)
    n_out = np.prod(Qf[:, list(op.out)], axis=1)
    agg_parts = np.prod(Qf[:, list(op.agg)], axis=1)
    split = agg_parts > 1
    tile_bytes = [x.nbytes / np.prod(Qf[:, list(x.pos)], axis=1) for x in op.inputs]
    in_tile = np.sum(tile_bytes, axis=0) if tile_bytes else np.zeros(len(Q))
    join_bytes = joins * in_tile
    return {
        "stmt": np.ones(len(Q)), "row": joins, "group": np.where(split, n_out, 0.0),
        "blas_call": joins if op.blas else np.zeros(len(Q)), "join_byte": join_bytes,
        "list_byte": np.where(split & (not fused), join_bytes, 0.0), "out_byte": np.full(len(Q), float(op.out_bytes)),
        "agg_parts": agg_parts, "n_out": n_out, "in_tile": in_tile,
        "tile_flops": 2.0 * np.prod(np.ceil(n / Qf), axis=1) if len(n) else np.full(len(Q), 2.0),
    }


def kernel_seconds(op: Op, f: dict[str, np.ndarray], c: Constants, workers: int) -> np.ndarray:
    """Tile-kernel time: BLAS at an efficiency that grows with the tile's flops (float64 at
    half the float32 rate), or a loop kernel at a constant time per element and operand."""
    elements = float(np.prod(np.array(op.sizes, dtype=np.float64)))
    if op.blas:
        scale = min(workers, c.threads) / max(c.threads, 1) * 4 / op.node.dtype.itemsize
        return 2.0 * elements / (c.peak_flops * scale) * (1.0 + c.half_flops / f["tile_flops"])
    return np.full(len(f["row"]), elements * max(len(op.inputs), 1) * c.elem)


def op_cost(op: Op, Q: np.ndarray, c: Constants, budget: Budget) -> OpCost:
    """The cost of ``op`` under every partition vector (row of ``Q``).

    Memory: a statement holds its join's build side, or, when an aggregated index is split,
    every group's list at once (``mem_list`` bytes per list byte), and what its scans load;
    over the statement budget the op runs in bands of its tile grid. A worker holds one
    group's tiles and its output tile; a group over the worker's memory is split across
    statements (bands over the aggregated indices), each reading its tiles through a key
    index (only the band's tiles are loaded) and adding the partial result of the bands
    before it (one more output tile per worker). Infeasible (``inf``): one joined row of
    tiles does not fit a worker.

    A fused op (``c.fused`` and ``fusible``) holds no list: instead each group's state, one
    output tile (``malloc``ed: outside DuckDB's memory_limit, so charged here), as many times
    as threads aggregate the group at once (DuckDB's hash aggregate keeps a state per group in
    each thread's table until it combines them). Its groups are split across statements as a
    list's would be (conservative: a worker holds one joined row at a time)."""
    fused = bool(c.fused) and fusible(op)
    f = features(op, Q, fused)
    out_bytes = float(op.out_bytes)
    out_tile = out_bytes / f["n_out"]
    whole = [float(x.nbytes) for x in op.inputs]
    build = (sum(whole) - max(whole)) if whole else 0.0
    split = f["agg_parts"] > 1
    row_mem = np.maximum(f["in_tile"] * c.mem_list, c.list_block)
    rows_fit = np.maximum(np.floor((budget.memory - 2 * out_tile) / row_mem), 1.0)  # joined rows a worker holds
    agg_bands = np.where(split, np.ceil(f["agg_parts"] / np.minimum(rows_fit, f["agg_parts"])), 1.0)
    if fused:
        held = out_bytes * np.minimum(budget.workers, np.ceil(f["agg_parts"] / agg_bands))  # the states
    else:
        held = list_memory(f["row"], f["in_tile"], c)  # every joined row in a list
    # bands of one tile per aggregated index run unsplit: nothing in a list(), no state
    working_set = np.where(split & (agg_bands < f["agg_parts"]), held, 0.0) + build * c.mem_join + out_bytes
    piece = np.where(split, np.ceil(f["agg_parts"] / agg_bands), 1.0) * f["in_tile"] + out_tile
    piece = piece + np.where(agg_bands > 1, out_tile, 0.0)
    scans = 0.0  # every band scans its inputs: the vectors it touches, or its own tiles by key
    for x in op.inputs:
        tiles = np.prod(Q[:, list(x.pos)], axis=1).astype(np.float64)
        keyed = (agg_bands > 1) & np.isin(list(x.pos), list(op.agg)).any()
        scans = scans + np.where(keyed, x.nbytes / agg_bands, scan_memory(x.nbytes / tiles, tiles))
    room = budget.statement * BAND_FILL - scans
    bands = np.maximum(np.maximum(1.0, np.ceil(working_set / np.maximum(room, 1.0))), agg_bands)
    partials = np.where(agg_bands > 1, out_bytes * (agg_bands - 1), 0.0)  # read and written once per band
    # bands cut the output grid evenly: an operand holding a share s of the output indices is
    # read out_bands ** (1 - s) times (once if it has them all, in every band if it has none);
    # bands across aggregated indices read each their own slice
    n_out_idx = max(len(op.out), 1)
    out_bands = np.ceil(bands / agg_bands)
    rescans = sum(x.nbytes * (out_bands ** (1.0 - sum(1 for i in set(x.pos) if i in op.out) / n_out_idx) - 1.0)
                  for x in op.inputs)
    parts = {
        "statements": f["stmt"] * c.stmt,
        "rows": f["row"] * c.row + f["group"] * c.group + f["blas_call"] * c.blas_call,
        "join": f["join_byte"] * c.join_byte,
        "list": np.where(agg_bands < f["agg_parts"], f["list_byte"], 0.0) * c.list_byte,
        "output": f["out_byte"] * c.out_byte,
        "kernel": kernel_seconds(op, f, c, budget.workers),
        "partial": out_bytes * (f["agg_parts"] - 1) * c.copy_byte + partials * (c.out_byte + c.join_byte),
        "bands": (bands - 1) * c.stmt + rescans * c.scan_byte,
    }
    total = sum(parts.values())
    stored = scan_memory(out_tile, f["n_out"]) <= budget.statement * BAND_FILL  # its table can be read back
    total = np.where((piece > budget.memory) | (bands > f["row"]) | ~stored | (room <= 0),
                     np.inf, total)
    return OpCost(total, parts, working_set, piece, bands, agg_bands)


@dataclass(frozen=True)
class Repartition:
    """Cost of re-tiling a tensor of ``nbytes``: ``fixed + per_tile * (source tiles + target
    tiles)`` when the tilings differ, zero when they agree. Separable in the two tilings,
    which is what keeps the DP's edge step linear in the number of tilings."""

    fixed: float
    per_tile: float

    def __call__(self, same: np.ndarray, src_tiles, dst_tiles) -> np.ndarray:
        return np.where(same, 0.0, self.fixed + self.per_tile * (np.asarray(src_tiles) + np.asarray(dst_tiles)))


def repartition(nbytes: float, c: Constants, budget: Budget) -> Repartition:
    bands = max(1, ceil(nbytes * c.mem_list / (budget.statement * BAND_FILL)))
    fixed = c.stmt * bands + nbytes * (c.place_byte + (bands - 1) * c.scan_byte)
    return Repartition(fixed, c.piece)


def pairs(n: int, src_tile: int, dst_tile: int) -> int:
    """(source tile, target tile) pairs that overlap along a dimension of ``n`` elements."""
    starts = np.arange(0, n, dst_tile)
    ends = np.minimum(starts + dst_tile, n)
    return int(np.sum((ends - 1) // src_tile - starts // src_tile + 1))


def retile_traffic(shape: tuple[int, ...], itemsize: int, src_tile: tuple[int, ...],
                   dst_tile: tuple[int, ...]) -> tuple[int, float]:
    """(pieces, bytes through list()) of re-tiling: each piece carries its whole source tile."""
    pieces = int(np.prod([pairs(n, s, t) for n, s, t in zip(shape, src_tile, dst_tile)]))
    return pieces, float(pieces * itemsize * np.prod(src_tile))


def leaf_repartition(shape: tuple[int, ...], itemsize: int, src_tile: tuple[int, ...], dst_parts: np.ndarray,
                     c: Constants, budget: Budget) -> np.ndarray:
    """Cost of reading a stored tensor (tiles ``src_tile``) in the tiling of each row of
    ``dst_parts`` (tiles per dimension): statements, pieces and the bytes they carry (each
    piece its whole source tile, so cutting big tiles small costs more than the tensor's
    size); ``inf`` where one target tile and its pieces do not fit a worker; 0 if unchanged."""
    if not shape:
        return np.zeros(len(dst_parts))
    nbytes = itemsize * float(np.prod(shape))
    src_parts = np.array([ceil(n / t) for n, t in zip(shape, src_tile)])
    per_dim = []
    for d, (n, ts) in enumerate(zip(shape, src_tile)):
        values, inverse = np.unique(dst_parts[:, d], return_inverse=True)
        table = np.array([pairs(n, ts, ceil(n / int(v))) for v in values], dtype=np.float64)
        per_dim.append(table[inverse.reshape(-1)])
    pieces = np.prod(per_dim, axis=0)
    listed = pieces * itemsize * float(np.prod(src_tile))
    dst_tiles = np.prod(dst_parts, axis=1).astype(np.float64)
    src_tile_bytes = itemsize * float(np.prod(src_tile))
    room = budget.statement * BAND_FILL - float(scan_memory(src_tile_bytes, np.prod(src_parts)))
    bands = np.maximum(1.0, np.ceil(list_memory(pieces, src_tile_bytes, c) / max(room, 1.0)))
    cost = c.stmt * bands + c.piece * pieces + c.place_byte * listed + (bands - 1) * nbytes * c.scan_byte
    worker = (listed + nbytes) / dst_tiles
    stored = scan_memory(nbytes / dst_tiles, dst_tiles) <= budget.statement * BAND_FILL
    cost = np.where((worker > budget.memory) | ~stored | (room <= 0), np.inf, cost)
    return np.where(np.all(dst_parts == src_parts, axis=1), 0.0, cost)


def list_memory(count, elem_bytes, c: Constants):
    """Memory of ``count`` blobs of ``elem_bytes`` held in list()s: ``mem_list`` per byte, but
    at least one ``list_block`` each."""
    return count * np.maximum(np.asarray(elem_bytes) * c.mem_list, c.list_block)


def repartition_bands(pieces: float, src_tile_bytes: float, c: Constants, budget: Budget) -> int:
    """Statements a re-tiling runs in, given its pieces and their (source tile) size."""
    return max(1, ceil(float(list_memory(pieces, src_tile_bytes, c)) / (budget.statement * BAND_FILL)))
