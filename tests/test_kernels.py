"""Numba kernels: generated once, cached on disk, reused by a new process."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from tra_sql.udfs import codegen
from tra_sql.udfs.codegen import canonical, kernel_source
from tra_sql.udfs.contract import TileEinsum
from tra_sql.udfs.cores import all_cores


def test_canonical_names_share_kernels():
    assert canonical(("xy", "yz"), "xz") == canonical(("ab", "bc"), "ac") == (("ab", "bc"), "ac")


def test_kernel_source_loops_in_memory_order():
    src = kernel_source(("ab", "bc"), "ac", "x0 * x1", "sum")  # i-k-j: the operands read row by row
    assert src.index("for i_a") < src.index("for i_b") < src.index("for i_c")
    assert "nogil=True, cache=True" in src
    src = kernel_source(("ab", "b"), "b", "x0 * x1", "sum")  # column sums still walk rows
    assert src.index("for i_a") < src.index("for i_b")
    src = kernel_source(("ab", "b"), "a", "x0 * x1", "sum", parallel=True)
    assert src.index("numba.prange(n_a)") < src.index("acc = out[i_a]") < src.index("for i_b")
    src = kernel_source(("ab", "b"), "b", "x0 * x1", "sum", parallel=True)  # threads own outputs
    assert src.index("numba.prange(n_b)") < src.index("for i_a")


def test_loop_kernel_matches_numpy():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 3)), rng.standard_normal((3, 4))
    out = np.zeros(3)
    TileEinsum(("ii", "ik"), "i").accumulate(out, [a, b])
    np.testing.assert_allclose(out, np.einsum("ii,ik->i", a, b))
    out = np.empty(4)
    kernel = TileEinsum(("ij",), "j", agg="max")
    kernel.init(out)
    kernel.accumulate(out, [b])
    np.testing.assert_array_equal(out, b.max(axis=0))


def test_new_process_loads_kernel_from_disk_cache(tmp_path):
    script = textwrap.dedent("""
        import numpy as np
        from tra_sql.udfs.codegen import loop_kernel
        k = loop_kernel(("ab",), "b", "x0 * 2.0", "max")
        out = np.full(3, -np.inf)
        k(out, np.arange(6.0).reshape(2, 3))
        assert out.tolist() == [6.0, 8.0, 10.0]
        print(sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values()))
    """)
    env = dict(os.environ, TRA_SQL_CACHE_DIR=str(tmp_path))
    run = lambda: subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                 text=True, check=True).stdout.split()
    assert run() == ["0", "1"]
    assert run() == ["1", "0"]


def test_big_tiles_use_the_threaded_kernel_and_agree():
    rng = np.random.default_rng(2)
    x, b = rng.standard_normal((300, 400)), rng.standard_normal(400)
    kernel = TileEinsum(("ij", "j"), "ij", "max(x0 + x1, 0.0)")
    out = np.empty((300, 400))
    kernel.init(out)
    kernel.accumulate(out, [x, b])
    np.testing.assert_allclose(out, np.maximum(x + b, 0))
    assert "numba.prange" in kernel_source(("ab", "b"), "ab", "x0", "sum", parallel=True)


def test_compute_overwrites_out_without_a_fill():
    """``compute`` is ``init`` + ``accumulate``; element-wise loops and BLAS products write
    every element, so whatever ``out`` held before must not leak into the result."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((300, 400)), rng.standard_normal((400, 5))
    x[0, 0] = np.nan
    cases = [(TileEinsum(("ij", "ij"), "ij", "x0 * (1 if x1 > 0.0 else 0)"), [x, x], x * (x > 0)),
             (TileEinsum(("ij",), "ji", "x0", agg="max"), [x], x.T),  # an element-wise max keeps NaN
             (TileEinsum(("ij", "jk"), "ik"), [x, w], x @ w),
             (TileEinsum(("ij", "jk"), "ki"), [x, w], (x @ w).T),
             (TileEinsum(("ij",), "j", "x0", agg="min"), [x], np.min(x, axis=0))]  # NaN wins, as in NumPy
    for kernel, tiles, expected in cases:
        out = np.full(expected.shape, 7.0)
        kernel.compute(out, tiles)
        np.testing.assert_allclose(out, expected, equal_nan=True)
    assert "acc" not in kernel_source(("ab", "ab"), "ab", "x0 * x1", "sum", assign=True)
    with pytest.raises(ValueError, match="aggregates"):
        kernel_source(("ab",), "a", "x0", "sum", assign=True)


def test_kernels_on_every_core_take_turns():
    """A BLAS product or threaded loop waits while another holds the cores (DuckDB may call
    two UDFs at once); a small single-threaded loop does not."""
    rng = np.random.default_rng(4)
    x, small = rng.standard_normal((300, 400)), rng.standard_normal((3, 4))
    out, small_out = np.empty((300, 300)), np.empty(3)
    product, small_done = threading.Event(), threading.Event()
    with all_cores():
        for kernel, into, tiles, done in ((TileEinsum(("ij", "kj"), "ik"), out, [x, x], product),
                                          (TileEinsum(("ij",), "i"), small_out, [small], small_done)):
            threading.Thread(target=lambda k=kernel, o=into, t=tiles, d=done: (k.compute(o, t), d.set())).start()
        assert small_done.wait(30) and not product.wait(0.3)
    assert product.wait(30)
    np.testing.assert_allclose(out, x @ x.T)
    np.testing.assert_allclose(small_out, small.sum(axis=1))


def test_loop_sums_are_compensated_whatever_the_tiling():
    """A million float64 elements summed in one tile keep NumPy's pairwise accuracy (an
    element-after-element sum lost ~1e-12); infinities and NaNs stay what they are."""
    import math

    rng = np.random.default_rng(3)
    x = rng.random(1_000_000) * 10 ** rng.uniform(-3, 3, 1_000_000)
    out = np.zeros(())
    TileEinsum(("i",), "", "x0").compute(out, [x])
    exact = math.fsum(x)
    assert abs(out[()] - exact) <= 4e-16 * abs(exact)
    rows = np.zeros(2)
    TileEinsum(("ij",), "i", "x0").compute(rows, [np.array([[1.0, np.inf, 2.0], [1.0, np.nan, 2.0]])])
    assert rows[0] == np.inf and np.isnan(rows[1])
    ints = np.zeros((), dtype=np.int64)
    TileEinsum(("i",), "", "x0").compute(ints, [np.arange(1000, dtype=np.int64)])
    assert ints[()] == 499500


@pytest.mark.parametrize("agg, reduce", [("max", np.max), ("min", np.min)])
def test_loop_max_and_min_propagate_nan_as_numpy_does(agg, reduce):
    x = np.array([[np.nan, np.inf, 1.0], [np.inf, np.nan, -np.inf], [2.0, -1.0, 3.0]])
    out = np.empty(3)
    TileEinsum(("ij",), "i", "x0", agg).compute(out, [x])
    np.testing.assert_array_equal(out, reduce(x, axis=1))


def test_blas_products_give_ieee_values_without_warnings():
    """inf * 0 and overflow in a BLAS product give NaN and inf as NumPy computes them, and no
    NumPy RuntimeWarning escapes from the kernel (which, as an error, failed the UDF)."""
    import warnings

    import tra_sql

    db = tra_sql.connect()
    x, y = np.array([[np.inf, 1.0], [1e200, 3.0]]), np.array([[0.0, 1.0], [1e200, 0.0]])
    with np.errstate(all="ignore"):
        expected = x @ y
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = db.einsum("ij,jk->ik", db.from_numpy("x", x), db.from_numpy("y", y)).numpy()
    np.testing.assert_array_equal(got, expected)


def test_a_registration_failing_part_way_keeps_the_kernels_registered_before_it():
    import tra_sql
    from tra_sql.udfs.protocol import Kernel

    good, bad = Kernel("einsum", 2), Kernel("einsum", 3)
    with tra_sql.connect() as db:
        engine, register = db.engine, db.engine.register_kernels
        calls = []

        def failing(kernels):
            calls.extend(kernels)
            if bad in kernels:
                raise RuntimeError("refused")
            register(kernels)

        engine.register_kernels = failing
        with pytest.raises(RuntimeError):
            engine.ensure_kernels([bad, good])
        engine.register_kernels = register
        engine.ensure_kernels([bad, good])  # only the one that failed is registered again
        assert calls == [good, bad]
        x = np.arange(6.0).reshape(2, 3)
        got = db.einsum("ij,jk->ik", db.from_numpy("x", x), db.from_numpy("y", x.T), join="x0 * x1 + 0 * x0")
        np.testing.assert_allclose(got.numpy(), x @ x.T)


def test_generated_modules_are_not_reused_under_other_kernel_sources(monkeypatch):
    """Numba checks only a cached function's own file: a generated module's name holds a digest
    of the kernel sources, so a kernel compiled against an older tra_sql's functions is not
    loaded by a newer one."""
    source = "VALUE = 1\n"
    here = codegen.load_module(source, "tra_test")
    assert codegen.load_module(source, "tra_test") is here
    monkeypatch.setattr(codegen, "kernel_sources", lambda: b"other kernel sources")
    other = codegen.load_module(source, "tra_test")
    assert other is not here and other.__name__ != here.__name__ and other.VALUE == 1


def test_an_epilogue_reads_the_result_it_overwrites_from_out():
    """An element-wise kernel whose operand is ``out`` itself reads it through ``out``, so
    the loop vectorizes (docs/kernels.md); only an assigning kernel, and only an operand
    subscripted as the output, can be read so."""
    src = kernel_source(("ab", "ab"), "ab", "x0 * x1", "sum", assign=True, in_place=1)
    assert "x1 = out[i_a, i_b]" in src and "X1[" not in src and "x0 = X0[i_a, i_b]" in src
    with pytest.raises(ValueError, match="cannot be read from its output"):
        kernel_source(("ab", "b"), "ab", "x0 * x1", "sum", assign=True, in_place=1)
    with pytest.raises(ValueError, match="cannot be read from its output"):
        kernel_source(("ab", "ab"), "ab", "x0 * x1", "sum", in_place=0)


@pytest.mark.parametrize("shape", [(7, 5), (300, 400)])  # the plain and the threaded kernel
def test_compute_over_its_own_output_agrees_with_numpy(shape):
    """``compute`` finds the operand that is ``out`` (same memory, shape and strides), at
    either position, and reads it in place; a transposed view of that memory, a copy or a
    slice is not ``out``."""
    rng = np.random.default_rng(4)
    h = rng.standard_normal(shape)
    h[0, 0] = np.nan
    mask = "x0 * (1 if ((x1 > 0.0 or x1 != x1)) != 0 else 0)"  # a ReLU gradient's, as translated
    for position, code in ((0, mask), (1, mask.replace("x0", "x9").replace("x1", "x0").replace("x9", "x1"))):
        out = rng.standard_normal(shape)
        want = out * ((h > 0) | np.isnan(h))
        tiles = [out, h] if position == 0 else [h, out]
        kernel = TileEinsum(("ij", "ij"), "ij", code)
        assert kernel._in_place(out, tiles) == position
        kernel.compute(out, tiles)
        np.testing.assert_array_equal(out, want)
    square = rng.standard_normal((6, 6))
    kernel = TileEinsum(("ij", "ij"), "ij", mask)
    assert kernel._in_place(square, [square.T, square.copy()]) is None
    assert kernel._in_place(square, [square.copy(), square[:, :3]]) is None
