"""Logistic regression and a 2-layer MLP on scikit-learn's digits, trained inside DuckDB.

The data is read from the CSV file that scikit-learn bundles (no download) straight into a
DuckDB table; the split, the standardization and the one-hot labels are SQL; the features and
labels are tensor relations (views) over those tables; the model, its gradients and the Adam
updates are SQL over weight tables. The same model, initial weights and full-batch schedule run
in PyTorch for comparison when it is installed.

    python examples/digits.py --model mlp --epochs 100
"""

from __future__ import annotations

import argparse
import importlib.resources
import time

import numpy as np

import tra_sql
from tra_sql import nn
from tra_sql.optim import Adam
from tra_sql.train import accuracy, cross_entropy

CLASSES, PIXELS = 10, 64


def data_file() -> str:
    """scikit-learn's bundled ``digits.csv.gz`` (64 pixel columns, then the label)."""
    return str(importlib.resources.files("sklearn.datasets") / "data" / "digits.csv.gz")


def load(db: tra_sql.Session, path: str | None = None) -> dict[str, int]:
    """Tables ``digits`` (the file), ``digit_split`` (every 4th image is a test image),
    ``digit_x`` (split, row, pixel, standardized value) and ``digit_y`` (split, row, label)."""
    con = db.engine.con
    con.execute(f"CREATE OR REPLACE TABLE digits_file AS FROM read_csv('{path or data_file()}', header = false)"
                ).fetchall()
    con.execute("CREATE OR REPLACE TABLE digits AS SELECT rowid AS id, * FROM digits_file").fetchall()
    con.execute("""CREATE OR REPLACE TABLE digit_split AS
        SELECT id, split, row_number() OVER (PARTITION BY split ORDER BY id) - 1 AS row
        FROM (SELECT id, CASE WHEN id % 4 = 0 THEN 'test' ELSE 'train' END AS split FROM digits)""").fetchall()
    con.execute("""CREATE OR REPLACE TABLE digit_pixels AS
        SELECT id, CAST(substr(name, 7) AS INTEGER) AS pixel, CAST(value AS DOUBLE) AS value
        FROM (UNPIVOT (SELECT * EXCLUDE (column64) FROM digits) ON COLUMNS(* EXCLUDE (id))
              INTO NAME name VALUE value)""").fetchall()
    con.execute("""CREATE OR REPLACE TABLE digit_x AS
        WITH stats AS (
            SELECT pixel, avg(value) AS mu, coalesce(nullif(stddev_pop(value), 0), 1) AS sd
            FROM digit_pixels JOIN digit_split USING (id) WHERE split = 'train' GROUP BY pixel)
        SELECT split, row, pixel, (value - mu) / sd AS value
        FROM digit_pixels JOIN digit_split USING (id) JOIN stats USING (pixel)""").fetchall()
    con.execute("""CREATE OR REPLACE TABLE digit_y AS
        SELECT split, row, column64 AS label FROM digits JOIN digit_split USING (id)""").fetchall()
    counts = dict(con.execute("SELECT split, count(*) FROM digit_split GROUP BY split").fetchall())
    for split, n in counts.items():
        con.execute(f"CREATE OR REPLACE VIEW digit_x_{split} AS SELECT row, pixel, value FROM digit_x "
                    f"WHERE split = '{split}'").fetchall()
        con.execute(f"CREATE OR REPLACE VIEW digit_y_{split} AS SELECT row, label FROM digit_y "
                    f"WHERE split = '{split}'").fetchall()
        db.relation(f"digit_x_{split}", ("row", "pixel"), "value", (n, PIXELS), name=f"X_{split}",
                    tile=(n, PIXELS), replace=True)
        db.relation(f"digit_y_{split}", ("row", "label"), None, (n, CLASSES), name=f"Y_{split}",
                    tile=(n, CLASSES), replace=True)
    return counts


def initial_weights(model: str, hidden: int, seed: int) -> dict[str, np.ndarray]:
    """PyTorch's ``nn.Linear`` initialization (uniform ±1/sqrt(fan_in)), drawn with NumPy."""
    rng = np.random.default_rng(seed)
    sizes = [PIXELS, CLASSES] if model == "logreg" else [PIXELS, hidden, CLASSES]
    weights = {}
    for layer, (n_in, n_out) in enumerate(zip(sizes, sizes[1:]), start=1):
        bound = 1 / np.sqrt(n_in)
        weights[f"W{layer}"] = rng.uniform(-bound, bound, (n_in, n_out))
        weights[f"b{layer}"] = rng.uniform(-bound, bound, n_out)
    return weights


def logits(db: tra_sql.Session, x: tra_sql.Tensor, params: dict[str, tra_sql.Tensor]) -> tra_sql.Tensor:
    layers = [(params[f"W{k}"], params[f"b{k}"]) for k in range(1, len(params) // 2 + 1)]
    return nn.mlp(db, x, layers, activation="relu")


def torch_reference(X, Y, Xt, Yt, weights, epochs: int, lr: float) -> float:
    """Test accuracy of the same model trained the same way in PyTorch."""
    import torch

    ps = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    opt = torch.optim.Adam(list(ps.values()), lr=lr)
    x, y = torch.tensor(X), torch.tensor(Y.argmax(1))

    def forward(inp):
        h = inp
        for k in range(1, len(ps) // 2 + 1):
            h = h @ ps[f"W{k}"] + ps[f"b{k}"]
            if k < len(ps) // 2:
                h = torch.relu(h)
        return h

    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        opt.step()
    with torch.no_grad():
        return float((forward(torch.tensor(Xt)).argmax(1).numpy() == Yt.argmax(1)).mean())


def run(model: str = "mlp", epochs: int = 100, lr: float = 0.01, hidden: int = 64, seed: int = 0,
        database: str = ":memory:", progress: bool | None = None, compare: bool = True) -> dict:
    """Train in SQL; returns test accuracies (ours and, if ``compare``, PyTorch's) and timings."""
    db = tra_sql.connect(database)
    counts = load(db)
    weights = initial_weights(model, hidden, seed)
    params = {k: db.parameter(f"{model}_{k}", init=v) for k, v in weights.items()}
    X, Y, Xt, Yt = (db.tensor(n) for n in ("X_train", "Y_train", "X_test", "Y_test"))
    loss = cross_entropy(db, logits(db, X, params), Y, counts["train"])
    start = time.perf_counter()
    history = db.train(loss, list(params.values()), Adam(lr=lr), epochs, run=model, progress=progress)
    seconds = time.perf_counter() - start
    result = {"model": model, "epochs": history.epochs, "final_loss": history.losses[-1],
              "train_accuracy": float(accuracy(db, logits(db, X, params), Y, counts["train"]).numpy()),
              "test_accuracy": float(accuracy(db, logits(db, Xt, params), Yt, counts["test"]).numpy()),
              "seconds": seconds}
    if compare:
        result["torch_test_accuracy"] = torch_reference(X.numpy(), Y.numpy(), Xt.numpy(), Yt.numpy(), weights,
                                                        epochs, lr)
    db.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["logreg", "mlp"], default="mlp")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database", default=":memory:", help="a DuckDB file makes the run resumable")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    args = parser.parse_args()
    result = run(args.model, args.epochs, args.lr, args.hidden, args.seed, args.database, compare=not args.no_torch)
    for key, value in result.items():
        print(f"{key:>20}: {value:.4f}" if isinstance(value, float) else f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
