"""Parameters, optimizers as SQL updates, the training loop, resuming a run, and the
workloads in examples/ (accuracy against the same models in PyTorch)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import tra_sql
from tra_sql import nn, train
from tra_sql.optim import SGD, Adam, AdamW

torch = pytest.importorskip("torch")


def _problem(db, rng, prefix=""):
    X, Y = rng.standard_normal((8, 4)), rng.standard_normal((8, 2))
    x, y = db.from_numpy(prefix + "X", X, tile=(4, 4), replace=True), db.from_numpy(prefix + "Y", Y, replace=True)
    init = {"W1": rng.standard_normal((4, 3)) * 0.5, "b1": rng.standard_normal(3) * 0.1,
            "W2": rng.standard_normal((3, 2)) * 0.5}
    params = [db.parameter(prefix + k, init=v, tile=(2, 3) if k == "W1" else None) for k, v in init.items()]
    W1, b1, W2 = params
    h = nn.linear(db, x, W1, b1, "tanh")
    loss = db.einsum("nk,nk->", db.einsum("nh,hk->nk", h, W2), y, join="(x0 - x1) * (x0 - x1) / 16")
    return loss, params, (X, Y, init)


def _torch_run(data, make_opt, steps):
    X, Y, init = data
    ps = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    opt = make_opt(list(ps.values()))
    for _ in range(steps):
        opt.zero_grad()
        h = torch.tanh(torch.tensor(X) @ ps["W1"] + ps["b1"])
        (((h @ ps["W2"] - torch.tensor(Y)) ** 2).sum() / 16).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in ps.items()}


OPTIMIZERS = {
    "sgd": (SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd-decay": (SGD(lr=0.1, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01)),
    "momentum": (SGD(lr=0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "nesterov": (SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
                 lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "adam": (Adam(lr=0.05, weight_decay=0.01), lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.01)),
    "adamw": (AdamW(lr=0.05, betas=(0.8, 0.99), weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=0.05, betas=(0.8, 0.99), weight_decay=0.1)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_torch(db, rng, name):
    ours, theirs = OPTIMIZERS[name]
    loss, params, data = _problem(db, rng)
    history = db.train(loss, params, ours, 4, run=f"r_{name.replace('-', '_')}", progress=False)
    assert history.epochs == 4 and history.steps == 4
    expected = _torch_run(data, theirs, 4)
    for p, key in zip(params, ["W1", "b1", "W2"]):
        np.testing.assert_allclose(p.numpy(), expected[key], rtol=1e-10, atol=1e-12, err_msg=f"{name} {key}")


def test_learning_rate_schedule_and_per_parameter_weight_decay(db, rng):
    loss, params, data = _problem(db, rng)
    opt = SGD(lr=lambda step: 0.1 / step, weight_decay={"W1": 0.5})
    db.train(loss, params, opt, 3, run="sched", progress=False)

    def make(p):
        o = torch.optim.SGD([{"params": p[:1], "weight_decay": 0.5}, {"params": p[1:]}], lr=0.1)
        return o

    X, Y, init = data
    ps = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    opt_t = make(list(ps.values()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt_t, lambda e: 1 / (e + 1))
    for _ in range(3):
        opt_t.zero_grad()
        h = torch.tanh(torch.tensor(X) @ ps["W1"] + ps["b1"])
        (((h @ ps["W2"] - torch.tensor(Y)) ** 2).sum() / 16).backward()
        opt_t.step()
        sched.step()
    for p, key in zip(params, ["W1", "b1", "W2"]):
        np.testing.assert_allclose(p.numpy(), ps[key].detach().numpy(), rtol=1e-10)


def test_parameters_and_initializers(db):
    W = db.parameter("W", (200, 100), init="glorot_uniform", seed=3)
    assert W.shape == (200, 100) and np.abs(W.numpy()).max() <= np.sqrt(6 / 300)
    assert db.parameter("W", (200, 100), init="zeros").numpy().any()   # exists: returned as stored
    again = tra_sql.connect()
    np.testing.assert_array_equal(again.parameter("W", (200, 100), init="glorot_uniform", seed=3).numpy(), W.numpy())
    assert db.parameter("b", (5,), init="zeros", dtype="float32").dtype == np.float32
    assert db.parameter("c", init=np.arange(3.0)).shape == (3,)
    assert db.parameter("d", (4, 4), init=lambda rng, shape: np.eye(4)).numpy()[2, 2] == 1
    assert np.abs(db.parameter("e", (1000,), init="normal", scale=0.01).numpy()).max() < 0.1
    with pytest.raises(tra_sql.SpecError, match="initializer"):
        db.parameter("f", (2,), init="nope")
    with pytest.raises(tra_sql.ShapeError):
        db.parameter("g", (2,), init=np.ones(3))


def test_training_logs_losses_and_batches(db, rng):
    X = rng.standard_normal((40, 3))
    w_true = np.array([1.0, -2.0, 0.5])
    y = X @ w_true
    xs = [db.from_numpy(f"X{b}", X[b * 20:(b + 1) * 20]) for b in range(2)]
    ys = [db.from_numpy(f"y{b}", y[b * 20:(b + 1) * 20]) for b in range(2)]
    w = db.parameter("w", (3,), init="zeros")

    def loss(batch):
        pred = db.einsum("ni,i->n", xs[batch], w)
        return db.einsum("n,n->", pred, ys[batch], join="(x0 - x1) * (x0 - x1) / 20")

    seen = []
    history = db.train(loss, [w], Adam(lr=0.1), 60, batches=2, run="lin", progress=False,
                       on_epoch=lambda epoch, value: seen.append(epoch))
    assert history.steps == 120 and seen == list(range(60))
    assert history.losses[-1] < 1e-3 < history.losses[0]
    np.testing.assert_allclose(w.numpy(), w_true, atol=0.02)
    logged = db.engine.con.execute("SELECT count(*), max(epoch) FROM tra_run_log WHERE run = 'lin'").fetchall()
    assert logged == [(60, 59)]
    assert db.engine.con.execute("SELECT step, epoch FROM tra_runs WHERE run = 'lin'").fetchall() == [(120, 60)]


def test_step_in_one_query_equals_staged_statements(db, rng, monkeypatch):
    """Under half the memory_limit a step is one query (steps as CTEs); past it, statements
    into staging tables that can spill. Both give the same run, and both are written in
    DuckDB's dialect."""
    x = db.from_numpy("X", rng.standard_normal((30, 4)), tile=(10, 4))
    y = db.from_numpy("Y", np.eye(3)[rng.integers(0, 3, 30)], tile=(10, 3))
    start = {"W": rng.standard_normal((4, 3)), "b": np.zeros(3)}
    results = {}
    for mode in ("fused", "staged"):
        if mode == "staged":
            monkeypatch.setattr(train.Trainer, "fuse_bytes", lambda self: 0)
        params = [db.parameter(f"{mode}_{k}", init=v) for k, v in start.items()]
        loss = train.cross_entropy(db, nn.mlp(db, x, [tuple(params)]), y, 30)
        history = db.train(loss, params, Adam(lr=0.1), 5, run=mode, progress=False)
        trainer = train.Trainer(db, loss, params, Adam(lr=0.1), f"{mode}_probe", 1)
        plan = trainer.plan(0)
        assert (plan.fused is None) == (mode == "staged")
        # both render through DuckDB's dialect: the weight gradient (a sum over split rows) is fused
        texts = [plan.fused] if plan.fused else [sql for _, sql in plan.statements]
        assert any("TRA_CONTRACT_AGG_FLOAT64(" in text for text in texts)
        results[mode] = (history.losses, [p.numpy() for p in params])
    np.testing.assert_allclose(results["fused"][0], results["staged"][0], rtol=1e-12)
    for fused, staged in zip(results["fused"][1], results["staged"][1]):
        np.testing.assert_allclose(fused, staged, rtol=1e-12)


def test_step_whose_one_query_runs_out_of_memory_is_staged(tmp_path, rng, monkeypatch):
    """A fused step that exceeds DuckDB's memory_limit is rerun as staged statements (which
    spill), and the run equals one without the limit."""
    X = rng.standard_normal((8192, 64)).astype("float32")
    runs = {}
    for limit in (None, "24MB"):
        db = tra_sql.connect(str(tmp_path / f"{limit}.duckdb"), **({"memory_limit": limit} if limit else {}))
        x, y = db.from_numpy("X", X, tile=(1024, 64)), db.from_numpy("y", np.tanh(X[:, 0]), tile=(1024,))
        params = [db.parameter(name, shape, dtype="float32")
                  for name, shape in (("W1", (64, 64)), ("b1", (64,)), ("W2", (64, 1)), ("b2", (1,)))]
        out = nn.mlp(db, x, [tuple(params[:2]), tuple(params[2:])])
        loss = db.einsum("no,n->", out, y, join="(x0 - x1) * (x0 - x1) / 8192")
        trainer = train.Trainer(db, loss, params, Adam(lr=0.01), "oom", 1)
        if limit:
            monkeypatch.setattr(train.Trainer, "fuse_bytes", lambda self: 1e12)  # always try one query first
            assert trainer.plan(0).fused is not None
        losses = [trainer.step(0, step) for step in (1, 2)]
        assert (trainer.plans[0].fused is None) == bool(limit)  # out of memory once: staged from then on
        runs[limit] = losses
        db.close()
    np.testing.assert_allclose(runs["24MB"], runs[None], rtol=1e-6)


@pytest.mark.parametrize("optimizer", [Adam(lr=0.1), SGD(lr=0.1, momentum=0.9)])
def test_float32_parameters_stay_float32(db, rng, optimizer):
    x = rng.standard_normal((30, 4))
    y = np.eye(3)[rng.integers(0, 3, 30)]
    w0 = rng.standard_normal((4, 3))
    losses = {}
    for dtype in ("float32", "float64"):
        X, Y = db.from_numpy(f"X_{dtype}", x.astype(dtype)), db.from_numpy(f"Y_{dtype}", y.astype(dtype))
        W = db.parameter(f"W_{dtype}", init=w0, dtype=dtype)
        loss = train.cross_entropy(db, db.einsum("ni,ic->nc", X, W), Y, 30)
        losses[dtype] = db.train(loss, [W], optimizer, 4, run=f"r_{dtype}", progress=False).losses
        assert db.tensor(f"W_{dtype}").numpy().dtype == dtype
    np.testing.assert_allclose(losses["float32"], losses["float64"], rtol=1e-5)


def test_interrupted_run_resumes_from_the_database_file(tmp_path, rng):
    def session(path):
        db = tra_sql.connect(str(path))
        loss, params, _ = _problem(db, np.random.default_rng(1))
        return db, loss, params

    reference, loss, params = session(tmp_path / "ref.duckdb")
    reference.train(loss, params, Adam(lr=0.05), 6, run="fit", progress=False)
    expected = [p.numpy() for p in params]
    reference.close()

    path = tmp_path / "run.duckdb"
    db, loss, params = session(path)

    def stop(step, batch):
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        db.train(loss, params, Adam(lr=0.05), 6, run="fit", progress=False, before_step=stop)
    db.close()                                                    # the process "dies" here
    db, loss, params = session(path)                              # parameters come back from the file
    assert db.engine.con.execute("SELECT step FROM tra_runs").fetchall() == [(4,)]
    history = db.train(loss, params, Adam(lr=0.05), 6, run="fit", progress=False)
    assert history.epochs == 6 and history.steps == 6
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.numpy(), e, rtol=1e-12)
    assert "fit__m__W1" in db.tensors() and "fit__v__b1" in db.tensors()
    with pytest.raises(tra_sql.TraError, match="another run name"):
        db.train(loss, params, SGD(lr=0.1), 7, run="fit", progress=False)
    db.close()


def test_sparse_gradient_keeps_untouched_rows(db, rng):
    db.engine.con.execute("CREATE TABLE picks AS SELECT * FROM (VALUES (0, 0), (1, 2)) t(n, row)").fetchall()
    pick = db.relation("picks", ("n", "row"), shape=(2, 5))
    E = db.parameter("E", init=rng.standard_normal((5, 2)), tile=(1, 2))
    before = E.numpy()
    loss = db.einsum("nr,rd->", pick, E, join="x0 * x1 * x1")
    db.train(loss, [E], SGD(lr=0.1), 1, run="emb", progress=False)
    after = E.numpy()
    assert db.engine.con.execute('SELECT count(*) FROM "E"').fetchall() == [(5,)]
    np.testing.assert_array_equal(after[[1, 3, 4]], before[[1, 3, 4]])
    np.testing.assert_allclose(after[[0, 2]], before[[0, 2]] * (1 - 0.2))


def test_dropout_masks_are_reproducible_and_differentiable(db, rng):
    drop = train.Dropout(db, "drop", (50, 40), p=0.5, tile=(25, 40), seed=1)
    x = db.from_numpy("x", np.ones((50, 40)))
    first = drop.apply(x).numpy()
    assert set(np.unique(first)) == {0.0, 2.0} and 0.4 < (first == 0).mean() < 0.6
    drop.resample(1)
    second = drop.apply(x).numpy()
    drop.resample(0)
    np.testing.assert_array_equal(drop.apply(x).numpy(), first)
    assert (first != second).any()
    g = db.grad(db.einsum("ij->", drop.apply(x)), x).numpy()
    np.testing.assert_array_equal(g, first)


# -- the workloads in examples/ ---------------------------------------------------------------
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model,epochs", [("logreg", 40), ("mlp", 25)])
def test_digits_accuracy_matches_torch(model, epochs):
    pytest.importorskip("sklearn")
    result = _example("digits").run(model, epochs=epochs, hidden=32, progress=False)
    assert result["test_accuracy"] > 0.9
    assert abs(result["test_accuracy"] - result["torch_test_accuracy"]) <= 0.01


def test_matrix_factorization_on_movielens_matches_torch():
    mf = _example("mf")
    try:
        mf.data_file()
    except FileNotFoundError:
        pytest.skip("MovieLens 100k: pip install --no-deps recbole==1.2.1")
    result = mf.run(epochs=6, progress=False)
    assert result["test_rmse"] < 1.2
    assert abs(result["test_rmse"] / result["torch_test_rmse"] - 1) <= 0.02


def test_distmult_on_umls_matches_torch():
    kg = _example("kg")
    try:
        kg.data_folder()
    except FileNotFoundError:
        pytest.skip("UMLS: pip install --no-deps pykeen==1.11.1")
    result = kg.run(epochs=10, k=32, progress=False)
    assert result["test_mrr"] > 0.3
    assert abs(result["test_mrr"] / result["torch_test_mrr"] - 1) <= 0.05


@pytest.mark.slow
def test_gcn_on_cora_reaches_80_percent():
    gcn = _example("gcn")
    if not (Path(gcn.DEFAULT_DATA) / "edges.csv").exists():
        pytest.skip("Cora is not in ../shared/data")
    result = gcn.run(progress=False, evaluate_every=5)
    assert result["test_accuracy"] >= 0.80


def test_resuming_a_run_with_another_optimizer_is_a_spec_error(db, rng):
    loss, params, _ = _problem(db, rng)
    db.train(loss, params, SGD(lr=0.1), 1, run="swap", progress=False)
    with pytest.raises(tra_sql.errors.SpecError, match="run 'swap' was started with"):
        db.train(loss, params, Adam(lr=0.1), 2, run="swap", progress=False)


def test_a_stored_parameter_of_another_shape_is_a_shape_error(db):
    db.parameter("P", (5, 5))
    assert db.parameter("P", (5, 5)).shape == (5, 5) and db.parameter("P").shape == (5, 5)
    with pytest.raises(tra_sql.errors.ShapeError, match="'P' is stored with shape"):
        db.parameter("P", (4, 5))
    with pytest.raises(tra_sql.errors.ShapeError, match="'P' is stored with shape"):
        db.parameter("P", init=np.zeros(3))


def test_a_stored_parameter_of_another_dtype_or_tiling_is_an_error_and_its_arguments_are_checked(db):
    w = db.parameter("P", (4, 6), dtype="float32", tile=(2, 3)).numpy()
    assert db.parameter("P").dtype == np.float32  # no dtype given: the stored one
    assert db.parameter("P", (4, 6), dtype="float32", tile=(2, 3)).tile == (2, 3)
    with pytest.raises(tra_sql.errors.DTypeError, match="'P' is stored as float32, not float64"):
        db.parameter("P", (4, 6), dtype="float64")
    with pytest.raises(tra_sql.errors.ShapeError, match=r"'P' is stored in tiles of \(2, 3\), not \(4, 6\)"):
        db.parameter("P", (4, 6), tile=(4, 6))
    with pytest.raises(tra_sql.errors.DTypeError, match="float16 is not supported"):
        db.parameter("P", (4, 6), dtype="float16")
    with pytest.raises(tra_sql.errors.SpecError, match="initializer 'glorot'"):
        db.parameter("P", (4, 6), init="glorot")
    np.testing.assert_array_equal(db.tensor("P").numpy(), w)


def test_accuracy_is_hits_over_count_as_numpy_rounds_it(db):
    """Hits are counted, then divided once: summing 1/count per row over 64-row tiles gave
    1.0000000000000004 for a perfect score."""
    n = 1000
    rng = np.random.default_rng(3)
    logits, labels = rng.standard_normal((n, 4)), rng.integers(0, 4, n)
    logits[np.arange(n), labels] += 10  # every row right: exactly 1
    targets = np.eye(4)[labels]
    tiled = {"tile": (64, 4), "replace": True}
    acc = train.accuracy(db, db.from_numpy("lg", logits, **tiled), db.from_numpy("tg", targets, **tiled), n)
    assert acc.numpy() == 1.0
    logits[:7] = -logits[:7]
    hits = (logits.argmax(1) == labels).sum()
    acc = train.accuracy(db, db.from_numpy("lg", logits, **tiled), db.from_numpy("tg", targets, **tiled), n)
    assert acc.numpy() == hits / n


def test_a_run_failing_before_its_first_commit_leaves_nothing(db, rng):
    loss, params, data = _problem(db, rng)
    tensors = set(db.tensors())
    not_scalar = db.einsum("ij,jk->ik", db.tensor("X"), params[0])
    with pytest.raises(tra_sql.errors.ShapeError, match="must be a scalar"):
        db.train(not_scalar, params, Adam(lr=0.05), 1, run="first", progress=False)
    assert set(db.tensors()) == tensors  # no Adam state tensors, no scalars
    assert db.sql("SELECT count(*) FROM tra_runs WHERE run = 'first'").fetchall() == [(0,)]
    # the name is free: the run starts over with another optimizer and gives PyTorch's weights
    db.train(loss, params, SGD(lr=0.1), 2, run="first", progress=False)
    expected = _torch_run(data, OPTIMIZERS["sgd"][1], 2)
    for p, name in zip(params, ("W1", "b1", "W2")):
        np.testing.assert_allclose(db.tensor(p.name).numpy(), expected[name], rtol=1e-6, atol=1e-8)


def test_an_interrupted_run_keeps_its_committed_steps(db, rng):
    loss, params, _ = _problem(db, rng)

    def stop(epoch, _):
        if epoch == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        db.train(loss, params, Adam(lr=0.05), 5, run="kept", progress=False, on_epoch=stop)
    assert db.sql("SELECT step FROM tra_runs WHERE run = 'kept'").fetchall() == [(2,)]
    assert {"kept__m__W1", "kept__v__W1"} <= {t for t in db.tensors()}


@pytest.mark.parametrize("make, message", [
    (lambda: SGD(lr=-0.1), "lr must be a finite number >= 0, got -0.1"),
    (lambda: Adam(lr=float("nan")), "lr must be a finite number >= 0, got nan"),
    (lambda: SGD(lr="0.1"), "lr must be"),
    (lambda: SGD(lr=0.1, momentum=-0.9), "momentum must be"),
    (lambda: SGD(lr=0.1, weight_decay={"W1": -1e-4}), "weight_decay of 'W1' must be"),
    (lambda: Adam(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\), got 1.0"),
    (lambda: Adam(betas=(0.9,)), "betas must be two numbers"),
    (lambda: AdamW(eps=-1e-8), "eps must be"),
])
def test_optimizer_hyperparameters_are_checked_as_pytorch_checks_them(make, message):
    with pytest.raises(tra_sql.SpecError, match=message):
        make()


def test_a_schedules_bad_rate_stops_the_run_before_that_step(db, rng):
    """A schedule whose rate is negative at step 3 raises ``SpecError`` naming the step; steps
    1 and 2 are committed."""
    loss, params, _ = _problem(db, rng)
    with pytest.raises(tra_sql.SpecError, match=r"lr of step 3 \(the schedule's value\) must be a finite number "
                                                r">= 0, got -0.1"):
        db.train(loss, params, SGD(lr=lambda step: 0.1 if step < 3 else -0.1), 5, run="sched", progress=False)
    assert db.sql("SELECT step FROM tra_runs WHERE run = 'sched'").fetchall() == [(2,)]


def test_schedules_and_numpy_numbers_are_hyperparameters():
    assert SGD(lr=lambda step: 0.1 / step).rate(2) == 0.05
    assert Adam(lr=np.float32(0.5), betas=(np.float64(0.8), 0.9)).rate(1) == 0.5


@pytest.mark.parametrize("options, message", [
    ({"epochs": -1}, "epochs must be a non-negative integer, got -1"),
    ({"epochs": 1.5}, "epochs must be a non-negative integer, got 1.5"),
    ({"epochs": 1, "batches": 0}, "batches must be a positive integer, got 0"),
    ({"epochs": 1, "twice": True}, "parameter 'W1' is given more than once"),
])
def test_bad_training_arguments_are_spec_errors_that_leave_nothing(db, rng, options, message):
    loss, params, _ = _problem(db, rng)
    before = sorted(db.tensors())
    options = dict(options)
    if options.pop("twice", False):
        params = params + ["w1"]  # the same tensor by name (names are case-insensitive)
    with pytest.raises(tra_sql.SpecError, match=message):
        db.train(loss, params, SGD(lr=0.1), run="bad", progress=False, **options)
    assert sorted(db.tensors()) == before


def test_training_through_a_stale_handle_is_an_error_and_changes_nothing(db):
    """A parameter replaced under its name by a tensor of another dtype with the same bytes
    per tile, after the handles and the loss were made, would be trained as if it were the old
    one (its int64 tiles read as float64): ``train`` raises ``StaleTensorError`` before any
    step, and leaves the new tensor and the runs as they were."""
    x = db.from_numpy("sX", np.ones((4, 3)))
    w = db.from_numpy("sW", np.zeros(3))
    loss = db.einsum("ni,i->", x, w, join="(x0 * x1 - 1) * (x0 * x1 - 1)")
    db.from_numpy("sW", np.arange(3), replace=True)  # int64: 8 bytes an element, as float64
    with pytest.raises(tra_sql.StaleTensorError, match="'sW' was replaced"):
        db.train(loss, [w], SGD(lr=0.1), 1, run="stale", progress=False)
    np.testing.assert_array_equal(db.tensor("sW").numpy(), np.arange(3))
    assert db.engine.con.execute("SELECT count(*) FROM tra_runs WHERE run = 'stale'").fetchall() == [(0,)]
