"""Kernel images (udfs/native/images.py): a native kernel is compiled by Numba once, and a new
process loads its machine code without setting up Numba's compiler (a session's first einsums
without importing Numba at all); an unreadable image or one calling what the process cannot
resolve is compiled again, never crashing the process."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from llvmlite import binding

import tra_sql
from tra_sql.udfs.native import images, loader

MODULE = textwrap.dedent("""
    import numpy as np
    from numba import njit, types

    from tra_sql.udfs.native.images import native


    @njit
    def _total(n):
        return np.arange(n).sum()  # an array: Numba's runtime allocates it


    @native(types.int64(types.int64))
    def SUM_BELOW(n):
        return _total(n)
""")

SCRIPT = textwrap.dedent("""
    import ctypes, sys
    sys.path.insert(0, sys.argv[1])
    import image_test_kernels
    function = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(image_test_kernels.SUM_BELOW.address)
    print(function(10), "numba.np.arraymath" in sys.modules)  # the compiler's registries: set up or not
""")


def _run(folder, cache) -> list[str]:
    env = dict(os.environ, TRA_SQL_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_a_new_process_loads_the_image_without_numbas_compiler(tmp_path):
    (tmp_path / "image_test_kernels.py").write_text(MODULE)
    cache = tmp_path / "cache"
    assert _run(tmp_path, cache) == ["45", "True"]  # compiled, the image written
    [image] = (cache / "images").rglob("image_test_kernels.SUM_BELOW.img")
    assert _run(tmp_path, cache) == ["45", "False"]
    for damaged in (image.read_bytes()[: image.stat().st_size // 2], b"not an image", b""):
        image.write_bytes(damaged)
        assert _run(tmp_path, cache) == ["45", "True"]  # compiled again, and written whole
        assert _run(tmp_path, cache) == ["45", "False"]


def test_a_session_runs_its_first_einsums_without_importing_numba():
    script = textwrap.dedent("""
        import sys
        import numpy as np, tra_sql
        db = tra_sql.connect()
        x = db.from_numpy("x", np.arange(12.0).reshape(3, 4), tile=(2, 2))
        a = np.arange(12.0).reshape(3, 4)
        assert db.engine.kernels == "native"
        np.testing.assert_allclose(db.einsum("ij,kj->ik", x, x).numpy(), a @ a.T)  # BLAS, fused split sum
        np.testing.assert_allclose(db.einsum("ij,ij->i", x, x, join="exp(x0) * x1", agg="max").numpy(),
                                   (np.exp(a) * a).max(axis=1))  # a generated loop body
        print("numba" in sys.modules)
    """)
    run = lambda: subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRA_SQL_KERNELS="native"),
                                 capture_output=True, text=True, check=True).stdout.split()
    run()  # compiles whatever kernel has no image yet
    assert run() == ["False"]


def _object(ir: str) -> bytes:
    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    module = binding.parse_assembly(ir)
    return binding.Target.from_default_triple().create_target_machine(codemodel="jitdefault").emit_object(module)


def test_an_image_calling_an_unknown_symbol_is_refused():
    code = _object("declare void @tra_no_such_function()\n"
                   "define void @calls_it() {\n  call void @tra_no_such_function()\n  ret void\n}\n")
    assert "tra_no_such_function" in images.undefined_symbols(code)
    with pytest.raises(images.ImageError, match="tra_no_such_function"):
        images.load("calls_it", code)


def test_an_image_without_its_symbol_is_refused():
    code = _object("define i64 @seven() {\n  ret i64 7\n}\n")
    assert images.undefined_symbols(code) == set()
    with pytest.raises(images.ImageError, match="does not define"):
        images.load("eight", code)


@pytest.mark.parametrize("data", [b"", b"\x7fELF\x02\x01", b"\x7fELF\x02\x01" + b"\xff" * 64, b"MZ" * 40])
def test_bytes_that_are_no_object_raise_image_error(data):
    with pytest.raises(images.ImageError):
        images.undefined_symbols(data)


def test_a_truncated_object_raises_image_error():
    code = _object("define i64 @seven() {\n  ret i64 7\n}\n")
    for end in range(0, len(code), max(1, len(code) // 200)):  # the section headers come last
        with pytest.raises(images.ImageError):
            images.undefined_symbols(code[:end])


@pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")
def test_the_images_compute_what_numpy_does(monkeypatch):
    monkeypatch.setenv("TRA_SQL_KERNELS", "native")
    db = tra_sql.connect()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((7, 3)).astype(np.float32)
    A, B = db.from_numpy("A", a, tile=(2, 3)), db.from_numpy("B", b, tile=(3, 2))
    np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).numpy(), a @ b, rtol=1e-5)
    np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B, join="exp(x0) * x1", agg="max").numpy(),
                               (np.exp(a)[:, :, None] * b[None]).max(axis=1), rtol=1e-5)
