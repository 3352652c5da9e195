#include "collectives/communicator.h"

#include <elf.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <link.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "collectives/algorithms.h"
#include "collectives/engine.h"
#include "collectives/quorum/wire.h"

namespace qring::collectives {

namespace {

// Version of what the collectives put on the wire (tags, operation descriptors, the engine's
// control messages): ranks with different versions cannot talk.
constexpr int kProtocolVersion = 2;
constexpr size_t kMaxSettingsBytes = 4096;

// The GNU build id of the executable ("" when it has none): ranks running different builds
// may reduce or update with different bits (compiler, flags, vector width).
std::string executable_build_id() {
  std::string id;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) -> int {
        auto& res = *static_cast<std::string*>(out);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_NOTE) continue;
          const char* p = reinterpret_cast<const char*>(info->dlpi_addr + ph.p_vaddr);
          const char* end = p + ph.p_memsz;
          while (p + sizeof(ElfW(Nhdr)) <= end) {
            ElfW(Nhdr) nh;
            std::memcpy(&nh, p, sizeof(nh));
            const char* name = p + sizeof(nh);
            const char* desc = name + ((nh.n_namesz + 3) & ~3u);
            if (desc + nh.n_descsz > end) break;
            if (nh.n_type == NT_GNU_BUILD_ID && nh.n_namesz == 4 && std::memcmp(name, "GNU", 4) == 0) {
              for (size_t k = 0; k < nh.n_descsz; ++k)
                res += fmt::format("{:02x}", uint8_t(desc[k]));
              return 1;
            }
            p = desc + ((nh.n_descsz + 3) & ~3u);
          }
        }
        return 1;  // the first object is the executable: stop there
      },
      &id);
  return id;
}

// Instruction set the reduction kernels were compiled for.
std::string kernel_isa() {
  std::string isa;
#if defined(__x86_64__)
  isa = "x86_64";
#elif defined(__aarch64__)
  isa = "aarch64";
#else
  isa = "other";
#endif
#ifdef __AVX512F__
  isa += "+avx512f";
#endif
#ifdef __AVX2__
  isa += "+avx2";
#endif
#ifdef __FMA__
  isa += "+fma";
#endif
#ifdef __ARM_FEATURE_SVE
  isa += "+sve";
#endif
  return isa;
}

std::map<std::string, std::string> parse_settings(const std::string& text, int from, int rank) {
  std::map<std::string, std::string> m;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    const std::string line = text.substr(pos, nl - pos);
    const size_t eq = line.find('=');
    if (eq == std::string::npos || eq == 0)
      throw ProtocolError(fmt::format("rank {}: malformed communicator settings from rank {}",
                                      rank, from));
    m[line.substr(0, eq)] = line.substr(eq + 1);
    pos = nl + 1;
  }
  return m;
}

}  // namespace

std::string Communicator::settings_text(const net::Endpoint& ep, const CommOptions& opts) {
  std::string t;
  auto add = [&](const char* k, const std::string& v) { t += fmt::format("{}={}\n", k, v); };
  add("protocol", std::to_string(kProtocolVersion));
  add("quorum_wire", std::to_string(qwire::kVersion));
  add("provider", ep.provider());
  add("max_message_size", std::to_string(ep.max_message_size()));
  add("immediate_data_bytes", std::to_string(ep.data_bytes()));
  add("small_allreduce_bytes", std::to_string(small_allreduce_bytes(opts)));
  add("halving_doubling_bytes", std::to_string(halving_doubling_bytes(opts)));
  add("segment_bytes", std::to_string(segment_bytes(opts, ep.traits())));
  const std::string id = executable_build_id();
  add("build_id", id.empty() ? "unknown" : id);
  add("kernel_isa", kernel_isa());
  return t;
}

std::string Communicator::settings_difference(const std::string& mine, int mine_rank,
                                              const std::string& theirs, int their_rank) {
  const auto own = parse_settings(mine, mine_rank, mine_rank);
  const auto other = parse_settings(theirs, their_rank, mine_rank);
  for (const auto& [key, value] : own) {
    auto it = other.find(key);
    const std::string v = it == other.end() ? "(not set)" : it->second;
    if (v != value)
      return fmt::format("{} is '{}' on rank {} and '{}' on rank {}", key, value, mine_rank, v,
                         their_rank);
  }
  for (const auto& [key, value] : other)
    if (!own.count(key))
      return fmt::format("{} is '{}' on rank {} and not set on rank {}", key, value, their_rank,
                         mine_rank);
  return {};
}

// Every rank sends its settings to every other and compares what it gets with its own; two
// ranks that differ both name the setting and both values, and every other rank differs from
// one of them, so every rank fails. A rank whose settings do not arrive by the deadline is
// named. On any failure the endpoint is closed before the buffers go away.
void Communicator::check_settings(net::Endpoint& ep, const CommOptions& opts) {
  const int rank = ep.rank(), world = ep.world_size();
  if (world == 1) return;
  const std::string mine = settings_text(ep, opts);
  if (mine.size() > kMaxSettingsBytes)
    throw UsageError(fmt::format("rank {}: communicator settings of {} bytes", rank, mine.size()));
  const uint64_t tag = net::make_tag(net::Op::kHello, 0, 0);
  std::vector<std::vector<char>> in(static_cast<size_t>(world));
  std::vector<net::RequestPtr> recvs(static_cast<size_t>(world)), sends;
  try {
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      in[size_t(p)].resize(kMaxSettingsBytes);
      recvs[size_t(p)] = ep.irecv(p, tag, in[size_t(p)].data(), kMaxSettingsBytes);
    }
    for (int p = 0; p < world; ++p)
      if (p != rank) sends.push_back(ep.isend(p, tag, mine.data(), mine.size()));
    const Deadline deadline = Clock::now() + opts.timeout;
    net::Backoff backoff;
    while (true) {
      std::vector<int> missing;
      for (int p = 0; p < world; ++p)
        if (p != rank && !recvs[size_t(p)]->done()) missing.push_back(p);
      const bool sent = std::all_of(sends.begin(), sends.end(), [](auto& r) { return r->done(); });
      if (missing.empty() && sent) break;
      if (ep.progress() > 0) {
        backoff.reset();
        continue;
      }
      if (Clock::now() >= deadline)
        throw TimeoutError(fmt::format(
            "rank {}: communicator setup timed out after {} ms: no settings from rank(s) {} "
            "(not started, or a different world)",
            rank, opts.timeout.count(), fmt::join(missing, ", ")));
      backoff.idle();
    }
    for (const auto& s : sends) net::throw_if_failed(*s, "communicator setup");
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      const net::Request& rv = *recvs[size_t(p)];
      net::throw_if_failed(rv, "communicator setup");
      const std::string why =
          settings_difference(mine, rank, std::string(in[size_t(p)].data(), rv.bytes), p);
      if (!why.empty())
        throw ConfigError(fmt::format(
            "rank {}: communicator settings differ: {}; every rank must run the same build "
            "with the same settings",
            rank, why));
    }
  } catch (...) {
    ep.close();  // nothing stays posted into `in` or reads `mine`
    throw;
  }
}

Communicator::Communicator(std::unique_ptr<net::Endpoint> endpoint, CommOptions opts)
    : rank_(endpoint->rank()), size_(endpoint->world_size()), opts_(opts) {
  if (opts_.timeout.count() <= 0) throw UsageError("CommOptions.timeout must be > 0");
  // A rank that joins a running job reaches no peer yet: its quorum all-reduce compares the
  // settings with every member it connects to instead.
  bool joining = endpoint->incarnation() > 0 && size_ > 1;
  for (int p = 0; p < size_ && joining; ++p) joining = p == rank_ || !endpoint->connected(p);
  if (!joining) check_settings(*endpoint, opts_);
  engine_ = std::make_unique<Engine>(std::move(endpoint), opts_);
}

Communicator::~Communicator() = default;

std::string Communicator::provider() const {
  return engine_->provider();
}
bool Communicator::broken() const {
  return engine_->broken();
}

WorkPtr Communicator::submit(std::unique_ptr<EngineOp> op) {
  if (op->deadline == Deadline{}) op->deadline = engine_->now() + opts_.timeout;
  bool wake = !caller_drives_;
  caller_drives_ = false;
  return engine_->submit(std::move(op), wake);
}

namespace {
void check_buffers(const char* what, const void* send, const void* recv, size_t count) {
  if (count && (!send || !recv))
    throw UsageError(fmt::format("{}: null buffer for {} elements", what, count));
}
void check_members(const char* what, const std::vector<int>& m, int rank, int size) {
  if (m.empty()) return;
  for (size_t i = 0; i < m.size(); ++i)
    if (m[i] < 0 || m[i] >= size || (i > 0 && m[i] <= m[i - 1]))
      throw UsageError(fmt::format("{}: members must be distinct ranks in [0, {}) in ascending "
                                   "order",
                                   what, size));
  if (!std::binary_search(m.begin(), m.end(), rank))
    throw UsageError(fmt::format("{}: rank {} is not among the members", what, rank));
}
}  // namespace

WorkPtr Communicator::allreduce_async(const void* send, void* recv, size_t count, DataType type,
                                      RedOp op, const std::vector<int>& members) {
  check_buffers("allreduce", send, recv, count);
  check_members("allreduce", members, rank_, size_);
  CollArgs a{CollKind::kAllreduce, send, recv, count, type, op, net::Op::kAllreduce, members};
  auto e = make_collective_op(*engine_, opts_, a);
  e->seq = next_seq();
  return submit(std::move(e));
}

WorkPtr Communicator::allgather_async(const void* send, void* recv, size_t count, DataType type,
                                      const std::vector<int>& members) {
  check_buffers("allgather", send, recv, count);
  check_members("allgather", members, rank_, size_);
  CollArgs a{CollKind::kAllgather, send,   recv, count, type, RedOp::kSum,
             net::Op::kAllgather,  members};
  auto e = make_collective_op(*engine_, opts_, a);
  e->seq = next_seq();
  return submit(std::move(e));
}

WorkPtr Communicator::reduce_scatter_async(const void* send, void* recv, size_t count,
                                           DataType type, RedOp op) {
  check_buffers("reduce_scatter", send, recv, count);
  CollArgs a{CollKind::kReduceScatter, send, recv, count, type, op, net::Op::kReduceScatter, {}};
  auto e = make_collective_op(*engine_, opts_, a);
  e->seq = next_seq();
  return submit(std::move(e));
}

WorkPtr Communicator::broadcast_async(void* buf, size_t count, DataType type, int root) {
  if (root < 0 || root >= size_)
    throw UsageError(fmt::format("broadcast: root {} out of range [0, {})", root, size_));
  check_buffers("broadcast", buf, buf, count);
  auto e = make_broadcast_op(*engine_, opts_, buf, count, type, root);
  e->seq = next_seq();
  return submit(std::move(e));
}

WorkPtr Communicator::barrier_async() {
  auto e = make_barrier_op(*engine_);
  e->seq = next_seq();
  return submit(std::move(e));
}

void Communicator::register_buffer(const void* ptr, size_t bytes) {
  engine_->run([&](net::Endpoint& ep) { ep.register_memory(ptr, bytes); });
}

}  // namespace qring::collectives
