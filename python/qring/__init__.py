"""qring: synchronous data parallelism with backup workers, from Python.

    import qring
    qring.init()                       # from qring-launch, torchrun, mpirun, Slurm or QRING_*
    qring.allreduce(t)                 # in place, every rank
    q = qring.QuorumAllreduce(t.numel(), quorum=qring.size() - 1)
    q.contribute(step, t)
    r = q.wait(step)                   # t = mean over r.contributors
    qring.finalize()

Buffers: any contiguous float32 CPU torch tensor or numpy array, taken without a copy.
PyTorch: qring.torch.DistributedOptimizer. Documentation: docs/python.md.
"""
import atexit as _atexit
import numbers as _numbers

from . import _qring
from ._qring import (Behind, ConfigError, DataError, Error, Evicted, IoError, JobOver,
                     ProtocolError, QuorumLost, QuorumResult, QuorumTimeout, TimeoutError,
                     UsageError)

__all__ = [
    "init", "finalize", "initialized", "rank", "size", "local_rank", "local_size", "incarnation",
    "rejoining", "provider", "launcher", "allreduce", "broadcast", "barrier", "QuorumAllreduce",
    "QuorumResult", "Error", "ConfigError", "UsageError", "ProtocolError", "DataError", "IoError",
    "TimeoutError", "QuorumTimeout", "QuorumLost", "Evicted", "Behind", "JobOver", "EXIT_EVICTED",
]

# The exit status of a rank evicted while alive: qring-launch --tolerate-failures counts it as
# a lost rank (as qring-train's).
EXIT_EVICTED = 75

_INIT_OPTIONS = {
    # name: (type, default, what)
    "provider": (str, "auto", "libfabric provider: auto, shm, tcp or a provider string"),
    "timeout_ms": (int, 60000, "deadline of every collective"),
    "setup_timeout_ms": (int, 30000, "deadline of the rendezvous and address exchange"),
    "log_level": (str, "warn", "qring's log level: trace, debug, info, warn, error, off"),
    "wait": (str, "block", "while waiting for peers: block in the kernel until their traffic "
                           "(shm) or poll and yield"),
}


def _check_kwargs(where, given, allowed):
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise TypeError(f"{where}: unknown option(s) {', '.join(unknown)}; "
                        f"expected {', '.join(sorted(allowed))}")


def _typed(where, name, value, kind):
    if kind is int and (isinstance(value, bool) or not isinstance(value, _numbers.Integral)):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
    if kind is str and not isinstance(value, str):
        raise TypeError(f"{where}: {name} must be a str, got {type(value).__name__}")
    return value


def init(**options):
    """Joins the job this process was launched into and makes the communicator.

    The launch comes from the environment: qring-launch (QRING_*), torchrun (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT...), mpirun (OMPI_COMM_WORLD_*), Slurm (SLURM_*); none of them: a
    single process. A partial or contradictory environment raises ConfigError naming the
    variables. Options: provider="auto", timeout_ms=60000, setup_timeout_ms=30000,
    log_level="warn", wait="block" (over shm a rank that waits for its peers blocks in the
    kernel until their traffic wakes it, leaving the cores to ranks that compute; "poll":
    poll and yield, as qring-train and qring-bench do). A rank restarted by qring-launch --max-restarts joins the running job
    (rejoining() is True; qring.torch.DistributedOptimizer then takes the job's state)."""
    _check_kwargs("qring.init", options, _INIT_OPTIONS)
    values = {}
    for name, (kind, default, _) in _INIT_OPTIONS.items():
        values[name] = _typed("qring.init", name, options.get(name, default), kind)
    _qring.init(**values)


def finalize():
    """Closes every QuorumAllreduce, the communicator and the rendezvous (its final barrier
    skips the ranks the job lost). Runs at exit if the program did not call it."""
    _qring.finalize()


def initialized():
    return _qring.initialized()


def rank():
    """This process's rank."""
    return _qring.rank()


def size():
    """The number of ranks in the job."""
    return _qring.size()


def local_rank():
    return _qring.local_rank()


def local_size():
    return _qring.local_size()


def incarnation():
    """0 at the job's start; k for the k-th time this rank came back."""
    return _qring.incarnation()


def rejoining():
    """True in a rank that came back to a running job (it joins it instead of starting it)."""
    return _qring.rejoining()


def provider():
    """The libfabric provider the communicator runs on (e.g. 'shm', 'tcp;ofi_rxm')."""
    return _qring.provider()


def launcher():
    """Where the rank came from: 'env' (qring-launch, QRING_*), 'torchrun', 'mpi', 'slurm',
    'single'."""
    return _qring.launcher()


def allreduce(t, op="sum"):
    """Reduces t in place over every rank (op: sum, mean, min, max). t: a contiguous float32
    CPU tensor or numpy array, taken without a copy."""
    _typed("qring.allreduce", "op", op, str)
    _qring.allreduce(t, op)
    return t


def broadcast(t, root=0):
    """t from rank root to every rank, in place."""
    _typed("qring.broadcast", "root", root, int)
    _qring.broadcast(t, root)
    return t


def barrier():
    _qring.barrier()


_LATE = ("drop", "carry")


class QuorumAllreduce:
    """The bounded-wait quorum all-reduce: each step completes once `quorum` ranks have
    contributed (plus grace_ms for more); every rank gets the same contributors and the
    bit-identical mean (or sum) over exactly their buffers. One per process at a time; every
    rank makes it at the same point of its program.

        q = qring.QuorumAllreduce(count, quorum=3, grace_ms=0, late="drop", evict_ms=5000,
                                  straggler="none")
        q.contribute(step, t)        # non-blocking; steps 0, 1, 2, ...
        r = q.wait(step)             # t holds the result; r.contributors, r.count, r.excluded

    quorum: an int (ranks), a float in (0, 1] (a fraction of the live ranks), or None (every
    rank). grace_ms: how long to wait for more once `quorum` have arrived. late: "drop" (a
    late gradient is lost, the paper's rule) or "carry" (added into the next contribution).
    evict_ms: a rank silent this long leaves the job; the others go on while at least
    max(quorum, min_world) are live. max_lag_ms: a rank whose oldest missing result was
    decided longer ago than this leaves too (qring.Behind, an Evicted; it may rejoin with a
    live member's state), where the job survives it; 0 = 3 x evict_ms, -1 = never.
    deadline_ms: fewer than `quorum` by then fails the step
    (QuorumTimeout). straggler: a delay model slept before each contribution (or at delay()),
    as qring-train's
    straggler.model ("fixed:RANK:MS", "lognormal:MU:SIGMA", "exp:MS", "shiftexp:S:M",
    "tail:P:MS", "trace:FILE"), with `seed`. mean: the mean over contributors (else the sum).
    """

    def __init__(self, count, quorum=None, grace_ms=0, late="drop", evict_ms=5000,
                 straggler="none", deadline_ms=30000, min_world=0, seed=0, mean=True,
                 agreed="", max_lag_ms=0):
        where = "qring.QuorumAllreduce"
        s = _qring._QuorumSettings()
        s.count = _typed(where, "count", count, int)
        if count < 1:
            raise ValueError(f"{where}: count must be at least 1, got {count}")
        s.quorum = _quorum_spec(where, quorum)
        s.grace_ms = _typed(where, "grace_ms", grace_ms, int)
        s.evict_ms = _typed(where, "evict_ms", evict_ms, int)
        s.deadline_ms = _typed(where, "deadline_ms", deadline_ms, int)
        s.max_lag_ms = _typed(where, "max_lag_ms", max_lag_ms, int)
        if s.max_lag_ms < -1:
            raise ValueError(f"{where}: max_lag_ms must be -1 (never), 0 (3 x evict_ms) or "
                             f"a time in ms, got {max_lag_ms}")
        s.min_world = _typed(where, "min_world", min_world, int)
        s.seed = _typed(where, "seed", seed, int)
        if late not in _LATE:
            raise ValueError(f"{where}: late must be 'drop' or 'carry', got {late!r}")
        s.late = late
        s.straggler = _typed(where, "straggler", straggler, str)
        s.mean = bool(mean)
        s.agreed = _typed(where, "agreed", agreed, str)
        self._h = _qring._Quorum(s)
        self.count = count

    def contribute(self, step, t, digest=None):
        """This rank's contribution to `step` (t: count float32 elements, kept untouched until
        wait(step) returns; the result is written into it). `digest`: a digest of this rank's
        replicated state (qring.torch passes the parameters'); two ranks with different
        digests for one step stop the job (QuorumLost, "replicas drifted")."""
        self._h.contribute(_typed("contribute", "step", step, int), t, digest)

    def wait(self, step, out=None):
        """Blocks until the step is decided and reduced; writes the result into the buffer
        contributed to the step (or `out`) and returns a QuorumResult."""
        return self._h.wait(_typed("wait", "step", step, int), out)

    def delay(self, step):
        """Sleeps the straggler model's delay for `step` (once; contribute() does it otherwise),
        cut short as soon as the step is decided without this rank; returns excluded(step).
        Call it before computing the step's contribution, as qring-train does, so that a rank
        excluded meanwhile can skip that work."""
        return self._h.delay(_typed("delay", "step", step, int))

    def excluded(self, step):
        """True once this rank's contribution to `step` can no longer be counted."""
        return self._h.excluded(step)

    def members(self):
        """The live ranks as of the last step this rank completed."""
        return self._h.members()

    def coordinator(self):
        return self._h.coordinator()

    def survives_loss(self):
        """Whether the job goes on when a rank is lost (max(quorum, min_world) < size)."""
        return self._h.survives_loss()

    # Rejoin (a rank that came back; qring.torch.DistributedOptimizer does this).
    def join(self, timeout_ms=60000):
        """Blocks until this rejoining rank is admitted; returns (step, donor, epoch, members):
        the first step it takes part in and the rank that sends it the state."""
        return self._h.join(timeout_ms)

    def receive_state(self, max_bytes, timeout_ms=60000):
        return self._h.receive_state(max_bytes, timeout_ms)

    def send_state(self, to, step, state):
        self._h.send_state(to, step, state)

    def close(self):
        """Stops this all-reduce (the ranks the job lost are remembered for finalize())."""
        self._h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _quorum_spec(where, quorum):
    if quorum is None:
        return ""
    if isinstance(quorum, bool) or not isinstance(quorum, (_numbers.Integral, float)):
        raise TypeError(f"{where}: quorum must be an int (ranks), a float in (0, 1] or None, "
                        f"got {type(quorum).__name__}")
    if isinstance(quorum, float):
        if not 0 < quorum <= 1:
            raise ValueError(f"{where}: a quorum fraction must be in (0, 1], got {quorum}")
        return f"{float(quorum):.9f}"
    return str(int(quorum))


def _finalize_at_exit():
    try:
        _qring.finalize()
    except Exception as e:  # the interpreter is going away: say it, do not raise
        import sys
        print(f"qring: finalize at exit: {e}", file=sys.stderr)


_atexit.register(_finalize_at_exit)
