"""One einsum step on tiles: BLAS for sums of products, Numba loop kernels for the rest."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from math import prod

import numpy as np

from tra_sql.aggregates import AGGREGATES
from tra_sql.udfs import sparse
from tra_sql.udfs.codegen import canonical, loop_kernel
from tra_sql.udfs.cores import all_cores
from tra_sql.udfs.protocol import FLOATS, ChainStep, EinsumStep

PARALLEL_ELEMENTS = 1 << 16  # output tiles this big run the threaded variant of a loop kernel


def blas_groups(inputs: tuple[str, ...], output: str):
    """(batch, left, contracted, right) index lists if the sum of products of two operands
    ``inputs`` into ``output`` is a (batched) matrix product, else None."""
    if len(inputs) != 2:
        return None
    a, b = inputs
    if len(set(a)) != len(a) or len(set(b)) != len(b):
        return None
    if any(c not in b and c not in output for c in a) or any(c not in a and c not in output for c in b):
        return None
    batch = [c for c in a if c in b and c in output]
    contracted = [c for c in a if c in b and c not in output]
    return batch, [c for c in a if c not in b], contracted, [c for c in b if c not in a]


@dataclass(frozen=True)
class GemmForm:
    """A product whose tiles BLAS reads as they are stored: per batch element, ``a`` is
    (left, contracted) or, ``trans_a``, (contracted, left); ``b`` is (contracted, right) or,
    ``trans_b``, (right, contracted); the output (left, right) or, ``swap``, (right, left)."""

    groups: tuple[tuple[int, ...], tuple[int, ...]]  # per operand dimension: 0 batch, 1 left/right, 2 contracted
    trans_a: bool
    trans_b: bool
    swap: bool


def _blocks(sub: str, first: list[str], second: list[str], skip: int) -> bool | None:
    """After ``skip`` batch indices, whether ``sub`` is ``second + first`` (True), ``first +
    second`` (False) or neither (None)."""
    rest = list(sub[skip:])
    if rest == first + second:
        return False
    return True if rest == second + first else None


def gemm_form(step) -> GemmForm | None:
    """The ``GemmForm`` of a ``protocol.EinsumStep`` that is a plain product of two dense tiles
    of one float dtype whose stored layout BLAS reads directly, else None."""
    if (step.join is not None or step.agg != "sum" or step.layouts or step.epilogue is not None or step.prologue
            or step.out_dtype not in FLOATS or set(step.dtypes) != {step.out_dtype}):
        return None
    groups = blas_groups(step.inputs, step.output)
    if groups is None:
        return None
    batch, left, contracted, right = groups
    a, b = step.inputs
    nb = len(batch)
    if list(a[:nb]) != batch or list(b[:nb]) != batch or list(step.output[:nb]) != batch:
        return None
    trans_a, trans_b = _blocks(a, left, contracted, nb), _blocks(b, contracted, right, nb)
    swap = _blocks(step.output, left, right, nb)
    if trans_a is None or trans_b is None or swap is None:
        return None
    kind = {c: 0 for c in batch} | {c: 1 for c in left + right} | {c: 2 for c in contracted}
    return GemmForm((tuple(kind[c] for c in a), tuple(kind[c] for c in b)), trans_a, trans_b, swap)


def _dense(step, dtype: str) -> bool:
    """Whether ``step`` reads and writes dense tiles of ``dtype`` only and has no prologue."""
    return (not step.layouts and step.out_layout == "dense" and not step.prologue and step.out_dtype == dtype
            and set(step.dtypes) <= {dtype})


def native_loop(step) -> bool:
    """Whether a native per-row kernel computes the ``protocol.EinsumStep`` ``step``: tiles of
    one float dtype, no prologue, its result the BLAS product ``gemm_form`` reads as stored, a
    CSR tile's product with a dense one that ``sparse.native_product`` accepts, or (dense tiles
    only) a generated loop kernel's (not a product BLAS reads only after a copy: ``TileEinsum``
    runs those through ``np.matmul``); then an element-wise epilogue over dense tiles of that
    dtype, if any."""
    inner = replace(step, epilogue=None)
    if step.out_dtype not in FLOATS:
        return False
    if sparse.native_product(inner) is not None:
        if set(step.dtypes) != {step.out_dtype}:
            return False
    elif not _dense(step, step.out_dtype) or gemm_form(inner) is None and step.join is None \
            and step.agg == "sum" and blas_groups(step.inputs, step.output) is not None:
        return False
    after = step.epilogue
    return after is None or (_dense(after, step.out_dtype) and after.epilogue is None
                             and after.inputs[after.position] == after.output
                             and set("".join(after.inputs)) <= set(after.output))


def native_chain(chain) -> bool:
    """Whether a native per-row kernel computes the ``protocol.ChainStep`` ``chain``: every
    leaf and every step over dense tiles of one float dtype, each step one that
    ``native_loop`` accepts (none has an epilogue: a chain's epilogues are steps of their own)."""
    dtype = chain.leaves.out_dtype
    return (dtype in FLOATS and _dense(chain.leaves, dtype)
            and all(_dense(step, dtype) and step.epilogue is None and native_loop(step) for step in chain.steps))


def prologue_chain(step) -> ChainStep | None:
    """The ``protocol.EinsumStep`` ``step``, which has a prologue (and, as the compiler writes
    them, no epilogue), as the chain that computes the same per joined row: its prologue's
    steps, then itself, reading its present operands as the leaves; None unless
    ``native_chain`` accepts that chain."""
    if step.epilogue is not None:
        return None
    computed = {p.position: k for k, p in enumerate(step.prologue)}
    leaf = {m: i for i, m in enumerate(step.present)}

    def origin(m: int) -> int:
        return leaf[m] if m in leaf else -1 - computed[m]

    steps = [replace(p, sources=tuple(map(origin, p.sources))) for p in step.prologue]
    steps.append(replace(step, prologue=(), position=0, sources=tuple(map(origin, range(len(step.inputs))))))
    inputs, names, dtypes = (tuple(getattr(step, f)[m] for m in step.present) for f in ("inputs", "names", "dtypes"))
    chain = ChainStep(EinsumStep(inputs, step.output, step.sizes, step.tiles, dtypes, step.out_dtype, names),
                      tuple(steps))
    return chain if native_chain(chain) else None


@dataclass(frozen=True)
class TileEinsum:
    """``out[o] = agg over the other indices of join(x0[...], ..., xn[...])`` on one tile set.

    ``join_code`` is a Numba-compilable scalar expression over ``x0..xn``; ``None`` means the
    product, which (with ``agg='sum'`` on two operands) is routed to BLAS via ``np.matmul``.
    """

    inputs: tuple[str, ...]
    output: str
    join_code: str | None = None
    agg: str = "sum"

    @cached_property
    def _matmul_layout(self):
        """(batch, left, contracted, right) index groups if this is a BLAS contraction."""
        if self.join_code is not None or self.agg != "sum":
            return None
        return blas_groups(self.inputs, self.output)

    @cached_property
    def elementwise(self) -> bool:
        """Nothing is aggregated: every input index is an output index."""
        return set("".join(self.inputs)) <= set(self.output)

    def _loop(self, out: np.ndarray, tiles: list[np.ndarray], assign: bool = False) -> None:
        """Run the Numba kernel; threaded (prange over the first output index) for big tiles;
        ``assign``: the element-wise kernel that overwrites ``out``."""
        code = self.join_code or " * ".join(f"x{m}" for m in range(len(self.inputs)))
        inputs, output = canonical(self.inputs, self.output)
        parallel = out.ndim > 0 and out.shape[0] > 1 and out.size >= PARALLEL_ELEMENTS
        in_place = self._in_place(out, tiles) if assign else None
        kernel = loop_kernel(inputs, output, code, self.agg, parallel, assign=assign, in_place=in_place)
        with all_cores(parallel):
            kernel(out, *tiles)

    def _in_place(self, out: np.ndarray, tiles: list[np.ndarray]) -> int | None:
        """The operand that is ``out`` itself (an epilogue overwriting the result it reads:
        the same memory, shape and strides, subscripted as the output), if any."""
        at = out.__array_interface__["data"][0]
        return next((m for m, (tile, sub) in enumerate(zip(tiles, self.inputs))
                     if sub == self.output and tile.shape == out.shape and tile.strides == out.strides
                     and tile.__array_interface__["data"][0] == at), None)

    def batched(self) -> TileEinsum:
        """The same einsum with a leading batch index on every operand and the output."""
        z = next(c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBAzyxwvutsrqponmlkjihgfedcba"
                 if c not in "".join(self.inputs) + self.output)
        return TileEinsum(tuple(z + sub for sub in self.inputs), z + self.output, self.join_code, self.agg)

    def init(self, out: np.ndarray) -> None:
        """Set ``out`` to the aggregate's identity."""
        out[...] = AGGREGATES[self.agg].identity(out.dtype)

    def compute(self, out: np.ndarray, tiles: list[np.ndarray]) -> None:
        """``out`` set to this einsum of one tile set: ``init`` then ``accumulate``, without
        filling ``out`` first where every element is written anyway (BLAS products,
        element-wise loops)."""
        if any(isinstance(t, sparse.CSRTile) for t in tiles):
            self.init(out)
            sparse.accumulate(self.inputs, self.output, self.join_code, self.agg, out, tiles)
        elif self._matmul_layout is not None:
            self._product(out, tiles, assign=True)
        elif self.elementwise:
            self._loop(out, tiles, assign=True)
        else:
            self.init(out)
            self._loop(out, tiles)

    def accumulate(self, out: np.ndarray, tiles: list[np.ndarray]) -> None:
        """Aggregate this tile set into ``out``, which holds a running aggregate. With CSR
        tiles, see ``sparse.accumulate``."""
        if any(isinstance(t, sparse.CSRTile) for t in tiles):
            sparse.accumulate(self.inputs, self.output, self.join_code, self.agg, out, tiles)
        elif self._matmul_layout is not None:
            self._product(out, tiles, assign=False)
        else:
            self._loop(out, tiles)

    def _product(self, out: np.ndarray, tiles: list[np.ndarray], assign: bool) -> None:
        """The BLAS contraction of two tiles written into (``assign``) or added to ``out``; IEEE
        results (inf, NaN) without NumPy's warnings, as the loop kernels give them."""
        a, b = tiles
        batch, left, contracted, right = self._matmul_layout
        sa, sb = self.inputs
        size = {c: a.shape[sa.index(c)] for c in sa} | {c: b.shape[sb.index(c)] for c in sb}
        a3 = a.transpose([sa.index(c) for c in batch + left + contracted]).reshape(
            prod(size[c] for c in batch), prod(size[c] for c in left), prod(size[c] for c in contracted)
        )
        b3 = b.transpose([sb.index(c) for c in batch + contracted + right]).reshape(
            a3.shape[0], a3.shape[2], prod(size[c] for c in right)
        )
        natural = batch + left + right
        if natural == list(self.output) and assign and out.flags.c_contiguous:
            with all_cores(), np.errstate(all="ignore"):
                np.matmul(a3, b3, out=out.reshape(a3.shape[0], a3.shape[1], b3.shape[2]))
            return
        with all_cores(), np.errstate(all="ignore"):
            product = np.matmul(a3, b3)
        product = product.reshape([size[c] for c in natural]).transpose([natural.index(c) for c in self.output])
        if assign:
            out[...] = product
        else:
            with np.errstate(all="ignore"):
                out += product
