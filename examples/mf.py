"""Matrix factorization with biases on MovieLens 100k, trained inside DuckDB.

``pred(u, i) = <P_u, Q_i> + b_u + b_i + mean``, squared error over the observed ratings,
full-batch Adam with L2 weight decay on the factors. The ratings file shipped with RecBole
(``pip install --no-deps recbole==1.2.1``; located without importing it) is read into a DuckDB
table; ids are mapped to indices and the 80/20 split is drawn in SQL; the ratings are a sparse
tensor relation (a view over the table, kept as CSR tiles), so the prediction is an einsum
over the ratings' entries that reads each rating's user and item factor rows. The same model
runs in PyTorch.

    python examples/mf.py --epochs 100
"""

from __future__ import annotations

import argparse
import time
from importlib.metadata import PackageNotFoundError, distribution

import numpy as np

import tra_sql
from tra_sql.optim import Adam


def data_file() -> str:
    """RecBole's ``ml-100k.inter`` (TSV: user_id, item_id, rating, timestamp)."""
    try:
        path = distribution("recbole").locate_file("recbole/dataset_example/ml-100k/ml-100k.inter")
    except PackageNotFoundError:
        raise FileNotFoundError("install the data: pip install --no-deps recbole==1.2.1") from None
    return str(path)


def load(db: tra_sql.Session, path: str | None = None, ratings_table: str | None = None,
         dtype: str = "float64") -> dict:
    """Table ``ratings(u, i, r, split)`` (from the file, or from ``ratings_table`` with columns
    user, item, rating) and relations ``R_<split>`` (rating values) and ``M_<split>`` (1 per
    rating) of ``dtype``."""
    con = db.engine.con
    if ratings_table is None:
        con.execute(f"""CREATE OR REPLACE TABLE ml_file AS SELECT "user_id:token" AS user, "item_id:token" AS item,
            "rating:float" AS rating FROM read_csv('{path or data_file()}', delim = '\\t', header = true)""").fetchall()
        ratings_table = "ml_file"
    con.execute(f"""CREATE OR REPLACE TABLE ratings AS
        SELECT dense_rank() OVER (ORDER BY user) - 1 AS u, dense_rank() OVER (ORDER BY item) - 1 AS i,
               CAST(rating AS DOUBLE) AS r,
               CASE WHEN hash(user, item, 'split') % 5 = 0 THEN 'test' ELSE 'train' END AS split
        FROM {ratings_table}""").fetchall()
    users, items, mean = con.execute(
        "SELECT max(u) + 1, max(i) + 1, avg(r) FILTER (WHERE split = 'train') FROM ratings").fetchall()[0]
    sizes = {"users": users, "items": items, "mean": mean}
    for split in ("train", "test"):
        con.execute(f"CREATE OR REPLACE VIEW ratings_{split} AS SELECT u, i, r FROM ratings "
                    f"WHERE split = '{split}'").fetchall()
        db.relation(f"ratings_{split}", ("u", "i"), "r", (users, items), name=f"R_{split}", replace=True,
                    layout="csr", dtype=dtype)
        db.relation(f"ratings_{split}", ("u", "i"), None, (users, items), name=f"M_{split}", replace=True,
                    layout="csr", dtype=dtype)
        sizes[split] = con.execute(f"SELECT count(*) FROM ratings_{split}").fetchall()[0][0]
    return sizes


def initial_weights(users: int, items: int, k: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"P": rng.normal(0, 0.1, (users, k)), "Q": rng.normal(0, 0.1, (items, k)),
            "bu": np.zeros(users), "bi": np.zeros(items)}


def squared_error(db: tra_sql.Session, params: dict, mean: tra_sql.Tensor, split: str, scale: float) -> tra_sql.Tensor:
    """``scale · Σ (pred - r)^2`` over the ratings of ``split``: a dot product per rating (the
    mask relation joins each rating with its user's and item's factor rows), the residual with
    the biases in one join, then its sum of squares."""
    dot = db.einsum("ui,uk,ik->ui", db.tensor(f"M_{split}"), params["P"], params["Q"], join="x1 * x2")
    residual = db.einsum("ui,ui,u,i,->ui", dot, db.tensor(f"R_{split}"), params["bu"], params["bi"], mean,
                         join="x0 + x2 + x3 + x4 - x1")
    return db.einsum("ui->", residual, join=f"x0 * x0 * {scale!r}")


def torch_reference(db: tra_sql.Session, weights: dict, sizes: dict, epochs: int, lr: float, wd: float) -> float:
    """Test RMSE of the same model trained the same way in PyTorch."""
    import torch

    def split(name):
        u, i, r = np.array(db.engine.con.execute(f"SELECT u, i, r FROM ratings_{name}").fetchall()).T
        return torch.tensor(u.astype(np.int64)), torch.tensor(i.astype(np.int64)), torch.tensor(r)

    ps = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    opt = torch.optim.Adam([{"params": [ps["P"], ps["Q"]], "weight_decay": wd},
                            {"params": [ps["bu"], ps["bi"]]}], lr=lr)

    def predict(u, i):
        return (ps["P"][u] * ps["Q"][i]).sum(1) + ps["bu"][u] + ps["bi"][i] + sizes["mean"]

    u, i, r = split("train")
    for _ in range(epochs):
        opt.zero_grad()
        ((predict(u, i) - r) ** 2).mean().backward()
        opt.step()
    u, i, r = split("test")
    with torch.no_grad():
        return float(((predict(u, i) - r) ** 2).mean().sqrt())


def run(epochs: int = 100, k: int = 32, lr: float = 0.02, weight_decay: float = 0.01, seed: int = 0,
        database: str = ":memory:", progress: bool | None = None, compare: bool = True,
        ratings_table: str | None = None, setup=None) -> dict:
    """Train; returns train/test RMSE (and PyTorch's test RMSE if ``compare``) and timings.
    ``setup(db)`` may create ``ratings_table`` first (e.g. synthetic ratings)."""
    db = tra_sql.connect(database)
    if setup is not None:
        setup(db)
    sizes = load(db, ratings_table=ratings_table)
    weights = initial_weights(sizes["users"], sizes["items"], k, seed)
    params = {name: db.parameter(f"mf_{name}", init=value) for name, value in weights.items()}
    mean = db.from_numpy("mf_mean", np.array(sizes["mean"]), replace=True)
    loss = squared_error(db, params, mean, "train", 1 / sizes["train"])
    optimizer = Adam(lr=lr, weight_decay={"mf_P": weight_decay, "mf_Q": weight_decay})
    start = time.perf_counter()
    history = db.train(loss, list(params.values()), optimizer, epochs, run="mf", progress=progress)
    seconds = time.perf_counter() - start
    result = {"epochs": history.epochs, "train_rmse": float(np.sqrt(history.losses[-1])),
              "test_rmse": float(np.sqrt(squared_error(db, params, mean, "test", 1 / sizes["test"]).numpy())),
              "seconds": seconds, "seconds_per_epoch": seconds / max(1, epochs)}
    if compare:
        result["torch_test_rmse"] = torch_reference(db, weights, sizes, epochs, lr, weight_decay)
    db.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--database", default=":memory:", help="a DuckDB file makes the run resumable")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    result = run(args.epochs, args.k, args.lr, database=args.database, compare=not args.no_torch)
    for key, value in result.items():
        print(f"{key:>18}: {value:.4f}" if isinstance(value, float) else f"{key:>18}: {value}")


if __name__ == "__main__":
    main()
