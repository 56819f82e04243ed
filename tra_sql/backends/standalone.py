"""A Spark standalone cluster on this machine: a master and workers on 127.0.0.1, started
with Spark's own launcher (``bin/spark-class`` of the pyspark install), each in its own
process group so that stopping (or killing) one ends its executors and Python workers too.

    with StandaloneCluster(workers=2, cores=1, memory="1g") as cluster:
        db = tra_sql.connect(engine="spark", master=cluster.url, executor_memory="512m")
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tra_sql.errors import ExecutionError

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def spark_home() -> Path:
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home())


class StandaloneCluster:
    """``workers`` Spark workers of ``cores`` cores and ``memory`` each, and their master,
    with daemon JVMs of ``daemon_memory`` heap. Logs and work files go to ``workdir``."""

    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "1g", daemon_memory: str = "256m",
                 workdir: str | os.PathLike | None = None):
        self.cores, self.memory, self.workers_wanted = cores, memory, workers
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="tra_spark_cluster_") if workdir is None else workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.webui_port = free_port(), free_port()
        self.master: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = []
        self.env = dict(os.environ, SPARK_HOME=str(spark_home()), SPARK_DAEMON_MEMORY=daemon_memory,
                        SPARK_LOCAL_IP=HOST, SPARK_MASTER_HOST=HOST, PYSPARK_PYTHON=sys.executable,
                        SPARK_NO_DAEMONIZE="1")

    @property
    def url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    def _launch(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            return subprocess.Popen([str(spark_home() / "bin" / "spark-class"), *args], env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def start(self, wait: bool = True, timeout: float = 120.0) -> StandaloneCluster:
        """Start the master and the workers; with ``wait``, return once all workers have
        registered (else call ``wait_for_workers``)."""
        try:
            self.master = self._launch("master", "org.apache.spark.deploy.master.Master", "--host", HOST,
                                       "--port", str(self.port), "--webui-port", str(self.webui_port))
            for _ in range(self.workers_wanted):
                self.start_worker(wait=False)
            if wait:
                self.wait_for_workers(self.workers_wanted, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self, wait: bool = True, timeout: float = 120.0) -> int:
        """Start one more worker; its index."""
        index = len(self.workers)
        work = self.workdir / f"worker-{index}"
        work.mkdir(exist_ok=True)
        self.workers.append(self._launch(
            f"worker-{index}", "org.apache.spark.deploy.worker.Worker", self.url, "--host", HOST,
            "--cores", str(self.cores), "--memory", self.memory, "--work-dir", str(work),
            "--webui-port", str(free_port())))
        if wait:
            self.wait_for_workers(self.alive() + 1, timeout)
        return index

    def status(self) -> dict:
        """The master's JSON status (workers, applications)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.webui_port}/json/", timeout=5) as reply:
            return json.load(reply)

    def alive(self) -> int:
        """Workers the master counts as alive."""
        try:
            return sum(w["state"] == "ALIVE" for w in self.status()["workers"])
        except (OSError, ValueError):  # not up yet
            return 0

    def wait_for_workers(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.alive() < count:
            if self.master is None or self.master.poll() is not None:
                raise ExecutionError(f"the Spark master exited; see {self.workdir / 'master.log'}")
            if time.monotonic() > deadline:
                raise ExecutionError(f"{self.alive()} of {count} Spark workers registered within {timeout:.0f} s; "
                                     f"see the logs in {self.workdir}")
            time.sleep(0.25)

    def kill_worker(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill worker ``index`` with its executor and Python workers (a crash, by default)."""
        proc = self.workers[index]
        if proc is not None:
            _signal_group(proc, sig)
            proc.wait(timeout=30)
            self.workers[index] = None

    def stop(self) -> None:
        """Stop every process this cluster started (workers first), and remove its files."""
        for proc in [*self.workers, self.master]:
            if proc is not None and proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        for proc in [*self.workers, self.master]:
            if proc is None:
                continue
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=15)
        self.workers, self.master = [], None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
