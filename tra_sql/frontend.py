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
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import sqlglot
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.tokens import Token, TokenType

from tra_sql import absent, budget, catalog
from tra_sql.catalog import TensorInfo
from tra_sql.errors import (
    DTypeError,
    SpecError,
    SQLError,
    TraError,
    UnknownTensorError,
)
from tra_sql.graph import Source, topological
from tra_sql.session import translate
from tra_sql.tensor import Tensor
from tra_sql.udfs import protocol

if TYPE_CHECKING:
    from tra_sql.session import Session

DIALECT = Dialect.get_or_raise("duckdb")
TENSOR_FUNCTIONS = ("einsum", "grad", "tra_random", "tra_from_elements")
FUNCTIONS = TENSOR_FUNCTIONS + ("tra_elements", "tra_check")
OPTIONS = {
    "einsum": ("join", "agg"),
    "grad": (),
    "tra_random": ("shape", "tile", "seed", "dtype", "dist"),
    "tra_from_elements": ("shape", "tile", "dtype"),
    "tra_elements": (),
    "tra_check": ("repair",),
}
SQL_TYPES = {"float64": "DOUBLE", "float32": "FLOAT", "int32": "INTEGER", "int64": "BIGINT"}
USAGE_CREATE = ("CREATE TENSOR needs AS SELECT * FROM einsum(...), tra_random(...), "
                "tra_from_elements(...) or a stored tensor, optionally with WHERE on the keys k0..")


def ensure_functions(session: Session) -> None:
    """Register the element-level tile functions (``tra_sql.udfs.elements``)."""
    session.ensure_udfs([protocol.TILE_VALUES, protocol.TILE_INTS, protocol.RANDOM_TILE, protocol.PACK_TILE])


# -- statements ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Statement:
    """One statement of a script: its number (from 1), text and sqlglot tokens."""

    number: int
    text: str
    tokens: tuple[Token, ...]
    offset: int

    def words(self, start: int, count: int) -> list[str]:
        """Upper-cased texts of ``count`` tokens from ``start`` ('' for strings, quoted
        names and past the end)."""
        words = [t.text.upper() if t.token_type not in (TokenType.STRING, TokenType.IDENTIFIER) else ""
                 for t in self.tokens[start : start + count]]
        return words + [""] * (count - len(words))

    @property
    def kind(self) -> str:
        """create, drop, explain, tensor (calls a tensor function) or plain."""
        head = self.words(0, 4)
        if head[0] == "CREATE" and (head[1] == "TENSOR" or head[1:] == ["OR", "REPLACE", "TENSOR"]):
            return "create"
        if head[:2] == ["DROP", "TENSOR"]:
            return "drop"
        if head[0] == "EXPLAIN":
            return "explain"
        calls = any(t.token_type == TokenType.VAR and t.text.lower() in FUNCTIONS and
                    n.token_type == TokenType.L_PAREN for t, n in zip(self.tokens, self.tokens[1:]))
        return "tensor" if calls else "plain"

    @property
    def analyze(self) -> bool:
        """Whether this is ``EXPLAIN ANALYZE ...``."""
        return bool(re.match(r"EXPLAIN\s+ANALYZE\b", self.text, re.I))

    def rest(self, token: int) -> str:
        """The text after token number ``token``."""
        return self.text[self.tokens[token].end + 1 - self.offset :].strip()

    def where(self) -> str:
        text = " ".join(self.text.split())
        return f"statement {self.number} `{text if len(text) <= 160 else text[:157] + '...'}`"


def tokenize(text: str) -> list[Token]:
    try:
        return DIALECT.tokenize(text)
    except sqlglot.errors.TokenError as err:
        raise SQLError(f"cannot read the SQL: {err}") from None


def split_statements(text: str, first: int = 1) -> list[Statement]:
    """The statements of ``text`` (separated by ``;``), empty ones left out."""
    statements: list[Statement] = []
    current: list[Token] = []
    for tok in [*tokenize(text), None]:
        if tok is not None and tok.token_type != TokenType.SEMICOLON:
            current.append(tok)
            continue
        if current:
            begin = current[0].start
            body = text[begin : tok.start if tok is not None else len(text)].rstrip()
            statements.append(Statement(first + len(statements), body, tuple(current), begin))
        current = []
    return statements


def is_extended(text: str) -> bool:
    """Whether ``text`` uses tensor syntax (otherwise DuckDB gets it unchanged)."""
    try:
        statements = split_statements(text)
    except SQLError:
        return False
    return any(s.kind != "plain" and (s.kind != "explain" or explained(s).kind != "plain")
               for s in statements)


def explained(statement: Statement) -> Statement:
    """The statement an ``EXPLAIN [ANALYZE]`` statement explains."""
    body = statement.rest(0)
    analyze = re.match(r"ANALYZE\b", body, re.I)
    inner = split_statements(body[analyze.end() :] if analyze else body, statement.number)
    if len(inner) != 1:
        raise SQLError(f"{statement.where()}: EXPLAIN takes one statement")
    return inner[0]


def with_context(err: TraError, where: str, level: str) -> TraError:
    """``err`` (same class) with ``where`` in front of its message, once per ``level``
    (``call`` or ``statement``)."""
    levels = getattr(err, "tra_levels", frozenset())
    if level in levels:
        return err
    try:
        new = type(err)(f"{where}: {err}")
    except Exception:  # a subclass with another constructor
        new = SQLError(f"{where}: {err}")
    new.tra_levels = levels | {level}
    return new


def engine_error(err: duckdb.Error, where: str) -> TraError:
    """A ``TraError`` naming the statement for an engine error (tile UDF errors keep their class)."""
    if isinstance(err, duckdb.ParserException):
        error: TraError = SQLError(f"{where}: {' '.join(str(err).split())}")
    else:
        error = translate(err, where)
        if not str(error).startswith(where):
            error = type(error)(f"{where}: {error}")
    error.tra_levels = frozenset({"call", "statement"})
    return error


# -- literals in the AST ------------------------------------------------------------------
def _string(node: exp.Expression, what: str) -> str:
    if isinstance(node, exp.Literal) and node.is_string:
        return node.this
    raise SpecError(f"{what} must be a string literal, got {node.sql(dialect='duckdb')}")


def _int(node: exp.Expression, what: str) -> int:
    sign = 1
    if isinstance(node, exp.Neg):
        sign, node = -1, node.this
    if isinstance(node, exp.Literal) and not node.is_string and re.fullmatch(r"\d+", node.this):
        return sign * int(node.this)
    raise SpecError(f"{what} must be an integer, got {node.sql(dialect='duckdb')}")


def _ints(node: exp.Expression, what: str) -> tuple[int, ...]:
    if isinstance(node, (exp.Array, exp.Tuple)):
        return tuple(_int(e, what) for e in node.expressions)
    return (_int(node, what),)


def _dtype(name: str) -> np.dtype:
    """The dtype named ``name`` (``DTypeError`` for a name NumPy does not know, too)."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise DTypeError(f"dtype {name!r} is not one of {', '.join(SQL_TYPES)}") from None
    return catalog.check_dtype(dtype)


def _name(call: exp.Anonymous) -> str:
    return call.name.lower()


def _arguments(call: exp.Anonymous) -> tuple[list[exp.Expression], dict[str, exp.Expression]]:
    """Positional arguments and named options (``name => v`` or ``name := v``) of ``call``."""
    fname = _name(call)
    positional: list[exp.Expression] = []
    named: dict[str, exp.Expression] = {}
    for arg in call.expressions:
        if isinstance(arg, (exp.Kwarg, exp.PropertyEQ)):
            key = arg.this.name.lower()
            if key not in OPTIONS[fname]:
                known = ", ".join(OPTIONS[fname]) or "none"
                raise SpecError(f"{fname}() has no option {arg.this.name!r}; its options: {known}")
            if key in named:
                raise SpecError(f"{fname}() option {key!r} is given twice")
            named[key] = arg.expression
        elif named:
            raise SQLError(f"{fname}(): positional argument {arg.sql(dialect='duckdb')} after a named one")
        else:
            positional.append(arg)
    return positional, named


def _array(items: list[exp.Expression]) -> exp.Expression:
    return exp.Array(expressions=items) if items else exp.cast(exp.Array(expressions=[]), "BIGINT[]")


def _call(name: str, *args: exp.Expression) -> exp.Anonymous:
    return exp.Anonymous(this=name, expressions=list(args))


def _meta(**payload: Any) -> exp.Literal:
    return exp.Literal.string(json.dumps(payload, separators=(",", ":")))


def _alias(this: exp.Expression, name: str, columns: list[str] | None = None) -> exp.Expression:
    """``(query) AS name(columns)`` or ``table AS name(columns)``."""
    alias = exp.TableAlias(this=exp.to_identifier(name), columns=[exp.to_identifier(c) for c in columns or []])
    if isinstance(this, exp.Query):
        return exp.Subquery(this=this, alias=alias)
    this.set("alias", alias)
    return this


def _shown(node: exp.Expression) -> str:
    return node.sql(dialect="duckdb", normalize_functions=False)


def _position(d: int, extents: list[exp.Column]) -> exp.Expression:
    """Index ``d`` inside a tile of shape ``extents`` at flat (C order) position ``_p``."""
    position: exp.Expression = exp.column("_p")
    if d + 1 < len(extents):
        stride: exp.Expression = extents[d + 1].copy()
        for e in extents[d + 2 :]:
            stride = exp.Mul(this=stride, expression=e.copy())
        position = exp.paren(exp.IntDiv(this=position, expression=exp.paren(stride)))
    return exp.Mod(this=position, expression=extents[d].copy())


# -- the rewrite --------------------------------------------------------------------------
class Rewriter:
    """Rewrites one statement's tensor syntax into plain DuckDB SQL (sqlglot expressions)."""

    def __init__(self, session: Session, run: bool = False):
        self.session = session
        self.run = run  # the statement runs now (else it is only shown): memory budgets apply, tra_check may repair
        self.literals: dict[str, exp.Select] = {}
        self.complete: dict[str, bool] = {}  # literal -> whether it has every tile
        self.counter = itertools.count(1)
        self.named: dict[str, Tensor] = {}  # one node per stored tensor: grad() follows identity

    @contextmanager
    def blame(self, call: exp.Expression) -> Iterator[None]:
        """Name the offending call in any ``TraError`` raised inside."""
        try:
            yield
        except TraError as err:
            raise with_context(err, f"in {_shown(call)}", "call") from None

    def parse(self, text: str) -> exp.Expression:
        try:
            tree = sqlglot.parse_one(text, read="duckdb")
        except sqlglot.errors.ParseError as err:
            first = err.errors[0] if err.errors else {}
            raise SQLError(f"syntax error at line {first.get('line', '?')}, column {first.get('col', '?')} "
                           f"near {first.get('highlight', '')!r}: {first.get('description', err)}") from None
        except RecursionError:
            raise SQLError("the statement is nested too deeply to rewrite") from None
        if isinstance(tree, exp.Command):
            raise SQLError("this statement is outside the SQL that sqlglot can rewrite")
        return tree

    # tensors
    def tensor(self, node: exp.Expression) -> Tensor:
        """The tensor an operand names: a stored tensor or a nested tensor function."""
        if isinstance(node, exp.Anonymous) and _name(node) in TENSOR_FUNCTIONS:
            with self.blame(node):
                return getattr(self, f"_{_name(node)}")(node)
        if isinstance(node, exp.Column) and not node.table:
            return self.stored(node.name)
        if isinstance(node, exp.Literal) and node.is_string:
            return self.stored(node.this)
        raise SQLError(f"operand {_shown(node)} is not a tensor name or a tensor function "
                       f"({', '.join(TENSOR_FUNCTIONS)})")

    def stored(self, name: str) -> Tensor:
        """The stored tensor ``name`` (case-insensitive, like DuckDB's identifiers); the same
        Tensor each time it is named in the statement."""
        if name.lower() not in self.named:
            self.named[name.lower()] = self._lookup(name)
        return self.named[name.lower()]

    def _lookup(self, name: str) -> Tensor:
        try:
            return self.session.tensor(name)
        except UnknownTensorError:
            names = self.session.tensors()
            match = [n for n in names if n.lower() == name.lower()]
            if len(match) == 1:
                return self.session.tensor(match[0])
            listed = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "none"
            raise UnknownTensorError(f"no tensor named '{name}' in the catalog (tensors: {listed})") from None

    def _einsum(self, call: exp.Anonymous) -> Tensor:
        args, options = _arguments(call)
        if not args:
            raise SpecError("einsum() needs a spec string and operands: einsum('ij,jk->ik', A, B)")
        spec = _string(args[0], "the einsum spec")
        join = _string(options["join"], "join") if "join" in options else None
        agg = _string(options["agg"], "agg") if "agg" in options else "sum"
        operands = [self.tensor(a) for a in args[1:]]
        names = [t.name or t.node.label for t in operands]
        node = self.session.einsum_node(spec, [t.node for t in operands], names, join, agg, self.completeness())
        return Tensor(self.session, node)

    def completeness(self) -> absent.Completeness:
        """``Session.completeness``, told about the statement's literals, which are no tables:
        ``tra_random`` has every tile, ``tra_from_elements`` may lack some."""
        stored = self.session.completeness().source_complete
        return absent.Completeness(lambda source: self.complete[source.table] if source.table in self.complete
                                   else stored(source))

    def _grad(self, call: exp.Anonymous) -> Tensor:
        """``grad(loss, W)``: the gradient of the scalar tensor ``loss`` with respect to ``W``
        (both stored tensors or nested tensor functions), a relational program itself."""
        from tra_sql import autodiff

        args, _ = _arguments(call)
        if len(args) != 2:
            raise SpecError("grad() takes two tensors: grad(loss, W)")
        loss, wrt = (self.tensor(a) for a in args)
        return autodiff.grad(self.session, loss, wrt)

    def _geometry(self, fname: str, args, options, dtype: str) -> TensorInfo:
        if "shape" in options and args:
            raise SpecError(f"{fname}(): shape is given twice")
        if "shape" not in options and not args:
            raise SpecError(f"{fname}() needs shape => [...]")
        shape = _ints(options["shape"] if "shape" in options else args[0], "shape")
        name = f"_{fname}_{next(self.counter)}"
        tile = _ints(options["tile"], "tile") if "tile" in options else None
        dt = _dtype(_string(options["dtype"], "dtype") if "dtype" in options else dtype)
        return TensorInfo(name, dt, shape, catalog.check_tile(shape, tile, fname))

    def _literal(self, info: TensorInfo, select: exp.Select, complete: bool) -> Tensor:
        self.literals[info.name] = select
        self.complete[info.name] = complete
        return Tensor(self.session, Source(info.shape, info.dtype, info.tile, info.name, info.layout))

    def _tra_random(self, call: exp.Anonymous) -> Tensor:
        args, options = _arguments(call)
        if len(args) > 1:
            raise SpecError("tra_random() takes one positional argument, the shape")
        info = self._geometry("tra_random", args, options, "float64")
        seed = _int(options["seed"], "seed") if "seed" in options else 0
        dist = _string(options["dist"], "dist") if "dist" in options else "uniform"
        if dist not in ("uniform", "normal"):
            raise SpecError(f"tra_random(): dist must be 'uniform' or 'normal', got {dist!r}")
        if info.dtype.kind != "f":
            raise DTypeError(f"tra_random() draws floats; dtype {info.dtype} is not float32 or float64")
        if seed < 0:
            raise SpecError(f"tra_random(): seed must be non-negative, got {seed}")
        if self.run:
            budget.check_generated(self.session, "tra_random()", info.shape, info.tile, info.dtype)
        keys = [exp.column("k", f"r{d}") for d in range(len(info.shape))]
        meta = _meta(name="tra_random", dtype=info.dtype.name, shape=info.shape, tile=info.tile, seed=seed,
                     dist=dist)
        select = exp.select(*[exp.alias_(exp.cast(k.copy(), "INTEGER"), f"k{d}") for d, k in enumerate(keys)],
                            exp.alias_(_call("tra_random_tile", meta, _array(keys)), "tile"))
        for d, grid in enumerate(info.grid):
            table = _alias(exp.Table(this=_call("range", exp.Literal.number(grid))), f"r{d}", ["k"])
            select = select.from_(table) if d == 0 else select.join(table, join_type="cross")
        return self._literal(info, select, complete=True)

    def _tra_from_elements(self, call: exp.Anonymous) -> Tensor:
        args, options = _arguments(call)
        if not args or len(args) > 2:
            raise SpecError("tra_from_elements() takes a table or (query) of elements, then shape => [...]")
        source, args = args[0], args[1:]
        info = self._geometry("tra_from_elements", args, options, "float64")
        if self.run:
            budget.check_tile(budget.Budget.of(self.session), "tra_from_elements()", info.tile, info.dtype)
        rank = len(info.shape)
        columns = [f"i{d}" for d in range(rank)] + ["value"]
        if isinstance(source, exp.Subquery):
            relation: exp.Expression = self.rewrite(source.this)
        elif isinstance(source, exp.Column):
            relation = exp.to_table(source.sql(dialect="duckdb"), dialect="duckdb")
        else:
            raise SQLError(f"tra_from_elements(): {_shown(source)} is not a table name or a (query)")
        keys = [exp.column(f"k{d}") for d in range(rank)]
        inner = exp.select(
            *[exp.alias_(exp.cast(exp.IntDiv(this=exp.cast(exp.column(c, "e"), "BIGINT"),
                                             expression=exp.Literal.number(t)), "INTEGER"), f"k{d}")
              for d, (c, t) in enumerate(zip(columns, info.tile))],
            *[exp.alias_(exp.cast(exp.column(c, "e"), "BIGINT"), c) for c in columns[:-1]],
            exp.alias_(exp.cast(exp.column("value", "e"), "DOUBLE"), "value"),
        ).from_(_alias(relation, "e", columns)).where(exp.column("value", "e").is_(exp.null()).not_())
        pack = _call("tra_pack_tile", _meta(name="tra_from_elements", dtype=info.dtype.name, shape=info.shape,
                                            tile=info.tile),
                     _array([k.copy() for k in keys]),
                     exp.ArrayAgg(this=_array([exp.column(c) for c in columns[:-1]])),
                     exp.ArrayAgg(this=exp.column("value")))
        select = exp.select(*keys, exp.alias_(pack, "tile")).from_(_alias(inner, "e"))
        return self._literal(info, select.group_by(*[k.copy() for k in keys]) if keys else select, complete=False)

    def query(self, tensor: Tensor) -> exp.Select:
        """The tile relation of ``tensor``: the program's query with its literals' CTEs."""
        if self.run:
            budget.check_program(self.session, tensor.node)
        program = tensor.program()
        self.session.ensure_udfs(program.kernels)
        select = program.query()
        used = [n.table for n in topological(tensor.node) if isinstance(n, Source) and n.table in self.literals]
        if used:
            ctes = [exp.CTE(this=self.literals[name].copy(), alias=exp.TableAlias(this=exp.to_identifier(name)),
                            materialized=True) for name in used]
            old = select.args.get("with_")
            select.set("with_", exp.With(expressions=ctes + (list(old.expressions) if old else [])))
        return select

    def elements(self, call: exp.Anonymous) -> exp.Select:
        """``tra_elements(t)``: one row per element of the tiles present, (i0, ..., value)."""
        args, _ = _arguments(call)
        if len(args) != 1:
            raise SQLError("tra_elements() takes one tensor: tra_elements(A)")
        tensor = self.tensor(args[0])
        if tensor.node.layout != "dense":
            raise SQLError(f"tra_elements() needs dense tiles; {tensor.node.label} is {tensor.node.layout} "
                           f"(its entries are the rows of the table it was made from)")
        rank, dtype = tensor.ndim, tensor.dtype
        keys = [exp.column(f"k{d}") for d in range(rank)]
        extents = [exp.column(f"_e{d}") for d in range(rank)]
        decode = "tra_tile_ints" if dtype.kind == "i" else "tra_tile_values"
        tiles = exp.select(
            *keys,
            *[exp.alias_(_call("least", exp.Literal.number(t), exp.Sub(
                this=exp.Literal.number(n), expression=exp.Mul(this=k.copy(), expression=exp.Literal.number(t)))),
                f"_e{d}") for d, (k, n, t) in enumerate(zip(keys, tensor.shape, tensor.tile))],
            exp.alias_(_call(decode, exp.column("tile"), exp.Literal.string(dtype.name)), "_v"),
        ).from_(_alias(self.query(tensor), "_q"))
        flat = exp.select(
            *keys, *extents, exp.alias_(_call("unnest", exp.column("_v")), "value"),
            exp.alias_(_call("unnest", _call("range", _call("len", exp.column("_v")))), "_p"),
        ).from_(_alias(tiles, "_w"))
        indices = [exp.alias_(exp.Add(this=exp.Mul(this=k.copy(), expression=exp.Literal.number(t)),
                                      expression=_position(d, extents)), f"i{d}")
                   for d, (k, t) in enumerate(zip(keys, tensor.tile))]
        value = exp.alias_(exp.cast(exp.column("value"), SQL_TYPES[dtype.name]), "value")
        return exp.select(*indices, value).from_(_alias(flat, "_u"))

    def check(self, call: exp.Anonymous) -> exp.Select:
        """``tra_check([repair => true])``: ``Session.check``'s findings as rows (tensor,
        problem, detail, repaired); it repairs only when the statement runs (not in EXPLAIN)."""
        args, options = _arguments(call)
        repair = options.get("repair", exp.false())
        if args or not isinstance(repair, exp.Boolean):
            raise SQLError("write tra_check() or tra_check(repair => true)")
        return catalog.findings_query(self.session.check(repair=repair.this and self.run))

    def rewrite(self, tree: exp.Expression) -> exp.Expression:
        """``tree`` with every tensor function in FROM replaced by its relational SQL."""
        def visit(node: exp.Expression) -> exp.Expression:
            if isinstance(node, exp.Table) and isinstance(node.this, exp.Anonymous) \
                    and _name(node.this) in FUNCTIONS:
                call = node.this
                with self.blame(call):
                    select = self.elements(call) if _name(call) == "tra_elements" else \
                        self.check(call) if _name(call) == "tra_check" else self.query(self.tensor(call))
                alias = node.args.get("alias") or exp.TableAlias(this=exp.to_identifier(_name(call)))
                return exp.Subquery(this=select, alias=alias.copy())
            return node

        out = tree.transform(visit)
        for call in out.find_all(exp.Anonymous):
            if _name(call) in FUNCTIONS:
                raise SQLError(f"{_shown(call)} is a table function: use it in FROM or as an operand")
        return out

    # CREATE TENSOR
    def source(self, select: exp.Expression) -> tuple[Tensor, exp.Select]:
        """The tensor a CREATE TENSOR query stores, and the query computing its tiles."""
        if not isinstance(select, exp.Select) or not select.args.get("from_"):
            raise SQLError(USAGE_CREATE)
        extra = [k for k, v in select.args.items() if v and k not in ("expressions", "from_", "where")]
        star = select.expressions
        if extra or len(star) != 1 or not isinstance(star[0], exp.Star) or any(star[0].args.values()):
            raise SQLError(f"{USAGE_CREATE}; got {_shown(select)}")
        table = select.args["from_"].this
        if isinstance(table, exp.Table) and isinstance(table.this, exp.Anonymous) \
                and _name(table.this) in TENSOR_FUNCTIONS:
            tensor, default = self.tensor(table.this), _name(table.this)
        elif isinstance(table, exp.Table) and isinstance(table.this, exp.Identifier) and not table.args.get("db"):
            tensor, default = self.stored(table.name), table.name
        else:
            raise SQLError(f"{USAGE_CREATE}; got FROM {_shown(table)}")
        query = self.query(tensor)
        where = select.args.get("where")
        if where is None:
            return tensor, query
        alias = table.alias or default
        for column in where.find_all(exp.Column):
            if column.find_ancestor(exp.Select) is not select:
                continue
            match = re.fullmatch(r"k(\d+)", column.name)
            if not match or int(match.group(1)) >= tensor.ndim or column.table not in ("", alias):
                keys = ", ".join(f"k{d}" for d in range(tensor.ndim)) or "none"
                raise SQLError(f"the WHERE of CREATE TENSOR may test only the keys ({keys}), "
                               f"not {_shown(column)}")
        filtered = exp.select("*").from_(_alias(query, alias)).where(self.rewrite(where.this))
        return tensor, filtered


# -- running statements -------------------------------------------------------------------
@dataclass(frozen=True)
class CreateTensor:
    """What a ``CREATE [OR REPLACE] TENSOR [IF NOT EXISTS] name AS <select>`` asks for."""

    name: str
    replace: bool
    if_not_exists: bool
    select: str

    @staticmethod
    def of(statement: Statement) -> CreateTensor:
        tokens, i = statement.tokens, 2 if statement.words(1, 1) == ["TENSOR"] else 4
        replace = i == 4
        exists = statement.words(i, 3) == ["IF", "NOT", "EXISTS"]
        i += 3 if exists else 0
        if i + 1 >= len(tokens) or tokens[i].token_type not in (TokenType.VAR, TokenType.IDENTIFIER) \
                or statement.words(i + 1, 1) != ["AS"]:
            raise SQLError("write CREATE [OR REPLACE] TENSOR [IF NOT EXISTS] name AS SELECT ...")
        return CreateTensor(catalog.check_name(tokens[i].text), replace, exists, statement.rest(i + 1))


def _create(session: Session, statement: Statement, run: bool) -> str | None:
    create = CreateTensor.of(statement)
    name, replace, exists = create.name, create.replace, create.if_not_exists
    rewriter = Rewriter(session, run)
    tensor, query = rewriter.source(rewriter.parse(create.select))
    info = TensorInfo(name, tensor.dtype, tensor.shape, tensor.tile, tensor.node.layout)
    sql = query.sql(dialect="duckdb", pretty=not run)
    if not run:
        return (f"-- tensor {name}: shape {info.shape}, tile {info.tile}, dtype {info.dtype}\n"
                f'CREATE {"OR REPLACE " if replace else ""}TABLE "{name}" AS\n{sql}')
    if catalog.table_exists(session.con, name):
        if exists and name.lower() in (n.lower() for n in session.tensors()):
            return None
        if not replace:
            raise SQLError(f"a table named '{name}' exists already; use CREATE OR REPLACE TENSOR")
    try:
        if any(t.name.lower() == name.lower() for t in query.find_all(exp.Table)):
            _create_via_temp(session, info, sql, replace)
        else:
            catalog.create_tensor_table(session.con, info, sql, replace)
    except duckdb.Error as err:
        raise engine_error(err, statement.where()) from err
    return None


def _create_via_temp(session: Session, info: TensorInfo, sql: str, replace: bool) -> None:
    """Create a tensor whose query reads the table it replaces: compute it first."""
    temp = exp.table_(exp.to_identifier(f"_tra_new_{info.name}", quoted=True), db="main", catalog="temp")
    con = session.con
    con.execute(f"CREATE OR REPLACE TEMP TABLE {temp.sql(dialect='duckdb')} AS {sql}").fetchall()
    try:
        catalog.create_tensor_table(con, info, exp.select("*").from_(temp).sql(dialect="duckdb"), replace)
    finally:
        con.execute(f"DROP TABLE IF EXISTS {temp.sql(dialect='duckdb')}").fetchall()


def drop_tensor(session: Session, statement: Statement, run: bool) -> str | None:
    exists = statement.words(2, 2) == ["IF", "EXISTS"]
    at = 4 if exists else 2
    tokens = statement.tokens
    if len(tokens) != at + 1 or tokens[at].token_type not in (TokenType.VAR, TokenType.IDENTIFIER):
        raise SQLError("write DROP TENSOR [IF EXISTS] name")
    name = tokens[at].text
    match = [n for n in session.tensors() if n.lower() == name.lower()]
    if not match:
        if exists:
            return None
        raise UnknownTensorError(f"no tensor named '{name}' in the catalog")
    if not run:
        return f'DROP TABLE "{match[0]}";\nDELETE FROM {catalog.CATALOG_TABLE} WHERE name = \'{match[0]}\''
    session.drop(match[0])
    return None


def rewrite_statement(session: Session, statement: Statement, run: bool = False) -> str | None:
    """The SQL DuckDB runs for ``statement``; with ``run``, CREATE/DROP TENSOR are done
    (and give ``None``) instead of described."""
    kind = statement.kind
    if kind == "create":
        return _create(session, statement, run)
    if kind == "drop":
        return drop_tensor(session, statement, run)
    if kind == "explain":
        return rewrite_statement(session, explained(statement))
    if kind == "plain":
        return statement.text
    rewriter = Rewriter(session, run)
    return rewriter.rewrite(rewriter.parse(statement.text)).sql(dialect="duckdb", pretty=not run)


def _run_one(session: Session, statement: Statement, params, cursor: bool):
    if statement.kind == "explain":
        inner = explained(statement)
        if inner.kind == "plain":
            sql: str | None = statement.text
        elif statement.analyze and inner.kind == "tensor":
            sql = "EXPLAIN ANALYZE " + str(rewrite_statement(session, inner, run=True))
        else:
            text = rewrite_statement(session, inner)
            sql = exp.select(exp.alias_(exp.Literal.string(text or ""), "rewritten_sql")).sql(dialect="duckdb")
    else:
        sql = rewrite_statement(session, statement, run=True)
    if sql is None:
        return None
    try:
        return session.con.execute(sql, params) if cursor else session.con.sql(sql, params=params)
    except duckdb.Error as err:
        raise engine_error(err, statement.where()) from err


@contextmanager
def blamed(statement: Statement) -> Iterator[None]:
    """Name ``statement`` in any ``TraError`` raised inside; an engine error (reading the
    catalog while rewriting, say) becomes one."""
    try:
        yield
    except TraError as err:
        raise with_context(err, statement.where(), "statement") from None
    except duckdb.Error as err:
        raise engine_error(err, statement.where()) from None


def run_statement(session: Session, statement: Statement, params=None, *, cursor: bool = False):
    """Run one statement; its result as DuckDB gives it (``None`` for CREATE/DROP TENSOR)."""
    ensure_functions(session)
    with blamed(statement):
        return _run_one(session, statement, params, cursor)


def run(session: Session, text: str, params=None, *, cursor: bool = False):
    """Run every statement of ``text``; the last one's result (see ``Session.sql``)."""
    ensure_functions(session)
    if not is_extended(text):
        try:
            return session.con.execute(text, params) if cursor else session.con.sql(text, params=params)
        except duckdb.Error as err:
            raise engine_error(err, "statement") from err
    statements = split_statements(text)
    result = None
    for n, statement in enumerate(statements):
        last = n == len(statements) - 1
        result = run_statement(session, statement, params if last else None, cursor=cursor and last)
    return result


def explain_statement(session: Session, statement: Statement) -> str | None:
    """For ``EXPLAIN <statement with tensor syntax>``, the SQL it is rewritten into; else ``None``."""
    if statement.kind != "explain" or statement.analyze:
        return None
    with blamed(statement):
        inner = explained(statement)
        return None if inner.kind == "plain" else f"{rewrite_statement(session, inner)};"


def explain(session: Session, text: str) -> str:
    """The SQL that ``run`` would hand DuckDB for each statement of ``text``."""
    ensure_functions(session)
    out = []
    for statement in split_statements(text):
        with blamed(statement):
            out.append(rewrite_statement(session, statement))
    return ";\n\n".join(s for s in out if s) + ";"
