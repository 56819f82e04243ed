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
