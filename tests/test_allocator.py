"""The malloc tuning ``connect()`` applies (``tra_sql.allocator``): on by default on glibc,
off with ``TRA_SQL_MALLOC=system``. Each case runs in a fresh process (the setting is
process-wide)."""

import os
import subprocess
import sys

import pytest

from tra_sql import allocator

pytestmark = pytest.mark.skipif(not allocator._glibc(), reason="the tuning is glibc's mallopt")

PROBE = """
import numpy as np, tra_sql
from tra_sql import allocator
with tra_sql.connect() as db:
    x = np.arange(12.0).reshape(3, 4)
    assert (db.einsum("ij->ji", db.from_numpy("x", x, tile=(2, 2))).numpy() == x.T).all()
print(allocator._applied)
"""


def probe(**env) -> str:
    result = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env},
                            capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_connect_applies_the_tuning_by_default():
    assert probe(TRA_SQL_MALLOC="retain") == "True"


def test_system_leaves_glibc_defaults():
    assert probe(TRA_SQL_MALLOC="system") == "False"


def test_an_unknown_setting_is_a_clear_error():
    result = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "TRA_SQL_MALLOC": "off"},
                            capture_output=True, text=True)
    assert result.returncode != 0 and "TRA_SQL_MALLOC='off'" in result.stderr


SLOT = """
import ctypes, _duckdb, numpy as np, tra_sql
from tra_sql import allocator
with tra_sql.connect() as db:
    x = np.arange(12.0).reshape(3, 4)
    assert (db.einsum("ij->ji", db.from_numpy("x", x, tile=(2, 2))).numpy() == x.T).all()
    slot = ctypes.c_size_t.from_address(ctypes.CDLL(_duckdb.__file__)._handle).value \\
        + allocator._plt_slot(_duckdb.__file__, "malloc_trim")
    entry = ctypes.c_uint64.from_address(slot).value
    native = db.engine.native
    print(db.engine.kernels, native is not None and entry == native.keep_heap,
          entry == ctypes.cast(ctypes.CDLL(None).malloc_trim, ctypes.c_void_p).value, allocator.held_free() > 0)
"""


def slot(**env) -> str:
    result = subprocess.run([sys.executable, "-c", SLOT], env={**os.environ, **env}, capture_output=True, text=True,
                            check=True)
    return result.stdout.strip()


def test_duckdbs_malloc_trim_keeps_the_heap_while_the_tuning_is_on():
    """DuckDB calls ``malloc_trim`` after its tasks, which would hand the retained pages back:
    with the tuning and native kernels its call goes to the extension's ``tra_native_keep_heap``
    (``allocator.keep_duckdb_heap``) and the heap's free bytes are counted (``held_free``);
    with ``TRA_SQL_MALLOC=system`` DuckDB's call is not redirected and nothing is counted."""
    kernels, kept, _, held = slot(TRA_SQL_MALLOC="retain").split()
    if kernels != "native":
        pytest.skip("the native extension is not built")
    assert kept == "True" and held == "True"  # the heap's free bytes count as available (budget.available)
    assert slot(TRA_SQL_MALLOC="system").split()[1::2] == ["False", "False"]


def test_the_heaps_kept_free_memory_counts_as_available(monkeypatch):
    from tra_sql import budget

    monkeypatch.setattr(allocator, "held_free", lambda: 0)
    before = budget.available()
    monkeypatch.setattr(allocator, "held_free", lambda: 10**15)
    assert budget.available() - before >= 10**15 - 10**9  # MemAvailable may move a little in between


def test_the_plt_slot_of_a_symbol_not_called_or_of_a_file_not_elf_is_none():
    import _duckdb

    assert allocator._plt_slot(_duckdb.__file__, "malloc_trim") is not None
    assert allocator._plt_slot(_duckdb.__file__, "no_such_function_anywhere") is None
    assert allocator._plt_slot(__file__, "malloc_trim") is None
