"""A 2-layer graph convolutional network (Kipf & Welling) on Cora, trained inside DuckDB.

The edge list, node table and sparse features are read from files into DuckDB tables; the
self loops, the symmetric normalization ``D^-1/2 (A + I) D^-1/2`` and the row-normalized
features are SQL; adjacency and features are sparse tensor relations (views over those tables
kept as CSR tiles, so products with them run over the nonzeros), the labels dense blocks; the
model, its gradients and Adam are SQL over weight tables.

Setup as in the paper: hidden 16, dropout 0.5 (masks drawn in SQL, reproducible from the
step), Adam lr 0.01, weight decay 5e-4 on the first layer, 200 epochs, Glorot initialization;
the reported test accuracy is that of the epoch with the best validation accuracy.

    python examples/gcn.py --data ../shared/data/cora
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import tra_sql
from tra_sql.optim import Adam
from tra_sql.train import Dropout, accuracy, cross_entropy

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cora"


def load(db: tra_sql.Session, data: str | Path) -> dict[str, int]:
    """Tables ``cora_nodes``, ``cora_edges``, ``cora_features`` from the files; ``cora_adj``
    (normalized, with self loops) and ``cora_x`` (row-normalized) computed in SQL; relations
    ``A``, ``X`` and one-hot ``Y_<split>``. Returns the sizes and split counts."""
    data = Path(data)
    con = db.engine.con
    con.execute(f"CREATE OR REPLACE TABLE cora_nodes AS FROM read_csv('{data / 'nodes.csv'}')").fetchall()
    con.execute(f"CREATE OR REPLACE TABLE cora_edges AS FROM read_csv('{data / 'edges.csv'}')").fetchall()
    csr = np.load(data / "features.npz")
    rows = np.repeat(np.arange(len(csr["indptr"]) - 1), np.diff(csr["indptr"]))
    features = pa.table({"node": rows, "feature": csr["indices"].astype(np.int64), "value": csr["data"]})
    con.register("_features", features)
    con.execute("CREATE OR REPLACE TABLE cora_features AS FROM _features").fetchall()
    con.unregister("_features")
    con.execute("""CREATE OR REPLACE TABLE cora_adj AS
        WITH links AS (SELECT src, dst FROM cora_edges UNION SELECT node, node FROM cora_nodes),
             degree AS (SELECT dst AS node, count(*) AS d FROM links GROUP BY dst)
        SELECT l.dst, l.src, 1 / sqrt(a.d * b.d) AS w
        FROM links l JOIN degree a ON a.node = l.dst JOIN degree b ON b.node = l.src""").fetchall()
    con.execute("""CREATE OR REPLACE TABLE cora_x AS
        SELECT node, feature, value / sum(value) OVER (PARTITION BY node) AS value FROM cora_features""").fetchall()
    n = con.execute("SELECT count(*) FROM cora_nodes").fetchall()[0][0]
    f = int(csr["shape"][1])
    c = con.execute("SELECT max(label) + 1 FROM cora_nodes").fetchall()[0][0]
    db.relation("cora_adj", ("dst", "src"), "w", (n, n), name="A", replace=True, layout="csr")
    db.relation("cora_x", ("node", "feature"), "value", (n, f), name="X", replace=True, layout="csr")
    sizes = {"nodes": n, "features": f, "classes": c}
    for split in ("train", "val", "test"):
        con.execute(f"CREATE OR REPLACE VIEW cora_y_{split} AS SELECT node, label FROM cora_nodes "
                    f"WHERE split = '{split}'").fetchall()
        db.relation(f"cora_y_{split}", ("node", "label"), None, (n, c), name=f"Y_{split}", tile=(n, c), replace=True)
        sizes[split] = con.execute(f"SELECT count(*) FROM cora_y_{split}").fetchall()[0][0]
    return sizes


def gcn(db: tra_sql.Session, params: dict, drops: tuple[Dropout, Dropout] | None = None) -> tra_sql.Tensor:
    """Logits ``A relu(A drop(X) W1 + b1) W2 + b2`` (dropout on the input and hidden layer)."""
    A, X = db.tensor("A"), db.tensor("X")
    x = drops[0].apply(X) if drops else X
    h = db.einsum("mn,nh->mh", A, db.einsum("nf,fh->nh", x, params["W1"]))
    h = db.einsum("mh,h->mh", h, params["b1"], join="greatest(x0 + x1, 0)")
    h = drops[1].apply(h) if drops else h
    z = db.einsum("mn,nc->mc", A, db.einsum("nh,hc->nc", h, params["W2"]))
    return db.einsum("mc,c->mc", z, params["b2"], join="x0 + x1")


def run(data: str | Path = DEFAULT_DATA, epochs: int = 200, hidden: int = 16, lr: float = 0.01,
        weight_decay: float = 5e-4, dropout: float = 0.5, seed: int = 0, database: str = ":memory:",
        progress: bool | None = None, evaluate_every: int = 1) -> dict:
    """Train on the standard split; returns the test accuracy of the model with the best
    validation accuracy (checked every ``evaluate_every`` epochs, as PyG's GCN example selects
    its model), the accuracies after the last epoch, and timings."""
    db = tra_sql.connect(database)
    sizes = load(db, data)
    n, f, c = sizes["nodes"], sizes["features"], sizes["classes"]
    params = {
        "W1": db.parameter("gcn_W1", (f, hidden), "glorot_uniform", seed=seed),
        "b1": db.parameter("gcn_b1", (hidden,), "zeros"),
        "W2": db.parameter("gcn_W2", (hidden, c), "glorot_uniform", seed=seed),
        "b2": db.parameter("gcn_b2", (c,), "zeros"),
    }
    drops = (Dropout(db, "gcn_drop_x", p=dropout, like=db.tensor("X"), seed=seed),
             Dropout(db, "gcn_drop_h", (n, hidden), dropout, seed=seed + 1))
    loss = cross_entropy(db, gcn(db, params, drops), db.tensor("Y_train"), sizes["train"])

    def resample(step: int, batch: int) -> None:
        for d in drops:
            d.resample(step)

    optimizer = Adam(lr=lr, weight_decay={"gcn_W1": weight_decay, "gcn_b1": weight_decay})
    logits = gcn(db, params)
    targets = {split: db.tensor(f"Y_{split}") for split in ("train", "val", "test")}
    best = {"val_accuracy": -1.0}

    def evaluate(epoch: int, value: float) -> None:
        """Accuracies of the model as it is now (no dropout), kept if validation improved."""
        if epoch % evaluate_every and epoch != epochs - 1:
            return
        stored = logits.store("gcn_logits", replace=True)
        scores = {f"{split}_accuracy": float(accuracy(db, stored, y, sizes[split]).numpy())
                  for split, y in targets.items()}
        if scores["val_accuracy"] > best["val_accuracy"]:
            best.update(scores, epoch=epoch)

    start = time.perf_counter()
    history = db.train(loss, list(params.values()), optimizer, epochs, run="gcn", before_step=resample,
                       on_epoch=evaluate, progress=progress)
    seconds = time.perf_counter() - start
    result = {"epochs": history.epochs, "final_loss": history.losses[-1], "seconds": seconds,
              "seconds_per_epoch": seconds / max(1, epochs)}
    stored = logits.store("gcn_logits", replace=True)
    for split, y in targets.items():
        result[f"final_{split}_accuracy"] = float(accuracy(db, stored, y, sizes[split]).numpy())
    result.update({"best_epoch": best.get("epoch", epochs - 1), "val_accuracy": best["val_accuracy"],
                   "test_accuracy": best["test_accuracy"]})
    db.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="folder with nodes.csv, edges.csv, features.npz")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database", default=":memory:", help="a DuckDB file makes the run resumable")
    args = parser.parse_args()
    for key, value in run(args.data, args.epochs, seed=args.seed, database=args.database).items():
        print(f"{key:>18}: {value:.4f}" if isinstance(value, float) else f"{key:>18}: {value}")


if __name__ == "__main__":
    main()
