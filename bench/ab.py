"""Same-run A/B of a benchmark between an earlier commit and the working tree.

    python bench/ab.py --before d017d53 --rounds 3 bench_einsum.py --quick

checks out ``--before`` into a temporary git worktree, then runs the benchmark script (a file
in ``bench/``, with its arguments) alternately from that tree and from this one, ``--rounds``
times each, every run a fresh process with its own tree first on ``PYTHONPATH``. The script
prints a Markdown table; for every row and every column whose header names tra_sql's seconds,
the medians over rounds of both trees are printed with their ratio (after / before: below 1
is faster). The machine's load is printed first: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(rev: str, where: Path) -> Path:
    """A worktree of ``rev`` at ``where``, importable as a package (``tra_sql.udfs`` and
    ``tra_sql.sql`` are folders beside ``tra_sql`` that the install maps; linked here)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), rev], check=True)
    for name in ("udfs", "sql"):
        (where / "tra_sql" / name).symlink_to(where / name)
    return where


def run(tree: Path, script: str, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, str(tree / "bench" / script), *args], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout


def table(text: str) -> dict[tuple[str, str], float]:
    """``(row key, column) -> seconds`` of the tra_sql columns of a Markdown table."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0]]
    columns = [i for i, name in enumerate(header) if "tra_sql" in name and name.endswith(" s")]
    first_time = next(i for i, name in enumerate(header) if name.endswith(" s"))  # the cells before name the row
    values = {}
    for cells in rows[2:]:
        cells = [cell.strip() for cell in cells]
        key = " ".join(cells[:first_time])
        for i in columns:
            values[(key, header[i])] = float(cells[i])
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("script", help="a benchmark in bench/, e.g. bench_einsum.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    options = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        before = checkout(options.before, Path(tmp) / "before")
        try:
            results: dict[str, list[dict]] = {"before": [], "after": []}
            for _ in range(options.rounds):
                for label, tree in (("before", before), ("after", ROOT)):
                    results[label].append(table(run(tree, options.script, options.args)))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)
    print(f"load average after: {os.getloadavg()}")
    print(f"\n{options.script} {' '.join(options.args)}: median of {options.rounds} runs each, "
          f"before = {options.before}, after = working tree\n")
    print("| case | column | before s | after s | after / before |")
    print("|---|---|---|---|---|")
    for key in results["after"][0]:
        if not all(key in run_ for run_ in results["before"]):
            continue
        a = statistics.median(run_[key] for run_ in results["before"])
        b = statistics.median(run_[key] for run_ in results["after"])
        print(f"| {key[0]} | {key[1]} | {a:.3f} | {b:.3f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
