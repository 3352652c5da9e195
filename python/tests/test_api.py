"""The qring module in one process and under the launchers: bad inputs rejected with their
message, partial environments, torchrun and mpirun environments."""
import shutil
import socket
import subprocess
import textwrap

import pytest

from conftest import PYTHON, WORKER, clean_env, launch, python, run

PRELUDE = """
import qring
if HEAVY:
    import numpy as np, torch
def expect(exc, text, f, *args, **kw):
    try:
        f(*args, **kw)
    except exc as e:
        assert text in str(e), f"{exc.__name__}: {text!r} not in {str(e)!r}"
        print("OK", exc.__name__, str(e)[:100])
        return
    except Exception as e:
        raise AssertionError(f"expected {exc.__name__} ({text!r}), got {type(e).__name__}: {e}")
    raise AssertionError(f"expected {exc.__name__} ({text!r}), nothing was raised")
"""


def check(code, env=None, heavy=True):
    job = python(f"HEAVY = {heavy}\n" + PRELUDE + textwrap.dedent(code), env=env)
    assert job.rc == 0, job
    return job


def test_calls_before_init_are_errors():
    check("""
    expect(qring.UsageError, "call qring.init() first", qring.rank)
    expect(qring.UsageError, "call qring.init() first", qring.allreduce, torch.ones(2))
    expect(qring.UsageError, "call qring.init() first", qring.QuorumAllreduce, 4)
    import qring.torch
    model = torch.nn.Linear(2, 2)
    expect(qring.UsageError, "qring.init() first", qring.torch.DistributedOptimizer,
           torch.optim.SGD(model.parameters(), lr=0.1))
    """)


def test_bad_buffers_are_rejected_with_what_was_expected():
    check("""
    qring.init()
    assert (qring.rank(), qring.size(), qring.launcher()) == (0, 1, "single")
    q = qring.QuorumAllreduce(6, quorum=1)
    expect(TypeError, "expected float32 elements, got format 'd'", q.contribute, 0, np.zeros(6))
    expect(TypeError, "expected a float32 tensor, got dtype torch.float64", q.contribute, 0,
           torch.zeros(6, dtype=torch.float64))
    expect(TypeError, "got dtype torch.int32", qring.allreduce, torch.zeros(6, dtype=torch.int32))
    expect(ValueError, "expected a contiguous tensor", q.contribute, 0, torch.zeros(6, 2)[:, 0])
    expect(ValueError, "expected a C-contiguous array", q.contribute, 0,
           np.zeros((6, 2), dtype=np.float32)[:, 0])
    expect(ValueError, "expected a CPU tensor, got one on 'meta'", q.contribute, 0,
           torch.zeros(6, device="meta"))
    class CudaTensor:  # what a CUDA tensor shows the module (no GPU here)
        dtype = torch.float32
        device = torch.device("cuda", 0)
        layout = torch.strided
        def data_ptr(self): return 4096
        def is_contiguous(self): return True
        def numel(self): return 6
    expect(ValueError, "expected a CPU tensor, got one on 'cuda'", q.contribute, 0, CudaTensor())
    expect(ValueError, "expected 6 float32 elements (the count it was made with), got 5",
           q.contribute, 0, torch.zeros(5))
    expect(TypeError, "expected a contiguous float32 CPU torch tensor or numpy array, got list",
           q.contribute, 0, [0.0] * 6)
    ro = np.zeros(6, dtype=np.float32); ro.setflags(write=False)
    expect(ValueError, "expected a writable buffer", q.contribute, 0, ro)
    expect(ValueError, "expected a dense", qring.allreduce, torch.zeros(6).to_sparse())
    expect(ValueError, "nothing was contributed to this step; pass out=", q.wait, 0)
    t = torch.arange(6, dtype=torch.float32)
    q.contribute(0, t)
    r = q.wait(0)
    assert r.contributors == [0] and r.count == 1 and not r.excluded and t[5] == 5, r
    expect(qring.UsageError, "contribution for step 5, but step 1 is next", q.contribute, 5, t)
    expect(TypeError, "step must be an int", q.contribute, "1", t)
    q.close()
    expect(qring.UsageError, "was closed", q.contribute, 1, t)
    expect(ValueError, "op 'prod': expected sum, mean, min or max", qring.allreduce, t, "prod")
    expect(ValueError, "root rank 3 is not in [0, 1)", qring.broadcast, t, 3)
    expect(qring.UsageError, "qring.init() was called already", qring.init)
    """)


def test_bad_options_are_rejected():
    check("""
    expect(TypeError, "unknown option(s) provder", qring.init, provder="shm")
    expect(TypeError, "timeout_ms must be an int", qring.init, timeout_ms="1")
    expect(ValueError, "log_level 'loud'", qring.init, log_level="loud")
    expect(ValueError, "wait 'spin': expected 'block' or 'poll'", qring.init, wait="spin")
    qring.init()
    expect(ValueError, "count must be at least 1", qring.QuorumAllreduce, 0)
    expect(TypeError, "count must be an int", qring.QuorumAllreduce, 2.5)
    expect(TypeError, "quorum must be an int", qring.QuorumAllreduce, 4, quorum="3")
    expect(ValueError, "quorum fraction must be in (0, 1]", qring.QuorumAllreduce, 4, quorum=1.5)
    expect(qring.ConfigError, "quorum 2 out of range [1, 1]", qring.QuorumAllreduce, 4, quorum=2)
    expect(ValueError, "late must be 'drop' or 'carry'", qring.QuorumAllreduce, 4, late="keep")
    expect(qring.ConfigError, "fixed:x", qring.QuorumAllreduce, 4, straggler="fixed:x")
    expect(qring.ConfigError, "hard deadline", qring.QuorumAllreduce, 4, grace_ms=50,
           deadline_ms=10)
    expect(qring.ConfigError, "evict", qring.QuorumAllreduce, 4, evict_ms=0)
    expect(ValueError, "max_lag_ms must be -1 (never), 0", qring.QuorumAllreduce, 4,
           max_lag_ms=-2)
    expect(TypeError, "max_lag_ms must be an int", qring.QuorumAllreduce, 4, max_lag_ms=1.5)
    assert issubclass(qring.Behind, qring.Evicted)
    import qring.torch
    expect(TypeError, "expected a torch.optim.Optimizer", qring.torch.DistributedOptimizer, 3)
    model = torch.nn.Linear(2, 2)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    expect(TypeError, "must yield (str, Parameter) pairs", qring.torch.DistributedOptimizer,
           sgd(model), named_parameters=[1, 2])
    expect(ValueError, "not in named_parameters", qring.torch.DistributedOptimizer, sgd(model),
           named_parameters=[("w", model.weight)])
    double = torch.nn.Linear(2, 2).double()
    expect(TypeError, "parameter weight is torch.float64", qring.torch.DistributedOptimizer,
           sgd(double), named_parameters=double.named_parameters())
    expect(ValueError, "root_rank 1 is not in [0, 1)", qring.torch.broadcast_parameters,
           model.state_dict(), root_rank=1)
    expect(TypeError, "item 0 is int", qring.torch.broadcast_parameters, [3])
    """)


def test_a_forked_child_exits_without_touching_the_parents_session():
    # A DataLoader worker is a fork: at its exit, finalize() must not stop (or wait for) the
    # parent's engine thread, which the child does not have.
    check("""
    import os, sys, time
    qring.init()
    q = qring.QuorumAllreduce(4)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # runs the atexit finalize in the child
    for _ in range(400):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    assert done and os.waitstatus_to_exitcode(status) == 0, "the child hung or failed"
    t = torch.ones(4)
    q.contribute(0, t)
    assert q.wait(0).count == 1
    print("OK fork")
    """)


def test_partial_or_contradictory_environments_name_the_variables():
    cases = {
        "RANK is set but WORLD_SIZE is not": dict(RANK=0),
        "MASTER_ADDR is set but RANK and WORLD_SIZE are not": dict(MASTER_ADDR="127.0.0.1"),
        "MASTER_PORT is set but MASTER_ADDR is not": dict(RANK=0, WORLD_SIZE=2,
                                                          MASTER_PORT=29500),
        "LOCAL_RANK=1 contradicts RANK=0": dict(RANK=0, WORLD_SIZE=2, LOCAL_RANK=1,
                                                LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                                MASTER_PORT=29500),
        "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not":
            dict(OMPI_COMM_WORLD_SIZE=2),
    }
    for text, env in cases.items():
        job = check(f"""
        expect(qring.ConfigError, {text!r}, qring.init)
        assert not qring.initialized()
        """, env=clean_env(**env), heavy=False)
        assert "OK ConfigError" in job.out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_launcher_results(job, n, launcher):
    assert job.rc == 0, job
    ranks = job.by_rank()
    assert sorted(ranks) == list(range(n)), job
    for r, (res,) in ranks.items():
        assert res["launcher"] == launcher and res["size"] == n, job
        assert res["sum"] == n * (n + 1) / 2, job
        assert res["local_rank"] == r and res["local_size"] == n, job


def test_qring_launch_environment():
    check_launcher_results(launch(3, ["launcher"]), 3, "env")


def test_torchrun_environment(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed (python3-torch)")
    # --redirects 1 --tee 1: Debian's torchrun 1.13 fails under Python 3.11 with its default
    # (0: "'NoneType' object has no attribute 'get'"); these keep the output on the console.
    job = run([torchrun, "--redirects", "1", "--tee", "1", "--log_dir", str(tmp_path),
               "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), WORKER, "launcher"], timeout=120)
    check_launcher_results(job, 2, "torchrun")


def test_mpirun_environment():
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed (openmpi-bin)")
    job = run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2",
               "-x", "PYTHONPATH", "-x", "MASTER_ADDR=127.0.0.1",
               "-x", f"MASTER_PORT={free_port()}", PYTHON, WORKER, "launcher"], timeout=120,
              env=clean_env(OMPI_MCA_plm_rsh_agent="",
                            OMPI_MCA_btl_vader_single_copy_mechanism="none"))
    check_launcher_results(job, 2, "mpi")
