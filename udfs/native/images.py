"""Native kernels' machine code cached as images and loaded without Numba's compiler.

Loading a cached Numba ``cfunc`` makes Numba set up its whole CPU target first (its typing and
lowering registries, SciPy's BLAS check): about a second before the first einsum of a process.
A kernel declared ``@native(signature)`` instead is compiled by Numba once per machine (per
kernel sources, tool versions and CPU: ``environment``); its object code is written as an image
(``<cache>/images/<environment>/<module>.<name>.img``), and each process loads images into LLVM
JITs of its own through llvmlite, resolving what the code calls as Numba would: Numba's runtime
and helper functions (its C extension modules, loaded without the Numba package), Python's
exception types, tra_sql's BLAS symbols (``blas``) and DuckDB's C API (``capi``), the rest
from the process. An image that is unreadable or calls something unresolvable is compiled again.
"""

from __future__ import annotations

import builtins
import ctypes
import glob
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

from llvmlite import binding

from tra_sql import elf
from tra_sql.udfs.codegen import cache_dir, kernel_sources

MAGIC = b"tra_sql kernel image 1\n"
_lock = threading.RLock()  # loads and compiles one at a time; ``_loaded`` is shared
_loaded: dict[tuple[str, str], int] = {}  # (module, name) -> the loaded function's address
_keep: list = []  # the JITs (and fallback cfuncs) whose code DuckDB may call, for the process's life


class ImageError(Exception):
    """An image that cannot be used (it is compiled again)."""


class Native:
    """A C callback compiled by Numba's ``cfunc`` on first use (``address``), through its image."""

    def __init__(self, signature, function: Callable):
        self.signature, self.function = signature, function
        self.module, self.name = function.__module__, function.__qualname__

    @property
    def address(self) -> int:
        """The callback's C address (its image loaded, compiled first if there is none)."""
        return address(self.module, self.name, self.compile)

    def compile(self):
        """A new Numba ``cfunc`` of the function (its object code is the image)."""
        from numba import cfunc

        return cfunc(self.signature)(self.function)


def native(signature) -> Callable[[Callable], Native]:
    """``@native(numba signature)``: the decorated function as a ``Native`` callback."""
    return lambda function: Native(signature, function)


def callback(module: str, name: str) -> int:
    """The address of ``Native`` callback ``name`` of ``module``, importing the module (and
    Numba) only when it has no usable image."""
    return address(module, name, lambda: getattr(importlib.import_module(module), name).compile())


def address(module: str, name: str, compile: Callable) -> int:
    """The address of callback ``name`` of ``module`` from its image, loaded once per process;
    ``compile()`` makes a Numba ``cfunc`` of it when there is no usable image."""
    with _lock:
        if (module, name) not in _loaded:
            _loaded[module, name] = _load_or_compile(image_path(module, name), compile)
        return _loaded[module, name]


def _load_or_compile(path: Path, compile: Callable) -> int:
    try:
        return load(*read(path))
    except (OSError, ImageError):
        pass
    compiled = compile()
    try:
        symbol, code = compiled.native_name, compiled._library._get_compiled_object()
        write(path, symbol, code)
        return load(symbol, code)
    except (OSError, ImageError, ValueError, RuntimeError):  # e.g. not an ELF platform: Numba's own JIT runs it
        _keep.append(compiled)
        return compiled.address


def image_path(module: str, name: str) -> Path:
    return cache_dir().parent / "images" / environment() / f"{module}.{name}.img"


@cache
def environment() -> str:
    """A digest of what an image's code depends on: the kernel sources, Python's version,
    Numba's, llvmlite's and NumPy's installations (where, and when they were written), Numba's
    settings and the CPU."""
    parts = [sys.version, sys.platform, *_host(), *map(_installed, ("numba", "llvmlite", "numpy")),
             *sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NUMBA_"))]
    return hashlib.sha1(kernel_sources() + "\0".join(parts).encode()).hexdigest()[:16]


def _installed(package: str) -> str:
    """Where ``package`` is installed and when (no import: Numba's takes a quarter second)."""
    origin = importlib.util.find_spec(package).origin
    stat = os.stat(origin)
    return f"{origin}:{stat.st_size}:{stat.st_mtime_ns}"


@cache
def _host() -> tuple[str, str]:
    """The CPU's LLVM name and features."""
    return binding.get_host_cpu_name(), binding.get_host_cpu_features().flatten()


def write(path: Path, symbol: str, code: bytes) -> None:
    """Write an image (the callback's symbol and object code), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as out:
        out.write(MAGIC + json.dumps({"symbol": symbol}).encode() + b"\n" + code)
    os.replace(out.name, path)


def read(path: Path) -> tuple[str, bytes]:
    """(symbol, object code) of the image at ``path``."""
    data = path.read_bytes()
    header_end = data.find(b"\n", len(MAGIC))
    if not data.startswith(MAGIC) or header_end < 0:
        raise ImageError(f"{path} is not a kernel image")
    try:
        symbol = json.loads(data[len(MAGIC):header_end])["symbol"]
    except (ValueError, KeyError, TypeError):
        raise ImageError(f"{path} has no readable header") from None
    return str(symbol), data[header_end + 1:]


def load(symbol: str, code: bytes) -> int:
    """Load object ``code`` into a JIT of its own and return ``symbol``'s address."""
    _prepare()
    missing = sorted(name for name in undefined_symbols(code) if not _resolvable(name))
    if missing:  # LLVM would abort the process on the first it cannot resolve
        raise ImageError(f"the image calls unresolvable symbols {missing[:5]}")
    cpu, features = _host()
    machine = binding.Target.from_default_triple().create_target_machine(cpu=cpu, features=features,
                                                                         codemodel="jitdefault")
    engine = binding.create_mcjit_compiler(binding.parse_assembly(""), machine)
    engine.add_object_file(binding.ObjectFileRef.from_data(code))
    engine.finalize_object()
    found = engine.get_function_address(symbol)
    if not found:
        raise ImageError(f"the image does not define {symbol}")
    _keep.append(engine)
    return found


_PROCESS = ctypes.CDLL(None)


def _resolvable(name: str) -> bool:
    """Whether the JIT finds ``name``: among the symbols given to LLVM, or in the process."""
    if binding.address_of_symbol(name):
        return True
    try:
        getattr(_PROCESS, name)
        return True
    except AttributeError:
        return False


@cache
def _prepare() -> None:
    """Give LLVM the symbols Numba's code calls (as Numba does when its target starts),
    from Numba's C extension modules, loaded without the Numba package."""
    from tra_sql.udfs import blas  # noqa: F401  (binds the BLAS symbols)
    from tra_sql.udfs.native import capi  # noqa: F401  (loads DuckDB's C API library for LLVM)

    binding.initialize_native_target()
    binding.initialize_native_asmprinter()
    helpers = _numba_extension("numba._helperlib", "_helperlib")
    dynfunc = _numba_extension("numba._dynfunc", "_dynfunc")
    nrt = _numba_extension("numba.core.runtime._nrt_python", "core/runtime/_nrt_python")
    for c_helpers in (helpers.c_helpers, dynfunc.c_helpers):
        for name, at in c_helpers.items():
            binding.add_symbol(f"numba_{name}", at)
    for name, at in nrt.c_helpers.items():
        binding.add_symbol(name if name.startswith("_") else f"NRT_{name}", at)
    binding.add_symbol("_Py_NoneStruct", id(None))
    for value in builtins.__dict__.values():
        if isinstance(value, type) and issubclass(value, BaseException):
            binding.add_symbol(f"PyExc_{value.__name__}", id(value))


def _numba_extension(name: str, stem: str):
    """Numba's C extension module ``name`` (file ``numba/<stem>.*``), imported without
    importing the Numba package (and shared with it: it finds the module in ``sys.modules``)."""
    if name in sys.modules:
        return sys.modules[name]
    root = Path(importlib.util.find_spec("numba").origin).parent
    paths = [p for p in glob.glob(f"{root}/{stem}.*") if p.endswith((".so", ".pyd", ".dylib"))]
    if not paths:
        raise ImageError(f"Numba's {name} is not installed")
    spec = importlib.util.spec_from_file_location(name, paths[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def undefined_symbols(code: bytes) -> set[str]:
    """The symbols an ELF64 little-endian relocatable object refers to and does not define."""
    try:
        _, headers = elf.sections(code)
        names = set()
        for sh in headers:
            if sh[1] != elf.SHT_SYMTAB:
                continue
            symbols = elf.table(code, sh, elf.SYMBOL)
            strings = elf.contents(code, elf.linked(headers, sh))
            undefined = symbols[(symbols["section"] == 0) & (symbols["name"] != 0) & (symbols["info"] >> 4 != 0)]
            names.update(elf.name(strings, int(at)).decode() for at in undefined["name"])  # named, not local
        return names
    except (elf.ElfError, UnicodeDecodeError):
        raise ImageError("the image's ELF symbol table is unreadable") from None
