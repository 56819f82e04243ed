"""Numba loop kernels generated from an einsum over tiles.

For ``out[o] ⊕= join(x0[...], ..., xn[...])`` the generator writes a loop nest (output indices
outside, aggregated indices inside, a scalar accumulator) into a small Python module in the
kernel cache directory and compiles it with ``numba.njit(nogil=True, cache=True)``: the
module file gives Numba a stable place to cache machine code, so a new process skips the JIT.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from functools import cache
from pathlib import Path

from tra_sql.aggregates import AGGREGATES


@cache
def cache_dir() -> Path:
    """Where generated kernel modules (and Numba's cache beside them) live:
    ``$TRA_SQL_CACHE_DIR``, else ``~/.cache/tra_sql``, else the temp directory."""
    candidates = [os.environ.get("TRA_SQL_CACHE_DIR"), Path.home() / ".cache" / "tra_sql",
                  Path(tempfile.gettempdir()) / f"tra_sql-{os.getuid()}"]
    for root in filter(None, candidates):
        path = Path(root) / "kernels"
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise OSError("no writable directory for the kernel cache; set TRA_SQL_CACHE_DIR")


#: A kernel module's imports: the names the code of a join expression (``expr.join_code``) uses.
IMPORTS = ("import math", "import numba", "import numpy as np", "", "from tra_sql.udfs.vector_exp import exp64")


def namespace() -> dict:
    """The names of ``IMPORTS``, to run join code outside a kernel module (tests, references)."""
    scope: dict = {}
    exec("\n".join(IMPORTS), scope)  # noqa: S102
    return scope


def canonical(inputs: tuple[str, ...], output: str) -> tuple[tuple[str, ...], str]:
    """Rename indices in order of first appearance, so equivalent specs share one kernel."""
    names: dict[str, str] = {}
    for ch in "".join(inputs) + output:
        names.setdefault(ch, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[len(names)])
    return tuple("".join(names[c] for c in s) for s in inputs), "".join(names[c] for c in output)


def kernel_source(inputs: tuple[str, ...], output: str, join_code: str, agg: str, parallel: bool = False,
                  sparse: tuple[int, ...] = (), assign: bool = False, in_place: int | None = None) -> str:
    """Python source of the loop kernel ``kernel(out, X0, ..., Xn)``; ``out`` holds the
    running aggregate (the caller initializes it), ``join_code`` is a scalar expression
    over ``x0..xn``. ``parallel`` splits the first output index's loop over threads (prange).
    ``assign`` (an element-wise einsum: nothing aggregated) writes each value into ``out``
    instead, which then needs no initial value.

    With ``sparse`` (positions of CSR operands, all with the same two-index subscript, the
    pattern), the kernel is ``kernel(out, ROWS, COLS, X0, ..., Xn)``: the sparse operands are
    the data arrays of tiles sharing the entries (``ROWS[q]``, ``COLS[q]``), the loop runs over
    entries instead of the pattern's indices, and an output subscripted like the pattern is
    the data array of such a tile (``out[q]``).

    ``in_place`` (with ``assign``): operand ``in_place`` is ``out`` itself, subscripted as the
    output (an epilogue over the result it overwrites), and its elements are read from ``out``.
    The compiler then sees each element read and written at one address and vectorizes the
    loop; reading it through its own argument, LLVM's run-time alias check finds the two
    arrays overlapping and runs the scalar loop, whose branches (``CASE``, comparisons)
    mispredict on data: a ReLU's gradient mask took 9x as long."""
    arrays = [f"X{m}" for m in range(len(inputs))]
    pattern = inputs[sparse[0]] if sparse else ""
    size_of: dict[str, str] = {}
    for m, sub in enumerate(inputs):
        for d, ch in enumerate(sub):
            if m not in sparse and ch not in pattern:
                size_of.setdefault(ch, f"{arrays[m]}.shape[{d}]")
    var = {ch: f"i_{ch}" for ch in "".join(inputs)} | {"@": "i_q"}
    # loops in order of first appearance (the first operand's memory order), entries first,
    # the first output index outermost when threaded (threads then write disjoint outputs);
    # the running value sits in a scalar over the innermost loops, which aggregate only
    order = (["@"] if sparse else []) + list(size_of)
    if parallel and not sparse:
        order.insert(0, order.pop(order.index(output[0])))
    decides = {"@": bool(set(output) & set(pattern))} | {ch: ch in output for ch in size_of}
    split = max((d + 1 for d, ch in enumerate(order) if decides[ch]), default=0)
    lines = [
        *IMPORTS,
        "",
        "",
        f"@numba.njit(nogil=True, cache=True{', parallel=True' if parallel else ''})",
        f"def kernel(out, {'ROWS, COLS, ' if sparse else ''}{', '.join(arrays)}):",
    ]
    lines += [f"    n_{ch} = {size}" for ch, size in size_of.items()] + (["    n_q = len(ROWS)"] if sparse else [])
    lines += [f"    s{m} = {arrays[m]}[()]" for m, sub in enumerate(inputs) if not sub]  # scalars, read once
    indent = "    "

    def loop(ch: str, threaded: bool) -> None:
        nonlocal indent
        name = "q" if ch == "@" else ch
        lines.append(f"{indent}for {var[ch]} in {'numba.prange' if threaded else 'range'}(n_{name}):")
        indent += "    "
        if ch == "@":
            lines.extend([f"{indent}{var[pattern[0]]} = ROWS[i_q]", f"{indent}{var[pattern[1]]} = COLS[i_q]"])

    for d, ch in enumerate(order[:split]):
        loop(ch, parallel and d == 0)
    out_ref = "out[i_q]" if sparse and output == pattern else \
        f"out[{', '.join(var[c] for c in output)}]" if output else "out[()]"
    if assign and not all(decides[ch] for ch in order):
        raise ValueError(f"kernel {inputs}->{output} aggregates: it cannot assign its values")
    if in_place is not None and (not assign or sparse or inputs[in_place] != output):
        raise ValueError(f"kernel {inputs}->{output}: operand {in_place} cannot be read from its output")
    aggregate = AGGREGATES[agg]
    if not assign:
        lines.append(f"{indent}acc = {out_ref}")
        if aggregate.compensated:  # ``err`` carries the rounding error (see ``Aggregate``)
            lines.append(f"{indent}err = acc - acc")
    outer = indent
    for ch in order[split:]:
        loop(ch, False)
    for m, sub in enumerate(inputs):
        ref = out_ref if m == in_place else f"{arrays[m]}[i_q]" if m in sparse else \
            f"{arrays[m]}[{', '.join(var[c] for c in sub)}]" if sub else f"s{m}"
        lines.append(f"{indent}x{m} = {ref}")
    lines.append(f"{indent}v = {join_code}")
    if assign:
        lines.append(f"{indent}{out_ref} = v")
    else:
        lines.extend(f"{indent}{update}" for update in aggregate.loop_update.split("; "))
        # an infinite or NaN compensated result stays as it is (its rounding error is NaN)
        lines.append(f"{outer}{out_ref} = {'acc + err if acc - acc == 0 else acc' if aggregate.compensated else 'acc'}")
    return "\n".join(lines) + "\n"


_compiling = threading.Lock()


def loop_kernel(inputs: tuple[str, ...], output: str, join_code: str, agg: str, parallel: bool = False,
                sparse: tuple[int, ...] = (), assign: bool = False, in_place: int | None = None):
    """The compiled kernel for a canonical spec (see ``canonical``), join and aggregation
    (``sparse``, ``assign``, ``in_place``: see ``kernel_source``). Thread-safe: DuckDB may call UDFs
    needing the same new kernel from several threads."""
    with _compiling:
        return _load(inputs, output, join_code, agg, parallel, sparse, assign, in_place)


@cache
def _load(inputs: tuple[str, ...], output: str, join_code: str, agg: str, parallel: bool, sparse: tuple[int, ...],
          assign: bool, in_place: int | None):
    source = kernel_source(inputs, output, join_code, agg, parallel, sparse, assign, in_place)
    return load_module(source, "tra_kernel").kernel


@cache
def kernel_sources() -> bytes:
    """A digest of tra_sql's kernel sources (the ``udfs`` package). Numba checks only a cached
    function's own file, while the functions it calls are compiled into it: a module generated
    under other kernel sources (an older tra_sql) must not be reused, so its name holds this."""
    digest = hashlib.sha1()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.digest()


def module_name_of(source: str, prefix: str) -> str:
    """The name ``load_module`` gives the module of generated ``source``."""
    return f"{prefix}_{hashlib.sha1(kernel_sources() + source.encode()).hexdigest()[:16]}"


def load_module(source: str, prefix: str):
    """The module of generated ``source``, written once as ``<prefix>_<digest>.py`` in the
    kernel cache directory (Numba caches the machine code of its functions beside it) and
    imported under that name (callers hold a lock: the first import compiles). The digest is
    of ``source`` and of the kernel sources it was generated under (``kernel_sources``)."""
    module_name = module_name_of(source, prefix)
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = cache_dir() / f"{module_name}.py"
    if not path.exists():  # write, then rename: other processes see a whole file or none
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Numba's cache locator looks the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
