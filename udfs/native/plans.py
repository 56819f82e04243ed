"""The host side of native kernels, in Python without Numba: what DuckDB's calls of a kernel
point to. A per-row step's plan (``plan``: the int64 array a call's bind data points to, its
layout below; ``operands`` checks a row's tiles against it), the zeros results are allocated
from (``zeros``, ``results``), the whole-tile aggregates' codes (``OPS``, ``aggregate``), the
fused contraction aggregate's extra info and the records its plan lookup answers (``found``,
``fused``). Kernel modules hold the Numba code; a process
whose kernels all have images (``images``) never imports Numba for this."""

from __future__ import annotations

import ctypes
import mmap
import threading
from dataclasses import replace

import numpy as np

from tra_sql.udfs import cores, sparse
from tra_sql.udfs.contract import gemm_form, native_loop
from tra_sql.udfs.expr import join_code
from tra_sql.udfs.native import loops
from tra_sql.udfs.native.capi import ERROR_PREFIX
from tra_sql.udfs.protocol import TILE_REDUCTIONS, EinsumStep

# header: dtype code (0 float32, 1 float64), itemsize, operands (the step's, then its
# epilogue's others), the step's own operands, the address of the text (operand names, then
# the dtype's name), the kernels' mutex (``cores``), trans_a, trans_b, swap (a BLAS product),
# the step's loop body and the epilogue's (``loops``; 0: the BLAS product, no epilogue), the
# output's rank, the epilogue's operands, dimensions, indices, (offset, length) of the dtype's
# name, the CSR operand (``native.sparse``; -1: none), the address of zeros as long as the
# largest result tile (``zeros``); then per operand (rank, its first
# dimension, offset and length of its name); per
# output dimension the dimension its extent is read from; per epilogue operand the operand
# it is (-1: the step's result); per dimension (size, tile, index, BLAS group)
HEADER = 19
OPERAND = 4
DIM = 4
MESSAGE = 512


def plan(step: EinsumStep, product: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(the plan, the text it points to) of a step ``gemm_form`` or (unless ``product``: the
    BLAS product's kernels, ``tra_contract_2`` and the fused aggregate) ``native_loop`` accepts."""
    if product and gemm_form(step) is None:
        raise ValueError(f"{step.inputs}->{step.output} is not a native BLAS product")
    form = gemm_form(replace(step, epilogue=None))
    if form is None and not native_loop(step):
        raise ValueError(f"{step.inputs}->{step.output} is not a native product or loop")
    csr = sparse.native_product(replace(step, epilogue=None))
    after = step.epilogue
    index = indices(step.inputs, step.output)
    subs, names = list(step.inputs), list(step.names)
    dims = dimensions(step, index, form.groups if form else None)
    slots = []
    if after is not None:  # the epilogue's indices are the step's output's
        ours = {c: step.output[after.output.index(c)] for c in after.output}
        for j, sub in enumerate(after.inputs):
            slots.append(-1 if j == after.position else len(subs))
            if j != after.position:
                subs.append(sub)
                names.append(after.names[j])
                dims += [(after.sizes[c], after.tiles[c], index[ours[c]], 0) for c in sub]
    blas = (form.trans_a, form.trans_b, form.swap) if form else (0, 0, 0)
    if csr is not None:
        from tra_sql.udfs.native import sparse as native_sparse  # Numba's: CSR bodies are compiled here

        body = native_sparse.body(*csr, len(step.inputs[1 - csr[0]]), step.out_dtype)
    else:
        body = 0 if form else loops.body(step.inputs, step.output, code(step), step.agg, step.out_dtype)
    epilogue = loops.body(after.inputs, after.output, code(after), after.agg, step.out_dtype,
                          in_place=after.position) if after else 0
    return tables(step.out_dtype, subs, names, dims, sources(step.inputs, step.output), slots, blas, body, epilogue,
                  len(step.inputs), len(index), -1 if csr is None else csr[0])


def code(step: EinsumStep) -> str:
    """The Numba expression of ``step``'s join (the product without one)."""
    return join_code(step.join, len(step.inputs)) if step.join else " * ".join(f"x{m}" for m in range(len(step.inputs)))


def indices(inputs, output: str) -> dict[str, int]:
    """A number per index, in order of first appearance."""
    return {c: i for i, c in enumerate(dict.fromkeys("".join(inputs) + output))}


def dimensions(step: EinsumStep, index: dict[str, int], groups=None) -> list[tuple[int, ...]]:
    """(size, tile, index, BLAS group) of every dimension of ``step``'s operands."""
    return [(step.sizes[c], step.tiles[c], index[c], groups[m][d] if groups else 0)
            for m, sub in enumerate(step.inputs) for d, c in enumerate(sub)]


def sources(inputs, output: str) -> list[int]:
    """Per output index, the position (operand after operand) of its first dimension."""
    flat: dict[str, int] = {}
    at = 0
    for sub in inputs:
        for d, c in enumerate(sub):
            flat.setdefault(c, at + d)
        at += len(sub)
    return [flat[c] for c in output]


def tables(dtype: str, subs, names, dims, out, slots, blas, body: int, epilogue: int, own: int,
           count: int, csr: int = -1, largest: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The plan (see the layout above) and its text; ``largest``: the bytes of the largest
    result tile, if not that of the output ``out`` gives."""
    words = [name.encode() for name in names] + [dtype.encode()]
    text = np.frombuffer(b"".join(words) + b"\x00", dtype=np.uint8).copy()
    starts = np.cumsum([0] + [len(w) for w in words])
    firsts = np.cumsum([0] + [len(sub) for sub in subs])
    if largest is None:
        largest = np.dtype(dtype).itemsize * int(np.prod([min(dims[d][1], dims[d][0]) for d in out], dtype=np.int64))
    header = [0 if dtype == "float32" else 1, np.dtype(dtype).itemsize, len(subs), own, text.ctypes.data,
              cores.MUTEX, *blas, body, epilogue, len(out), len(slots), len(dims), count, int(starts[-2]),
              len(words[-1]), csr, zeros(largest)]
    for m, sub in enumerate(subs):
        header += [len(sub), int(firsts[m]), int(starts[m]), len(words[m])]
    return np.array(header + list(out) + list(slots) + [v for dim in dims for v in dim], dtype=np.int64), text


_ZEROS: list[mmap.mmap] = []  # every mapping handed out stays: plans hold their addresses
_ZEROS_LOCK = threading.Lock()


def zeros(nbytes: int) -> int:
    """The address of at least ``nbytes`` of zeros that are never written (an anonymous
    read-only mapping: reading it maps the kernel's one zero page, costing no memory). A
    kernel hands it to ``duckdb_vector_assign_string_element_len`` to have DuckDB allocate a
    result it then writes where it lies (``reserve``)."""
    with _ZEROS_LOCK:
        if not _ZEROS or len(_ZEROS[-1]) < nbytes:
            size = max(nbytes, 2 * len(_ZEROS[-1]) if _ZEROS else 64 << 20)
            _ZEROS.append(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ))
        return np.frombuffer(_ZEROS[-1], np.uint8).ctypes.data


# whole-tile aggregates (``aggregate``)
STATE = 16  # bytes of a state: buffer address, its length
AGGS = {"sum": 0, "max": 1, "min": 2, "prod": 3}  # the element-wise folds (the ufuncs of AGGREGATES)
DTYPES = {"float32": 0, "float64": 1}
OVERLAY = 4  # the fold of states whose tiles hold disjoint pieces, zeros elsewhere: bytes OR-ed (``placement``)
#: (agg, dtype) -> the function's extra info: its fold and dtype codes
OPS = {(agg, dtype): np.array([AGGS[agg], DTYPES[dtype]], dtype=np.int64) for agg, dtype in TILE_REDUCTIONS}


# the fused contraction aggregate (``fused``)
LOOKUP = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
EXTRA = 3  # words of a function's extra info: fold (sum), dtype code, the LOOKUP callback's address


def extra_info(dtype: str, lookup: int) -> np.ndarray:
    """The extra info of the ``dtype`` function: the whole-tile sum's (``OPS``), then
    the address of the binding's ``LOOKUP`` callback."""
    return np.array([AGGS["sum"], DTYPES[dtype], lookup], dtype=np.int64)


def error_record(err: Exception, what: str) -> np.ndarray:
    """The record ``LOOKUP`` answers for a text that is not a step: a word 1, the length of an
    error message about ``what``, then the message and a NUL."""
    message = f"{ERROR_PREFIX}{type(err).__name__}: {what}: {err}".encode()
    record = np.zeros(16 + len(message) + 1, dtype=np.uint8)
    record[:16] = np.array([1, len(message)], dtype=np.int64).view(np.uint8)
    record[16:16 + len(message)] = np.frombuffer(message, np.uint8)
    return record


def found(text: str) -> tuple[np.ndarray, ...]:
    """What ``LOOKUP`` answers for step text ``text`` (its first array's address): a word 0,
    then the step's plan (the arrays after it: what the plan points to); or ``error_record``'s."""
    try:
        product, names = plan(EinsumStep.decode(text), product=True)
    except Exception as err:  # not a native product's step: the update reports it
        return (error_record(err, "the step of a fused contraction"),)
    return np.concatenate([np.zeros(1, np.int64), product]), names
