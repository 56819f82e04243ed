"""Random tensor programs over the public API, for the differential tests.

A ``Program`` is a list of ``Step``s. A step is Python source (statements over ``db``, ``np``,
``nn``) and a PyTorch reference of the tensor it assigns, computed from the dense arrays (an
absent tile is a tile of zeros). ``Program.source()`` is the runnable program; the harness
builds the program by executing exactly that text, so a failure's printed snippet is what ran.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product

import numpy as np
import torch
from hypothesis import assume
from hypothesis import strategies as st

from tra_sql.aggregates import AGGREGATES

LETTERS = "abcdefgh"
FLOATS = ("float64", "float32")
INTS = ("int32", "int64")
AGGS = tuple(AGGREGATES)
#: PyTorch's function for each aggregation whose name differs (the others: ``torch.<agg>``)
TORCH_AGGS = {"max": "amax", "min": "amin"}
#: Paths compared and programs tried in this process (see conftest's summary).
COUNTS: Counter = Counter()
HEADER = """import numpy as np
import pyarrow as pa, pyarrow.compute
import tra_sql
import tra_sql.graph, tra_sql.tensor
from tra_sql import nn
from tra_sql.backends.spark_parameters import marker
from tra_sql.catalog import TensorInfo, assemble
from tra_sql.compile import program as compiled
from tra_sql.train_step import compile_step, run_step

def dense(t, tiles):  # a tile relation (arrow()) of tensor or node t as an ndarray, each tile key once
    node = getattr(t, "node", t)
    keys = set(zip(*(tiles.column(f"k{d}").to_pylist() for d in range(len(node.shape)))))
    assert tiles.num_rows == len(keys) if node.shape else tiles.num_rows <= 1, f"a tile key twice in {tiles}"
    return assemble(TensorInfo("t", node.dtype, node.shape, node.tile, node.layout), tiles)

def stepped(t, fused):  # tensor t's tiles computed as a training step computes its roots
    step = compile_step({"out": t.node}, "_diff_step", fuse_bytes=float("inf") if fused else 0)
    rows = run_step(db, step)
    if rows is None:  # the step's statements stored it
        return db.engine.arrow(f'SELECT * FROM "{step.tables["out"]}"')
    return rows.drop_columns(["target"])

def spark_stepped(t, ahead=False):  # tensor t's tiles computed as a training step on Spark computes its roots
    # (one job), with row-wise results read from t beside it (one step where t is complete: spark_siblings), each
    # 2t: one scales t by a stored scalar that holds 0 while the step binds 2 as its parameter (spark_parameters);
    # ahead: as a step planned while the step before runs (spark_pipeline), its stored inputs read through input
    # views over the kept rows of a step before that copies them
    results, scalars, args = {"out": t.node}, frozenset(), {}
    sources = {n.table.lower(): n for n in tra_sql.graph.topological(t.node)
               if isinstance(n, tra_sql.graph.Source)} if ahead else {}
    if t.node.layout == "dense" and t.node.shape and t.node.dtype.kind == "f":
        s = "abcdefgh"[:len(t.node.shape)]
        scalar = db.from_numpy(f"_diff_scalar_{t.node.dtype}", np.array(0, t.node.dtype), replace=True)
        scalars, args = frozenset({scalar.name.lower()}), {marker(scalar.name): np.array(2, t.node.dtype).tobytes()}
        results |= {"twice": db.einsum(f"{s}->{s}", t, join="x0 * 2").node,
                    "sum": db.einsum(f"{s},{s}->{s}", t, t, join="x0 + x1").node,
                    "scaled": db.einsum(f"{s},->{s}", t, scalar, join="x0 * x1").node}
    dialect = db.engine.sql_dialect()
    query = dialect.union_steps(compiled.Program.compile(*results.values()), results, db.engine.completeness(),
                                scalars, frozenset(sources))
    assert query.parameters == scalars and set(query.inputs) == set(sources)
    before = inputs = None
    if sources:
        from pyspark import StorageLevel
        from tra_sql.backends.spark_pipeline import kept_inputs
        from tra_sql.backends.spark_session import settings
        copied = {n.table: n for n in sources.values()}
        with settings(db.engine.spark, db.engine.query_settings()):
            before = db.engine.prepare(dialect.union_steps(compiled.Program.compile(*copied.values()), copied),
                                       "the step before", keep=StorageLevel.MEMORY_AND_DISK)
            before.frame.count()  # computes and keeps its rows
        inputs = kept_inputs(db.engine.spark, before,
                             {n.table.lower(): (n.table, len(n.shape)) for n in copied.values()})
    try:
        with db.engine.steps(query, "a differential step", args, inputs) as frame:
            rows = frame.toArrow()
    finally:
        if before is not None:
            before.discard()
    def of(target):
        return rows.filter(pa.compute.equal(rows["target"], target)).drop_columns(["target"])
    out = of("out")
    for target in results.keys() - {"out"}:
        np.testing.assert_array_equal(dense(results[target], of(target)), 2 * dense(t, out), err_msg=target)
    return out

def via_sql(t):  # tensor t through the SQL front end: its einsums nested einsum(...) calls, the rest stored first
    def public(node):  # an einsum that einsum(...) builds as it is (autodiff's may select tiles by keys, cast)
        if not isinstance(node, tra_sql.graph.Einsum) or node.softmax is not None:
            return False
        operands = [tra_sql.tensor.Tensor(db, op) for op in node.operands]
        built = db.einsum(str(node.spec), *operands, join=node.join, agg=node.agg).node
        return built.dtype == node.dtype and built.operands == node.operands
    texts = {}  # a node's text by its id: a node used twice is stored (and written) once
    def text(node):
        if id(node) not in texts:
            texts[id(node)] = written(node)
        return texts[id(node)]
    def written(node):
        if isinstance(node, tra_sql.graph.Source):
            return f'"{node.table}"'
        if not public(node):
            name = f"_via_sql_{len(db.tensors())}"
            tra_sql.tensor.Tensor(db, node).store(name)
            return f'"{name}"'
        join = [] if node.join is None else ['"join" => ' + "'" + node.join.replace("'", "''") + "'"]
        args = [f"'{node.spec}'", *map(text, node.operands), *join, f"agg => '{node.agg}'"]
        return f"einsum({', '.join(args)})"
    db.sql(f"CREATE OR REPLACE TENSOR _via_sql AS SELECT * FROM {text(t.node)}")
    return db.tensor("_via_sql").numpy(plan=False)

db = tra_sql.connect()
"""


@dataclass
class Var:
    """A tensor the program has built: its Python name, shape, dtype and layout."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = "dense"
    stored: bool = False  # a stored tensor (gradients may be taken with respect to it)
    complete: bool = True  # every tile present

    @property
    def floating(self) -> bool:
        return self.dtype in FLOATS


@dataclass
class Step:
    """Source lines that assign ``var``, and ``ref(env)``: its reference value (float64 torch)
    from the references of earlier steps, by name."""

    var: Var
    code: str
    ref: Callable[[dict], torch.Tensor]


@dataclass
class Program:
    steps: list[Step] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # leaves that gradients are taken of

    def source(self) -> str:
        return "\n".join(step.code for step in self.steps)

    def snippet(self, path: str = "") -> str:
        """A runnable script: the program, then ``path`` (statements assigning ``got``)."""
        return HEADER + self.source() + ("\n" + path if path else "") + "\n"

    def __repr__(self) -> str:
        return f"Program(outputs={self.outputs}):\n{self.source()}"

    def _repr_pretty_(self, printer, cycle) -> None:  # how hypothesis shows a drawn program
        printer.text(repr(self))

    def build(self, db, namespace: dict | None = None) -> dict:
        """Execute the program's source against session ``db``; the namespace it leaves."""
        env = {"db": db, "np": np, "torch": torch, **(namespace or {})}
        exec(compile(HEADER.split("db = ")[0] + self.source(), "<program>", "exec"), env)  # noqa: S102
        return env

    def reference(self) -> dict[str, torch.Tensor]:
        self.params.clear()
        env: dict = {"__params__": self.params}
        for step in self.steps:
            env[step.var.name] = step.ref(env)
        return env

    def var(self, name: str) -> Var:
        return next(s.var for s in self.steps if s.var.name == name)

    @property
    def dtypes(self) -> set[str]:
        return {s.var.dtype for s in self.steps}


# -- join expressions: a small grammar, rendered as SQL and evaluated in torch ----------------

def where(cond, a, b):
    return torch.where(cond, a, b)


@dataclass(frozen=True)
class Expr:
    """A join expression tree: ``op`` is ``x`` (operand ``arg``), ``c`` (constant ``arg``), or
    an operator over ``kids``."""

    op: str
    kids: tuple[Expr, ...] = ()
    arg: float | int = 0

    def sql(self) -> str:
        k = [kid.sql() for kid in self.kids]
        return {
            "x": lambda: f"x{self.arg}",
            "c": lambda: repr(self.arg),
            "+": lambda: f"({k[0]} + {k[1]})",
            "-": lambda: f"({k[0]} - {k[1]})",
            "*": lambda: f"({k[0]} * {k[1]})",
            "/": lambda: f"({k[0]} / (1 + abs({k[1]})))",
            "half": lambda: f"({k[0]} / 2)",
            "greatest": lambda: f"greatest({k[0]}, {k[1]})",
            "least": lambda: f"least({k[0]}, {k[1]})",
            "exp": lambda: f"exp(least({k[0]}, 2))",
            "abs": lambda: f"abs({k[0]})",
            "case": lambda: f"CASE WHEN {k[0]} > {k[1]} THEN {k[2]} ELSE {k[3]} END",
        }[self.op]()

    def eval(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """The value over broadcast operands ``xs`` in DuckDB's order (NaN above every number;
        ties of greatest/least go to the later argument, as tra_sql's derivative rules say)."""
        k = [kid.eval(xs) for kid in self.kids]
        if self.op == "x":
            return xs[self.arg]
        if self.op == "c":
            return torch.tensor(float(self.arg), dtype=torch.float64)
        return {
            "+": lambda: k[0] + k[1], "-": lambda: k[0] - k[1], "*": lambda: k[0] * k[1],
            "/": lambda: k[0] / (1 + torch.abs(k[1])), "half": lambda: k[0] / 2,
            "greatest": lambda: where(above(k[0], k[1]), k[0], k[1]),
            "least": lambda: where(above(k[1], k[0]), k[0], k[1]),
            "exp": lambda: torch.exp(where(k[0] < 2, k[0], torch.tensor(2.0, dtype=torch.float64))),
            "abs": lambda: torch.abs(k[0]),
            "case": lambda: where(above(k[0], k[1]), k[2], k[3]),
        }[self.op]()

    def uses(self) -> set[int]:
        return ({self.arg} if self.op == "x" else set()).union(*(kid.uses() for kid in self.kids))


ARITY = {"+": 2, "-": 2, "*": 2, "/": 2, "half": 1, "greatest": 2, "least": 2, "exp": 1, "abs": 1, "case": 4}


@st.composite
def exprs(draw, n: int, depth: int = 2) -> Expr:
    """A join expression over ``x0..x{n-1}``."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        if draw(st.integers(0, 4)) == 0:
            return Expr("c", arg=draw(st.sampled_from([0.5, -1.5, 2, 0.25])))
        return Expr("x", arg=draw(st.integers(0, n - 1)))
    op = draw(st.sampled_from(sorted(ARITY)))
    return Expr(op, tuple(draw(exprs(n, depth - 1)) for _ in range(ARITY[op])))


def above(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a > b`` in DuckDB's order, where NaN is above every number (and equal to itself)."""
    return (a > b) | (torch.isnan(a) & ~torch.isnan(b))


# -- the reference of an extended einsum --------------------------------------------------------

def einsum_ref(inputs: list[str], output: str, xs: list[torch.Tensor], join: Expr | None,
               agg: str) -> torch.Tensor:
    """``out[o] = agg over the other indices of join(x0[...], ...)``, evaluated over the full index
    grid (a size-1 dimension broadcasts, a repeated index takes the diagonal)."""
    sizes: dict[str, int] = {}
    for sub, x in zip(inputs, xs):
        for c, n in zip(sub, x.shape):
            sizes[c] = max(sizes.get(c, 1), n)
    letters = list(output) + sorted(set("".join(inputs)) - set(output))
    grid = torch.meshgrid(*[torch.arange(sizes[c]) for c in letters], indexing="ij") if letters else []
    at = dict(zip(letters, grid))
    vals = []
    for sub, x in zip(inputs, xs):
        index = tuple(at[c] if n > 1 else torch.zeros_like(at[c]) for c, n in zip(sub, x.shape))
        vals.append(x[index] if index else x.expand([sizes[c] for c in letters]))
    value = join.eval(vals) if join is not None else math.prod(vals[1:], start=vals[0])
    value = value.expand([sizes[c] for c in letters]) if letters else value
    out_shape = [sizes[c] for c in output]
    flat = value.reshape(out_shape + [-1])
    if AGGREGATES[agg].floating and not flat.is_floating_point():
        flat = flat.double()
    return getattr(torch, TORCH_AGGS.get(agg, agg))(flat, -1)


def result_dtype(dtypes: list[str], join: Expr | None, agg: str) -> str:
    dtype = np.result_type(*dtypes)
    return "float64" if (join is not None or AGGREGATES[agg].floating) and dtype.kind != "f" else dtype.name


# -- drawing programs ----------------------------------------------------------------------------

class Builder:
    """Draws the steps of one program, keeping the tensors built so far (``pool``)."""

    def __init__(self, draw, dtypes=FLOATS + INTS, absent: bool = True):
        self.draw, self.dtypes, self.absent = draw, dtypes, absent
        self.program = Program()
        self.pool: list[Var] = []
        self.seed = draw(st.integers(0, 2**16))

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{len(self.program.steps)}"

    def add(self, var: Var, code: str, ref) -> Var:
        self.program.steps.append(Step(var, code, ref))
        self.pool.append(var)
        return var

    def shape(self, rank: int | None = None, sizes=(1, 5)) -> tuple[int, ...]:
        rank = self.draw(st.sampled_from([1, 2, 2, 3, 3, 0])) if rank is None else rank
        return tuple(self.draw(st.integers(*sizes)) for _ in range(rank))

    def tile(self, shape) -> tuple[int, ...]:
        return tuple(self.draw(st.integers(1, n)) for n in shape)

    # leaves
    def leaf(self, shape=None, dtype=None, absent=None, positive=False, data=None) -> Var:
        """A stored tensor of random values (both signs; ``data``: a NumPy expression instead),
        ragged tiles, maybe some tiles deleted."""
        draw = self.draw
        shape = self.shape() if shape is None else shape
        dtype = draw(st.sampled_from(self.dtypes)) if dtype is None else dtype
        tile = self.tile(shape)
        seed = self.seed + len(self.program.steps)
        if data is not None:
            pass
        elif dtype in INTS:
            data = f"np.random.default_rng({seed}).integers(-3, 4, {shape!r}).astype({dtype!r})"
        elif positive:
            data = f"np.random.default_rng({seed}).uniform(0.5, 1.5, {shape!r}).astype({dtype!r})"
        else:
            data = f"np.random.default_rng({seed}).uniform(-2, 2, {shape!r}).astype({dtype!r})"
        name = self.fresh("A")
        code = f'{name} = db.from_numpy("{name}", np.asarray({data}), tile={tile!r})'
        grid = [range(math.ceil(n / t)) for n, t in zip(shape, tile)]
        keys = list(product(*grid))
        gone = []
        if (self.absent if absent is None else absent) and draw(st.integers(0, 2)) == 0:
            gone = sorted(draw(st.sets(st.sampled_from(keys), min_size=1, max_size=len(keys))))
            conds = " OR ".join(" AND ".join(f"k{d} = {k}" for d, k in enumerate(key)) or "true" for key in gone)
            code += f"\ndb.engine.con.execute('DELETE FROM \"{name}\" WHERE {conds}')"
        mask = np.ones(shape)
        for key in gone:
            mask[tuple(slice(k * t, (k + 1) * t) for k, t in zip(key, tile))] = 0

        def ref(env, data=data, mask=mask, name=name, dtype=dtype):
            value = torch.tensor(np.asarray(eval(data, {"np": np}), dtype=np.float64))  # noqa: S307
            if dtype in FLOATS:
                value.requires_grad_(True)
                env["__params__"][name] = value
            return value * torch.tensor(mask)

        return self.add(Var(name, shape, dtype, stored=True, complete=not gone), code, ref)

    def fill(self, shape=None, dtype=None) -> Var:
        shape = self.shape() if shape is None else shape
        dtype = self.draw(st.sampled_from(self.dtypes)) if dtype is None else dtype
        value = self.draw(st.sampled_from([0, 1, -2] if dtype in INTS else [0.0, 1.0, -1.5, 0.25]))
        tile = self.tile(shape)
        name = self.fresh("F")
        call = {0: "zeros", 1: "ones"}.get(value) if self.draw(st.booleans()) else None
        args = f"{shape!r}, dtype={dtype!r}, tile={tile!r}"
        code = f"{name} = db.{call}({args})" if call else f"{name} = db.full({shape!r}, {value!r}, dtype={dtype!r}, " \
                                                         f"tile={tile!r})"
        return self.add(Var(name, shape, dtype), code,
                        lambda env: torch.full(shape, float(value), dtype=torch.float64))

    def operand(self, shape=None, floating=False) -> Var:
        """A tensor from the pool (of ``shape`` if given; most often the latest), or a new leaf or fill."""
        fits = [v for v in self.pool if (shape is None or v.shape == shape) and v.layout == "dense"
                and (v.floating or not floating)]
        choice = self.draw(st.integers(0, 5))
        if fits and choice < 4:
            return fits[-1] if choice < 2 else self.draw(st.sampled_from(fits))
        dtypes = [d for d in self.dtypes if d in FLOATS or not floating]
        if choice == 4:
            return self.fill(shape, self.draw(st.sampled_from(dtypes)))
        return self.leaf(shape, self.draw(st.sampled_from(dtypes)))

    # ops
    def einsum(self, operands: list[Var] | None = None, join: bool | None = None, agg: str | None = None) -> Var:
        """A random extended einsum: repeated indices, size-1 broadcasting, implicit or explicit
        output (full reductions included), a random join expression and aggregate."""
        draw = self.draw
        operands = operands or [self.operand() for _ in range(draw(st.integers(1, 3)))]
        sizes: dict[str, int] = {}
        inputs = []
        for op in operands:
            sub = ""
            for n in op.shape:
                here = [c for c in dict.fromkeys(sub)  # a repeated index: a diagonal
                        if n > 1 and all(op.shape[e] == n for e, ch in enumerate(sub) if ch == c)]
                other = [c for c in sizes if c not in sub and (sizes[c] == n or 1 in (n, sizes[c]))]
                fresh = [c for c in LETTERS if c not in sizes]
                options = here + other * 2 + fresh[:1]
                c = draw(st.sampled_from(options))
                sizes[c] = max(sizes.get(c, 1), n)
                sub += c
            inputs.append(sub)
        used = sorted(set("".join(inputs)))
        if draw(st.integers(0, 4)) == 0:
            output = "".join(sorted(c for c in used if "".join(inputs).count(c) == 1))
            spec = ",".join(inputs)
        else:
            output = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
            spec = ",".join(inputs) + "->" + output
        expr = draw(exprs(len(operands))) if (draw(st.booleans()) if join is None else join) else None
        agg = draw(st.sampled_from(AGGS)) if agg is None else agg
        return self.einsum_of(spec, operands, inputs, output, expr, agg)

    def einsum_of(self, spec: str, operands: list[Var], inputs=None, output=None, expr: Expr | None = None,
                  agg: str = "sum") -> Var:
        """``db.einsum(spec, *operands, join=expr, agg=agg)`` (``inputs``, ``output``: the spec's
        subscripts, given for an implicit output)."""
        if inputs is None:
            inputs, output = spec.split("->")[0].split(","), spec.split("->")[1]
        sizes = {c: max(n for sub, op in zip(inputs, operands) for ch, n in zip(sub, op.shape) if ch == c)
                 for c in output}
        dtype = result_dtype([op.dtype for op in operands], expr, agg)
        layout = "csr" if any(op.layout == "csr" and sub == output for sub, op in zip(inputs, operands)) else "dense"
        name = self.fresh("E")
        args = ", ".join(op.name for op in operands)
        extra = (f", join={expr.sql()!r}" if expr else "") + (f", agg={agg!r}" if agg != "sum" else "")
        code = f'{name} = db.einsum("{spec}", {args}{extra})'
        names = [op.name for op in operands]
        return self.add(Var(name, tuple(sizes[c] for c in output), dtype, layout), code,
                        lambda env: einsum_ref(inputs, output, [env[n] for n in names], expr, agg))

    def keyed_sum(self) -> Var:
        first = self.operand()
        others = [self.operand(first.shape) for _ in range(self.draw(st.integers(1, 2)))]
        parts = [first, *others]
        name = self.fresh("S")
        dtype = np.result_type(*(p.dtype for p in parts)).name
        return self.add(Var(name, first.shape, dtype), f"{name} = db.add({', '.join(p.name for p in parts)})",
                        lambda env: sum(env[p.name] for p in parts))

    def retile(self) -> Var:
        x = self.operand()
        tile = self.tile(x.shape)
        name = self.fresh("R")
        return self.add(Var(name, x.shape, x.dtype), f"{name} = {x.name}.retile({tile!r})", lambda env: env[x.name])

    def cast(self) -> Var:
        """``x.astype(dtype)``: to a float, or int32 to int64 (truncating rounding noise, or
        wrapping a large product, would differ from the reference by design)."""
        x = self.operand()
        targets = [d for d in self.dtypes if d != x.dtype and (d in FLOATS or (d == "int64" and not x.floating))]
        dtype = self.draw(st.sampled_from(targets or [x.dtype]))
        name = self.fresh("T")
        return self.add(Var(name, x.shape, dtype), f"{name} = {x.name}.astype({dtype!r})", lambda env: env[x.name])

    def slice(self) -> Var:
        x = self.operand()
        assume(x.shape)
        items, shape = [], []
        for n in x.shape[: self.draw(st.integers(1, len(x.shape)))]:
            kind = self.draw(st.integers(0, 2))
            if kind == 0:
                items.append(str(self.draw(st.integers(-n, n - 1))))
                continue
            a = self.draw(st.integers(0, n - 1))
            b = self.draw(st.integers(a + 1, n))
            start = a - n if self.draw(st.booleans()) else a
            items.append(f"{start}:{b}" if kind == 1 else f"{start}:")
            shape.append(b - a if kind == 1 else n - a)
        shape += list(x.shape[len(items):])
        index = ", ".join(items)
        name = self.fresh("I")
        return self.add(Var(name, tuple(shape), x.dtype), f"{name} = {x.name}[{index}]",
                        lambda env: eval(f"t[{index}]", {"t": env[x.name]}))  # noqa: S307

    def concat(self) -> Var:
        x = self.operand()
        assume(x.shape)
        axis = self.draw(st.integers(0, len(x.shape) - 1))
        width = self.draw(st.integers(1, 4))
        other = self.operand(x.shape[:axis] + (width,) + x.shape[axis + 1:])
        parts = self.draw(st.permutations([x, other]))
        name = self.fresh("C")
        shape = x.shape[:axis] + (x.shape[axis] + width,) + x.shape[axis + 1:]
        dtype = np.result_type(x.dtype, other.dtype).name
        axis_code = f"{axis}" if self.draw(st.booleans()) else f"{axis - len(x.shape)}"
        return self.add(Var(name, shape, dtype), f"{name} = db.concat([{parts[0].name}, {parts[1].name}], {axis_code})",
                        lambda env: torch.cat([env[p.name] for p in parts], axis))

    def transpose(self) -> Var:
        x = self.operand()
        perm = tuple(self.draw(st.permutations(range(len(x.shape)))))
        name = self.fresh("P")
        reverse = perm == tuple(reversed(range(len(perm)))) and self.draw(st.booleans())
        code = f"{name} = {x.name}.T" if reverse else f"{name} = {x.name}.transpose{perm!r}"
        return self.add(Var(name, tuple(x.shape[p] for p in perm), x.dtype), code,
                        lambda env: env[x.name].permute(perm))

    def reshape(self) -> Var:
        x = self.operand()
        factors = [p for n in x.shape for p in _factors(n)]
        factors = self.draw(st.permutations(factors)) if self.draw(st.booleans()) else factors
        cuts = sorted(self.draw(st.sets(st.integers(1, max(1, len(factors) - 1)), max_size=2)))
        dims = [math.prod(factors[a:b]) for a, b in zip([0, *cuts], [*cuts, len(factors)])] if factors else []
        dims = [d for d in dims if d > 1] or ([1] if self.draw(st.booleans()) else [])
        if dims and self.draw(st.booleans()):
            dims.insert(self.draw(st.integers(0, len(dims))), 1)
        shape = tuple(dims)
        shown = list(shape)
        if shown and self.draw(st.booleans()):
            shown[self.draw(st.integers(0, len(shown) - 1))] = -1
        name = self.fresh("H")
        return self.add(Var(name, shape, x.dtype), f"{name} = {x.name}.reshape({', '.join(map(str, shown))})",
                        lambda env: env[x.name].reshape(shape))

    def op(self, layers: bool = False) -> Var:
        kinds = (["einsum"] * 4 + ["add", "retile", "cast", "slice", "concat", "transpose", "reshape"]
                 + ["layer"] * 2 * layers)
        kind = self.draw(st.sampled_from(kinds))
        return getattr(self, {"add": "keyed_sum"}.get(kind, kind))()

    # tra_sql.nn layers
    def layer(self) -> Var:
        x = self.operand(floating=True)
        if not x.shape:
            x = self.leaf(self.shape(self.draw(st.integers(1, 3))), self.draw(st.sampled_from(FLOATS)))
        kind = self.draw(st.sampled_from(["linear", "softmax", "log_softmax", "layer_norm", "rms_norm", "attention"]))
        if kind == "attention":
            return self.attention(x)
        return getattr(self, kind if kind in ("linear", "attention") else "normalize")(x, kind)

    def weight(self, shape, dtype) -> Var:
        return self.leaf(shape, dtype, absent=False)

    def linear(self, x: Var, kind: str) -> Var:
        width = self.draw(st.integers(1, 4))
        w = self.weight((x.shape[-1], width), x.dtype)
        b = self.weight((width,), x.dtype) if self.draw(st.booleans()) else None
        act = self.draw(st.sampled_from([None, "relu", "gelu", "tanh", "sigmoid", "silu"]))
        name = self.fresh("L")
        code = f"{name} = nn.linear(db, {x.name}, {w.name}, {b.name if b else None}, {act!r})"

        def ref(env):
            y = env[x.name] @ env[w.name] + (env[b.name] if b else 0)
            return ACTIVATIONS[act](y) if act else y

        return self.add(Var(name, x.shape[:-1] + (width,), x.dtype), code, ref)

    def normalize(self, x: Var, kind: str) -> Var:
        n = x.shape[-1]
        extra, name = "", self.fresh("N")
        gain = self.weight((n,), x.dtype) if kind in ("layer_norm", "rms_norm") and self.draw(st.booleans()) else None
        bias = self.weight((n,), x.dtype) if kind == "layer_norm" and self.draw(st.booleans()) else None
        mask = scale = None
        if kind in ("softmax", "log_softmax"):
            scale = self.draw(st.sampled_from([1.0, 0.5, 2.0]))
            if self.draw(st.booleans()):
                shape = x.shape[len(x.shape) - self.draw(st.integers(1, len(x.shape))):]
                data = (f"np.maximum(np.random.default_rng({self.seed + len(self.program.steps)}).uniform(0, 1, "
                        f"{shape!r}) > 0.4, np.arange({n}) == 0).astype({x.dtype!r})")  # a 1 in every row
                mask = self.leaf(shape, x.dtype, absent=False, data=data)
            extra = (f", mask={mask.name}" if mask else "") + f", scale={scale!r}"
        elif gain or bias:
            extra = f", {gain.name if gain else None}" + (f", {bias.name}" if bias else "")
        code = f"{name} = nn.{kind}(db, {x.name}{extra})"

        def ref(env):
            v = env[x.name]
            if kind in ("softmax", "log_softmax"):
                logit = v * scale
                if mask:
                    logit = torch.where(env[mask.name] > 0, logit, torch.tensor(-math.inf, dtype=torch.float64))
                return torch.softmax(logit, -1) if kind == "softmax" else torch.log_softmax(logit, -1)
            g = env[gain.name] if gain else None
            if kind == "layer_norm":
                return torch.nn.functional.layer_norm(v, (n,), g, env[bias.name] if bias else None, eps=1e-5)
            y = v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6)
            return y * g if gain else y

        return self.add(Var(name, x.shape, x.dtype), code, ref)

    def attention(self, x: Var) -> Var:
        """Multi-head self-attention of ``x`` (..., q, d), maybe causal, maybe with biases."""
        if len(x.shape) < 2:
            x = self.reshaped(x)
        d, heads, dk, dv, out = x.shape[-1], *(self.draw(st.integers(1, 3)) for _ in range(4))
        w = {k: self.weight(shape, x.dtype) for k, shape in
             (("Wq", (d, heads, dk)), ("Wk", (d, heads, dk)), ("Wv", (d, heads, dv)), ("Wo", (heads, dv, out)))}
        if self.draw(st.booleans()):
            w |= {k: self.weight(shape, x.dtype) for k, shape in
                  (("bq", (heads, dk)), ("bk", (heads, dk)), ("bv", (heads, dv)), ("bo", (out,)))}
        causal = self.draw(st.booleans())
        name = self.fresh("M")
        args = ", ".join(f"{k}={v.name}" for k, v in w.items())
        code = f"{name} = nn.attention(db, {x.name}, nn.AttentionWeights({args}), causal={causal})"

        def ref(env):
            v = {k: env[var.name] for k, var in w.items()}
            xs = env[x.name]
            zero = torch.zeros((), dtype=torch.float64)
            q = torch.einsum("...qd,dhk->...qhk", xs, v["Wq"]) + v.get("bq", zero)
            k = torch.einsum("...sd,dhk->...shk", xs, v["Wk"]) + v.get("bk", zero)
            val = torch.einsum("...sd,dhv->...shv", xs, v["Wv"]) + v.get("bv", zero)
            scores = torch.einsum("...qhk,...shk->...hqs", q, k) / math.sqrt(dk)
            if causal:
                keep = torch.tril(torch.ones(scores.shape[-2:], dtype=torch.bool))
                scores = torch.where(keep, scores, torch.tensor(-math.inf, dtype=torch.float64))
            heads_ = torch.einsum("...hqs,...shv->...qhv", torch.softmax(scores, -1), val)
            return torch.einsum("...qhv,hve->...qe", heads_, v["Wo"]) + v.get("bo", zero)

        return self.add(Var(name, x.shape[:-1] + (out,), x.dtype), code, ref)

    def reshaped(self, x: Var) -> Var:
        """``x`` as a matrix (one row per element)."""
        name = self.fresh("H")
        shape = (math.prod(x.shape), 1)
        return self.add(Var(name, shape, x.dtype), f"{name} = {x.name}.reshape{shape!r}",
                        lambda env: env[x.name].reshape(shape))

    # gradients
    def grads(self, out: Var) -> list[Var]:
        """A random scalar loss of ``out`` and its gradients with respect to stored float tensors."""
        letters = LETTERS[: len(out.shape)]
        expr = self.draw(st.none() | exprs(1))
        agg = self.draw(st.sampled_from(["sum", "sum", "max"]))
        loss = self.einsum_of(f"{letters}->", [out], expr=expr, agg=agg)
        return self.grads_of(loss, [v for v in self.pool if v.stored and v.floating])

    def grads_of(self, loss: Var, candidates: list[Var]) -> list[Var]:
        """``dA, dB, = db.grad(loss, [A, B])`` for some of ``candidates``."""
        wrt = self.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique_by=lambda v: v.name))
        names = [f"d{v.name}" for v in wrt]
        code = f"{', '.join(names)}, = db.grad({loss.name}, [{', '.join(v.name for v in wrt)}])"
        for n, (name, v) in enumerate(zip(names, wrt)):
            ref = (lambda env: _gradients(env, loss.name, [w.name for w in wrt])) if n == 0 \
                else (lambda env, n=n: env[names[0] + "__all"][n])
            self.program.steps.append(Step(Var(name, v.shape, v.dtype, stored=False, complete=v.complete),
                                           code if n == 0 else "", ref))
        self.program.outputs = [loss.name, *names]
        return [self.program.var(name) for name in names]

    def finish(self, out: Var) -> Program:
        self.program.outputs = [out.name]
        return self.program


ACTIVATIONS = {
    "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
    "gelu": lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
}


def _gradients(env: dict, loss: str, wrt: list[str]) -> torch.Tensor:
    """The gradient of ``loss`` with respect to the first of ``wrt`` (all of them kept in
    ``env['d<first>__all']``); zeros for a tensor the loss does not use."""
    params = [env["__params__"][name] for name in wrt]
    grads = torch.autograd.grad(env[loss], params, allow_unused=True, retain_graph=True) \
        if env[loss].requires_grad else [None] * len(params)
    env[f"d{wrt[0]}__all"] = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
    return env[f"d{wrt[0]}__all"][0]


def _factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def programs(draw, dtypes=FLOATS + INTS, absent: bool = True, ops: tuple[int, int] = (1, 4)) -> Program:
    """A DAG of einsums, keyed sums and structural ops over a few stored tensors and fills."""
    b = Builder(draw, dtypes, absent)
    for _ in range(draw(st.integers(1, 2))):
        b.leaf()
    out = None
    for _ in range(draw(st.integers(*ops))):
        out = b.op()
    return b.finish(out)


@st.composite
def layer_programs(draw) -> Program:
    """tra_sql.nn layers (and einsums) over float tensors, absent tiles included."""
    b = Builder(draw, FLOATS)
    b.leaf(b.shape(draw(st.integers(1, 3))))
    out = b.layer()
    for _ in range(draw(st.integers(0, 2))):
        out = b.op(layers=True)
    return b.finish(out)


@st.composite
def grad_programs(draw) -> Program:
    """A program over stored tensors (mostly float64), a random scalar loss of its result and
    the loss's gradients with respect to some of the stored tensors."""
    b = Builder(draw, ("float64", "float64", "float64", "float32", "int32"))
    for _ in range(draw(st.integers(1, 2))):
        b.leaf(dtype=draw(st.sampled_from(["float64", "float64", "float32"])))
    out = None
    for _ in range(draw(st.integers(1, 3))):
        out = b.op(layers=True)
    b.grads(out)
    return b.program


@st.composite
def csr_programs(draw) -> Program:
    """Products with a CSR relation (a table of unique entries viewed with layout='csr'): message
    passing both ways, row/column sums, sampled products with a CSR result, gradients."""
    b = Builder(draw, FLOATS)
    n, m = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    cells = sorted(draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, m - 1)), min_size=1)))
    values = [draw(st.sampled_from([0.5, -1.25, 2.0, -0.75, 1.5])) for _ in cells]
    dtype = draw(st.sampled_from(FLOATS))
    tile = draw(st.none() | st.tuples(st.integers(1, n), st.integers(1, m)))
    rows = ", ".join(f"({r}, {c}, {v})" for (r, c), v in zip(cells, values))
    code = (f'db.engine.con.execute("CREATE TABLE E AS SELECT * FROM (VALUES {rows}) AS t(r, c, v)")\n'
            f'R = db.relation("E", ("r", "c"), "v", ({n}, {m}), name="R", dtype={dtype!r}, tile={tile!r}, '
            f'layout="csr")')
    if draw(st.booleans()):
        code += '\nR = R.store("RS")'
    dense = np.zeros((n, m))
    for (r, c), v in zip(cells, values):
        dense[r, c] = v

    def ref(env):
        value = torch.tensor(dense, requires_grad=True)
        env["__params__"]["R"] = value
        return value

    csr = b.add(Var("R", (n, m), dtype, "csr", stored=True), code, ref)
    f = draw(st.integers(1, 3))
    spec, others = draw(st.sampled_from([
        ("vu,uf->vf", [(m, f)]), ("vu,vf->uf", [(n, f)]), ("ui,uk,ik->ui", [(n, f), (m, f)]),
        ("vu->v", []), ("vu->u", []), ("vu->", []), ("vu->uv", [])]))
    operands = [csr, *(b.leaf(shape, draw(st.sampled_from(FLOATS))) for shape in others)]
    out = b.einsum_of(spec, operands)
    if others and draw(st.booleans()):
        loss = b.einsum_of(f"{LETTERS[:len(out.shape)]}->", [out])
        b.grads_of(loss, [v for v in b.pool if v.stored and v.layout == "dense"])
        return b.program
    return b.finish(out)


@st.composite
def einsum_programs(draw, absent: bool = True) -> Program:
    """One extended einsum over one to three stored tensors (or fills)."""
    b = Builder(draw, FLOATS + INTS, absent)
    return b.finish(b.einsum())
