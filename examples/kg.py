"""Knowledge-graph embedding (DistMult) on UMLS, trained inside DuckDB.

``score(h, r, t) = Σ_k E[h,k] R[r,k] E[t,k]``, trained with the 1-vs-all cross-entropy in both
directions (each training triple's tail against every entity, and its head likewise) with
full-batch Adam. The triples shipped with PyKEEN (``pip install --no-deps pykeen==1.11.1``;
located without importing it) are read into DuckDB tables, entity and relation names are
mapped to indices in SQL, and the training triples are a tensor relation (a view over the
table). Evaluation: filtered MRR and Hits@10 on the test triples, for both directions. The
same model runs in PyTorch.

    python examples/kg.py --epochs 100
"""

from __future__ import annotations

import argparse
import time
from importlib.metadata import PackageNotFoundError, distribution

import numpy as np

import tra_sql
from tra_sql.optim import Adam


def data_folder(dataset: str = "umls") -> str:
    try:
        return str(distribution("pykeen").locate_file(f"pykeen/datasets/{dataset}"))
    except PackageNotFoundError:
        raise FileNotFoundError("install the data: pip install --no-deps pykeen==1.11.1") from None


def load(db: tra_sql.Session, folder: str | None = None) -> dict:
    """Tables ``kg_triples(h, r, t, split)`` with integer ids (``kg_entities``, ``kg_relations``
    map the names) and the relation ``Y_train`` (1 at every training triple)."""
    folder = folder or data_folder()
    con = db.engine.con
    con.execute(f"""CREATE OR REPLACE TABLE kg_raw AS
        SELECT *, 'train' AS split FROM read_csv('{folder}/train.txt', delim = '\\t', header = false,
                                                  columns = {{'head': 'VARCHAR', 'rel': 'VARCHAR', 'tail': 'VARCHAR'}})
        UNION ALL SELECT *, 'valid' FROM read_csv('{folder}/valid.txt', delim = '\\t', header = false,
                                                  columns = {{'head': 'VARCHAR', 'rel': 'VARCHAR', 'tail': 'VARCHAR'}})
        UNION ALL SELECT *, 'test' FROM read_csv('{folder}/test.txt', delim = '\\t', header = false,
                                                 columns = {{'head': 'VARCHAR', 'rel': 'VARCHAR', 'tail': 'VARCHAR'}})
        """).fetchall()
    con.execute("""CREATE OR REPLACE TABLE kg_entities AS
        SELECT name, row_number() OVER (ORDER BY name) - 1 AS id
        FROM (SELECT head AS name FROM kg_raw UNION SELECT tail FROM kg_raw)""").fetchall()
    con.execute("""CREATE OR REPLACE TABLE kg_relations AS
        SELECT rel AS name, row_number() OVER (ORDER BY rel) - 1 AS id
        FROM (SELECT DISTINCT rel FROM kg_raw)""").fetchall()
    con.execute("""CREATE OR REPLACE TABLE kg_triples AS
        SELECT h.id AS h, r.id AS r, t.id AS t, split FROM kg_raw
        JOIN kg_entities h ON h.name = head JOIN kg_relations r ON r.name = rel JOIN kg_entities t ON t.name = tail
        """).fetchall()
    n_e = con.execute("SELECT count(*) FROM kg_entities").fetchall()[0][0]
    n_r = con.execute("SELECT count(*) FROM kg_relations").fetchall()[0][0]
    con.execute("CREATE OR REPLACE VIEW kg_train AS SELECT DISTINCT h, r, t FROM kg_triples WHERE split = 'train'"
                ).fetchall()
    shape = (n_e, n_r, n_e)
    db.relation("kg_train", ("h", "r", "t"), None, shape, name="Y_train", tile=shape, replace=True)
    counts = dict(con.execute("SELECT split, count(*) FROM kg_triples GROUP BY split").fetchall())
    return {"entities": n_e, "relations": n_r, **counts}


def initial_weights(n_e: int, n_r: int, k: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"E": rng.normal(0, 0.1, (n_e, k)), "R": rng.normal(0, 0.1, (n_r, k))}


def scores(db: tra_sql.Session, E: tra_sql.Tensor, R: tra_sql.Tensor) -> tra_sql.Tensor:
    """Every triple's score, ``(entities, relations, entities)``."""
    return db.einsum("hk,rk,tk->hrt", E, R, E)


def loss(db: tra_sql.Session, E: tra_sql.Tensor, R: tra_sql.Tensor, n_train: int) -> tra_sql.Tensor:
    """Mean over the training triples of the tail and head 1-vs-all cross-entropies:
    row maxima (constants), sums of ``exp(score - max)`` over tails and over heads, then one join."""
    S, Y = scores(db, E, R), db.tensor("Y_train")
    top_t = db.detach(db.einsum("hrt->hr", S, agg="max"))
    top_h = db.detach(db.einsum("hrt->rt", S, agg="max"))
    sum_t = db.einsum("hrt,hr->hr", S, top_t, join="exp(x0 - x1)")
    sum_h = db.einsum("hrt,rt->rt", S, top_h, join="exp(x0 - x1)")
    return db.einsum("hrt,hrt,hr,hr,rt,rt->", Y, S, top_t, sum_t, top_h, sum_h,
                     join=f"x0 * (x2 + ln(x3) + x4 + ln(x5) - 2 * x1) * {0.5 / n_train!r}")


def filtered_ranks(S: np.ndarray, triples: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Realistic ranks (ties count half) of each triple's tail among (h, r, ·) and of its head
    among (·, r, t), other known true triples filtered out."""
    true = np.zeros(S.shape, dtype=bool)
    true[known[:, 0], known[:, 1], known[:, 2]] = True
    ranks = []
    for h, r, t in triples:
        for row, target, mask in ((S[h, r, :], t, true[h, r, :]), (S[:, r, t], h, true[:, r, t])):
            mask = mask.copy()
            mask[target] = False
            other = row[~mask]
            ranks.append(1 + (other > row[target]).sum() + 0.5 * ((other == row[target]).sum() - 1))
    return np.array(ranks)


def evaluate(S: np.ndarray, db: tra_sql.Session) -> dict:
    triples = np.array(db.engine.con.execute("SELECT h, r, t FROM kg_triples WHERE split = 'test'").fetchall())
    known = np.array(db.engine.con.execute("SELECT h, r, t FROM kg_triples").fetchall())
    ranks = filtered_ranks(S, triples, known)
    return {"mrr": float((1 / ranks).mean()), "hits@10": float((ranks <= 10).mean())}


def torch_reference(db: tra_sql.Session, weights: dict, n_train: int, epochs: int, lr: float) -> dict:
    """Filtered MRR of the same model trained the same way in PyTorch."""
    import torch

    Y = torch.tensor(db.tensor("Y_train").numpy())
    E, R = (torch.tensor(weights[k], requires_grad=True) for k in ("E", "R"))
    opt = torch.optim.Adam([E, R], lr=lr)
    for _ in range(epochs):
        opt.zero_grad()
        S = torch.einsum("hk,rk,tk->hrt", E, R, E)
        tails = torch.logsumexp(S, dim=2, keepdim=True)
        heads = torch.logsumexp(S, dim=0, keepdim=True)
        ((Y * (tails + heads - 2 * S)).sum() * (0.5 / n_train)).backward()
        opt.step()
    with torch.no_grad():
        return evaluate(torch.einsum("hk,rk,tk->hrt", E, R, E).numpy(), db)


def run(epochs: int = 100, k: int = 64, lr: float = 0.05, seed: int = 0, database: str = ":memory:",
        progress: bool | None = None, compare: bool = True, folder: str | None = None) -> dict:
    """Train; returns test filtered MRR and Hits@10 (and PyTorch's, if ``compare``) and timings."""
    db = tra_sql.connect(database)
    sizes = load(db, folder)
    weights = initial_weights(sizes["entities"], sizes["relations"], k, seed)
    E, R = (db.parameter(f"kg_{name}", init=value) for name, value in weights.items())
    start = time.perf_counter()
    history = db.train(loss(db, E, R, sizes["train"]), [E, R], Adam(lr=lr), epochs, run="kg", progress=progress)
    seconds = time.perf_counter() - start
    result = {"epochs": history.epochs, "final_loss": history.losses[-1], "seconds": seconds,
              "seconds_per_epoch": seconds / max(1, epochs)}
    result.update({f"test_{key}": value for key, value in evaluate(scores(db, E, R).numpy(), db).items()})
    if compare:
        result.update({f"torch_test_{key}": value
                       for key, value in torch_reference(db, weights, sizes["train"], epochs, lr).items()})
    db.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--database", default=":memory:", help="a DuckDB file makes the run resumable")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    result = run(args.epochs, args.k, args.lr, database=args.database, compare=not args.no_torch)
    for key, value in result.items():
        print(f"{key:>20}: {value:.4f}" if isinstance(value, float) else f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
