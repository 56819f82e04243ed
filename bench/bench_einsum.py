"""tra_sql einsum against numpy in the same run: median time, GFLOP/s and the ratio.

    python bench/bench_einsum.py            # full: 1024, 2048, 4096 and a batched matmul
    python bench/bench_einsum.py --quick    # under a minute: the regression guard CI prints

tra_sql's time is ``Tensor.numpy()``: the SQL runs in DuckDB (join on tile keys, tile UDF,
GROUP BY when the contracted index is split) and the result tiles are assembled into an
ndarray. Each case runs with whole-operand tiles and with split tiles, since the tiling
(chosen by hand here, by the planner later) decides how many bytes DuckDB moves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median_time  # noqa: E402

import tra_sql  # noqa: E402


def cases(quick: bool):
    sizes = (1024, 2048) if quick else (1024, 2048, 4096)
    for n in sizes:
        for tile in (n, n // 2):
            yield "ij,jk->ik", [(n, n), (n, n)], [(tile, tile)] * 2, 2 * n**3
    if not quick:
        b, n = 64, 512
        for tile in ((b, n, n), (b // 4, n, n), (b, n // 2, n // 2)):
            yield "bij,bjk->bik", [(b, n, n)] * 2, [tile] * 2, 2 * b * n**3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repetitions")
    parser.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 5; 3 quick)")
    args = parser.parse_args()
    repeat = args.repeat or (3 if args.quick else 5)
    rng = np.random.default_rng(0)
    print(f"machine: {machine()}; median of {repeat}\n")
    print("| einsum | shapes | tile | numpy s | tra_sql s | numpy GFLOP/s | tra_sql GFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    with tra_sql.connect() as db:
        for spec, shapes, tiles, flops in cases(args.quick):
            arrays = [rng.random(s, dtype=np.float32) for s in shapes]
            operands = [db.from_numpy(f"t{m}", a, tile=t, replace=True) for m, (a, t) in enumerate(zip(arrays, tiles))]
            result = db.einsum(spec, *operands)
            np.testing.assert_allclose(result.numpy(), np.einsum(spec, *arrays), rtol=1e-3)
            t_np = median_time(lambda a=arrays: np.matmul(*a), repeat)
            t_tra = median_time(result.numpy, repeat)
            print(f"| `{spec}` | {'×'.join(map(str, shapes[0]))} | {'×'.join(map(str, tiles[0]))} | "
                  f"{t_np:.3f} | {t_tra:.3f} | {flops / t_np / 1e9:.0f} | {flops / t_tra / 1e9:.0f} | "
                  f"{t_tra / t_np:.2f} |", flush=True)


if __name__ == "__main__":
    main()
