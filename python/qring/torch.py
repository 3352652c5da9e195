"""qring.torch: synchronous SGD with backup workers for any PyTorch model, in Horovod's shape.

    import qring, qring.torch
    qring.init()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = qring.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           quorum=3)
    qring.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    qring.torch.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(opt.step_count, steps):      # a rank that rejoined starts where the job is
        x, y = batch(step)                          # the data position follows from the step
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

step() all-reduces the whole gradient of the step as one quorum all-reduce (the first `quorum`
ranks to be ready are counted, the others' gradients dropped), averages it over that step's
contributors and runs the wrapped optimizer. Every rank, counted or not, applies the same
update, so the parameters stay bit-identical; a digest of them travels with each step and a
difference stops the job (QuorumLost, "replicas drifted"). The gradient lives in one flat
buffer that every param.grad views: no per-step copy. Documentation: docs/python.md.
"""
import hashlib
import io
import time

import torch

from . import _qring
from . import QuorumAllreduce, UsageError

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"]


def _require_init(where):
    if not _qring.initialized():
        raise UsageError(f"{where}: qring is not initialized: call qring.init() first")


def _check_dense_cpu(where, name, t):
    if t.device.type != "cpu":
        raise ValueError(f"{where}: {name} is on '{t.device.type}'; qring reduces host memory "
                         f"(a CPU model)")
    if t.layout != torch.strided:
        raise ValueError(f"{where}: {name} has layout {t.layout}; expected a dense tensor")


def _named_tensors(where, params):
    """(name, tensor) pairs from a state_dict, named_parameters() or a list of tensors."""
    if isinstance(params, dict):
        items = list(params.items())
    else:
        items = list(params)
        if items and isinstance(items[0], torch.Tensor):
            items = [(f"tensor.{i}", t) for i, t in enumerate(items)]
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"{where}: expected a state_dict, (name, tensor) pairs or tensors; "
                            f"item {i} is {type(item).__name__}")
    return items


def _describe(items):
    return "\n".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in items)


def _tensor_bytes(t):
    buf = io.BytesIO()
    torch.save(t.detach().cpu().contiguous(), buf)
    return buf.getvalue()


def broadcast_parameters(params, root_rank=0):
    """Copies rank root_rank's tensors (a state_dict, named_parameters() or a list) into every
    rank's, in place. The ranks must hold the same names and shapes (else ConfigError on every
    rank naming which ranks differ). float32 tensors travel without a copy; others serialized.
    In a rank that rejoined a running job it does nothing: DistributedOptimizer took the
    job's state from a live member."""
    where = "qring.torch.broadcast_parameters"
    _require_init(where)
    if _qring.rejoining():
        return
    items = _named_tensors(where, params)
    _qring.agree("the tensors of broadcast_parameters",
                 [("count", len(items)), ("names, shapes and dtypes", _describe(items))])
    root = _root(where, root_rank)
    with torch.no_grad():
        for name, t in items:
            _check_dense_cpu(where, name, t)
            if t.dtype == torch.float32 and t.is_contiguous():
                _qring.broadcast(t.detach(), root)
            else:
                data = _qring.broadcast_bytes(_tensor_bytes(t) if _qring.rank() == root else None,
                                              root)
                if _qring.rank() != root:
                    t.copy_(torch.load(io.BytesIO(data)))


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Copies rank root_rank's optimizer state (state_dict: per-parameter state such as momentum,
    hyperparameters of every group) to every rank. Does nothing in a rank that rejoined."""
    where = "qring.torch.broadcast_optimizer_state"
    _require_init(where)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if _qring.rejoining():
        return
    root = _root(where, root_rank)
    mine = None
    if _qring.rank() == root:
        buf = io.BytesIO()
        torch.save(torch.optim.Optimizer.state_dict(optimizer), buf)
        mine = buf.getvalue()
    data = _qring.broadcast_bytes(mine, root)
    if _qring.rank() != root:
        torch.optim.Optimizer.load_state_dict(optimizer, torch.load(io.BytesIO(data)))


def _root(where, root_rank):
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"{where}: root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= root_rank < _qring.size():
        raise ValueError(f"{where}: root_rank {root_rank} is not in [0, {_qring.size()})")
    return root_rank


class _DistributedOptimizer(torch.optim.Optimizer):
    # Its methods are copied into a subclass of the wrapped optimizer's class (as Horovod
    # does), so `super(self.__class__, self)` is the wrapped optimizer.
    def __init__(self, params, named_parameters, qopts, join_timeout_ms):
        super(self.__class__, self).__init__(params)
        self._qring_setup(named_parameters, qopts, join_timeout_ms)

    def _qring_setup(self, named_parameters, qopts, join_timeout_ms):
        where = "qring.torch.DistributedOptimizer"
        params = [p for group in self.param_groups for p in group["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"{where}: a parameter appears twice in the optimizer's groups")
        names = _parameter_names(where, params, named_parameters)
        for name, p in zip(names, params):
            _check_dense_cpu(where, name, p)
            if p.requires_grad and p.dtype != torch.float32:
                raise TypeError(f"{where}: parameter {name} is {p.dtype}; the quorum all-reduce "
                                f"takes float32 gradients")
        self._qring_params = params
        self._qring_trainable = [p for p in params if p.requires_grad]
        total = sum(p.numel() for p in self._qring_trainable)
        if total == 0:
            raise ValueError(f"{where}: no parameter requires a gradient")
        described = _describe(list(zip(names, params)))
        rejoining = _qring.rejoining()
        if not rejoining:  # a rank that rejoins is checked by the members at its admission
            _qring.agree("the models' parameters",
                         [("parameter count", total),
                          ("parameter names, shapes and dtypes", described)])
        # One flat gradient buffer; each param.grad is a view into it.
        self._qring_flat = torch.zeros(total, dtype=torch.float32)
        self._qring_views = []
        offset = 0
        for p in self._qring_trainable:
            view = self._qring_flat[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self._qring_views.append(view)
            offset += p.numel()
        shapes = hashlib.sha256(described.encode()).hexdigest()[:16]
        agreed = f"qring.torch parameters={total}\nqring.torch shapes={shapes}\n"
        self._qring_q = QuorumAllreduce(total, agreed=agreed, **qopts)
        self._qring_rank = _qring.rank()
        self._qring_step = 0
        self.last_result = None
        self.rejoined = None
        self.timings = {"steps": 0, "step_s": 0.0, "allreduce_s": 0.0, "delay_s": 0.0,
                        "optimizer_s": 0.0, "digest_s": 0.0}
        if rejoining:
            self._qring_rejoin(join_timeout_ms)

    @property
    def step_count(self):
        """The job's next step: 0 at the start, the step it was admitted at in a rank that
        rejoined. A training loop starts there."""
        return self._qring_step

    @property
    def quorum_allreduce(self):
        return self._qring_q

    def _qring_state(self, step):
        buf = io.BytesIO()
        torch.save({"params": [p.detach() for p in self._qring_params],
                    "optimizer": torch.optim.Optimizer.state_dict(self), "step": step}, buf)
        return buf.getvalue()

    def _qring_rejoin(self, timeout_ms):
        step, donor, epoch, members = self._qring_q.join(timeout_ms)
        param_bytes = sum(p.numel() * p.element_size() for p in self._qring_params)
        room = len(self._qring_state(0)) + 4 * param_bytes + (1 << 20)
        data = self._qring_q.receive_state(room, timeout_ms)
        state = torch.load(io.BytesIO(data))
        with torch.no_grad():
            for p, v in zip(self._qring_params, state["params"]):
                p.copy_(v)
        torch.optim.Optimizer.load_state_dict(self, state["optimizer"])
        # The loop goes on at the step this rank was admitted to (the donor's state is the one
        # before that step's update).
        self._qring_step = step
        self.rejoined = {"step": step, "donor": donor, "epoch": epoch, "members": members,
                         "state_bytes": len(data)}

    def _qring_point_grads(self):
        # param.grad must stay the view: one the user replaced (or set to None) is copied
        # back (or zeroed) and the view restored.
        for p, view in zip(self._qring_trainable, self._qring_views):
            g = p.grad
            if g is None:
                view.zero_()
                p.grad = view
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view

    def zero_grad(self, set_to_none=False):
        """Zeros the flat gradient buffer (the views stay; set_to_none is ignored). Where a
        step's work begins: a straggler model's delay for the step is slept here (else in
        step()), cut short once the step is decided without this rank (see excluded())."""
        self._qring_flat.zero_()
        self._qring_point_grads()
        self._qring_q._h.delay(self._qring_step)

    def excluded(self):
        """True once the current step (step_count) was decided without this rank: its
        gradient can no longer count, so the loop may skip computing it (step() still takes
        the step's result)."""
        return self._qring_q._h.excluded(self._qring_step)

    def step(self, closure=None):
        """One quorum all-reduce of the whole gradient (averaged over the step's contributors;
        last_result holds the result), then the wrapped optimizer's step on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        self._qring_point_grads()
        t = self._qring_step
        h = self._qring_q._h
        d0 = time.perf_counter()
        digest = _qring.digest(self._qring_trainable)
        d1 = time.perf_counter()
        h.contribute(t, self._qring_flat, digest)
        r = h.wait(t, None)
        t1 = time.perf_counter()
        for rank, _incarnation, _step, donor in r.joined:
            if donor == self._qring_rank:  # the state before this step's update
                self._qring_q.send_state(rank, t, self._qring_state(t))
        t2 = time.perf_counter()
        if not r.skipped:
            super(self.__class__, self).step()
        t3 = time.perf_counter()
        self._qring_step = t + 1
        self.last_result = r
        tm = self.timings
        tm["steps"] += 1
        tm["step_s"] += t3 - t0
        tm["delay_s"] += r.delay_ms / 1e3
        tm["allreduce_s"] += (t1 - d1) - r.delay_ms / 1e3
        tm["digest_s"] += d1 - d0
        tm["optimizer_s"] += t3 - t2
        return loss


def _parameter_names(where, params, named_parameters):
    if named_parameters is None:
        return [f"param.{i}" for i in range(len(params))]
    named = list(named_parameters)
    for i, item in enumerate(named):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"{where}: named_parameters must yield (str, Parameter) pairs, as "
                            f"model.named_parameters() does; item {i} is {item!r:.60}")
    by_id = {id(p): n for n, p in named}
    if len({n for n, _ in named}) != len(named):
        raise ValueError(f"{where}: named_parameters has duplicate names")
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"{where}: {len(missing)} of the optimizer's parameters are not in "
                         f"named_parameters (the first is parameter {missing[0]})")
    return [by_id[id(p)] for p in params]


def DistributedOptimizer(optimizer, named_parameters=None, quorum=None, grace_ms=0,
                         straggler="none", evict_ms=5000, late="drop", deadline_ms=30000,
                         min_world=0, seed=0, join_timeout_ms=120000, max_lag_ms=0):
    """Wraps `optimizer` (any torch.optim.Optimizer) for synchronous SGD with backup workers.

    quorum: ranks counted per step (int), a fraction of the live ranks (float), or None (all).
    grace_ms: wait this long for more after `quorum` ranks are ready. straggler: an injected
    delay model, as qring-train's straggler.model ("fixed:2:200": rank 2 is 200 ms late every
    step; "lognormal:MU:SIGMA", "trace:FILE", ...), with `seed`. evict_ms: a rank silent this
    long leaves the job, which goes on while max(quorum, min_world) ranks are live. late:
    "drop" or "carry" for a gradient that missed its step. max_lag_ms: a rank that falls
    this far behind (0 = 3 x evict_ms, -1 = never) leaves with qring.Behind. A rank restarted by
    `qring-launch --max-restarts` gets model, optimizer state and step count from a live member
    here (join_timeout_ms bounds the wait) and starts at step_count.

    Returns an optimizer of the same class (so schedulers work) whose step() does the quorum
    all-reduce; `last_result` is the last step's qring.QuorumResult, `timings` the time spent.
    """
    where = "qring.torch.DistributedOptimizer"
    _require_init(where)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    qopts = dict(quorum=quorum, grace_ms=grace_ms, straggler=straggler, evict_ms=evict_ms,
                 late=late, deadline_ms=deadline_ms, min_world=min_world, seed=seed,
                 max_lag_ms=max_lag_ms)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, qopts, join_timeout_ms)
    if optimizer.state and not wrapped.rejoined:
        torch.optim.Optimizer.load_state_dict(wrapped, optimizer.state_dict())
    return wrapped
