"""The protocol between the SQL compiler and the tile kernels: what a kernel call computes
and which kernel computes it, as typed values both sides import.

A kernel call's first argument is a step (``EinsumStep``, ``ChainStep``, ``AttentionStep``,
``PlaceStep``, ``FillStep``) rendered as a SQL string literal by ``Literal.encode`` and read
back by ``Literal.decode``; the step says WHAT to compute (subscripts, extents, dtypes,
joins, aggregations, layouts), never how. A ``Kernel`` names the function (``.name``, the SQL
function name) and its SQL parameter and result types (``.params``, ``.result``), from which
an engine registers its implementation. Any kind of kernel (Python over Arrow today) that
reads these steps implements the protocol.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from functools import lru_cache
from typing import ClassVar

META = "VARCHAR"  # the encoded step
KEYS = "BIGINT[]"
TILE = "BLOB"


class Literal:
    """A step that travels as a JSON string literal: fields at their defaults are left out;
    ``NESTED`` names the fields holding steps (or tuples of them)."""

    NESTED: ClassVar[dict[str, type]] = {}

    def plain(self) -> dict:
        """The step as JSON-ready values."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.default is MISSING or value != f.default:
                out[f.name] = _plain(value)
        return out

    def encode(self) -> str:
        """The SQL literal's text."""
        return json.dumps(self.plain(), separators=(",", ":"))

    @classmethod
    def decode(cls, text: str):
        """The step ``encode`` wrote (one object per distinct text)."""
        return _decode_text(cls, text)

    @classmethod
    def of(cls, value: dict):
        """The step of ``plain``'s values."""
        args = {}
        for f in fields(cls):
            if f.name not in value:
                continue
            item, nested = value[f.name], cls.NESTED.get(f.name)
            if nested is not None and item is not None:
                item = tuple(nested.of(v) for v in item) if isinstance(item, list) else nested.of(item)
            args[f.name] = _tuples(item)
        return cls(**args)


def _plain(value):
    if isinstance(value, Literal):
        return value.plain()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


@lru_cache(maxsize=512)
def _decode_text(cls: type, text: str):
    return cls.of(json.loads(text))


@dataclass(frozen=True)
class EinsumStep(Literal):
    """``out[output] = agg over the other indices of join(x0[inputs[0]], ...)`` on tiles:
    full ``sizes`` and tile sizes (``tiles``) per index, operand ``dtypes`` and ``names`` (for
    errors), tile ``layouts`` (empty: all dense; else per operand, ``dense`` or ``csr``).

    ``epilogue``: an element-wise step applied to the result, which enters its operands at
    its ``position``; ``prologue``: operands computed first from the others (each step's
    ``position`` is the operand it computes, ``sources`` the operands it reads)."""

    inputs: tuple[str, ...]
    output: str
    sizes: dict[str, int]
    tiles: dict[str, int]
    dtypes: tuple[str, ...]
    out_dtype: str
    names: tuple[str, ...]
    join: str | None = None
    agg: str = "sum"
    layouts: tuple[str, ...] = ()
    out_layout: str = "dense"
    epilogue: EinsumStep | None = None
    position: int = 0
    prologue: tuple[EinsumStep, ...] = ()
    sources: tuple[int, ...] = ()

    @property
    def aggregated(self) -> set[str]:
        return set("".join(self.inputs)) - set(self.output)

    @property
    def present(self) -> list[int]:
        """The operands whose tiles come in as arguments (the others: see ``prologue``)."""
        computed = {step.position for step in self.prologue}
        return [m for m in range(len(self.inputs)) if m not in computed]

    @property
    def others(self) -> list[int]:
        """The operands other than the one at ``position`` (an epilogue's own inputs)."""
        return [m for m in range(len(self.inputs)) if m != self.position]


EinsumStep.NESTED = {"epilogue": EinsumStep, "prologue": EinsumStep}


@dataclass(frozen=True)
class ChainStep(Literal):
    """Einsums computed one after another per joined row: ``leaves`` describes the joined
    relations (their subscripts in the chain's letters, and the result's); each of ``steps``
    reads leaves and earlier results (``sources``: leaf ``m``, or ``-1 - k`` for step ``k``)."""

    NESTED: ClassVar[dict[str, type]] = {"leaves": EinsumStep, "steps": EinsumStep}
    leaves: EinsumStep
    steps: tuple[EinsumStep, ...]


@dataclass(frozen=True)
class AttentionStep(Literal):
    """``softmax(scale * Q·K, mask) · V``: operand subscripts (Q, K, V[, mask]), the scores'
    (the softmax index last) and the output's, sizes and tiles per index, dtypes (the
    probabilities' a float type), names, the scale."""

    inputs: tuple[str, ...]
    scores: str
    output: str
    sizes: dict[str, int]
    tiles: dict[str, int]
    dtypes: tuple[str, ...]
    out_dtype: str
    probs_dtype: str
    names: tuple[str, ...]
    scale: float


@dataclass(frozen=True)
class PlaceStep(Literal):
    """One output tile of shape ``tile`` (of a ``shape`` tensor of ``dtype``) assembled from
    source pieces (sources' ``names`` and ``dtypes``), in row-major ``flat`` order or not,
    overlapping pieces summed (``add``) or written."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    tile: tuple[int, ...]
    flat: bool = False
    add: bool = False


@dataclass(frozen=True)
class FillStep(Literal):
    """The tiles of a ``shape`` tensor of ``dtype``, tiled ``tile``, every element ``value``."""

    dtype: str
    shape: tuple[int, ...]
    tile: tuple[int, ...]
    value: float


@dataclass(frozen=True)
class TileGeometry(Literal):
    """The tiles an element-level function writes (``tra_random_tile``, ``tra_pack_tile``,
    ``tra_pack_csr``): of tensor ``name`` (for errors), ``dtype``, ``shape``, tiled ``tile``;
    random tiles also have their ``seed`` and ``dist`` (``uniform`` or ``normal``); packed
    tiles whose elements must be ``unique`` refuse a repeated index (else they add up)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tile: tuple[int, ...]
    seed: int | None = None
    dist: str | None = None
    unique: bool = False


def _pairs(count: int) -> tuple[str, ...]:
    return (KEYS, TILE) * count


def _rows(arity: int) -> str:
    """A group's joined rows: ``list({keys0, tile0, ..., keys<arity-1>, tile<arity-1>})``."""
    return "STRUCT(" + ", ".join(f"keys{m} {KEYS}, tile{m} {TILE}" for m in range(arity)) + ")[]"


@dataclass(frozen=True)
class Signature:
    """A kernel kind's SQL parameter types (given its arity ``n`` and its epilogue operands
    ``k``) and result type; ``numbered``: its names carry the arity."""

    params: Callable[[int, int], tuple[str, ...]]
    result: str = TILE
    numbered: bool = False


#: kind -> its signature; a new kind of kernel is declared with ``declare``
SIGNATURES: dict[str, Signature] = {
    # one output tile per joined row: (keys, tile) of each operand
    "einsum": Signature(lambda n, k: (META, KEYS, *_pairs(n)), numbered=True),
    # an einsum that is a plain BLAS product of two tiles (``contract.gemm_form``): native where it can be
    "contract": Signature(lambda n, k: (META, KEYS, *_pairs(n)), numbered=True),
    # an einsum over dense float tiles that a native loop (or BLAS) kernel computes, epilogue
    # included (``contract.native_loop``): native where it can be, else ``einsum``'s UDF
    "loop": Signature(lambda n, k: (META, KEYS, *_pairs(n)), numbered=True),
    # one output tile per group, from its joined rows (fused join + aggregate); then k epilogue operands
    "einsum_agg": Signature(lambda n, k: (META, KEYS, _rows(n), *_pairs(k)), numbered=True),
    # one output tile per group, the aggregate of its rows' partial results; then k epilogue operands
    "reduce": Signature(lambda n, k: (META, KEYS, f"{TILE}[]", *_pairs(k))),
    "attention": Signature(lambda n, k: (META, KEYS, _rows(n)), numbered=True),
    "chain": Signature(lambda n, k: (META, KEYS, *_pairs(n)), numbered=True),
    # a chain whose steps native loop (or BLAS) kernels compute (``contract.native_chain``): native
    # where it can be, else ``chain``'s UDF
    "loop_chain": Signature(lambda n, k: (META, KEYS, *_pairs(n)), numbered=True),
    "place": Signature(lambda n, k: (META, KEYS, f"STRUCT(origin {KEYS}, shape {KEYS}, part INTEGER, tile {TILE})[]")),
    "fill": Signature(lambda n, k: (META, KEYS)),
    # grouped aggregates (Spark): a group's rows come in batches
    "einsum_group": Signature(lambda n, k: (META, KEYS, *_pairs(n), *_pairs(k)), numbered=True),
    "reduce_group": Signature(lambda n, k: (META, TILE)),
    # element-level functions for SQL users and the front ends (see ``tra_sql.udfs.elements``)
    "tile_values": Signature(lambda n, k: (TILE, "VARCHAR"), "DOUBLE[]"),
    "tile_ints": Signature(lambda n, k: (TILE, "VARCHAR"), "BIGINT[]"),
    "random_tile": Signature(lambda n, k: ("VARCHAR", KEYS)),
    "pack_tile": Signature(lambda n, k: ("VARCHAR", KEYS, f"{KEYS}[]", "DOUBLE[]")),
    "pack_csr": Signature(lambda n, k: ("VARCHAR", KEYS, KEYS, KEYS, "DOUBLE[]")),
    "pack": Signature(lambda n, k: ("DOUBLE",)),
    "pack_f32": Signature(lambda n, k: ("DOUBLE",)),
}


FLOATS = ("float32", "float64")  # the dtypes of BLAS products and whole-tile aggregates

#: (agg, dtype) of the whole-tile reductions: ``reduce_<agg>_<dtype>(meta, keys, tile)``, an
#: aggregate over a group's partial result tiles (native where it can be; else a macro over
#: ``tra_reduce`` and ``ARRAY_AGG``)
TILE_REDUCTIONS = tuple((agg, dtype) for agg in ("sum", "max", "min", "prod") for dtype in FLOATS)
for _agg, _dtype in TILE_REDUCTIONS:
    SIGNATURES[f"reduce_{_agg}_{_dtype}"] = Signature(lambda n, k: (META, KEYS, TILE))
#: the fused contraction aggregates ``contract_agg_<dtype>(meta, keys, keys0, tile0, keys1,
#: tile1)``: one output tile per group, each joined row's BLAS product (``contract``, the same
#: step) added into it (native where it can be; else a macro over ``tra_reduce`` and
#: ``ARRAY_AGG`` of ``tra_contract_2``)
for _dtype in FLOATS:
    SIGNATURES[f"contract_agg_{_dtype}"] = Signature(lambda n, k: (META, KEYS, *_pairs(2)))


#: the native attention aggregates ``attention_agg_<dtype>_<n>(meta, keys, keys0, tile0, ...,
#: keys<n-1>, tile<n-1>)``: one output tile per group, each joined row (Q, K_j, V_j[, mask_j])
#: folded into its online softmax (native where it can be; else a macro over
#: ``tra_attention_<n>`` and ``ARRAY_AGG``)
for _dtype in FLOATS:
    SIGNATURES[f"attention_agg_{_dtype}"] = Signature(lambda n, k: (META, KEYS, *_pairs(n)), numbered=True)


#: the placement aggregates ``place_agg(meta, keys, origin, shape, part, tile)`` (pieces
#: written, any dtype) and ``place_add_<dtype>`` (overlapping pieces summed): one output tile
#: per group, each piece (``tra_place``'s struct's fields) copied or added into it (native
#: where it can be; else a macro over ``tra_place`` and ``ARRAY_AGG``)
for _kind in ("place_agg", *(f"place_add_{_dtype}" for _dtype in FLOATS)):
    SIGNATURES[_kind] = Signature(lambda n, k: (META, KEYS, KEYS, KEYS, "BIGINT", TILE))


def declare(kind: str, signature: Signature) -> None:
    """A new kind of kernel (declared next to its kernel)."""
    if kind in SIGNATURES:
        raise ValueError(f"kernel kind {kind!r} is already declared")
    SIGNATURES[kind] = signature


@dataclass(frozen=True, order=True)
class Kernel:
    """A kernel function: its ``kind`` (a key of ``SIGNATURES``), the operands it joins per
    row (``arity``) and its epilogue operands passed after them (``epilogue``)."""

    kind: str
    arity: int = 0
    epilogue: int = 0

    def __post_init__(self):
        if self.kind not in SIGNATURES:
            raise ValueError(f"no kernel kind {self.kind!r}")

    @property
    def name(self) -> str:
        """The SQL function name."""
        return (f"tra_{self.kind}" + (f"_{self.arity}" if SIGNATURES[self.kind].numbered else "")
                + (f"_{self.epilogue}" if self.epilogue else ""))

    @property
    def params(self) -> tuple[str, ...]:
        """The SQL types of the parameters."""
        return SIGNATURES[self.kind].params(self.arity, self.epilogue)

    @property
    def result(self) -> str:
        """The SQL type of the result."""
        return SIGNATURES[self.kind].result


PLACE = Kernel("place")
FILL = Kernel("fill")
TILE_VALUES = Kernel("tile_values")
TILE_INTS = Kernel("tile_ints")
RANDOM_TILE = Kernel("random_tile")
PACK_TILE = Kernel("pack_tile")
PACK_CSR = Kernel("pack_csr")
PACK = Kernel("pack")
PACK_F32 = Kernel("pack_f32")
REDUCE_GROUP = Kernel("reduce_group")
PACKING = (PACK, PACK_F32, PACK_TILE, PACK_CSR)  # what relation views call (tra_sql.relations)


def tile_reduction(agg: str, dtype: str) -> Kernel | None:
    """The whole-tile reduction of ``agg`` over tiles of ``dtype`` (see ``TILE_REDUCTIONS``), or None."""
    return Kernel(f"reduce_{agg}_{dtype}") if (agg, dtype) in TILE_REDUCTIONS else None


REDUCTIONS = tuple(Kernel(f"reduce_{agg}_{dtype}") for agg, dtype in TILE_REDUCTIONS)
CONTRACTIONS = tuple(Kernel(f"contract_agg_{dtype}") for dtype in FLOATS)
CONTRACT = Kernel("contract", 2)  # the per-row BLAS product the fused contraction aggregates fuse


#: kind -> the kinds DuckDB's dialect may write instead for the steps native loop kernels
#: compute (a step with a prologue as a chain; an engine registers them with the kind)
NATIVE_FORMS = {"einsum": ("loop", "loop_chain"), "chain": ("loop_chain",),
                "attention": tuple(f"attention_agg_{dtype}" for dtype in FLOATS),
                "place": ("place_agg", *(f"place_add_{dtype}" for dtype in FLOATS))}
ATTENTIONS = tuple(f"attention_agg_{dtype}" for dtype in FLOATS)  # the kinds of the native attention aggregates
PLACEMENTS = tuple(Kernel(kind) for kind in NATIVE_FORMS["place"])  # the placement aggregates


def placement_aggregate(step: PlaceStep) -> Kernel | None:
    """The placement aggregate of ``step`` (see ``PLACEMENTS``): its sources of its dtype, and
    a float dtype where overlapping pieces are summed; or None (``tra_place`` and a list)."""
    if any(dtype != step.dtype for dtype in step.dtypes):
        return None
    if not step.add:
        return PLACEMENTS[0]
    return Kernel(f"place_add_{step.dtype}") if step.dtype in FLOATS else None


def fused_contraction(dtype: str) -> Kernel | None:
    """The fused contraction aggregate of BLAS products of ``dtype`` tiles, or None."""
    return Kernel(f"contract_agg_{dtype}") if dtype in FLOATS else None
