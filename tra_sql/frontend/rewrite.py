"""The rewrite of one statement's tensor syntax into plain DuckDB SQL (sqlglot expressions):
operands resolved to tensors, each tensor function in FROM replaced by its tiles' query."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import sqlglot
from sqlglot import exp

from tra_sql import budget
from tra_sql.errors import SQLError, TraError, UnknownTensorError
from tra_sql.frontend import tensor_views
from tra_sql.frontend.blame import with_context
from tra_sql.frontend.functions import TensorFunctions
from tra_sql.frontend.statements import FUNCTIONS, TENSOR_FUNCTIONS
from tra_sql.frontend.syntax import aliased, function_name, shown
from tra_sql.graph import Source, topological
from tra_sql.tensor import Tensor

if TYPE_CHECKING:
    from tra_sql.session import Session

RELATIONS = {"tra_elements": "elements", "tra_check": "check", "tra_plan": "plan"}  # the other functions
USAGE_CREATE = ("this CREATE TENSOR needs AS SELECT * FROM einsum(...), tra_random(...), "
                "tra_from_elements(...) or a stored tensor, optionally with WHERE on the keys k0..")


class Rewriter(TensorFunctions):
    """Rewrites one statement's tensor syntax into plain DuckDB SQL (sqlglot expressions)."""

    def __init__(self, session: Session, run: bool = False):
        super().__init__(session, run)
        self.named: dict[str, Tensor] = {}  # one node per stored tensor: grad() follows identity
        self.read: list[Tensor] = []  # the tensors that tensor functions in FROM stand for
        self.views = tensor_views.definitions(session)
        self.resolving: list[str] = []  # the tensor views being evaluated (a cycle is an error)

    @contextmanager
    def blame(self, call: exp.Expression) -> Iterator[None]:
        """Name the offending call in any ``TraError`` raised inside."""
        try:
            yield
        except TraError as err:
            raise with_context(err, f"in {shown(call)}", "call") from None

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

    def tensor(self, node: exp.Expression) -> Tensor:
        """The tensor an operand names: a stored tensor or a nested tensor function."""
        if isinstance(node, exp.Anonymous) and function_name(node) in TENSOR_FUNCTIONS:
            with self.blame(node):
                return getattr(self, f"_{function_name(node)}")(node)
        if isinstance(node, exp.Column) and not node.table:
            return self.stored(node.name)
        if isinstance(node, exp.Literal) and node.is_string:
            return self.stored(node.this)
        raise SQLError(f"operand {shown(node)} is not a tensor name or a tensor function "
                       f"({', '.join(TENSOR_FUNCTIONS)})")

    def stored(self, name: str) -> Tensor:
        """The stored tensor or tensor view ``name`` (case-insensitive, like DuckDB's
        identifiers); the same Tensor each time it is named in the statement."""
        if name.lower() not in self.named:
            self.named[name.lower()] = self.view(name) if name.lower() in self.views else self._lookup(name)
        return self.named[name.lower()]

    def view(self, name: str) -> Tensor:
        """Tensor view ``name``: its definition evaluated now."""
        view, text = self.views[name.lower()]
        if view.lower() in self.resolving:
            raise SQLError(f"tensor view '{view}' reads itself ({' -> '.join([*self.resolving, view.lower()])})")
        self.resolving.append(view.lower())
        try:
            with self.blame(exp.to_identifier(view)):
                return self.defined(self.parse(text))
        finally:
            self.resolving.pop()

    def defined(self, tree: exp.Expression) -> Tensor:
        """The tensor of a tensor view's definition, ``SELECT * FROM <tensor>``."""
        found = self.narrow(tree, tiles=False)
        if found is None or tree.args.get("where"):
            raise SQLError(f"a tensor view is defined as SELECT * FROM <tensor> (a tensor function or a stored "
                           f"tensor or view), got {shown(tree)}")
        return found[0]

    def _lookup(self, name: str) -> Tensor:
        try:
            return self.session.tensor(name)
        except UnknownTensorError:
            names = self.session.tensors()
            match = [n for n in names if n.lower() == name.lower()]
            if len(match) == 1:
                return self.session.tensor(match[0])
            if name.lower() in FUNCTIONS:
                raise UnknownTensorError(f"{name} is a table function, not a tensor: call it, "
                                         f"{name.lower()}(...)") from None
            listed = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "none"
            raise UnknownTensorError(f"no tensor named '{name}' in the catalog (tensors: {listed})") from None

    def query(self, tensor: Tensor) -> exp.Select:
        """The tile relation of ``tensor``: the program's query with its literals' CTEs."""
        if self.run:
            budget.check_program(self.session, tensor.node)
        program = tensor.program()
        self.session.engine.ensure_kernels(program.kernels)
        select = program.query()
        used = [n.table for n in topological(tensor.node) if isinstance(n, Source) and n.table in self.literals]
        if used:
            ctes = [exp.CTE(this=self.literals[name].copy(), alias=exp.TableAlias(this=exp.to_identifier(name)),
                            materialized=True) for name in used]
            old = select.args.get("with_")
            select.set("with_", exp.With(expressions=ctes + (list(old.expressions) if old else [])))
        return select

    def rewrite(self, tree: exp.Expression) -> exp.Expression:
        """``tree`` with every tensor function and tensor view in FROM replaced by its relational SQL."""
        ctes = {cte.alias.lower() for cte in tree.find_all(exp.CTE)}

        def visit(node: exp.Expression) -> exp.Expression:
            if isinstance(node, exp.Table) and isinstance(node.this, exp.Anonymous) \
                    and function_name(node.this) in FUNCTIONS:
                call = node.this
                with self.blame(call):
                    if function_name(call) in TENSOR_FUNCTIONS:
                        self.read.append(self.tensor(call))
                        select = self.query(self.read[-1])
                    else:
                        select = getattr(self, RELATIONS[function_name(call)])(call)
                alias = node.args.get("alias") or exp.TableAlias(this=exp.to_identifier(function_name(call)))
                return exp.Subquery(this=select, alias=alias.copy())
            if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier) and not node.args.get("db") \
                    and node.name.lower() in self.views and node.name.lower() not in ctes:
                self.read.append(self.stored(node.name))
                alias = node.args.get("alias") or exp.TableAlias(this=exp.to_identifier(node.name))
                return exp.Subquery(this=self.query(self.read[-1]), alias=alias.copy())
            return node

        out = tree.transform(visit)
        for call in out.find_all(exp.Anonymous):
            if function_name(call) in FUNCTIONS:
                raise SQLError(f"{shown(call)} is a table function: use it in FROM or as an operand")
        return out

    # CREATE TENSOR
    def source(self, select: exp.Expression) -> tuple[Tensor, exp.Select]:
        """The tensor a CREATE TENSOR ``SELECT * FROM <tensor> [WHERE <keys>]`` stores, and
        the query computing its tiles (an SQLError for any other query)."""
        found = self.narrow(select)
        if found is None:
            raise SQLError(f"{USAGE_CREATE}; got {shown(select)}")
        return found

    def narrow(self, select: exp.Expression, tiles: bool = True) -> tuple[Tensor, exp.Select | None] | None:
        """For ``SELECT * FROM <tensor> [WHERE <tests of the keys only>]``, the tensor and
        (with ``tiles``) its tiles' query (the tensor's geometry is the result's); else None."""
        if not isinstance(select, exp.Select) or not select.args.get("from_"):
            return None
        extra = [k for k, v in select.args.items() if v and k not in ("expressions", "from_", "where")]
        star = select.expressions
        if extra or len(star) != 1 or not isinstance(star[0], exp.Star) or any(star[0].args.values()):
            return None
        table = select.args["from_"].this
        if isinstance(table, exp.Table) and isinstance(table.this, exp.Anonymous) \
                and function_name(table.this) in TENSOR_FUNCTIONS:
            tensor, default = self.tensor(table.this), function_name(table.this)
        elif isinstance(table, exp.Table) and isinstance(table.this, exp.Identifier) and not table.args.get("db") \
                and (self.is_tensor(table.name) or table.name.lower() in FUNCTIONS):
            tensor, default = self.stored(table.name), table.name
        else:
            return None
        where = select.args.get("where")
        alias = table.alias or default
        if where is not None and not all(self._key_column(c, select, alias, tensor.ndim)
                                         for c in where.find_all(exp.Column)):
            return None
        if not tiles:
            return tensor, None
        query = self.query(tensor)
        if where is None:
            return tensor, query
        return tensor, exp.select("*").from_(aliased(query, alias)).where(self.rewrite(where.this))

    @staticmethod
    def _key_column(column: exp.Column, select: exp.Select, alias: str, rank: int) -> bool:
        """Whether ``column`` (in a WHERE of ``select``) is a key of the tensor read as ``alias``
        (or belongs to a subquery)."""
        if column.find_ancestor(exp.Select) is not select:
            return True
        match = re.fullmatch(r"k(\d+)", column.name)
        return bool(match) and int(match.group(1)) < rank and column.table in ("", alias)

    def is_tensor(self, name: str) -> bool:
        """Whether ``name`` names a stored tensor or a tensor view (case-insensitive)."""
        return name.lower() in self.named or name.lower() in self.views \
            or name.lower() in (n.lower() for n in self.session.tensors())
