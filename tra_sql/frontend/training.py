"""Training statements: ``CREATE [OR REPLACE] TENSOR VIEW``, ``DROP TENSOR VIEW``, ``CREATE [OR
REPLACE] PARAMETER`` and ``TRAIN [STEP]``, done (``run``) or described.

- ``CREATE [OR REPLACE] PARAMETER W WITH (shape := [..] [, init := 'glorot_uniform'] [, seed
  := 0] [, tile := [..]] [, dtype := 'float64'] [, scale := x])`` is ``db.parameter``: a stored
  W of that shape is kept (a script run again resumes), OR REPLACE draws it again.
- ``TRAIN [STEP] <loss> PARAMETERS W [, b ...] [WITH (optimizer := 'adam', lr := 0.1, epochs :=
  20, run := 'name', <the optimizer's options>)]`` is ``db.train`` with an optimizer of
  ``tra_sql.optim`` (``sgd``, ``adam``, ``adamw``): resumable under its ``run`` name (default:
  the loss's name), per-epoch loss in the run tables; STEP runs one more step of the run. The
  statement's result is the run's epochs (run, epoch from 0 as in ``tra_run_log``, loss, seconds).
- Tensor functions in the loss (``tra_random``, ``tra_from_elements``, ``tra_relation``) are
  relation views while the run trains (read by every step, never copied), dropped after.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from sqlglot import exp
from sqlglot.tokens import TokenType

from tra_sql import catalog, optim
from tra_sql.catalog import TensorInfo
from tra_sql.errors import ShapeError, SpecError, SQLError
from tra_sql.frontend import tensor_views
from tra_sql.frontend.rewrite import Rewriter
from tra_sql.frontend.statements import Statement
from tra_sql.frontend.syntax import int_literal, ints_literal, shown, string_literal, value_literal
from tra_sql.graph import Source, topological

if TYPE_CHECKING:
    from tra_sql.session import Session
    from tra_sql.tensor import Tensor

OPTIMIZERS = {"sgd": optim.SGD, "adam": optim.Adam, "adamw": optim.AdamW}
PARAMETER_OPTIONS = ("shape", "init", "seed", "tile", "dtype", "scale")
RUN_OPTIONS = ("optimizer", "epochs", "run")
OPTIMIZER_OPTIONS = tuple(dict.fromkeys(f.name for cls in OPTIMIZERS.values() for f in fields(cls)
                                        if f.name != "slots"))
NAMES = (TokenType.VAR, TokenType.IDENTIFIER)


def _name_at(statement: Statement, at: int, usage: str) -> str:
    if at >= len(statement.tokens) or statement.tokens[at].token_type not in NAMES:
        raise SQLError(usage)
    return catalog.check_name(statement.tokens[at].text)


def _replace(statement: Statement) -> tuple[bool, int]:
    """Whether a CREATE statement says OR REPLACE, and the token after its object word."""
    return (True, 4) if statement.words(1, 2) == ["OR", "REPLACE"] else (False, 2)


# -- tensor views -----------------------------------------------------------------------------
VIEW_USAGE = "write CREATE [OR REPLACE] TENSOR VIEW name AS SELECT * FROM <tensor>"


def create_view(session: Session, statement: Statement, run: bool) -> str | None:
    """Keep a tensor view's definition, after evaluating it once (so errors show now)."""
    replace, at = _replace(statement)
    name = _name_at(statement, at + 1, VIEW_USAGE)
    if statement.words(at + 2, 1) != ["AS"]:
        raise SQLError(VIEW_USAGE)
    definition = statement.rest(at + 2)
    rewriter = Rewriter(session, run)
    tensor = rewriter.defined(rewriter.parse(definition))
    if not run:
        return (f"-- tensor view {name}: shape {tensor.shape}, tile {tensor.tile}, dtype {tensor.dtype}; "
                f"evaluated where it is read\n{definition}")
    tensor_views.create(session, name, definition, replace)
    return None


def drop_view(session: Session, statement: Statement, run: bool) -> str | None:
    exists = statement.words(3, 2) == ["IF", "EXISTS"]
    at = 5 if exists else 3
    if len(statement.tokens) != at + 1:
        raise SQLError("write DROP TENSOR VIEW [IF EXISTS] name")
    name = _name_at(statement, at, "write DROP TENSOR VIEW [IF EXISTS] name")
    if not run:
        return f"DELETE FROM {tensor_views.TABLE} WHERE lower(name) = lower('{name}')"
    tensor_views.drop(session, name, exists)
    return None


# -- parameters -------------------------------------------------------------------------------
PARAMETER_USAGE = "write CREATE [OR REPLACE] PARAMETER name WITH (shape := [...] [, init := '...', seed := 0, ...])"


def create_parameter(session: Session, statement: Statement, run: bool) -> str | None:
    """``db.parameter`` from its statement (OR REPLACE: drawn again)."""
    replace, at = _replace(statement)
    name = _name_at(statement, at, PARAMETER_USAGE)
    if statement.words(at + 1, 2) != ["WITH", "("]:
        raise SQLError(PARAMETER_USAGE)
    options, end = statement.options(at + 2, "CREATE PARAMETER", PARAMETER_OPTIONS)
    if end != len(statement.tokens) or "shape" not in options:
        raise SQLError(PARAMETER_USAGE)
    shape = ints_literal(options["shape"], "shape")
    init = string_literal(options["init"], "init") if "init" in options else "glorot_uniform"
    given = {"seed": int_literal(options["seed"], "seed") if "seed" in options else 0,
             "dtype": string_literal(options["dtype"], "dtype") if "dtype" in options else None,
             "tile": ints_literal(options["tile"], "tile") if "tile" in options else None,
             "scale": float(value_literal(options["scale"], "scale")) if "scale" in options else None}
    if not run:
        return f"-- parameter {name}: shape {shape}, init {init!r}, {given} (a stored {name} of that shape is kept)"
    tensor_views.check_free(session, name)
    session.parameter(name, shape, init, replace=replace, **given)
    return None


# -- training ---------------------------------------------------------------------------------
TRAIN_USAGE = "write TRAIN [STEP] <loss> PARAMETERS W [, b ...] [WITH (optimizer := 'adam', lr := 0.1, epochs := 20)]"


def _train_parts(statement: Statement) -> tuple[bool, str, list[str], dict]:
    """(step, the loss's text, parameter names, options) of a TRAIN statement."""
    step = statement.words(1, 1) == ["STEP"]
    start = 2 if step else 1
    tokens, depth, at = statement.tokens, 0, None
    for i in range(start, len(tokens)):
        kind = tokens[i].token_type
        depth += (kind == TokenType.L_PAREN) - (kind == TokenType.R_PAREN)
        if depth == 0 and statement.words(i, 1) == ["PARAMETERS"]:
            at = i
            break
    if at is None or at == start:
        raise SQLError(TRAIN_USAGE)
    loss = statement.text[tokens[start].start - statement.offset : tokens[at].start - statement.offset].strip()
    names, i = [], at + 1
    while True:
        names.append(_name_at(statement, i, TRAIN_USAGE))
        if statement.words(i + 1, 1) != [","]:
            break
        i += 2
    options, end = {}, i + 1
    if statement.words(end, 2) == ["WITH", "("]:
        options, end = statement.options(end + 1, "TRAIN", RUN_OPTIONS + OPTIMIZER_OPTIONS)
    if end != len(tokens):
        raise SQLError(TRAIN_USAGE)
    return step, loss, names, options


def optimizer_of(options: dict) -> optim.Optimizer:
    """The optimizer the options name (default Adam), with its own options."""
    kind = string_literal(options["optimizer"], "optimizer").lower() if "optimizer" in options else "adam"
    if kind not in OPTIMIZERS:
        raise SpecError(f"optimizer {kind!r} is not one of {', '.join(OPTIMIZERS)}")
    cls = OPTIMIZERS[kind]
    accepted = {f.name for f in fields(cls)} - {"slots"}
    given = {k: value_literal(v, k) for k, v in options.items() if k not in RUN_OPTIONS}
    wrong = sorted(set(given) - accepted)
    if wrong:
        raise SpecError(f"optimizer {kind!r} has no option {wrong[0]!r}; its options: {', '.join(sorted(accepted))}")
    return cls(**given)


def _literal_views(session: Session, rewriter: Rewriter, loss: Tensor) -> list[str]:
    """The loss's tensor-function literals made relation views (their names)."""
    made = []
    for node in topological(loss.node):
        if isinstance(node, Source) and node.table in rewriter.literals and node.table not in made:
            info = TensorInfo(node.table, node.dtype, node.shape, node.tile, node.layout)
            session.engine.create_relation(info, rewriter.literals[node.table], replace=True)
            made.append(node.table)
    return made


def train(session: Session, statement: Statement, run: bool):
    """Train (``run``; the run's epochs as a relation) or describe the TRAIN statement."""
    step, text, names, options = _train_parts(statement)
    if step and "epochs" in options:
        raise SpecError("TRAIN STEP runs one step: it takes no epochs")
    epochs = int_literal(options["epochs"], "epochs") if "epochs" in options else 1
    if epochs < 0:
        raise SpecError(f"epochs must be non-negative, got {epochs}")
    optimizer = optimizer_of(options)
    rewriter = Rewriter(session, run)
    tree = rewriter.parse(text)
    default = tree.name if isinstance(tree, exp.Column) and not tree.table else None
    name = string_literal(options["run"], "run") if "run" in options else default
    if name is None:
        raise SpecError(f"TRAIN {shown(tree)}: name the run, WITH (run := '...'), or train a tensor view")
    loss = rewriter.tensor(tree)
    if loss.shape != ():
        raise ShapeError(f"TRAIN: the loss must be a scalar, got shape {loss.shape}")
    params = [rewriter.stored(n) for n in names]
    if not run:
        what = "one more step" if step else f"up to {epochs} epochs"
        return (f"-- run '{name}': {what} of {optimizer.describe()} on {', '.join(names)} minimizing "
                f"{shown(tree)}; one epoch's loss:\n{rewriter.query(loss).sql(dialect='duckdb', pretty=True)}")
    if any(p.name is None or p.name.lower() in rewriter.views for p in params):
        raise SQLError("TRAIN: parameters are stored tensors (CREATE PARAMETER), not tensor views")
    made = _literal_views(session, rewriter, loss)
    try:
        if step:
            epochs = session.train(loss, params, optimizer, 0, run=name, progress=False).epochs + 1
        history = session.train(loss, params, optimizer, epochs, run=name, progress=False)
    finally:
        for table in made:
            session.drop(table)
    return session.engine.query(epochs_query(name, history.losses, history.seconds).sql(dialect=session.engine.dialect))


def epochs_query(run: str, losses: list[float], seconds: list[float]) -> exp.Select:
    """The rows (run, epoch, loss, seconds) of a run's epochs, as SQL of literals."""
    columns = ["run", "epoch", "loss", "seconds"]
    if not losses:
        types = ("VARCHAR", "BIGINT", "DOUBLE", "DOUBLE")
        return exp.select(*[exp.alias_(exp.cast(exp.null(), t), c) for c, t in zip(columns, types)]).where(
            exp.false())
    def double(x: float) -> exp.Expression:  # exact, and nan or inf (a diverged run) too
        return exp.cast(exp.Literal.string(repr(float(x))), "DOUBLE")

    rows = [exp.tuple_(exp.Literal.string(run), exp.Literal.number(epoch), double(loss), double(s))
            for epoch, (loss, s) in enumerate(zip(losses, seconds))]
    values = exp.Values(expressions=rows, alias=exp.TableAlias(this=exp.to_identifier("epochs"),
                                                               columns=[exp.to_identifier(c) for c in columns]))
    return exp.select(*columns).from_(values)
