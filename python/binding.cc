// qring._qring: the Python binding of qring (pybind11). The Python package python/qring wraps
// it (qring.init, qring.allreduce, qring.QuorumAllreduce, qring.torch); docs/python.md.
//
// Every use of qring's C++ quorum API by Python goes through this file (QuorumHandle below),
// so that a change of that API is adapted here once.
//
// Buffers are taken without a copy: a torch tensor through its data pointer (duck-typed, so the
// module links no libtorch and works with any PyTorch), anything else through the buffer
// protocol (numpy arrays). Only contiguous float32 CPU memory is accepted; anything else is a
// TypeError (dtype, type) or ValueError (layout, device, length, read-only) saying what was
// expected. Every blocking call releases the GIL. qring's exceptions arrive as the Python
// classes of the same names (qring.Error and below), with qring's message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "collectives/quorum/quorum.h"
#include "collectives/session.h"
#include "collectives/straggler.h"
#include "net/base/error.h"
#include "net/base/fnv1a.h"

namespace py = pybind11;
namespace qc = qring::collectives;
using Clock = std::chrono::steady_clock;

namespace {

// ------------------------------------------------------------------ buffers

// Contiguous float32 CPU memory of a tensor or array, and what keeps it alive.
class Buffer {
 public:
  Buffer() = default;
  Buffer(py::handle obj, const std::string& what, bool writable) {
    if (is_torch_tensor(obj)) {
      from_tensor(obj, what);
    } else {
      from_buffer(obj, what, writable);
    }
  }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    release();
    data_ = o.data_;
    count_ = o.count_;
    owner_ = std::move(o.owner_);
    view_ = o.view_;
    has_view_ = o.has_view_;
    o.has_view_ = false;
    o.data_ = nullptr;
    return *this;
  }
  ~Buffer() { release(); }
  float* data() const { return data_; }
  size_t count() const { return count_; }
  bool empty() const { return data_ == nullptr && !has_view_ && !owner_; }

 private:
  static bool is_torch_tensor(py::handle obj) {
    return py::hasattr(obj, "data_ptr") && py::hasattr(obj, "dtype") &&
           py::hasattr(obj, "is_contiguous") && py::hasattr(obj, "device");
  }

  void from_tensor(py::handle t, const std::string& what) {
    const std::string dtype = py::str(t.attr("dtype"));
    if (dtype != "torch.float32")
      throw py::type_error(
          fmt::format("{}: expected a float32 tensor, got dtype {} (use .float())", what, dtype));
    const std::string device = py::str(t.attr("device").attr("type"));
    if (device != "cpu")
      throw py::value_error(fmt::format(
          "{}: expected a CPU tensor, got one on '{}' (qring reduces host memory: use .cpu())",
          what, device));
    const std::string layout = py::str(t.attr("layout"));
    if (layout != "torch.strided")
      throw py::value_error(
          fmt::format("{}: expected a dense (strided) tensor, got layout {}", what, layout));
    if (!t.attr("is_contiguous")().cast<bool>())
      throw py::value_error(
          fmt::format("{}: expected a contiguous tensor (use .contiguous())", what));
    count_ = t.attr("numel")().cast<size_t>();
    data_ = reinterpret_cast<float*>(t.attr("data_ptr")().cast<uintptr_t>());
    owner_ = py::reinterpret_borrow<py::object>(t);
  }

  void from_buffer(py::handle obj, const std::string& what, bool writable) {
    if (!PyObject_CheckBuffer(obj.ptr()))
      throw py::type_error(fmt::format(
          "{}: expected a contiguous float32 CPU torch tensor or numpy array, got {}", what,
          std::string(py::str(obj.get_type().attr("__name__")))));
    const int flags = PyBUF_RECORDS_RO | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      PyErr_Clear();
      if (writable && PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_RECORDS_RO) == 0) {
        PyBuffer_Release(&view_);
        throw py::value_error(fmt::format(
            "{}: expected a writable buffer (the result is written into it), got a read-only "
            "one",
            what));
      }
      PyErr_Clear();
      throw py::value_error(
          fmt::format("{}: expected a contiguous float32 buffer; this one cannot be read", what));
    }
    has_view_ = true;
    const std::string format = view_.format ? view_.format : "B";
    if (view_.itemsize != 4 || (format != "f" && format != "<f" && format != "=f"))
      throw py::type_error(fmt::format(
          "{}: expected float32 elements, got format '{}' ({} bytes each; numpy: "
          ".astype(numpy.float32))",
          what, format, view_.itemsize));
    if (!PyBuffer_IsContiguous(&view_, 'C'))
      throw py::value_error(fmt::format(
          "{}: expected a C-contiguous array (numpy: numpy.ascontiguousarray)", what));
    data_ = static_cast<float*>(view_.buf);
    count_ = size_t(view_.len) / 4;
    owner_ = py::reinterpret_borrow<py::object>(obj);
  }

  void release() {
    if (has_view_) PyBuffer_Release(&view_);
    has_view_ = false;
  }

  float* data_ = nullptr;
  size_t count_ = 0;
  py::object owner_;
  Py_buffer view_{};
  bool has_view_ = false;
};

// ------------------------------------------------------------------ the session

std::unique_ptr<qc::Session> g_session;
pid_t g_pid = 0;  // the process that made the session (a forked child has no engine thread)
class QuorumHandle;
std::vector<std::weak_ptr<QuorumHandle>> g_quorums;
uint32_t g_instances = 0;  // quorum all-reduces made in this session (their instance numbers)

qc::Session& session() {
  if (!g_session) throw qring::UsageError("qring is not initialized: call qring.init() first");
  return *g_session;
}

template <typename F>
auto without_gil(F&& f) {
  py::gil_scoped_release release;
  return f();
}

std::optional<qc::RedOp> redop_of(const std::string& op) {
  if (op == "mean" || op == "average") return qc::RedOp::kAvg;
  return qc::parse_redop(op);
}

// ------------------------------------------------------------------ the quorum all-reduce

struct Result {
  uint64_t step = 0;
  std::vector<int> contributors;
  int count = 0;
  bool excluded = false;
  std::vector<int> dropped;
  int quorum = 0;
  bool skipped = false;
  uint64_t epoch = 0;
  uint32_t attempt = 0;
  std::vector<std::tuple<int, uint32_t, uint64_t, int>> joined;  // rank, incarnation, step, donor
  double wait_ms = 0, reduce_ms = 0, delay_ms = 0;
};

Result to_result(const qc::QuorumResult& r, int world, double delay_ms) {
  Result out;
  out.step = r.step;
  if (!r.skipped)
    for (int p = 0; p < world; ++p)
      if (r.contains(p)) out.contributors.push_back(p);
  out.count = r.count;
  out.excluded = !r.self_counted;
  out.dropped = r.dropped;
  out.quorum = r.quorum;
  out.skipped = r.skipped;
  out.epoch = r.epoch;
  out.attempt = r.attempt;
  for (const auto& j : r.joined) out.joined.emplace_back(j.rank, j.incarnation, j.step, j.donor);
  out.wait_ms = r.wait_ms;
  out.reduce_ms = r.reduce_ms;
  out.delay_ms = delay_ms;
  return out;
}

struct QuorumSettings {
  size_t count = 0;
  std::string quorum;  // "" = the world; "3"; "0.75"
  int64_t grace_ms = 0, evict_ms = 5000, deadline_ms = 30000, max_lag_ms = 0;
  std::string late = "drop", straggler = "none";
  uint64_t seed = 0;
  int min_world = 0;
  bool mean = true;
  std::string agreed;
};

class QuorumHandle {
 public:
  explicit QuorumHandle(const QuorumSettings& s)
      : straggler_(qc::StragglerModel::parse(s.straggler)), seed_(s.seed), count_(s.count) {
    qc::Session& ses = session();
    if (s.count < 1) throw py::value_error("QuorumAllreduce: count must be at least 1");
    qc::QuorumOptions qo;
    const int world = ses.size();
    if (!s.quorum.empty()) {
      if (s.quorum.find('.') != std::string::npos) {
        qo.fraction = std::stod(s.quorum);
        if (!(qo.fraction > 0 && qo.fraction <= 1))
          throw qring::ConfigError(fmt::format("quorum fraction {} must be in (0, 1]", s.quorum));
      }
      qo.quorum = qc::resolve_quorum(s.quorum, world);
    }
    qo.grace = std::chrono::milliseconds(s.grace_ms);
    qo.evict = std::chrono::milliseconds(s.evict_ms);
    qo.max_lag = std::chrono::milliseconds(s.max_lag_ms);
    qo.deadline = std::chrono::milliseconds(s.deadline_ms);
    qo.late = qc::parse_late_policy(s.late);
    qo.min_world = s.min_world;
    qo.mean = s.mean;
    qo.agreed = s.agreed;
    qo.store = ses.store();
    qo.join = ses.rejoining();
    qo.instance = int(++g_instances);
    rank_ = ses.rank();
    world_ = world;
    q_ = std::make_unique<qc::QuorumAllreduce>(ses.comm(), s.count, qo);
  }

  ~QuorumHandle() {
    if (getpid() != g_pid) {  // a forked child: the engine is the parent's
      abandon();
      return;
    }
    // The engine may still write into a pending buffer: stop it before they are released.
    py::gil_scoped_release release;
    q_.reset();
  }
  QuorumHandle(const QuorumHandle&) = delete;
  QuorumHandle& operator=(const QuorumHandle&) = delete;

  qc::QuorumAllreduce& q() {
    if (!q_)
      throw qring::UsageError("this QuorumAllreduce was closed (close() or qring.finalize())");
    return *q_;
  }

  // The straggler model's delay for `step` (once per step), cut short as soon as the step is
  // decided without this rank. Returns whether this rank is excluded from the step (its work
  // for it can be abandoned). Releases the GIL.
  bool delay(uint64_t step) {
    qc::QuorumAllreduce& qa = q();
    if (delayed_ && *delayed_ == step) return qa.excluded(step);
    delayed_ = step;
    const auto d = straggler_.delay(seed_, rank_, step);
    const auto t0 = Clock::now();
    without_gil([&] { return qc::sleep_unless(d, [&] { return qa.excluded(step); }); });
    delay_ms_[step] = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    return qa.excluded(step);
  }

  // This rank's contribution to `step`, after the step's delay (unless delay() ran for it),
  // unless the step was decided without this rank meanwhile. Releases the GIL.
  void contribute(uint64_t step, py::handle t, std::optional<uint64_t> digest) {
    Buffer b(t, "QuorumAllreduce.contribute", /*writable=*/true);
    check_count(b, "contribute");
    qc::QuorumAllreduce& qa = q();
    if (!delay(step))
      without_gil([&] {
        if (!qa.excluded(step)) qa.contribute(step, b.data(), count_, digest);
        return 0;
      });
    pending_[step] = std::move(b);
  }

  // The step's result, written into `out` (default: the buffer contributed to the step).
  Result wait(uint64_t step, py::handle out) {
    Buffer target;
    if (!out.is_none()) {
      target = Buffer(out, "QuorumAllreduce.wait(out=)", /*writable=*/true);
      check_count(target, "wait");
    } else {
      auto it = pending_.find(step);
      if (it == pending_.end())
        throw py::value_error(fmt::format(
            "QuorumAllreduce.wait({}): nothing was contributed to this step; pass out= (a "
            "float32 buffer of {} elements) for the result",
            step, count_));
      target = std::move(it->second);
      pending_.erase(it);
    }
    qc::QuorumAllreduce& qa = q();
    float* dst = target.data();
    qc::QuorumResult r = without_gil([&] { return qa.wait(step, dst); });
    double delay = 0;
    if (auto it = delay_ms_.find(step); it != delay_ms_.end()) {
      delay = it->second;
      delay_ms_.erase(it);
    }
    pending_.erase(step);
    return to_result(r, world_, delay);
  }

  // Ranks that left the view: the final barrier of qring.finalize() does not wait for them.
  std::vector<int> lost() {
    if (!q_) return {};
    std::vector<int> members = q_->membership().members(), out;
    for (int r = 0; r < world_; ++r)
      if (!std::binary_search(members.begin(), members.end(), r)) out.push_back(r);
    return out;
  }

  void close() {
    if (!q_) return;
    if (g_session) g_session->lost(lost());
    pending_.clear();
    without_gil([&] {
      q_.reset();
      return 0;
    });
  }

  size_t count() const { return count_; }

  // In a forked child: drop the all-reduce without stopping the parent's engine.
  void abandon() { (void)q_.release(); }

 private:
  void check_count(const Buffer& b, const char* what) const {
    if (b.count() != count_)
      throw py::value_error(fmt::format(
          "QuorumAllreduce.{}: expected {} float32 elements (the count it was made with), got {}",
          what, count_, b.count()));
  }

  qc::StragglerModel straggler_;
  uint64_t seed_;
  size_t count_;
  int rank_ = 0, world_ = 1;
  std::unique_ptr<qc::QuorumAllreduce> q_;
  std::map<uint64_t, Buffer> pending_;  // contributed, not yet waited for: kept alive
  std::map<uint64_t, double> delay_ms_;
  std::optional<uint64_t> delayed_;  // the last step whose delay was slept
};

std::shared_ptr<QuorumHandle> make_quorum(const QuorumSettings& s) {
  auto h = std::make_shared<QuorumHandle>(s);
  g_quorums.erase(std::remove_if(g_quorums.begin(), g_quorums.end(),
                                 [](const auto& w) { return w.expired(); }),
                  g_quorums.end());
  g_quorums.push_back(h);
  return h;
}

// ------------------------------------------------------------------ module functions

void init(const std::string& provider, int64_t timeout_ms, int64_t setup_timeout_ms,
          const std::string& log_level, const std::string& wait) {
  if (g_session)
    throw qring::UsageError(fmt::format(
        "qring.init() was called already (rank {} of {}); call qring.finalize() first",
        g_session->rank(), g_session->size()));
  auto level = spdlog::level::from_str(log_level);
  if (level == spdlog::level::off && log_level != "off")
    throw py::value_error(fmt::format(
        "log_level '{}': expected trace, debug, info, warn, error, critical or off", log_level));
  if (timeout_ms <= 0 || setup_timeout_ms <= 0)
    throw py::value_error("qring.init: timeout_ms and setup_timeout_ms must be > 0");
  if (wait != "block" && wait != "poll")
    throw py::value_error(fmt::format("qring.init: wait '{}': expected 'block' or 'poll'", wait));
  const qring::net::BootstrapInfo info = qring::net::detect_bootstrap();
  spdlog::set_level(level);
  spdlog::set_pattern(fmt::format("[%H:%M:%S.%e] [%^%l%$] [qring rank {}] %v", info.rank));
  qc::SessionOptions so;
  so.provider = provider;
  so.setup_timeout = std::chrono::milliseconds(setup_timeout_ms);
  so.comm.timeout = std::chrono::milliseconds(timeout_ms);
  so.doorbells = wait == "block";
  g_session = without_gil([&] { return std::make_unique<qc::Session>(info, so); });
  g_pid = getpid();
  g_instances = 0;
}

void finalize() {
  if (g_session && getpid() != g_pid) {
    // A forked child (a DataLoader worker...): the threads and connections are the parent's;
    // let go of the objects without running their shutdown.
    for (auto& w : g_quorums)
      if (auto h = w.lock()) h->abandon();
    g_quorums.clear();
    (void)g_session.release();
    return;
  }
  for (auto& w : g_quorums)
    if (auto h = w.lock()) h->close();
  g_quorums.clear();
  if (!g_session) return;
  std::unique_ptr<qc::Session> s = std::move(g_session);
  without_gil([&] {
    s.reset();
    return 0;
  });
}

void allreduce(py::handle t, const std::string& op) {
  auto red = redop_of(op);
  if (!red)
    throw py::value_error(
        fmt::format("qring.allreduce: op '{}': expected sum, mean, min or max", op));
  Buffer b(t, "qring.allreduce", /*writable=*/true);
  qc::Communicator& comm = session().comm();
  without_gil([&] {
    comm.allreduce(b.data(), b.data(), b.count(), qc::DataType::kFloat32, *red);
    return 0;
  });
}

void check_root(int root) {
  if (root < 0 || root >= session().size())
    throw py::value_error(fmt::format("root rank {} is not in [0, {})", root, session().size()));
}

void broadcast(py::handle t, int root) {
  check_root(root);
  Buffer b(t, "qring.broadcast", /*writable=*/true);
  qc::Communicator& comm = session().comm();
  without_gil([&] {
    comm.broadcast(b.data(), b.count(), qc::DataType::kFloat32, root);
    return 0;
  });
}

// Bytes from `root` to every rank (root passes them, the others None): the length first, then
// the bytes in 4-byte words.
py::bytes broadcast_bytes(py::object data, int root) {
  check_root(root);
  qc::Session& s = session();
  std::string mine;
  if (s.rank() == root) {
    if (data.is_none()) throw py::value_error("broadcast_bytes: the root rank passes the bytes");
    mine = py::bytes(data);
  }
  int64_t len = int64_t(mine.size());
  qc::Communicator& comm = s.comm();
  std::vector<int32_t> words;
  without_gil([&] {
    comm.broadcast(&len, 1, qc::DataType::kInt64, root);
    words.assign((size_t(len) + 3) / 4, 0);
    if (s.rank() == root) std::memcpy(words.data(), mine.data(), mine.size());
    if (!words.empty()) comm.broadcast(words.data(), words.size(), qc::DataType::kInt32, root);
    return 0;
  });
  return py::bytes(reinterpret_cast<const char*>(words.data()), size_t(len));
}

void barrier() {
  qc::Communicator& comm = session().comm();
  without_gil([&] {
    comm.barrier();
    return 0;
  });
}

// A digest of float32 buffers (the parameters): equal on two ranks iff (almost surely) their
// bytes are.
uint64_t digest(const py::sequence& tensors) {
  uint64_t h = qring::kFnv1aOffset;
  std::vector<Buffer> bufs;
  bufs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    bufs.emplace_back(tensors[i], fmt::format("qring digest: item {}", i), false);
  without_gil([&] {
    for (const Buffer& b : bufs) h = qring::fnv1a64_words(b.data(), b.count() * 4, h);
    return 0;
  });
  return h;
}

// Every rank states (key, value) items (value an int, compared and shown as it is, or a str,
// compared by digest); a difference is a ConfigError on every rank naming the key and which
// ranks hold which value.
void agree(const std::string& what, const std::vector<std::pair<std::string, py::object>>& items) {
  qc::Session& s = session();
  std::vector<int64_t> mine;
  std::vector<bool> numeric;
  for (const auto& [key, value] : items) {
    const bool is_int = py::isinstance<py::int_>(value);
    numeric.push_back(is_int);
    mine.push_back(is_int ? value.cast<int64_t>()
                          : int64_t(qring::fnv1a64(std::string(py::str(value)))));
  }
  const size_t k = mine.size();
  std::vector<int64_t> all(k * size_t(s.size()));
  qc::Communicator& comm = s.comm();
  without_gil([&] {
    comm.allgather(mine.data(), all.data(), k, qc::DataType::kInt64);
    return 0;
  });
  std::vector<std::string> diffs;
  for (size_t i = 0; i < k; ++i) {
    std::map<int64_t, std::vector<int>> holders;
    for (int r = 0; r < s.size(); ++r) holders[all[size_t(r) * k + i]].push_back(r);
    if (holders.size() < 2) continue;
    std::vector<std::string> parts;
    for (const auto& [v, ranks] : holders)
      parts.push_back(fmt::format("{} on rank(s) {}",
                                  numeric[i] ? fmt::format("{}", v)
                                             : fmt::format("digest {:016x}", uint64_t(v)),
                                  fmt::join(ranks, ", ")));
    diffs.push_back(fmt::format("{}: {}", items[i].first, fmt::join(parts, "; ")));
  }
  if (!diffs.empty())
    throw qring::ConfigError(fmt::format("rank {}: {} differ across ranks: {}", s.rank(), what,
                                         fmt::join(diffs, " | ")));
}

// ------------------------------------------------------------------ exceptions

struct PyErrors {
  PyObject *error, *config, *usage, *protocol, *data, *io, *timeout, *quorum_timeout,
      *quorum_lost, *evicted, *behind, *job_over;
};
PyErrors g_err{};

PyObject* new_error(py::module_& m, const char* name, std::vector<PyObject*> bases,
                    const char* doc) {
  py::tuple t(bases.size());
  for (size_t i = 0; i < bases.size(); ++i) t[i] = py::reinterpret_borrow<py::object>(bases[i]);
  PyObject* cls = PyErr_NewExceptionWithDoc((std::string("qring.") + name).c_str(), doc,
                                            t.ptr(), nullptr);
  if (!cls) throw py::error_already_set();
  m.attr(name) = py::reinterpret_borrow<py::object>(cls);
  return cls;
}

void register_errors(py::module_& m) {
  g_err.error = new_error(m, "Error", {PyExc_RuntimeError}, "Root of qring's errors.");
  g_err.config = new_error(m, "ConfigError", {g_err.error, PyExc_ValueError},
                           "Bad configuration, environment or arguments.");
  g_err.usage = new_error(m, "UsageError", {g_err.error, PyExc_ValueError},
                          "The caller did something wrong (wrong step, closed object...).");
  g_err.protocol = new_error(m, "ProtocolError", {g_err.error}, "A malformed wire message.");
  g_err.data = new_error(m, "DataError", {g_err.error, PyExc_ValueError}, "Bad input data.");
  g_err.io = new_error(m, "IoError", {g_err.error},
                       "The transport failed: the communicator is broken.");
  g_err.timeout = new_error(m, "TimeoutError", {g_err.io, PyExc_TimeoutError},
                            "A deadline passed; the message names what was awaited.");
  g_err.quorum_timeout = new_error(m, "QuorumTimeout", {g_err.timeout},
                                   "Fewer than the quorum contributed by the hard deadline.");
  g_err.quorum_lost = new_error(m, "QuorumLost", {g_err.quorum_timeout},
                                "The job cannot go on (too few live ranks, replicas drifted).");
  g_err.evicted = new_error(m, "Evicted", {g_err.io},
                            "This rank was evicted while alive; the others went on without it.");
  g_err.behind = new_error(m, "Behind", {g_err.evicted},
                           "This rank fell more than max_lag_ms behind the others and left; it "
                           "catches up by rejoining with a live member's state.");
  g_err.job_over = new_error(m, "JobOver", {g_err.io},
                             "A rank that came back found the job finished.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const qc::QuorumLost& e) {
      PyErr_SetString(g_err.quorum_lost, e.what());
    } catch (const qc::QuorumTimeout& e) {
      PyErr_SetString(g_err.quorum_timeout, e.what());
    } catch (const qc::Behind& e) {
      PyErr_SetString(g_err.behind, e.what());
    } catch (const qc::Evicted& e) {
      PyErr_SetString(g_err.evicted, e.what());
    } catch (const qc::JobOver& e) {
      PyErr_SetString(g_err.job_over, e.what());
    } catch (const qring::TimeoutError& e) {
      PyErr_SetString(g_err.timeout, e.what());
    } catch (const qring::IoError& e) {
      PyErr_SetString(g_err.io, e.what());
    } catch (const qring::ConfigError& e) {
      PyErr_SetString(g_err.config, e.what());
    } catch (const qring::UsageError& e) {
      PyErr_SetString(g_err.usage, e.what());
    } catch (const qring::ProtocolError& e) {
      PyErr_SetString(g_err.protocol, e.what());
    } catch (const qring::DataError& e) {
      PyErr_SetString(g_err.data, e.what());
    } catch (const qring::Error& e) {
      PyErr_SetString(g_err.error, e.what());
    }
  });
}

// ------------------------------------------------------------------ the module

void bind_quorum(py::module_& m) {
  py::class_<Result>(m, "QuorumResult", "The result of one step of the quorum all-reduce.")
      .def_readonly("step", &Result::step)
      .def_readonly("contributors", &Result::contributors, "ranks counted in the step, sorted")
      .def_readonly("count", &Result::count, "len(contributors)")
      .def_readonly("excluded", &Result::excluded, "this rank's contribution was not counted")
      .def_readonly("dropped", &Result::dropped, "ranks not counted")
      .def_readonly("quorum", &Result::quorum, "the quorum the step was decided with")
      .def_readonly("skipped", &Result::skipped,
                    "no result: a member was lost mid-step and too few contributors survived")
      .def_readonly("epoch", &Result::epoch, "the view (membership) that decided the step")
      .def_readonly("attempt", &Result::attempt)
      .def_readonly("joined", &Result::joined,
                    "(rank, incarnation, step, donor) of ranks that rejoined at this step")
      .def_readonly("wait_ms", &Result::wait_ms)
      .def_readonly("reduce_ms", &Result::reduce_ms)
      .def_readonly("delay_ms", &Result::delay_ms, "straggler delay slept before contributing")
      .def("__repr__", [](const Result& r) {
        return fmt::format("QuorumResult(step={}, contributors=[{}], count={}, excluded={}{})",
                           r.step, fmt::join(r.contributors, ", "), r.count,
                           r.excluded ? "True" : "False", r.skipped ? ", skipped=True" : "");
      });

  py::class_<QuorumSettings>(m, "_QuorumSettings")
      .def(py::init<>())
      .def_readwrite("count", &QuorumSettings::count)
      .def_readwrite("quorum", &QuorumSettings::quorum)
      .def_readwrite("grace_ms", &QuorumSettings::grace_ms)
      .def_readwrite("evict_ms", &QuorumSettings::evict_ms)
      .def_readwrite("max_lag_ms", &QuorumSettings::max_lag_ms)
      .def_readwrite("deadline_ms", &QuorumSettings::deadline_ms)
      .def_readwrite("late", &QuorumSettings::late)
      .def_readwrite("straggler", &QuorumSettings::straggler)
      .def_readwrite("seed", &QuorumSettings::seed)
      .def_readwrite("min_world", &QuorumSettings::min_world)
      .def_readwrite("mean", &QuorumSettings::mean)
      .def_readwrite("agreed", &QuorumSettings::agreed);

  py::class_<QuorumHandle, std::shared_ptr<QuorumHandle>>(m, "_Quorum")
      .def(py::init(&make_quorum))
      .def("contribute", &QuorumHandle::contribute, py::arg("step"), py::arg("t"),
           py::arg("digest") = py::none())
      .def("wait", &QuorumHandle::wait, py::arg("step"), py::arg("out") = py::none())
      .def("delay", &QuorumHandle::delay, py::arg("step"))
      .def("excluded", [](QuorumHandle& h, uint64_t step) { return h.q().excluded(step); })
      .def("members", [](QuorumHandle& h) { return h.q().membership().members(); })
      .def("coordinator", [](QuorumHandle& h) { return h.q().membership().coordinator(); })
      .def("survives_loss", [](QuorumHandle& h) { return h.q().membership().survives_loss(); })
      .def("join",
           [](QuorumHandle& h, int64_t timeout_ms) {
             auto& m = h.q().membership();
             qc::JoinInfo j = without_gil(
                 [&] { return m.join(Clock::now() + std::chrono::milliseconds(timeout_ms)); });
             return py::make_tuple(j.step, j.donor, j.epoch, j.members);
           })
      .def("receive_state",
           [](QuorumHandle& h, size_t max_bytes, int64_t timeout_ms) {
             auto& m = h.q().membership();
             std::string buf(max_bytes, '\0');
             size_t n = without_gil([&] {
               return m.receive_state(buf.data(), buf.size(),
                                      Clock::now() + std::chrono::milliseconds(timeout_ms));
             });
             return py::bytes(buf.data(), n);
           })
      .def("send_state",
           [](QuorumHandle& h, int to, uint64_t step, const py::bytes& state) {
             std::string s = state;
             h.q().membership().send_state(to, step, std::vector<char>(s.begin(), s.end()));
           })
      .def("lost", &QuorumHandle::lost)
      .def("close", &QuorumHandle::close)
      .def_property_readonly("count", &QuorumHandle::count);
}

}  // namespace

PYBIND11_MODULE(_qring, m) {
  m.doc() = "qring's C++ core (use the qring package: docs/python.md)";
  register_errors(m);
  m.def("init", &init, py::arg("provider"), py::arg("timeout_ms"), py::arg("setup_timeout_ms"),
        py::arg("log_level"), py::arg("wait"));
  m.def("finalize", &finalize);
  m.def("initialized", [] { return bool(g_session); });
  m.def("rank", [] { return session().rank(); });
  m.def("size", [] { return session().size(); });
  m.def("local_rank", [] { return session().info().local_rank; });
  m.def("local_size", [] { return session().info().local_size; });
  m.def("incarnation", [] { return session().incarnation(); });
  m.def("rejoining", [] { return session().rejoining(); });
  m.def("provider", [] { return session().provider(); });
  m.def("launcher", [] { return session().info().source; });
  m.def("allreduce", &allreduce, py::arg("t"), py::arg("op"));
  m.def("broadcast", &broadcast, py::arg("t"), py::arg("root"));
  m.def("broadcast_bytes", &broadcast_bytes, py::arg("data"), py::arg("root"));
  m.def("barrier", &barrier);
  m.def("digest", &digest, py::arg("tensors"));
  m.def("agree", &agree, py::arg("what"), py::arg("items"));
  m.def("straggler_delay_ms",
        [](const std::string& spec, uint64_t seed, int rank, uint64_t step) {
          return double(qc::StragglerModel::parse(spec).delay(seed, rank, step).count()) / 1000;
        },
        py::arg("spec"), py::arg("seed"), py::arg("rank"), py::arg("step"),
        "The delay in ms a straggler model gives (rank, step): what QuorumAllreduce sleeps");
  bind_quorum(m);
}
