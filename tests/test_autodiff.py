"""Gradients: the symbolic derivative rules, every op kind against PyTorch autograd and
finite differences, and random extended einsums (hypothesis)."""

import math
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql import derivative, expressions, graph
from tra_sql.autodiff import Context, gradients
from tra_sql.udfs.codegen import namespace
from tra_sql.udfs.expr import join_code

torch = pytest.importorskip("torch")

# (join expression, the same in torch) over x0, x1
RULES = [
    ("x0 * x1", lambda a, b: a * b),
    ("x0 + 2 * x1 - 3", lambda a, b: a + 2 * b - 3),
    ("x0 / (1 + x1 * x1)", lambda a, b: a / (1 + b * b)),
    ("-x0 * x1", lambda a, b: -a * b),
    ("pow(x0, 3) - pow(x1, 2)", lambda a, b: a ** 3 - b ** 2),
    ("pow(abs(x0) + 1, x1)", lambda a, b: (a.abs() + 1) ** b),
    ("exp(x0 - x1)", lambda a, b: torch.exp(a - b)),
    ("ln(1 + x0 * x0) * x1", lambda a, b: torch.log(1 + a * a) * b),
    ("log(2 + x0 * x0)", lambda a, b: torch.log10(2 + a * a) + 0 * b),
    ("log(3, 2 + x1 * x1)", lambda a, b: torch.log(2 + b * b) / math.log(3) + 0 * a),
    ("sqrt(1 + x0 * x0) * x1", lambda a, b: torch.sqrt(1 + a * a) * b),
    ("abs(x0 - x1)", lambda a, b: (a - b).abs()),
    ("tanh(x0 * x1)", lambda a, b: torch.tanh(a * b)),
    ("sin(x0) * cos(x1)", lambda a, b: torch.sin(a) * torch.cos(b)),
    ("sigmoid(x0 + x1)", lambda a, b: torch.sigmoid(a + b)),
    ("relu(x0) * x1", lambda a, b: torch.relu(a) * b),
    ("erf(x0) + x1", lambda a, b: torch.erf(a) + b),
    ("greatest(x0, x1, 0.1)", lambda a, b: torch.maximum(torch.maximum(a, b), torch.tensor(0.1, dtype=a.dtype))),
    ("least(x0 * 2, x1)", lambda a, b: torch.minimum(2 * a, b)),
    ("CASE WHEN x0 > x1 THEN x0 * x1 WHEN x0 < -1 THEN 2 * x0 ELSE x1 - x0 END",
     lambda a, b: torch.where(a > b, a * b, torch.where(a < -1, 2 * a, b - a))),
    ("IF(x0 > 0, x0, x1 * x1)", lambda a, b: torch.where(a > 0, a, b * b)),
    ("x0 % (abs(x1) + 0.5)", lambda a, b: torch.fmod(a, b.abs() + 0.5)),
    ("floor(x0) * x1 + sign(x1) + round(x0) + ceil(x1)",
     lambda a, b: torch.floor(a) * b + torch.sign(b) + torch.round(a) + torch.ceil(b)),
    ("CAST(x0 AS DOUBLE) * pi()", lambda a, b: a * math.pi + 0 * b),
    ("x0 // 1 + x1", lambda a, b: torch.floor(a).detach() + b),
]


def _evaluate(sql: str, values) -> float:
    code = join_code(sql, 2)
    return float(eval(code, namespace(), {"x0": values[0], "x1": values[1]}))


def _symbolic(sql: str, values) -> list[float]:
    expr = expressions.parse_join(sql)
    return [_evaluate(expressions.to_sql(derivative.diff(expr, f"x{k}")), values) for k in range(2)]


@pytest.mark.parametrize("sql,fn", RULES, ids=[r[0] for r in RULES])
def test_derivative_rule_matches_torch_and_finite_differences(sql, fn):
    rng = np.random.default_rng(zlib.crc32(sql.encode()))
    for _ in range(6):
        point = rng.uniform(-2, 2, 2)
        ours = _symbolic(sql, point)
        t = torch.tensor(point, requires_grad=True)
        fn(t[0], t[1]).backward()
        np.testing.assert_allclose(ours, t.grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=sql)
        h = 1e-6
        for k in range(2):
            up, down = point.copy(), point.copy()
            up[k] += h
            down[k] -= h
            fd = (_evaluate(sql, up) - _evaluate(sql, down)) / (2 * h)
            if abs(fd - ours[k]) > 1e-4 * (1 + abs(fd)):  # only a kink within h may differ
                assert any(abs(_evaluate(sql, p) - _evaluate(sql, point)) > 1e-3 for p in (up, down)), sql


@pytest.mark.parametrize("sql,point,expected", [
    ("greatest(x0, 0)", (0.0, 0.0), [0.0, 0.0]),      # ReLU at 0 gives 0
    ("relu(x0)", (0.0, 0.0), [0.0, 0.0]),
    ("abs(x0)", (0.0, 1.0), [0.0, 0.0]),
    ("greatest(x0, x1)", (1.0, 1.0), [0.0, 1.0]),     # ties go to the later argument
    ("CASE WHEN x0 * x1 > 0 THEN x0 ELSE 3 * x1 END", (1.0, 2.0), [1.0, 0.0]),  # no gradient via the condition
    ("sign(x0) + floor(x1) + round(x0 * x1)", (0.3, 0.7), [0.0, 0.0]),
])
def test_pytorch_conventions_at_special_points(sql, point, expected):
    assert _symbolic(sql, point) == expected


def test_unknown_function_raises_not_a_silent_zero():
    with pytest.raises(tra_sql.TraError, match="no derivative rule"):
        derivative.diff(expressions.parse_join("atan(x0) * x1"), "x0")
    # a node built around the Python API's validation still fails clearly when differentiated
    node = graph.Source((3,), np.dtype("float64"), (3,), "t")
    bad = graph.einsum("i->", [node], ["t"], join="cot(x0)")
    with pytest.raises(tra_sql.TraError, match="cot"):
        gradients(bad, [node], Context(lambda n: True, None))
    # but a constant subexpression needs no rule
    assert expressions.to_sql(derivative.diff(expressions.parse_join("x0 * cot(2)"), "x0")) == "COT(2)"


def test_derivative_simplifies():
    d = derivative.diff(expressions.parse_join("x0 * x1 + 0 * x0"), "x0")
    assert expressions.to_sql(d) == "x1"
    assert expressions.to_sql(derivative.diff(expressions.parse_join("exp(x1)"), "x0")) == "0"


@pytest.mark.parametrize("join, var, over_y", [
    ("greatest(x0 + x1, 0.0)", "x0", "CASE WHEN _y > 0.0 THEN 1 ELSE 0 END"),
    ("relu(x0 - x1)", "x1", "CASE WHEN _y > 0 THEN -1 ELSE 0 END"),
    ("least(x0, 6)", "x0", "CASE WHEN 6 > _y THEN 1 ELSE 0 END"),
    ("tanh(x0 + x1)", "x1", "1 - (_y * _y)"),
    ("sigmoid(x0)", "x0", "_y * (1 - _y)"),
    ("exp(x0 - x1)", "x1", "-_y"),
    ("relu(x0 * x1)", "x0", None),  # the derivative needs x1 itself
    ("greatest(x0, x1)", "x0", None),  # no constant to compare the output with
])
def test_derivative_over_the_output(join, var, over_y):
    J = expressions.parse_join(join)
    got = derivative.through_output(J, derivative.diff(J, var), "_y")
    assert (got if got is None else expressions.to_sql(got)) == over_y


def test_relu_backward_reads_its_output_not_its_input(db, rng):
    """As PyTorch's ReLU saves its output: the pre-activation is read only by the ReLU, so the
    step computing it can carry the ReLU as its epilogue."""
    X, W, b = rng.standard_normal((6, 4)), rng.standard_normal((4, 3)), rng.standard_normal(3)
    w, bias = db.from_numpy("w", W), db.from_numpy("b", b)
    pre = db.einsum("ni,io->no", db.from_numpy("x", X), w)
    y = db.einsum("no,o->no", pre, bias, join="greatest(x0 + x1, 0)")
    gw, gb = db.grad(db.einsum("no->", y, join="x0 * x0"), [w, bias])
    readers = {id(n) for g in (gw, gb) for n in graph.topological(g.node)
               if isinstance(n, graph.Einsum) and any(op is pre.node for op in n.operands)}
    assert readers == {id(y.node)}
    dpre = 2 * np.maximum(X @ W + b, 0) * (X @ W + b > 0)
    np.testing.assert_allclose(gw.numpy(), X.T @ dpre, rtol=1e-12)
    np.testing.assert_allclose(gb.numpy(), dpre.sum(0), rtol=1e-12)


# -- whole programs against torch -------------------------------------------------------------
def _torch_einsum(inputs, output, tensors, fn, agg):
    """Extended einsum in torch: join elementwise over the full index space, then reduce."""
    letters = list(dict.fromkeys("".join(inputs)))
    sizes = {c: t.shape[sub.index(c)] for sub, t in zip(inputs, tensors) for c in sub}
    full = [sizes[c] for c in letters]
    spread = []
    for sub, t in zip(inputs, tensors):
        unique = "".join(dict.fromkeys(sub))
        if unique != sub:
            t = torch.einsum(f"{sub}->{unique}", t)
        t = t.permute(sorted(range(len(unique)), key=lambda d: letters.index(unique[d])))
        shape = [sizes[c] if c in unique else 1 for c in letters]
        spread.append(t.reshape(shape).expand(full))
    v = fn(*spread)
    axes = [d for d, c in enumerate(letters) if c not in output]
    if axes:
        if agg == "sum":
            v = v.sum(dim=axes)
        elif agg == "max":
            v = v.amax(dim=axes)
        elif agg == "min":
            v = v.amin(dim=axes)
        else:
            for d in sorted(axes, reverse=True):
                v = v.prod(dim=d)
    kept = [c for c in letters if c in output]
    return v.permute([kept.index(c) for c in output]) if output else v


def _check(db, spec, arrays, tiles, join=None, fn=None, agg="sum", dtype=np.float64, rtol=1e-9):
    """Our gradients of ``sum(einsum(...) * C)`` against torch's."""
    lhs, out = spec.split("->")
    inputs = lhs.split(",")
    tensors = [db.from_numpy(f"op{m}", a.astype(dtype), tile=t, replace=True) for m, (a, t) in
               enumerate(zip(arrays, tiles))]
    y = db.einsum(spec, *tensors, join=join, agg=agg)
    weights = np.random.default_rng(7).uniform(0.5, 1.5, y.shape)
    c = db.from_numpy("weights", weights.astype(dtype), replace=True)
    loss = db.einsum(f"{out},{out}->", y, c)
    ours = db.grad(loss, tensors)
    ts = [torch.tensor(a.astype(dtype), requires_grad=True) for a in arrays]
    fn = fn or (lambda *xs: math.prod(xs))
    ty = _torch_einsum(inputs, out, ts, fn, agg)
    (ty * torch.tensor(weights.astype(dtype))).sum().backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=rtol, atol=rtol)
    for g, t in zip(ours, ts):
        np.testing.assert_allclose(g.numpy(), t.grad.numpy(), rtol=rtol, atol=rtol * 10, err_msg=spec)
    return ours


@pytest.mark.parametrize("agg", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("join", [None, "tanh(x0 * x1)", "greatest(x0 - x1, 0) + 0.5 * x1"])
def test_einsum_aggregations(db, rng, agg, join):
    fns = {None: None, "tanh(x0 * x1)": lambda a, b: torch.tanh(a * b),
           "greatest(x0 - x1, 0) + 0.5 * x1": lambda a, b: torch.relu(a - b) + 0.5 * b}
    arrays = [rng.uniform(-1.5, 1.5, (5, 4)), rng.uniform(-1.5, 1.5, (4, 3))]
    _check(db, "ij,jk->ik", arrays, [(2, 3), (3, 2)], join, fns[join], agg)


def test_contraction_gradient_stays_a_blas_contraction(db, rng):
    a = db.from_numpy("a", rng.standard_normal((6, 5)), tile=(3, 5))
    b = db.from_numpy("b", rng.standard_normal((5, 4)))
    loss = db.einsum("ik->", db.einsum("ij,jk->ik", a, b), join="x0 * x0")
    ga = db.grad(loss, a)
    assert ga.node.join is None and ga.node.spec.inputs[1] == "jk"  # dA = dC B^T, the default product
    sql = ga.sql()
    assert "TRA_LOOP_" in sql  # dA's product may be chained after dC's step


@pytest.mark.parametrize("agg", ["max", "min"])
def test_float32_max_min_with_a_computed_join(db, rng, agg):
    arrays = [rng.uniform(-1, 1, (4, 6)), rng.uniform(-1, 1, (6,))]
    _check(db, "ij,j->i", arrays, [(3, 4), (4,)], "x0 * 1.5 + x1 * 0.3", lambda a, b: a * 1.5 + b * 0.3, agg,
           dtype=np.float32, rtol=1e-5)


@pytest.mark.parametrize("agg", ["max", "min"])
def test_float32_max_min_of_three_factors(db, rng, agg):
    """The float32 route materializes the join as one step: a pairwise chain hid the operands
    from the gradient (zeros where torch gives -4.27, found by the differential harness)."""
    arrays = [rng.uniform(-2, 2, (4, 3)), rng.uniform(-2, 2, (3, 5)), rng.uniform(-2, 2, (5,))]
    _check(db, "ij,jk,k->i", arrays, [(2, 3), (3, 2), (5,)], agg=agg, dtype=np.float32, rtol=1e-5)


def test_max_ties_split_evenly_like_amax(db):
    t = db.from_numpy("t", np.array([[1.0, 1.0, 0.0], [2.0, 0.0, 2.0]]), tile=(1, 2))
    loss = db.einsum("i->", db.einsum("ij->i", t, agg="max"))
    np.testing.assert_array_equal(db.grad(loss, t).numpy(), [[0.5, 0.5, 0], [0.5, 0, 0.5]])


def test_prod_with_zero_factors(db):
    p = np.array([[1.0, 0.0, 3.0], [2.0, 4.0, 0.5], [0.0, 0.0, 1.0]])
    _check(db, "ij->i", [p], [(2, 2)], agg="prod")


def test_repeated_index_broadcast_and_scalars(db, rng):
    _check(db, "ii,i->i", [rng.standard_normal((4, 4)), rng.standard_normal(4)], [(3, 2), (2,)],
           "x0 * exp(x1)", lambda a, b: a * torch.exp(b))
    _check(db, "ij,kj->ik", [rng.standard_normal((3, 4)), rng.standard_normal((1, 4))], [(2, 2), (1, 3)],
           "x0 - x1", lambda a, b: a - b)
    _check(db, ",i->i", [np.array(1.7), rng.standard_normal(5)], [(), (2,)], "sin(x0 * x1)",
           lambda a, b: torch.sin(a * b))


def test_three_operands_and_an_unused_dense_operand(db, rng):
    arrays = [rng.standard_normal((3, 4)), rng.standard_normal((4, 2)), rng.standard_normal((2, 5))]
    _check(db, "ij,jk,kl->il", arrays, [(2, 2), (4, 1), (1, 5)])
    # x1 does not appear in d/dx0: dropped, and its index k scales by its size
    _check(db, "ij,k->i", arrays[:1] + [rng.standard_normal(6)], [(2, 4), (4,)], "x0 * x0 + x1",
           lambda a, b: a * a + b)


def test_structural_ops(db, rng):
    A, B = rng.standard_normal((4, 5)), rng.standard_normal((3, 5))
    a = db.from_numpy("A", A, tile=(3, 2))
    b = db.from_numpy("B", B, tile=(2, 4))
    c = db.concat([a[1:3, :], b], axis=0).retile((2, 3))         # slice, concat, retile
    r = c.reshape(5, 5).T                                         # reshape, transpose
    s = db.add(r, db.einsum("ij->ij", r, join="x0 * x0"))         # keyed sum
    loss = db.einsum("ij->", s, join="sin(x0)")
    ga, gb = db.grad(loss, [a, b])
    ta, tb = (torch.tensor(x, requires_grad=True) for x in (A, B))
    tr = torch.cat([ta[1:3, :], tb], 0).reshape(5, 5).T
    torch.sin(tr + tr * tr).sum().backward()
    np.testing.assert_allclose(ga.numpy(), ta.grad.numpy(), atol=1e-12)
    np.testing.assert_allclose(gb.numpy(), tb.grad.numpy(), atol=1e-12)
    assert ga.tile == (3, 2) and gb.tile == (2, 4)


def test_fan_out_and_intermediate_targets(db, rng):
    X = rng.standard_normal((4, 3))
    x = db.from_numpy("x", X, tile=(2, 2))
    h = db.einsum("ij->ij", x, join="tanh(x0)")
    loss = db.einsum("ij,ij,ij->", h, x, h)                      # x used directly and through h twice
    gx, gh = db.grad(loss, [x, h])
    tx = torch.tensor(X, requires_grad=True)
    th = torch.tanh(tx)
    th.retain_grad()
    (th * tx * th).sum().backward()
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), atol=1e-12)
    np.testing.assert_allclose(gh.numpy(), th.grad.numpy(), atol=1e-12)


def test_fan_out_of_gradients_missing_tiles_is_a_keyed_sum(db):
    """Where the contributions may lack tiles (a relation with empty blocks), they add as a keyed
    sum, absent tiles counting as zeros; complete ones add in a join (test_sparse)."""
    db.engine.con.execute("CREATE TABLE pts AS SELECT * FROM (VALUES (0, 1, 1.5), (3, 2, -2.0)) t(i, j, v)").fetchall()
    E = db.relation("pts", keys=("i", "j"), value="v", shape=(4, 4), tile=(2, 2))  # tiles (0, 0), (1, 1)
    X = np.arange(16.0).reshape(4, 4) / 10
    x = db.from_numpy("x", X, tile=(2, 2))
    y = db.einsum("ij,ij->ij", E, x)
    loss = db.einsum("ij,ij->", y, db.einsum("ij->ij", y, join="tanh(x0)"))  # y read twice
    (gx,) = db.grad(loss, [x])
    assert "TRA_PLACE" in gx.sql()
    tx = torch.tensor(X, requires_grad=True)
    ty = torch.tensor(E.numpy()) * tx
    (ty * torch.tanh(ty)).sum().backward()
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), atol=1e-12)


def test_unreached_parameter_gets_zeros_and_bad_calls_raise(db, rng):
    x = db.from_numpy("x", rng.standard_normal(3))
    w = db.from_numpy("w", rng.standard_normal(3))
    loss = db.einsum("i->", x)
    assert np.all(db.grad(loss, w).numpy() == 0)
    with pytest.raises(tra_sql.ShapeError, match="scalar"):
        db.grad(db.einsum("i->i", x), [x])
    with pytest.raises(tra_sql.DTypeError):
        db.grad(db.einsum("i->", db.from_numpy("n", np.arange(3))), "n")
    seed = db.from_numpy("seed", np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(db.grad(db.einsum("i->i", x, join="x0 * 2"), x, seed=seed).numpy(), [2, 4, 6])


def _directional(db, build, arrays, tiles, h=1e-5):
    """(finite-difference directional derivative, <grad, v>) of ``build(tensors)``."""
    rng = np.random.default_rng(3)
    names = [f"fd{m}" for m in range(len(arrays))]
    tensors = [db.from_numpy(n, a, tile=t, replace=True) for n, a, t in zip(names, arrays, tiles)]
    loss = build(tensors)
    grads = [g.numpy() for g in db.grad(loss, tensors)]
    vs = [rng.standard_normal(a.shape) for a in arrays]

    def at(sign):
        for n, a, t, v in zip(names, arrays, tiles, vs):
            db.from_numpy(n, a + sign * h * v, tile=t, replace=True)
        return float(loss.numpy())

    fd = (at(1) - at(-1)) / (2 * h)
    return fd, sum(float((g * v).sum()) for g, v in zip(grads, vs))


@pytest.mark.parametrize("case", ["sum", "max", "min", "prod", "structural", "softmax"])
def test_finite_differences(db, rng, case):
    A, B = rng.uniform(0.5, 1.5, (4, 3)), rng.uniform(-1, 1, (3, 5))

    def build(ts):
        a, b = ts
        if case == "structural":
            y = db.concat([a.T, b], axis=1)[:, 1:7].reshape(2, 9)
            return db.einsum("ij->", y, join="exp(x0) * x0")
        if case == "softmax":
            from tra_sql import nn
            p = nn.log_softmax(db, db.einsum("ij,jk->ik", a, b))
            return db.einsum("ik->", p, join="x0 * x0")
        y = db.einsum("ij,jk->ik", a, b, join="x0 * sin(x1) + x1", agg=case)
        return db.einsum("ik->", y, join="x0 * x0")

    fd, analytic = _directional(db, build, [A, B], [(2, 2), (3, 2)])
    assert fd == pytest.approx(analytic, rel=1e-6, abs=1e-8)


def test_sparse_relation_gradient_exists_at_its_keys_only(db):
    db.engine.con.execute("CREATE TABLE edges AS SELECT * FROM (VALUES (0, 1, 0.5), (1, 2, 2.0), (3, 0, -1.0)) "
                   "t(dst, src, w)").fetchall()
    E = db.relation("edges", keys=("dst", "src"), value="w", shape=(4, 4))
    x = db.from_numpy("x", np.arange(4.0) + 1)
    loss = db.einsum("i->", db.einsum("ij,j->i", E, x), join="x0 * x0")
    gE, gx = db.grad(loss, [E, x])
    dense = E.numpy()
    tE, tx = torch.tensor(dense, requires_grad=True), torch.tensor(np.arange(4.0) + 1, requires_grad=True)
    ((tE @ tx) ** 2).sum().backward()
    assert gE.arrow().num_rows == 3
    np.testing.assert_allclose(gE.numpy(), tE.grad.numpy() * (dense != 0))
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy())


# -- random extended einsums ----------------------------------------------------------------
JOINS2 = [
    (None, lambda a, b: a * b),
    ("x0 + x1", lambda a, b: a + b),
    ("exp(x0 - x1)", lambda a, b: torch.exp(a - b)),
    ("greatest(x0 * x1, 0.2)", lambda a, b: torch.clamp(a * b, min=0.2)),
    ("CASE WHEN x0 > x1 THEN x0 * x0 ELSE tanh(x1) END", lambda a, b: torch.where(a > b, a * a, torch.tanh(b))),
    ("sigmoid(x0) * x1 - x0 / (2 + x1)", lambda a, b: torch.sigmoid(a) * b - a / (2 + b)),
]


@st.composite
def extended_einsums(draw):
    pool = "ijkl"
    sizes = {c: draw(st.integers(1, 4)) for c in pool}
    n = draw(st.integers(1, 2))
    inputs = []
    for _ in range(n):
        rank = draw(st.integers(0, 3))
        inputs.append("".join(draw(st.sampled_from(pool)) for _ in range(rank)))
    used = list(dict.fromkeys("".join(inputs)))
    output = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
    tiles = [tuple(draw(st.integers(1, sizes[c])) for c in sub) for sub in inputs]
    join = draw(st.sampled_from(JOINS2 if n == 2 else [(None, lambda a: a), ("tanh(x0) * 2", None)]))
    agg = draw(st.sampled_from(["sum", "max", "min", "prod"]))
    seed = draw(st.integers(0, 2**16))
    return sizes, inputs, output, tiles, join, agg, seed


@settings(max_examples=16, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=extended_einsums())
def test_random_extended_einsums_against_torch(db, case):
    sizes, inputs, output, tiles, (join, fn), agg, seed = case
    if join == "tanh(x0) * 2":
        fn = lambda a: torch.tanh(a) * 2  # noqa: E731
    rng = np.random.default_rng(seed)
    arrays = [rng.uniform(0.3, 1.2, tuple(sizes[c] for c in sub)) * rng.choice([-1, 1], tuple(sizes[c] for c in sub))
              for sub in inputs]
    _check(db, ",".join(inputs) + "->" + output, arrays, tiles, join, fn, agg, rtol=1e-8)


def test_gradient_sql_is_inspectable(db, rng):
    w = db.from_numpy("W", rng.standard_normal((3, 2)))
    x = db.from_numpy("X", rng.standard_normal((4, 3)))
    loss = db.einsum("nk->", db.einsum("ni,ik->nk", x, w), join="greatest(x0, 0)")
    sql = db.grad(loss, w).sql()
    assert "x0 * CASE WHEN x1 > 0 THEN 1 ELSE 0 END" in sql and sql.startswith("WITH")
