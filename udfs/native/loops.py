"""Loop bodies for the native per-row kernel (``contract.KERNEL``): the generated Numba loop
kernel of a canonical spec (``codegen.loop_kernel``, the very function the Arrow path runs)
behind a ``cfunc`` with a C address, ``body(out, tiles, extents)``: ``out`` the result tile's
address, ``tiles`` the address of the operand tiles' addresses, ``extents`` the address of
their extents (int64, operand after operand). It views the memory as arrays of the spec's
ranks, sets ``out`` to the aggregate's identity unless the kernel assigns, and runs the loops
(never threaded: it runs on DuckDB's threads). Each body is written as a module beside the
loop kernel's and compiled once per (spec, join, aggregate, dtype), its image cached (``images``)."""

from __future__ import annotations

import math
import threading
from functools import cache

import numpy as np

from tra_sql.aggregates import AGGREGATES
from tra_sql.udfs.codegen import canonical, kernel_source, load_module, loop_kernel, module_name_of
from tra_sql.udfs.native import images

_compiling = threading.Lock()


def _literal(value: float) -> str:
    if math.isinf(value):
        return "-math.inf" if value < 0 else "math.inf"
    return repr(float(value))


def body_source(kernel_module: str, inputs: tuple[str, ...], output: str, agg: str, dtype: str,
                assign: bool) -> str:
    """Python source of the ``cfunc`` running ``kernel_module``'s kernel (see the module)."""
    view = {"float32": "f32", "float64": "f64"}[dtype]
    first, flat = {}, 0  # each index's first position in the extents
    shapes = []
    for sub in inputs:
        shapes.append([f"e[{flat + d}]" for d in range(len(sub))])
        for d, c in enumerate(sub):
            first.setdefault(c, f"e[{flat + d}]")
        flat += len(sub)
    out_shape = [first[c] for c in output]

    def array(at: str, shape: list[str]) -> str:
        return f"{view}({at}, {' * '.join(shape) or '1'}).reshape(({''.join(s + ', ' for s in shape)}))"

    lines = [
        "import math",
        "",
        "import numpy as np",
        "from numba import types",
        "",
        "from tra_sql.udfs.native.images import native",
        f"from tra_sql.udfs.native.memory import {view}, i64, u64",
        f"from {kernel_module} import kernel",
        "",
        "",
        "@native(types.void(types.uint64, types.uint64, types.uint64))",
        "def body(out, tiles, extents):",
        f"    t = u64(tiles, {len(inputs)})",
        f"    e = i64(extents, {max(flat, 1)})",
        f"    o = {view}(out, {' * '.join(out_shape) or '1'})",
    ]
    if not assign:
        identity = AGGREGATES[agg].identity(np.dtype(dtype))
        lines.append(f"    o.fill(np.{dtype}({_literal(identity)}))")
    operands = ", ".join(array(f"t[{m}]", shape) for m, shape in enumerate(shapes))
    lines.append(f"    kernel(o.reshape(({''.join(s + ', ' for s in out_shape)})), {operands})")
    return "\n".join(lines) + "\n"


def body(inputs: tuple[str, ...], output: str, join_code: str, agg: str, dtype: str,
         in_place: int | None = None) -> int:
    """The C address of the body computing ``out[output] = agg of join_code(x0[inputs[0]],
    ...)`` over ``dtype`` tiles (assigning where nothing is aggregated); ``in_place``: the
    operand that is ``out`` itself (an epilogue's result, ``codegen.kernel_source``).
    Thread-safe."""
    inputs, output = canonical(inputs, output)
    assign = set("".join(inputs)) <= set(output)
    with _compiling:
        return _compiled(inputs, output, join_code, agg, dtype, assign, in_place)


@cache
def _compiled(inputs: tuple[str, ...], output: str, join_code: str, agg: str, dtype: str, assign: bool,
              in_place: int | None) -> int:
    kernel = kernel_source(inputs, output, join_code, agg, assign=assign, in_place=in_place)
    source = body_source(module_name_of(kernel, "tra_kernel"), inputs, output, agg, dtype, assign)

    def compile():  # the loop kernel's module first: the body's imports it
        loop_kernel(inputs, output, join_code, agg, assign=assign, in_place=in_place)
        return load_module(source, "tra_native").body.compile()
    return images.address(module_name_of(source, "tra_native"), "body", compile)
