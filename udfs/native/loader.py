"""Loading tra_sql's DuckDB extension (``extension.c``, built by the package's build when a C
compiler is present) on a connection: the built library gets the metadata footer DuckDB
requires, in a cache copy, and ``LOAD`` hands back a C API connection to the same database."""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import duckdb

from tra_sql.udfs.codegen import cache_dir

STEM = "tra_native"  # DuckDB calls <stem>_init_c_api of <stem>.duckdb_extension
C_API_VERSION = "v1.2.0"
_LOADING = threading.Lock()  # one LOAD at a time: the handle passes through the library's globals


def built() -> Path | None:
    """The extension library the build made, if it did."""
    here = Path(__file__).parent
    for suffix in EXTENSION_SUFFIXES:
        path = here / f"_extension{suffix}"
        if path.exists():
            return path
    return None


def footer(platform: str, version: str = "v0.1.0") -> bytes:
    """DuckDB's 534-byte extension metadata: a WebAssembly-style custom section header, eight
    32-byte fields in reverse order (three unused, the ABI type, the extension's version, the C
    API version, the platform, the magic value ``4``) and 256 bytes of (absent) signature."""
    fields = ["4", platform, C_API_VERSION, version, "C_STRUCT", "", "", ""]
    header = b"\x00\x93\x04\x10duckdb_signature\x80\x04"
    return header + b"".join(f.encode().ljust(32, b"\x00") for f in reversed(fields)) + b"\x00" * 256


def extension_file(library: Path, platform: str) -> Path:
    """The loadable copy of ``library`` for ``platform`` (written once, atomically) beside the
    kernel cache (``codegen.cache_dir``)."""
    data = library.read_bytes() + footer(platform)
    folder = cache_dir().parent / "extension" / hashlib.sha256(data).hexdigest()[:16]
    path = folder / f"{STEM}.duckdb_extension"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as out:
            out.write(data)
        os.replace(out.name, path)
    return path


def unsigned_allowed(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether ``con``'s database may load an unsigned extension."""
    value = con.execute("SELECT current_setting('allow_unsigned_extensions')").fetchall()[0][0]
    return str(value).lower() == "true"


def load(con: duckdb.DuckDBPyConnection, duckdb_connect) -> tuple[int, int, int] | None:
    """(a C API connection to ``con``'s database, the addresses of the extension's identity
    copy callback ``tra_native_same`` and of ``tra_native_keep_heap``, a ``malloc_trim`` that
    trims nothing, 0 in a library built without it) after loading the extension on ``con``, or None where
    it cannot be (no built library, unsigned extensions not allowed, a refused load).
    ``duckdb_connect`` is the C API's function of that name."""
    library = built()
    if library is None or not unsigned_allowed(con):
        return None
    platform = con.execute("PRAGMA platform").fetchall()[0][0]
    path = extension_file(library, platform)
    with _LOADING:
        lib = ctypes.CDLL(str(path))  # the instance DuckDB's LOAD will find already open
        connect = ctypes.c_void_p.in_dll(lib, "tra_native_connect")
        handle = ctypes.c_void_p.in_dll(lib, "tra_native_connection")
        connect.value, handle.value = ctypes.cast(duckdb_connect, ctypes.c_void_p).value, None
        try:
            con.execute(f"LOAD '{path}'").fetchall()
        except duckdb.Error:
            return None
        finally:
            connect.value = None
        result, handle.value = handle.value, None
    keep_heap = getattr(lib, "tra_native_keep_heap", None)  # 0: a library built before it existed
    return (result, ctypes.cast(lib.tra_native_same, ctypes.c_void_p).value,
            ctypes.cast(keep_heap, ctypes.c_void_p).value if keep_heap else 0) if result else None
