"""Helpers of the Python tests: the build (QRING_BUILD, default <repo>/build), a clean launch
environment, and jobs run under qring-launch whose ranks print "RESULT {json}" lines
(python/tests/worker.py)."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.abspath(os.environ.get("QRING_BUILD", os.path.join(ROOT, "build")))
LAUNCH = os.path.join(BUILD, "net", "qring-launch")
WORKER = os.path.join(ROOT, "python", "tests", "worker.py")
PYTHON = sys.executable
# Variables of any launcher: a test's ranks see only the ones it sets.
LAUNCHER_VARS = re.compile(r"^(QRING_|SLURM_|OMPI_|PMI_|PMIX_|MPI_LOCAL|RANK$|WORLD_SIZE$|"
                           r"LOCAL_RANK$|LOCAL_WORLD_SIZE$|MASTER_ADDR$|MASTER_PORT$|"
                           r"TORCHELASTIC_|GROUP_RANK$|ROLE_)")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env["PYTHONPATH"] = os.path.join(BUILD, "python")
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Job:
    def __init__(self, proc_out, rc):
        self.out = proc_out
        self.rc = rc
        self.results = []
        decoder = json.JSONDecoder()
        # Every "RESULT {json}" (mpirun may put two ranks' lines on one).
        for m in re.finditer(r"RESULT ", proc_out):
            try:
                self.results.append(decoder.raw_decode(proc_out, m.end())[0])
            except ValueError:
                pass  # a line cut by another rank's output: the test sees it missing

    def by_rank(self, key="rank"):
        out = {}
        for r in self.results:
            out.setdefault(r[key], []).append(r)
        return out

    def __repr__(self):
        return f"Job(rc={self.rc}) output:\n{self.out[-6000:]}"


def kill_session(leader):
    """SIGKILLs `leader` (a session leader), every process of its session (a launcher's ranks
    live in process groups of their own) and every descendant of those, until none is left."""
    for _ in range(10):
        children, doomed = {}, set()
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pid, state, ppid, session = int(d), fields[0], int(fields[1]), int(fields[3])
            if state == "Z" or pid == os.getpid():
                continue
            children.setdefault(ppid, []).append(pid)
            if pid == leader or session == leader:
                doomed.add(pid)
        todo = list(doomed)
        while todo:
            for c in children.get(todo.pop(), []):
                if c not in doomed:
                    doomed.add(c)
                    todo.append(c)
        if not doomed:
            return
        for pid in doomed:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def run(cmd, timeout=180, env=None):
    """Runs `cmd` in a session of its own; past `timeout` seconds it kills the whole session
    (ranks too, which would keep the output pipe open) and fails the test with the output."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env or clean_env(), cwd=ROOT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(p.pid)
        try:
            out, _ = p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out = "(no end of output 5 s after the kill)"
        pytest.fail(f"killed after {timeout} s: {cmd}\noutput:\n{out[-6000:]}", pytrace=False)
    return Job(out, p.returncode)


def launch(n, args, launcher_args=(), timeout=180, env=None):
    """qring-launch -n N [launcher_args] -- python worker.py ARGS"""
    return run([LAUNCH, "-n", str(n), *launcher_args, "--", PYTHON, WORKER, *args],
               timeout=timeout, env=env)


def python(code, timeout=60, env=None):
    """A single process (no launcher) running `code`."""
    return run([PYTHON, "-c", code], timeout=timeout, env=env)


@pytest.fixture(scope="session", autouse=True)
def built():
    if not os.path.exists(os.path.join(BUILD, "python", "qring", "__init__.py")):
        pytest.fail(f"{BUILD}/python/qring is not built: scripts/build.sh (needs pybind11-dev)")
    if not os.access(LAUNCH, os.X_OK):
        pytest.fail(f"{LAUNCH} is not built")
