"""Training epochs in tra_sql against the same models in PyTorch CPU, in the same run.

    python bench/bench_training.py               # MLP, GCN (100k nodes, 1M edges, 128 features),
                                                 # MF (1M ratings), and an out-of-core MLP run
    python bench/bench_training.py --quick       # 10x smaller, for a fast look
    python bench/bench_training.py --write       # also replace the "## Training" section of RESULTS.md

Every (workload, framework) pair runs in a subprocess of its own, so each reports its own peak
resident memory (DuckDB and the tile kernels live in the process). An epoch is one full-batch
step (forward, backward, Adam) unless said otherwise, timed to the end of its commit (the new
weights written, as PyTorch's ``opt.step()`` writes them); the first epoch (kernel
compilation, plan building) is not timed. The out-of-core run trains an MLP in minibatches on data four
times DuckDB's ``memory_limit``, in a database file.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).parent))

SIZES = {
    "full": {"mlp": (65536, 128, 256, 10), "gcn": (100_000, 1_000_000, 128, 16, 8), "mf": (6040, 3706, 1_000_000, 32),
             "ooc": (819_200, 128, 64, 32)},
    "quick": {"mlp": (8192, 64, 128, 10), "gcn": (10_000, 100_000, 128, 16, 8), "mf": (943, 1682, 100_000, 32),
              "ooc": (409_600, 128, 64, 32)},
}


# seconds per epoch (the median); bench/ab.py reads the columns named "tra_sql ... s"
TABLE_HEAD = ("| workload | dtype | tra_sql s | PyTorch s | ratio | tra_sql peak MB | PyTorch peak MB |",
              "|---|---|---|---|---|---|---|")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_training(db, loss, params, epochs: int, **options):
    """``db.train`` with Adam for one warm-up epoch (compilation) and ``epochs`` more:
    (history, median seconds of the timed epochs, seconds of the first). An epoch is timed
    from the end of the previous one to the end of its last commit (``History.seconds`` stops
    before that commit, which writes the new weights)."""
    from tra_sql.optim import Adam

    ends = [time.perf_counter()]
    history = db.train(loss, list(params), Adam(lr=0.01), epochs + 1, progress=False,
                       on_epoch=lambda *_: ends.append(time.perf_counter()), **options)
    spans = np.diff(ends)
    return history, float(np.median(spans[1:])), float(spans[0])


def timed_epochs(step, epochs: int) -> float:
    """Median time of ``epochs`` calls of ``step`` after a warm-up call."""
    step()  # warm-up: compilation, plans
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# -- data -------------------------------------------------------------------------------------
def mlp_data(n, f, c, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, f))
    labels = (X[:, :c] + 0.5 * rng.standard_normal((n, c))).argmax(1)
    return X, np.eye(c)[labels]


def mlp_weights(f, h, c, seed=0):
    rng = np.random.default_rng(seed + 1)
    return {"W1": rng.uniform(-1, 1, (f, h)) / np.sqrt(f), "b1": np.zeros(h),
            "W2": rng.uniform(-1, 1, (h, c)) / np.sqrt(h), "b2": np.zeros(c)}


def graph_data(n, e, f, c, seed=0):
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    return src, dst, rng.standard_normal((n, f)), rng.integers(0, c, n)


def ratings_data(users, items, count, k, seed=0):
    rng = np.random.default_rng(seed)
    pairs = np.unique(rng.integers(0, users, count * 11 // 10).astype(np.int64) * items
                      + rng.integers(0, items, count * 11 // 10), return_index=False)[:count]
    u, i = pairs // items, pairs % items
    P, Q = rng.normal(0, 0.5, (users, 4)), rng.normal(0, 0.5, (items, 4))
    r = np.clip(np.round(3.5 + (P[u] * Q[i]).sum(1) + 0.5 * rng.standard_normal(len(u))), 1, 5)
    return u, i, r


# -- tra_sql workers ---------------------------------------------------------------------------
def tra_mlp(n, f, h, c, epochs, dtype):
    import tra_sql
    from tra_sql import nn
    from tra_sql.train import cross_entropy

    X, Y = mlp_data(n, f, c)
    db = tra_sql.connect()
    rows = min(n, 8192)
    x, y = db.from_numpy("X", X.astype(dtype), tile=(rows, f)), db.from_numpy("Y", Y.astype(dtype), tile=(rows, c))
    p = {k: db.parameter(k, init=v, dtype=dtype) for k, v in mlp_weights(f, h, c).items()}
    loss = cross_entropy(db, nn.mlp(db, x, [(p["W1"], p["b1"]), (p["W2"], p["b2"])]), y, n)
    return timed_training(db, loss, p.values(), epochs, run="bench")[1]


def tra_gcn(n, e, f, h, c, epochs, dtype):
    import pyarrow as pa

    import tra_sql
    from tra_sql.train import cross_entropy

    src, dst, X, labels = graph_data(n, e, f, c)
    db = tra_sql.connect()
    db.engine.con.register("_edges", pa.table({"src": src, "dst": dst}))
    db.engine.con.execute("""CREATE TABLE adj AS
        WITH links AS (SELECT src, dst FROM _edges UNION SELECT range, range FROM range(?)),
             degree AS (SELECT dst AS node, count(*) AS d FROM links GROUP BY dst)
        SELECT l.dst, l.src, 1 / sqrt(a.d * b.d) AS w
        FROM links l JOIN degree a ON a.node = l.dst JOIN degree b ON b.node = l.src""", [n]).fetchall()
    db.engine.con.register("_labels", pa.table({"node": np.arange(n), "label": labels}))
    db.engine.con.execute("CREATE TABLE labels AS SELECT * FROM _labels WHERE node % 10 = 0").fetchall()
    A = db.relation("adj", ("dst", "src"), "w", (n, n), name="A_view", layout="csr", dtype=dtype).store("A")
    Y = db.relation("labels", ("node", "label"), None, (n, c), name="Y_view", tile=(n, c), dtype=dtype).store("Y")
    x = db.from_numpy("X", X.astype(dtype), tile=(n, f))
    rng = np.random.default_rng(1)
    p = {"W1": db.parameter("W1", init=rng.uniform(-1, 1, (f, h)) * np.sqrt(6 / (f + h)), dtype=dtype),
         "b1": db.parameter("b1", (h,), "zeros", dtype=dtype),
         "W2": db.parameter("W2", init=rng.uniform(-1, 1, (h, c)) * np.sqrt(6 / (h + c)), dtype=dtype),
         "b2": db.parameter("b2", (c,), "zeros", dtype=dtype)}
    hid = db.einsum("mh,h->mh", db.einsum("mn,nh->mh", A, db.einsum("nf,fh->nh", x, p["W1"])), p["b1"],
                    join="greatest(x0 + x1, 0)")
    z = db.einsum("mc,c->mc", db.einsum("mn,nc->mc", A, db.einsum("nh,hc->nc", hid, p["W2"])), p["b2"],
                  join="x0 + x1")
    loss = cross_entropy(db, z, Y, int((np.arange(n) % 10 == 0).sum()))
    return timed_training(db, loss, p.values(), epochs, run="bench")[1]


def tra_mf(users, items, count, k, epochs, dtype):
    import mf
    import pyarrow as pa

    import tra_sql

    u, i, r = ratings_data(users, items, count, k)
    db = tra_sql.connect()
    db.engine.con.register("_ratings", pa.table({"user": u, "item": i, "rating": r}))
    db.engine.con.execute("CREATE TABLE synthetic AS FROM _ratings").fetchall()
    sizes = mf.load(db, ratings_table="synthetic", dtype=dtype)
    weights = mf.initial_weights(sizes["users"], sizes["items"], k, 0)
    params = {name: db.parameter(f"mf_{name}", init=v, dtype=dtype) for name, v in weights.items()}
    mean = db.from_numpy("mf_mean", np.array(sizes["mean"], dtype))
    loss = mf.squared_error(db, params, mean, "train", 1 / sizes["train"])
    return timed_training(db, loss, params.values(), epochs, run="bench")[1]


def tra_ooc(n, f, h, batches, epochs, dtype):
    """An MLP regression in ``batches`` minibatches, in a file whose ``memory_limit`` is a
    quarter of the data."""
    import tra_sql
    from tra_sql import nn

    with tempfile.TemporaryDirectory() as tmp:
        data_mb = n * f * np.dtype(dtype).itemsize / 2**20
        limit = f"{data_mb / 4:.0f}MB"
        db = tra_sql.connect(str(Path(tmp) / "ooc.duckdb"), memory_limit=limit)
        db.engine.con.execute(f"SET temp_directory = '{tmp}/spill'").fetchall()
        rng = np.random.default_rng(0)
        w_true = rng.standard_normal(f)
        per = n // batches
        for b in range(batches):
            X = rng.standard_normal((per, f))
            db.from_numpy(f"X{b}", X.astype(dtype), tile=(1024, f))
            db.from_numpy(f"y{b}", np.tanh(X @ w_true / np.sqrt(f)).astype(dtype), tile=(1024,))
        p = {k: db.parameter(k, init=v, dtype=dtype) for k, v in mlp_weights(f, h, 1).items()}

        def loss(b):
            out = nn.mlp(db, db.tensor(f"X{b}"), [(p["W1"], p["b1"]), (p["W2"], p["b2"])])
            return db.einsum("no,n->", out, db.tensor(f"y{b}"), join=f"(x0 - x1) * (x0 - x1) / {per}")

        history, epoch_s, first_s = timed_training(db, loss, p.values(), epochs, batches=batches, run="ooc")
        return {"epoch_s": epoch_s, "first_epoch_s": first_s, "data_mb": data_mb,
                "memory_limit": limit, "loss": history.losses}


# -- PyTorch workers ---------------------------------------------------------------------------
def torch_mlp(n, f, h, c, epochs, dtype):
    import torch

    X, Y = mlp_data(n, f, c)
    x, y = torch.tensor(X.astype(dtype)), torch.tensor(Y.argmax(1))
    p = {k: torch.tensor(v.astype(dtype), requires_grad=True) for k, v in mlp_weights(f, h, c).items()}
    opt = torch.optim.Adam(list(p.values()), lr=0.01)

    def step():
        opt.zero_grad()
        out = torch.relu(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()

    return timed_epochs(step, epochs)


def torch_gcn(n, e, f, h, c, epochs, dtype):
    import torch

    src, dst, X, labels = graph_data(n, e, f, c)
    pairs = np.unique(np.concatenate([np.stack([dst, src], 1), np.stack([np.arange(n)] * 2, 1)]), axis=0)
    deg = np.bincount(pairs[:, 0], minlength=n)
    w = 1 / np.sqrt(deg[pairs[:, 0]] * deg[pairs[:, 1]])
    A = torch.sparse_coo_tensor(torch.tensor(pairs.T), torch.tensor(w.astype(dtype)), (n, n)).coalesce()
    x = torch.tensor(X.astype(dtype))
    train = torch.tensor(np.arange(n) % 10 == 0)
    y = torch.tensor(labels)
    rng = np.random.default_rng(1)
    p = {"W1": torch.tensor((rng.uniform(-1, 1, (f, h)) * np.sqrt(6 / (f + h))).astype(dtype), requires_grad=True),
         "b1": torch.zeros(h, dtype=getattr(torch, dtype), requires_grad=True),
         "W2": torch.tensor((rng.uniform(-1, 1, (h, c)) * np.sqrt(6 / (h + c))).astype(dtype), requires_grad=True),
         "b2": torch.zeros(c, dtype=getattr(torch, dtype), requires_grad=True)}
    opt = torch.optim.Adam(list(p.values()), lr=0.01)

    def step():
        opt.zero_grad()
        hid = torch.relu(torch.sparse.mm(A, x @ p["W1"]) + p["b1"])
        out = torch.sparse.mm(A, hid @ p["W2"]) + p["b2"]
        torch.nn.functional.cross_entropy(out[train], y[train]).backward()
        opt.step()

    return timed_epochs(step, epochs)


def torch_mf(users, items, count, k, epochs, dtype):
    import torch

    u, i, r = ratings_data(users, items, count, k)
    # the same 80/20 split and index mapping as tra_sql's (ids are already dense here)
    import duckdb
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT * FROM (SELECT unnest(?) AS user, unnest(?) AS item)",
                [u.tolist(), i.tolist()]).fetchall()
    train = np.array(con.execute("SELECT hash(user, item, 'split') % 5 <> 0 FROM t").fetchall())[:, 0]
    rng = np.random.default_rng(0)
    P, Q = rng.normal(0, 0.1, (users, k)), rng.normal(0, 0.1, (items, k))
    p = {"P": torch.tensor(P.astype(dtype), requires_grad=True), "Q": torch.tensor(Q.astype(dtype), requires_grad=True),
         "bu": torch.zeros(users, dtype=getattr(torch, dtype), requires_grad=True),
         "bi": torch.zeros(items, dtype=getattr(torch, dtype), requires_grad=True)}
    ut, it, rt = torch.tensor(u[train]), torch.tensor(i[train]), torch.tensor(r[train].astype(dtype))
    mean = float(r[train].mean())
    opt = torch.optim.Adam(list(p.values()), lr=0.01)

    def step():
        opt.zero_grad()
        pred = (p["P"][ut] * p["Q"][it]).sum(1) + p["bu"][ut] + p["bi"][it] + mean
        ((pred - rt) ** 2).mean().backward()
        opt.step()

    return timed_epochs(step, epochs)


WORKERS = {("tra", "mlp"): tra_mlp, ("tra", "gcn"): tra_gcn, ("tra", "mf"): tra_mf, ("tra", "ooc"): tra_ooc,
           ("torch", "mlp"): torch_mlp, ("torch", "gcn"): torch_gcn, ("torch", "mf"): torch_mf}


def worker(framework: str, workload: str, size: str, epochs: int, dtype: str) -> None:
    if framework == "torch":
        import torch
        torch.set_num_threads(2)
    out = WORKERS[(framework, workload)](*SIZES[size][workload], epochs, dtype)
    result = out if isinstance(out, dict) else {"epoch_s": out}
    result["peak_mb"] = peak_mb()
    print("RESULT " + json.dumps(result))


def spawn(framework: str, workload: str, size: str, epochs: int, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", framework, workload, "--size", size, "--epochs", str(epochs),
           "--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(lines[-1][len("RESULT "):])


def describe(size: str) -> dict[str, str]:
    s = SIZES[size]
    n, f, h, c = s["mlp"]
    gn, ge, gf, gh, gc = s["gcn"]
    users, items, count, k = s["mf"]
    return {"mlp": f"MLP {n}x{f} -> {h} -> {c}, full batch",
            "gcn": f"GCN {gn:,} nodes, {ge:,} edges (CSR adjacency), {gf} features, hidden {gh}",
            "mf": f"MF {count:,} ratings (CSR), {users}x{items}, k={k}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs (the median is reported)")
    parser.add_argument("--only", nargs="*", default=["mlp", "gcn", "mf", "ooc"])
    parser.add_argument("--dtype", nargs="*", default=["float32", "float64"],
                        help="run every workload in each (both frameworks alike; the out-of-core run in the first)")
    parser.add_argument("--write", action="store_true", help="replace the Training section of bench/RESULTS.md")
    parser.add_argument("--note", default="", help="a remark for RESULTS.md (e.g. the machine's load)")
    parser.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "WORKLOAD"))
    parser.add_argument("--size", default="full")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.size, args.epochs, args.dtype[0])
        return
    from common import machine

    size = "quick" if args.quick else "full"
    rows = []
    print(machine())
    print("\n".join(TABLE_HEAD))
    for workload, label in describe(size).items():
        if workload not in args.only:
            continue
        for dtype in args.dtype:
            ours = spawn("tra", workload, size, args.epochs, dtype)
            theirs = spawn("torch", workload, size, args.epochs, dtype)
            if "error" in ours or "error" in theirs:
                print(f"{label}, {dtype}: failed: {ours.get('error') or theirs.get('error')}")
                continue
            ratio = ours["epoch_s"] / theirs["epoch_s"]
            rows.append(f"| {label} | {dtype} | {ours['epoch_s']:.3f} | {theirs['epoch_s']:.3f} | {ratio:.2f} | "
                        f"{ours['peak_mb']:.0f} | {theirs['peak_mb']:.0f} |")
            print(rows[-1])
    ooc = None
    if "ooc" in args.only:
        ooc = spawn("tra", "ooc", size, 1, args.dtype[0])  # a second epoch, timed after the first (which compiles)
        ooc["dtype"] = args.dtype[0]
        print("out-of-core:", ooc)
    if args.write:
        write_results(rows, ooc, size, args.epochs, args.note)


def write_results(rows: list[str], ooc: dict | None, size: str, epochs: int, note: str = "") -> None:
    import textwrap

    from common import machine

    n, f, h, batches = SIZES[size]["ooc"]
    wrap = lambda text: textwrap.fill(text, 95)  # noqa: E731
    lines = ["## Training", "",
             wrap(f"`python bench/bench_training.py{' --quick' if size == 'quick' else ''}` "
                  f"({time.strftime('%Y-%m-%d')}, {machine()}). Median seconds per epoch of {epochs} (full-batch "
                  "forward, backward and Adam step; the first epoch, which compiles, is not timed) and peak resident "
                  "memory of the "
                  f"process, each framework in a subprocess of its own; ratio = tra_sql / PyTorch CPU. {note}"),
             "", *TABLE_HEAD, *rows, ""]
    if ooc and "error" not in ooc:
        limit = ooc["memory_limit"]
        lines += [wrap(f"Out of core: an MLP ({f} -> {h} -> 1, {ooc['dtype']}) trained in {batches} minibatches on "
                       f"{ooc['data_mb']:.0f} MB of data in a database file with DuckDB `memory_limit` = {limit} "
                       f"(data {ooc['data_mb'] / _mb(limit):.1f}x the limit): {ooc['epoch_s']:.1f} s per epoch "
                       f"({ooc['first_epoch_s']:.1f} s for the first, which compiles every batch's program), "
                       f"peak resident memory {ooc['peak_mb']:.0f} MB (the limit does not cover memory used "
                       f"inside tile UDFs)."), ""]
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find("## Training")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + "\n".join(lines) + ("\n" + text[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    path.write_text(text)


def _mb(limit: str) -> float:
    value, unit = float(limit[:-2]), limit[-2:].upper()
    return value * {"KB": 1 / 1024, "MB": 1, "GB": 1024}[unit]


if __name__ == "__main__":
    main()
