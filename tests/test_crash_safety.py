"""Crash safety: a worker process that stores tensors (from_numpy, store of an einsum, CREATE
TENSOR, DROP), and commits training steps into a database file is SIGKILLed at random moments,
many times. After each kill the file reopens with every tensor whole or absent (``db.check()``
finds nothing, known contents are exact, the weights and optimizer state are those of the
committed step), and the run, resumed, ends with the weights of an uninterrupted run.

Workers are forked from a zygote process that has imported tra_sql and warmed its kernels, so
a kill cycle costs the work and not the interpreter's start. ``python tests/test_crash_safety.py
zygote`` is that process: for each ``fork <path>`` line on stdin it forks a worker on ``path``;
every process reports on stdout (``forked <pid>``, ``ready``, ``step`` before each training step, ``done``,
``error <text>``)."""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

import tra_sql
from tra_sql import nn, train
from tra_sql.optim import Adam

ENDLESS = 10**9  # the epochs of a run that is killed before it ends
BATCHES = 2  # steps per epoch (a kill between them resumes mid-epoch)
CHUNK = 25  # epochs the reference run trains ahead
EDGES = [(0, 1, 0.5), (2, 3, -1.0), (3, 3, 2.0)]
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
TWO = 2 * np.eye(5)
STATE = [f"fit__{slot}__{name}" for slot in ("m", "v") for name in ("W1", "b1", "W2")]


# -- what a worker does ---------------------------------------------------------------------------
def stamp(g: int) -> np.ndarray:
    """A 6x5 array that names its generation: element [0, 0] is ``g``."""
    return g + np.arange(30.0).reshape(6, 5) / 64


def data() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    X, Y = rng.standard_normal((8, 4)), rng.standard_normal((8, 2))
    return X, Y, {"W1": rng.standard_normal((4, 3)) * 0.5, "b1": rng.standard_normal(3) * 0.1,
                  "W2": rng.standard_normal((3, 2)) * 0.5}


def factors() -> tuple[np.ndarray, np.ndarray]:
    """PA and PB, whose product P a planned store computes in bands."""
    rng = np.random.default_rng(2)
    return rng.random((40, 64)), rng.random((64, 30))


def model(db: tra_sql.Session):
    """A tiny MLP's loss and parameters (as in tests/test_training.py); its data is stored anew."""
    X, Y, init = data()
    x, y = db.from_numpy("X", X, tile=(4, 4), replace=True), db.from_numpy("Y", Y, replace=True)
    params = [db.parameter(k, init=v, tile=(2, 3) if k == "W1" else None) for k, v in init.items()]
    W1, b1, W2 = params
    out = db.einsum("nh,hk->nk", nn.linear(db, x, W1, b1, "tanh"), W2)
    return db.einsum("nk,nk->", out, y, join="(x0 - x1) * (x0 - x1) / 16"), params


def storage_round(db: tra_sql.Session, step: int) -> None:
    """Replace T (a new generation), C = 2 T (twice), D = T.T, R and the relation view E; add
    N<g>; drop all but the two newest N tensors (by db.drop or DROP TENSOR); every third step,
    store P = PA PB under a plan that stages it in bands."""
    g = random.randrange(1, 10**6)
    db.from_numpy("T", stamp(g), tile=(4, 3), replace=True)
    db.from_numpy(f"N{g}", stamp(g), tile=(4, 3))
    db.einsum("ij,jk->ik", "T", "TWO").store("C", replace=True)
    db.sql("CREATE OR REPLACE TENSOR C AS SELECT * FROM einsum('ij->ij', C)")  # reads what it replaces
    db.sql("CREATE OR REPLACE TENSOR D AS SELECT * FROM einsum('ij->ji', T)")
    db.sql(f"CREATE OR REPLACE TENSOR R AS {RANDOM}")
    db.relation("edges", ("dst", "src"), "w", shape=(4, 4), name="E", replace=True)
    stale = db.engine.con.execute("SELECT name FROM tra_tensors WHERE name LIKE 'N%' ORDER BY rowid").fetchall()[:-2]
    for (name,) in stale:
        db.drop(name) if step % 2 else db.sql(f"DROP TENSOR {name}")
    if step % 3 == 0:
        product = db.einsum("ij,jk->ik", "PA", "PB")
        product.store("P", replace=True, plan=db.plan(product, workers=1, memory="40KB"))


def work(path: str, epochs: int, staged: bool) -> None:
    """Train for ``epochs`` epochs (resuming the run), a storage round before each step; each
    step as one query, or ``staged`` in temp tables."""
    if staged:
        train.Trainer.fuse_bytes = lambda self: 0
    db = tra_sql.connect(path, threads=1)
    db.engine.con.execute("SET checkpoint_threshold = '64KB'").fetchall()  # checkpoints often: kills land in them
    report("ready")
    loss, params = model(db)
    for name, value, tile in [("TWO", TWO, (3, 3)), *zip(("PA", "PB"), factors(), ((10, 16), (16, 10)))]:
        if name not in db.tensors():
            db.from_numpy(name, value, tile=tile)
    db.engine.con.execute(f"CREATE TABLE IF NOT EXISTS edges AS SELECT * FROM (VALUES {', '.join(map(str, EDGES))}) "
                   f"t(dst, src, w)").fetchall()
    db.train(loss, params, Adam(lr=0.05), epochs, run="fit", batches=BATCHES, progress=False,
             before_step=lambda step, batch: (report("step"), storage_round(db, step)))
    db.close()
    report("done")


def report(event: str) -> None:
    """``<event> <pid>`` on stdout, in one write (lines of processes sharing the pipe stay whole)."""
    os.write(1, f"{event} {os.getpid()}\n".encode())


def zygote() -> None:
    """Warm up (kernels compiled and loaded), then fork a worker per ``fork <path> <epochs>
    <staged>``."""
    work(":memory:", 2, False)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped as they die
    for line in sys.stdin:
        _, path, epochs, staged = line.split()
        pid = os.fork()
        if pid:
            os.write(1, f"forked {pid}\n".encode())
            continue
        try:
            random.seed()
            work(path, int(epochs), staged == "1")
            os._exit(0)
        except BaseException:
            report("error " + traceback.format_exc().replace("\n", " | "))
            os._exit(1)


# -- the test: kill, reopen, check ----------------------------------------------------------------
class Zygote:
    """The zygote process, and the reports of its workers."""

    def __init__(self):
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, __file__, "zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line.strip()) for line in self.proc.stdout],
                         daemon=True).start()
        self.next(self.proc.pid, 300, "done")  # its warm-up

    def next(self, pid: int, timeout: float, *events: str) -> str | None:
        """The next of ``events`` that process ``pid`` reports within ``timeout`` seconds, or
        None; an error it reports fails the test. Reports of other processes are skipped."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event, rest = self.lines.get(timeout=left).split(" ", 1)
            except queue.Empty:
                return None
            who = rest.split(" ", 1)[0] if event != "forked" else str(self.proc.pid)
            assert not (event == "error" and who == str(pid)), rest.replace(" | ", "\n")
            if who == str(pid) and event in events:
                return rest if event == "forked" else event
        return None

    def run(self, path: Path, epochs: int, kill_after: float | None, staged: bool = False, steps: int = 0) -> bool:
        """Run a worker; SIGKILL it ``kill_after`` seconds after its fork, or after it began its
        ``steps``-th training step, unless it finished first (None: wait for it). Whether it was
        killed."""
        self.proc.stdin.write(f"fork {path} {epochs} {int(staged)}\n")
        self.proc.stdin.flush()
        pid = int(self.next(self.proc.pid, 30, "forked"))
        for _ in range(steps):
            assert self.next(pid, 300, "step") == "step", "a worker began no training step in 5 minutes"
        if self.next(pid, 600 if kill_after is None else kill_after, "done"):
            return False
        assert kill_after is not None, "a worker ran for 10 minutes"
        kill(pid)
        return True

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


def kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it is gone (its file lock released)."""
    try:
        os.kill(pid, signal.SIGKILL)
        while True:
            os.kill(pid, 0)
            time.sleep(0.005)
    except ProcessLookupError:
        pass


RANDOM = "SELECT * FROM tra_random(shape => [6, 5], tile => [4, 3], seed => 7)"


class Reference:
    """An uninterrupted run in its own file, trained further when a later step is asked for."""

    def __init__(self, path: Path):
        self.db = tra_sql.connect(str(path), threads=1)
        self.loss, self.params = model(self.db)
        self.names = [p.name for p in self.params] + STATE
        self.steps = {0: {**{p.name: p.numpy() for p in self.params},
                          **{s: np.zeros(self.db.tensor(s.split("__")[2]).shape) for s in STATE}}}
        self.losses: list[float] = []
        self.db.sql(f"CREATE TENSOR R AS {RANDOM}")
        PA, PB = factors()
        E = np.zeros((4, 4))
        for dst, src, w in EDGES:
            E[dst, src] = w
        self.known = {"X": data()[0], "Y": data()[1], "TWO": TWO, "R": self.db.tensor("R").numpy(), "PA": PA,
                      "PB": PB, "P": PA @ PB, "E": E}

    def at(self, step: int) -> dict[str, np.ndarray]:
        """What the tensors hold once ``step`` is committed: weights, Adam moments, constants."""
        if step not in self.steps:
            epochs = step // BATCHES + CHUNK
            history = self.db.train(self.loss, self.params, Adam(lr=0.05), epochs, run="fit", batches=BATCHES,
                                    progress=False, before_step=lambda done, _: self.steps.setdefault(
                                        done, self.snapshot()))
            self.steps[epochs * BATCHES], self.losses = self.snapshot(), history.losses
        return {**self.known, **self.steps[step]}

    def snapshot(self) -> dict[str, np.ndarray]:
        return {name: self.db.tensor(name).numpy() for name in self.names}


def check_file(path: Path, reference: Reference) -> tuple[int, int]:
    """Reopen ``path``; assert that every tensor is whole or absent and holds what it should,
    the weights and moments those of the committed step, the logged losses the uninterrupted
    run's. (That step, staging tables that ``db.check(repair=True)`` had to drop.)"""
    with tra_sql.connect(str(path), threads=1) as db:
        found = db.check(repair=True)
        assert [f.problem for f in found] == ["stage table"] * len(found), found
        assert db.check() == []
        step, losses = committed(db)
        known = reference.at(step)
        np.testing.assert_allclose(losses, reference.losses[: len(losses)], rtol=1e-12)
        for name in db.tensors():
            value = db.tensor(name).numpy()
            if name in ("T", "C", "D") or re.fullmatch(r"N\d+", name):
                value = {"C": value / 2, "D": value.T}.get(name, value)
                g = int(name[1:]) if name.startswith("N") else int(value[0, 0])
                np.testing.assert_array_equal(value, stamp(g), err_msg=name)
            elif name in known:
                np.testing.assert_allclose(value, known[name], rtol=1e-12, atol=0, err_msg=f"{name} at step {step}")
        return step, len(found)


def committed(db: tra_sql.Session) -> tuple[int, list[float]]:
    """The run's committed step (0 before it started) and its logged losses, which agree."""
    tables = {t for (t,) in db.engine.con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    row = db.engine.con.execute("SELECT step, epoch, batch FROM tra_runs WHERE run = 'fit'").fetchall() \
        if "tra_runs" in tables else []
    if not row:
        return 0, []
    step, epoch, batch = row[0]
    log = db.engine.con.execute("SELECT epoch, step, loss FROM tra_run_log WHERE run = 'fit' ORDER BY epoch").fetchall()
    assert step == epoch * BATCHES + batch and [(e, s) for e, s, _ in log] == [
        (e, (e + 1) * BATCHES) for e in range(epoch)]
    return step, [loss for _, _, loss in log]


def crash_loop(tmp_path: Path, kills: int, seed: int) -> list[tuple[int, int]]:
    """Workers (half of them staging steps in temp tables) killed at random moments, ``kills``
    times, the file checked after each kill (but now and then left for the next worker to
    recover); then a worker that trains two more epochs and finishes, with the weights of the
    uninterrupted run. Per kill: (the step committed, staging tables left), (-1, 0) if the
    file was not checked."""
    rng = random.Random(seed)
    reference = Reference(tmp_path / "reference.duckdb")
    path, zygote_, seen = tmp_path / "crash.duckdb", Zygote(), []
    try:
        while len(seen) < kills:
            # a kill soon after the fork, at any moment later, or in a step after the first
            # (whatever the machine's speed, some kills land after a step was committed)
            delay, steps = rng.choice([(rng.uniform(0, 0.3), 0), (rng.uniform(0.3, 1.5), 0), (rng.uniform(0, 0.5), 2)])
            assert zygote_.run(path, ENDLESS, delay, staged=rng.random() < 0.5, steps=steps), \
                "a worker finished an endless run"
            seen.append(check_file(path, reference) if rng.random() < 0.8 else (-1, 0))
        last = check_file(path, reference)[0] // BATCHES + 2
        assert not zygote_.run(path, last, None)
        assert check_file(path, reference) == (last * BATCHES, 0)
    finally:
        zygote_.close()
        reference.db.close()
    return seen


def test_killed_workers_leave_every_tensor_whole_or_absent(tmp_path):
    seen = crash_loop(tmp_path, kills=30, seed=0)
    assert len(seen) == 30 and max(step for step, _ in seen) > 0   # kills landed before and during training


@pytest.mark.fuzz
@pytest.mark.skipif(PROFILE != "long", reason="the long profile only (HYPOTHESIS_PROFILE=long)")
def test_many_kills(tmp_path):
    seed = int(time.time())
    print(f"crash_loop seed={seed} (rerun: crash_loop(tmp_path, kills=400, seed={seed}))")  # shown if it fails
    assert len(crash_loop(tmp_path, kills=400, seed=seed)) == 400


# -- a kill while DuckDB creates the file ---------------------------------------------------------
def new_database_header(tmp_path: Path) -> bytes:
    """The first 4096 bytes of a new database file: its main header, the first one written."""
    tra_sql.connect(str(tmp_path / "whole.duckdb")).close()
    return (tmp_path / "whole.duckdb").read_bytes()[:4096]


@pytest.mark.parametrize("written", [0, 4096])
def test_a_file_whose_creation_was_killed_opens_as_a_new_database(tmp_path, written):
    """A process killed in connect() before DuckDB wrote the file's headers leaves it empty or
    with its main header only (both seen when killing at random moments); DuckDB refused to open
    it ever after ("not a valid DuckDB database file", "Could not read enough bytes")."""
    path = tmp_path / "new.duckdb"
    path.write_bytes(new_database_header(tmp_path)[:written])
    with tra_sql.connect(str(path)) as db:
        db.from_numpy("A", np.arange(3.0))
    with tra_sql.connect(str(path)) as db:
        np.testing.assert_array_equal(db.tensor("A").numpy(), np.arange(3.0))


def test_small_files_that_are_not_interrupted_creations_are_left_alone(tmp_path):
    other = tmp_path / "notes.duckdb"
    other.write_bytes(b"not a database")
    with pytest.raises(tra_sql.ExecutionError, match="not a valid DuckDB database"):
        tra_sql.connect(str(other))
    assert other.read_bytes() == b"not a database"
    busy = tmp_path / "busy.duckdb"   # empty, but another process has it open and locked (creating it)
    busy.touch()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'rb+'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); print(flush=True); time.sleep(60)", str(busy)],
                              stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        with pytest.raises(tra_sql.ExecutionError, match="lock"):
            tra_sql.connect(str(busy))
        assert busy.exists()
    finally:
        holder.kill()
        holder.wait()


if __name__ == "__main__" and sys.argv[1:] == ["zygote"]:
    zygote()
