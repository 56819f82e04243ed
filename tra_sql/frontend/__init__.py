"""The tensor extension of SQL (the reference: docs/sql.md). Statements are DuckDB SQL plus::

    SELECT ... FROM einsum('ij,jk->ik', A, B [, "join" => 'x0 + x1'] [, agg => 'max'])
    SELECT ... FROM grad(<loss>, <W>)
    SELECT ... FROM tra_random(shape => [..] [, tile, seed, dtype, dist])
    SELECT ... FROM tra_from_elements(<table> | (<query>), shape => [..] [, tile, dtype, nulls, duplicates])
    SELECT ... FROM tra_relation(<table>, keys => [..] [, value, shape, tile, dtype, layout, sum_duplicates])
    SELECT ... FROM tra_elements(<tensor>) | tra_plan(<tensor> [, workers, memory, format])
                  | tra_check([repair => true])
    CREATE [OR REPLACE] TENSOR [IF NOT EXISTS] name [WITH (shape := [..], tile, dtype, layout)] AS <query>
    CREATE [OR REPLACE] TENSOR VIEW name AS SELECT * FROM <tensor>     -- evaluated where read
    CREATE [OR REPLACE] PARAMETER name WITH (shape := [..] [, init, seed, tile, dtype, scale])
    TRAIN [STEP] <loss> PARAMETERS W [, ...] [WITH (optimizer, lr, epochs, run, ...)]
    DROP TENSOR [VIEW] [IF EXISTS] name
    EXPLAIN <statement>        -- the rewritten SQL (EXPLAIN ANALYZE: DuckDB's, on the rewrite)

A *tensor* (an operand) is a stored tensor's or tensor view's name or a nested tensor function
(``einsum``, ``grad``, ``tra_random``, ``tra_from_elements``, ``tra_relation``), which in FROM
is a relation (keys ``k0..``, BLOB ``tile``) rewritten into a subquery. Statements without
tensor syntax go to DuckDB unchanged; a statement that runs first checks the sizes it knows
(``tra_sql.budget``). Scalar functions: ``tra_tile_values(tile, dtype)``, ``tra_tile_ints``.

Modules: ``statements`` (tokens, statements, their kinds), ``syntax`` (literal arguments,
options, SQL pieces), ``functions`` (each table function's meaning), ``rewrite`` (a
statement's tensor syntax into SQL), ``ddl`` (CREATE/DROP TENSOR), ``query_tensor`` (CREATE
TENSOR over any query of tiles), ``tensor_views`` and ``training`` (views, parameters, TRAIN),
``blame`` (errors naming their statement), ``runner`` (``Frontend``: scripts run or explained).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tra_sql.frontend.runner import Frontend

if TYPE_CHECKING:
    from tra_sql.session import Session


def run(session: Session, text: str, params=None, *, cursor: bool = False):
    """Run every statement of ``text`` on DuckDB; the last one's result (see ``Session.sql``)."""
    return Frontend(session).run(text, params, cursor=cursor)


def explain(session: Session, text: str) -> str:
    """The SQL that ``run`` would hand DuckDB for each statement of ``text``."""
    return Frontend(session).explain(text)
