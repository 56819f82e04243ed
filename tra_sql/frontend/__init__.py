"""The tensor extension of SQL: einsum and friends as table functions, CREATE/DROP TENSOR.

Statements are DuckDB SQL plus the following (options are named arguments, written
``name => value`` or ``name := value``; quote ``"join"``, it is a keyword)::

    SELECT ... FROM einsum('ij,jk->ik', A, B [, "join" => 'x0 + x1'] [, agg => 'max']) [AS e]
    SELECT ... FROM grad(<loss>, <W>)                   -- d loss / d W, itself a tensor relation
    SELECT ... FROM tra_random(shape => [4, 3] [, tile => [2, 2]] [, seed => 0]
                               [, dtype => 'float64'] [, dist => 'uniform' | 'normal'])
    SELECT ... FROM tra_from_elements(<table> | (<query>), shape => [4, 3]
                                      [, tile => [2, 2]] [, dtype => 'float64'])
    SELECT ... FROM tra_elements(<tensor>)               -- one row per element: i0, ..., value
    SELECT ... FROM tra_check([repair => true])          -- catalog drift and corrupt tiles
    CREATE [OR REPLACE] TENSOR [IF NOT EXISTS] name AS SELECT * FROM <tensor> [WHERE <keys>]
    DROP TENSOR [IF EXISTS] name
    EXPLAIN <statement>        -- the rewritten SQL (EXPLAIN ANALYZE: DuckDB's, on the rewrite)

- A *tensor* (an einsum operand, the argument of ``tra_elements``, the source of CREATE
  TENSOR) is a stored tensor's name (identifier or string; case-insensitive) or a nested
  ``einsum(...)``, ``tra_random(...)`` or ``tra_from_elements(...)``.
- Those three in FROM are tensor relations (keys ``k0..``, BLOB ``tile``), rewritten into
  a subquery: they join, filter and nest in CTEs like any table.
- ``tra_random`` draws each tile from a generator seeded with (seed, tile key): values
  depend on the seed and the tiling. ``tra_from_elements`` reads the first rank columns
  of its relation as indices and the next as the value; absent elements are zeros,
  repeated ones add up, NULL values are skipped, an index outside the shape is a ShapeError.
- ``tra_elements`` gives the elements of the tiles present (absent tiles are zeros and
  give no rows), ``value`` in the tensor's SQL type (integers exact).
- CREATE TENSOR stores exactly ``SELECT * FROM <tensor>``, optionally with a WHERE that
  tests only the keys: shape, tile and dtype are the tensor's; filtered-out tiles are
  absent, i.e. zeros. It may read the tensor it replaces. Table and catalog row are
  written in one transaction (so not inside the user's own ``BEGIN``).
- Statements without tensor syntax go to DuckDB unchanged. A SELECT's result is DuckDB's
  lazy relation: errors raised in tile functions while reading it are DuckDB's errors.
- A statement that runs first checks the sizes it knows (``tra_sql.budget``): a ``tra_random``
  or a tile the session cannot hold is a ``MemoryBudgetError`` before anything is allocated
  (EXPLAIN, which runs nothing, still shows it).

Scalar functions registered on the connection: ``tra_tile_values(tile, dtype)`` (DOUBLE[])
and ``tra_tile_ints(tile, dtype)`` (BIGINT[]) give a tile's elements in C order;
``tra_random_tile`` and ``tra_pack_tile`` serve the rewrites above (all in ``tra_sql.udfs.elements``).

Modules: ``statements`` (tokens, statements, their kinds), ``syntax`` (literal arguments,
options, SQL pieces), ``functions`` (each table function's meaning), ``rewrite`` (a
statement's tensor syntax into SQL), ``ddl`` (CREATE/DROP TENSOR), ``blame`` (errors naming
their statement), ``runner`` (``Frontend``: scripts run or explained on DuckDB).
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
