"""The typed protocol between the SQL compiler and the kernels (``tra_sql.udfs.protocol``)."""

import duckdb
import numpy as np
import pytest

import tra_sql
from tra_sql.compile.dialect import DUCKDB
from tra_sql.udfs import protocol
from tra_sql.udfs.protocol import ChainStep, EinsumStep, Kernel, PlaceStep


def test_kernel_names_and_types():
    assert Kernel("einsum", 2).name == "tra_einsum_2"
    assert Kernel("einsum_agg", 3, 1).name == "tra_einsum_agg_3_1"
    assert Kernel("reduce").name == "tra_reduce" and Kernel("reduce", 0, 2).name == "tra_reduce_2"
    assert Kernel("attention", 4).name == "tra_attention_4" and Kernel("chain", 5).name == "tra_chain_5"
    assert Kernel("einsum_group", 2).name == "tra_einsum_group_2" and protocol.REDUCE_GROUP.name == "tra_reduce_group"
    assert protocol.PLACE.name == "tra_place" and protocol.PACK_F32.name == "tra_pack_f32"
    assert Kernel("einsum", 2).params == ("VARCHAR", "BIGINT[]", "BIGINT[]", "BLOB", "BIGINT[]", "BLOB")
    assert Kernel("reduce", 0, 1).params == ("VARCHAR", "BIGINT[]", "BLOB[]", "BIGINT[]", "BLOB")
    assert protocol.TILE_VALUES.result == "DOUBLE[]"
    for kernel in (Kernel("einsum_agg", 2, 1), Kernel("attention", 3), protocol.PLACE, protocol.PACK_TILE):
        for sql_type in (*kernel.params, kernel.result):
            duckdb.sqltype(sql_type)  # every type is one DuckDB parses
    with pytest.raises(ValueError, match="no kernel kind"):
        Kernel("einsum_2")
    assert sorted({Kernel("einsum", 2), Kernel("einsum", 2), protocol.FILL}) == [Kernel("einsum", 2), protocol.FILL]


def test_steps_round_trip_through_their_sql_literal():
    inner = EinsumStep(("ij", "jk"), "ik", {"i": 4, "j": 6, "k": 2}, {"i": 2, "j": 3, "k": 2},
                       ("float64", "float32"), "float64", ("A", "B"))
    epilogue = EinsumStep(("ik", "k"), "ik", {"i": 4, "k": 2}, {"i": 2, "k": 2}, ("float64", "float64"),
                          "float64", ("", "b"), join="greatest(x0 + x1, 0)", position=0)
    step = EinsumStep(inner.inputs, inner.output, inner.sizes, inner.tiles, inner.dtypes, inner.out_dtype,
                      inner.names, agg="max", epilogue=epilogue, prologue=(epilogue,))
    assert EinsumStep.decode(step.encode()) == step
    assert '"join"' not in inner.encode() and '"epilogue"' in step.encode()  # defaults are left out
    chain = ChainStep(inner, (inner, epilogue))
    assert ChainStep.decode(chain.encode()) == chain
    place = PlaceStep(("A",), ("int32",), "int32", (4, 6), (2, 3), add=True)
    assert PlaceStep.decode(place.encode()) == place


def test_programs_list_the_kernels_they_call():
    with tra_sql.connect() as db:
        A = db.from_numpy("A", np.ones((4, 6)), tile=(2, 3))
        B = db.from_numpy("B", np.ones((6, 2)), tile=(3, 2))
        program = db.einsum("ij,jk->ik", A, B).program()
        assert all(isinstance(kernel, Kernel) for kernel in program.kernels)
        assert {kernel.name for kernel in program.kernels} <= {"tra_contract_2", "tra_reduce", "tra_einsum_agg_2"}
        # as DuckDB's dialect writes it: the split sum of products as the fused contraction aggregate
        text, called = DUCKDB.render(program.query())
        assert {kernel.name for kernel in called} == {"tra_contract_agg_float64"}
        assert all(kernel.name.upper() + "(" in text for kernel in called)


def test_every_kernel_kind_has_an_implementation():
    from tra_sql.backends.spark_udfs import GROUPED
    from tra_sql.udfs.python_kernels import IMPLEMENTATIONS

    # native aggregates, or macros over tra_reduce, tra_attention_<n> and tra_place
    reductions = {kernel.kind for kernel in (*protocol.REDUCTIONS, *protocol.CONTRACTIONS, *protocol.PLACEMENTS)} \
        | set(protocol.ATTENTIONS)
    assert set(protocol.SIGNATURES) == set(IMPLEMENTATIONS) | set(GROUPED) | reductions
    with pytest.raises(ValueError, match="already declared"):
        protocol.declare("place", protocol.SIGNATURES["place"])
