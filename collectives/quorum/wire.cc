#include "collectives/quorum/wire.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "net/base/error.h"

namespace qring::collectives::qwire {

namespace {

constexpr uint32_t kUpMagic = 0x50555251;    // "QRUP"
constexpr uint32_t kDownMagic = 0x4E445251;  // "QRDN"

struct UpWire {
  uint32_t magic;
  uint16_t version;
  uint8_t type;
  uint8_t have;
  uint32_t rank;
  uint32_t world;
  uint64_t step;
  uint64_t count;
  int64_t completed;
  uint32_t attempt;
  int32_t suspect;
};
static_assert(sizeof(UpWire) == kUpBytes);

struct DownWire {
  uint32_t magic;
  uint16_t version;
  uint8_t type;
  uint8_t status;
  uint32_t world;
  uint32_t attempt;
  uint64_t step;
  uint64_t epoch;
  int64_t decide_us;
  int64_t settled;
  int32_t bad_rank;
  int32_t source;
  uint64_t bad_count;
  uint32_t quorum;
  uint32_t body;  // bytes after the header
  uint32_t bad_layout;
  uint32_t pad;
};
static_assert(sizeof(DownWire) == 80);

struct DepartureWire {
  uint32_t rank;
  uint32_t why;
  double silent_ms;
};
static_assert(sizeof(DepartureWire) == 16);

struct JoinedWire {
  uint32_t rank;
  uint32_t incarnation;
  uint64_t step;
  int32_t donor;
  uint32_t pad;
};
static_assert(sizeof(JoinedWire) == 24);

size_t bitmap_bytes(int world) {
  return (size_t(world) + 7) / 8;
}

void put_bitmap(std::vector<char>& out, int world, const std::vector<int>& ranks) {
  size_t at = out.size();
  out.resize(at + bitmap_bytes(world), 0);
  for (int r : ranks) out[at + size_t(r) / 8] |= char(1u << (r % 8));
}

std::vector<int> get_bitmap(const char* p, int world) {
  std::vector<int> r;
  for (int i = 0; i < world; ++i)
    if ((uint8_t(p[i / 8]) >> (i % 8)) & 1) r.push_back(i);
  return r;
}

}  // namespace

struct KnownWire {
  uint64_t step;
  uint32_t attempt;
  uint32_t skipped;
};
static_assert(sizeof(KnownWire) == 16);

size_t up_capacity(int world) {
  return sizeof(UpWire) + std::max(kMaxKnown * (sizeof(KnownWire) + bitmap_bytes(world)),
                                   kMaxShardValues * sizeof(double));
}

size_t down_capacity(int world) {
  size_t decide = 2 * bitmap_bytes(world) + 8 * size_t(world);
  size_t view = bitmap_bytes(world) + (sizeof(DepartureWire) + sizeof(JoinedWire)) * size_t(world);
  return sizeof(DownWire) + std::max({decide, view, kMaxFatalText});
}

using qproto::Down;
using qproto::Up;
using UpKind = qproto::Up::Kind;
using DownKind = qproto::Down::Kind;

std::vector<char> encode_up(int world, const Up& e) {
  const UpKind type = e.kind;
  if (type == UpKind::kTick || type == UpKind::kJoin || type == UpKind::kDied)
    throw UsageError(fmt::format("quorum: a local event (kind {}) cannot be sent", int(type)));
  UpWire w{};
  w.magic = kUpMagic;
  w.version = kVersion;
  w.type = uint8_t(type);
  w.have = e.absent ? 2 : e.have ? 1 : 0;
  w.rank = uint32_t(e.from);
  w.world = uint32_t(world);
  w.step = e.step;
  w.count = e.count;
  w.completed = e.completed;
  w.attempt = e.attempt;
  w.suspect = e.suspect;
  if (type == UpKind::kAck) w.count = e.epoch;
  if (type == UpKind::kReady) w.attempt = e.layout;  // READY has no attempt: its layout
  std::vector<char> out(sizeof(w));
  std::memcpy(out.data(), &w, sizeof(w));
  if (type == UpKind::kReady && e.digest) {
    out.resize(sizeof(w) + 8);
    std::memcpy(out.data() + sizeof(w), &*e.digest, 8);
  }
  if (type == UpKind::kReady && e.grad_sq) {  // + 16 bytes: the norms (NaN: no previous step's)
    const double norms[2] = {*e.grad_sq, e.prev_mean_sq ? *e.prev_mean_sq : std::nan("")};
    const size_t at = out.size();
    out.resize(at + sizeof(norms));
    std::memcpy(out.data() + at, norms, sizeof(norms));
  }
  if (type == UpKind::kShard) {
    const size_t n = std::min(e.values.size(), kMaxShardValues);
    out.resize(sizeof(w) + 8 * n);
    if (n) std::memcpy(out.data() + sizeof(w), e.values.data(), 8 * n);
  }
  if (type == UpKind::kAck) {
    for (size_t i = 0; i < e.known.size() && i < kMaxKnown; ++i) {
      const auto& k = e.known[i];
      KnownWire kw{k.step, k.attempt, k.skipped ? 1u : 0u};
      size_t at = out.size();
      out.resize(at + sizeof(kw));
      std::memcpy(out.data() + at, &kw, sizeof(kw));
      put_bitmap(out, world, k.contributors);
    }
  }
  return out;
}

namespace {

// decode_up: throws unless `w` (of a message of `len` bytes, `extra` after the header, an
// ACK's entries of `entry` bytes) is one rank `from` may send.
void check_up(const UpWire& w, size_t len, size_t extra, size_t entry, int world, int from) {
  bool bad_len;
  if (w.type == uint8_t(UpKind::kAck))
    bad_len = extra % entry != 0 || extra / entry > kMaxKnown;
  else if (w.type == uint8_t(UpKind::kReady))
    bad_len = extra != 0 && extra != 8 && extra != 16 && extra != 24;
  else if (w.type == uint8_t(UpKind::kShard))
    bad_len = extra == 0 || extra % 8 != 0 || extra / 8 > kMaxShardValues;
  else
    bad_len = extra != 0;
  if (bad_len)
    throw ProtocolError(fmt::format(
        "quorum: malformed message from rank {} (type {}, {} bytes)", from, w.type, len));
  if (w.magic != kUpMagic)
    throw ProtocolError(fmt::format("quorum: malformed message from rank {} (magic {:#x})", from,
                                    w.magic));
  if (w.version != kVersion)
    throw ProtocolError(fmt::format(
        "quorum: rank {} speaks quorum protocol version {}, this rank {}", from, w.version,
        kVersion));
  if (int64_t(w.world) != world || int64_t(w.rank) != from)
    throw ProtocolError(fmt::format(
        "quorum: a message from rank {} claims rank {} of {} ranks; this world has {}", from,
        w.rank, w.world, world));
  if (w.type < uint8_t(UpKind::kReady) ||
      (w.type > uint8_t(UpKind::kWarm) && w.type != uint8_t(UpKind::kLeave)))
    throw ProtocolError(fmt::format("quorum: unknown message type {} from rank {}", w.type, from));
  if (w.type == uint8_t(UpKind::kSuspect) && (w.suspect < 0 || w.suspect >= world))
    throw ProtocolError(
        fmt::format("quorum: rank {} reports rank {} of {} as suspect", from, w.suspect, world));
  if (w.type == uint8_t(UpKind::kAccept) && (w.suspect < 0 || w.suspect >= world || w.suspect == from))
    throw ProtocolError(
        fmt::format("quorum: rank {} accepts rank {} of {} as a joiner", from, w.suspect, world));
  if ((w.type == uint8_t(UpKind::kHello) || w.type == uint8_t(UpKind::kAccept)) &&
      (w.count == 0 || w.count > UINT32_MAX))
    throw ProtocolError(
        fmt::format("quorum: rank {} names incarnation {} of a joiner", from, w.count));
  if (w.have > 2)
    throw ProtocolError(fmt::format("quorum: rank {} sends a report of kind {}", from, w.have));
  if (w.type == uint8_t(UpKind::kShard) && (w.count == 0 || w.count > uint64_t(world) ||
                                        uint64_t(w.attempt) >= w.count))
    throw ProtocolError(fmt::format("quorum: rank {} sends part {} of {} of a report", from,
                                    w.attempt, w.count));
  if (w.completed < -1)
    throw ProtocolError(fmt::format("quorum: rank {} reports completed step {}", from, w.completed));
}

}  // namespace

Up decode_up(const void* buf, size_t len, int world, int from) {
  if (len < sizeof(UpWire))
    throw ProtocolError(
        fmt::format("quorum: malformed message from rank {} ({} bytes, expected {})", from, len,
                    sizeof(UpWire)));
  UpWire w;
  std::memcpy(&w, buf, sizeof(w));
  const size_t entry = sizeof(KnownWire) + bitmap_bytes(world);
  const size_t extra = len - sizeof(UpWire);
  check_up(w, len, extra, entry, world, from);
  Up e;
  e.kind = UpKind(w.type);
  const UpKind type = e.kind;
  e.from = from;
  e.step = w.step;
  e.count = w.count;
  e.completed = w.completed;
  e.attempt = w.attempt;
  if (type == UpKind::kReady) {
    e.layout = w.attempt;
    e.attempt = 0;
  }
  e.have = w.have == 1;
  e.absent = w.have == 2;
  e.suspect = w.suspect;
  const char* extra_at = static_cast<const char*>(buf) + sizeof(UpWire);
  if (type == UpKind::kReady && (extra == 8 || extra == 24)) {
    uint64_t d;
    std::memcpy(&d, extra_at, 8);
    e.digest = d;
  }
  if (type == UpKind::kReady && extra >= 16) {
    double norms[2];
    std::memcpy(norms, extra_at + extra - 16, 16);
    auto bad = [](double v) { return !std::isfinite(v) || v < 0; };
    if (bad(norms[0]) || (!std::isnan(norms[1]) && bad(norms[1])))
      throw ProtocolError(fmt::format(
          "quorum: rank {} sends gradient norms {} and {} with step {}", from, norms[0], norms[1],
          w.step));
    e.grad_sq = norms[0];
    if (!std::isnan(norms[1])) e.prev_mean_sq = norms[1];
  }
  if (type == UpKind::kShard) {
    e.values.resize(extra / 8);
    std::memcpy(e.values.data(), extra_at, extra);
    for (double v : e.values)
      if (!std::isfinite(v))
        throw ProtocolError(
            fmt::format("quorum: rank {} sends a report with a non-finite value", from));
  }
  if (type == UpKind::kAck) {
    e.epoch = w.count;
    const char* p = static_cast<const char*>(buf) + sizeof(UpWire);
    for (size_t i = 0; i < extra / entry; ++i, p += entry) {
      KnownWire kw;
      std::memcpy(&kw, p, sizeof(kw));
      qproto::Known k{kw.step, kw.attempt, kw.skipped != 0, get_bitmap(p + sizeof(kw), world)};
      e.known.push_back(std::move(k));
    }
  }
  return e;
}

std::vector<char> encode_down(int world, const Down& m) {
  DownWire h{};
  h.magic = kDownMagic;
  h.version = kVersion;
  h.type = uint8_t(m.kind);
  h.world = uint32_t(world);
  std::vector<char> body;
  switch (m.kind) {
    case DownKind::kDecide: {
      const auto& d = m.decide;
      h.status = uint8_t(d.status);
      h.attempt = d.attempt;
      h.step = d.step;
      h.epoch = d.epoch;
      h.decide_us = d.decide_us;
      h.settled = d.settled;
      h.bad_rank = d.bad_rank;
      h.source = d.source;
      h.bad_count = d.bad_count;
      h.bad_layout = d.bad_layout;
      h.quorum = uint32_t(d.quorum);
      put_bitmap(body, world, d.contributors);
      put_bitmap(body, world, d.needers);
      size_t at = body.size();
      body.resize(at + 8 * size_t(world));
      for (int r = 0; r < world; ++r) {
        int64_t v = size_t(r) < d.offsets_us.size() ? d.offsets_us[size_t(r)] : -1;
        std::memcpy(body.data() + at + 8 * size_t(r), &v, 8);
      }
      break;
    }
    case DownKind::kView: {
      h.epoch = m.view.epoch;
      h.quorum = uint32_t(m.left.size());  // departures, then joined ranks
      h.attempt = uint32_t(m.joined.size());
      put_bitmap(body, world, m.view.members);
      for (const auto& d : m.left) {
        DepartureWire dw{uint32_t(d.rank), uint32_t(d.why), d.silent_ms};
        size_t at = body.size();
        body.resize(at + sizeof(dw));
        std::memcpy(body.data() + at, &dw, sizeof(dw));
      }
      for (const auto& j : m.joined) {
        JoinedWire jw{uint32_t(j.rank), j.incarnation, j.step, j.donor, 0};
        size_t at = body.size();
        body.resize(at + sizeof(jw));
        std::memcpy(body.data() + at, &jw, sizeof(jw));
      }
      break;
    }
    case DownKind::kJoining:
      h.source = m.joiner;
      h.attempt = m.incarnation;
      break;
    case DownKind::kRecover:
      h.step = m.step;
      h.attempt = m.attempt;
      break;
    case DownKind::kFatal:
      body.assign(m.reason.begin(), m.reason.begin() + long(std::min(m.reason.size(), kMaxFatalText)));
      break;
    case DownKind::kTakeover:
      h.epoch = m.view.epoch;
      put_bitmap(body, world, m.view.members);
      break;
    case DownKind::kEvicted:
      h.attempt = uint32_t(m.why);
      break;
    case DownKind::kHeartbeat:
    case DownKind::kBye:
      break;
  }
  h.body = uint32_t(body.size());
  std::vector<char> out(sizeof(h) + body.size());
  std::memcpy(out.data(), &h, sizeof(h));
  if (!body.empty()) std::memcpy(out.data() + sizeof(h), body.data(), body.size());
  return out;
}

namespace {

ProtocolError malformed_down(int from, const std::string& what) {
  return ProtocolError(
      fmt::format("quorum: malformed message from the coordinator (rank {}): {}", from, what));
}

// decode_down's DECIDE.
void decode_decide(const DownWire& h, const char* body, int world, int from,
                   qproto::Decision& d) {
  auto bad = [&](const std::string& what) { return malformed_down(from, what); };
  if (h.body != 2 * bitmap_bytes(world) + 8 * size_t(world))
    throw bad(fmt::format("DECIDE body of {} bytes", h.body));
  if (h.status > uint8_t(qproto::Status::kSkipped))
    throw bad(fmt::format("DECIDE status {}", h.status));
  d.status = qproto::Status(h.status);
  d.step = h.step;
  d.attempt = h.attempt;
  d.epoch = h.epoch;
  d.decide_us = h.decide_us;
  d.settled = h.settled;
  d.bad_rank = h.bad_rank;
  d.source = h.source;
  d.bad_count = h.bad_count;
  d.bad_layout = h.bad_layout;
  d.quorum = int(h.quorum);
  if (d.source < -1 || d.source >= world) throw bad(fmt::format("source rank {}", d.source));
  d.contributors = get_bitmap(body, world);
  d.needers = get_bitmap(body + bitmap_bytes(world), world);
  d.offsets_us.resize(size_t(world));
  std::memcpy(d.offsets_us.data(), body + 2 * bitmap_bytes(world), 8 * size_t(world));
  // A forward (attempt > 0, a source) may name no contributors: a recovery whose S(t) the
  // coordinator did not know (StepRecovery::rebuild); the needers keep the one they were told.
  const bool forward = d.attempt > 0 && d.source >= 0;
  if (d.status == qproto::Status::kOk && d.contributors.empty() && !forward)
    throw bad("DECIDE without contributors");
}

// decode_down's VIEW.
void decode_view(const DownWire& h, const char* body, int world, int from, Down& m) {
  auto bad = [&](const std::string& what) { return malformed_down(from, what); };
  const size_t bm = bitmap_bytes(world);
  const size_t n_left = h.quorum, n_joined = h.attempt;
  if (n_left > size_t(world) || n_joined > size_t(world) ||
      h.body != bm + n_left * sizeof(DepartureWire) + n_joined * sizeof(JoinedWire))
    throw bad(fmt::format("VIEW body of {} bytes ({} departures, {} joined)", h.body, n_left,
                          n_joined));
  m.view.epoch = h.epoch;
  m.view.members = get_bitmap(body, world);
  size_t at = bm;
  for (size_t i = 0; i < n_left; ++i, at += sizeof(DepartureWire)) {
    DepartureWire dw;
    std::memcpy(&dw, body + at, sizeof(dw));
    if (int64_t(dw.rank) >= world || dw.why < 1 || dw.why > uint32_t(qproto::Why::kBehind) ||
        !std::isfinite(dw.silent_ms))
      throw bad(fmt::format("VIEW departure of rank {} ({})", dw.rank, dw.why));
    m.left.push_back({int(dw.rank), qproto::Why(dw.why), dw.silent_ms});
  }
  for (size_t i = 0; i < n_joined; ++i, at += sizeof(JoinedWire)) {
    JoinedWire jw;
    std::memcpy(&jw, body + at, sizeof(jw));
    if (int64_t(jw.rank) >= world || jw.donor < 0 || jw.donor >= world ||
        int64_t(jw.donor) == int64_t(jw.rank) || jw.incarnation == 0 ||
        !std::binary_search(m.view.members.begin(), m.view.members.end(), int(jw.rank)) ||
        !std::binary_search(m.view.members.begin(), m.view.members.end(), jw.donor))
      throw bad(fmt::format("VIEW joiner rank {} (incarnation {}, donor {})", jw.rank,
                            jw.incarnation, jw.donor));
    m.joined.push_back({int(jw.rank), jw.incarnation, jw.step, jw.donor});
  }
  if (m.view.members.empty()) throw bad("VIEW without members");
}

}  // namespace

Down decode_down(const void* buf, size_t len, int world, int from) {
  auto bad = [&](const std::string& what) { return malformed_down(from, what); };
  if (len < sizeof(DownWire)) throw bad(fmt::format("{} bytes", len));
  DownWire h;
  std::memcpy(&h, buf, sizeof(h));
  if (h.magic != kDownMagic) throw bad(fmt::format("magic {:#x}", h.magic));
  if (h.version != kVersion)
    throw ProtocolError(fmt::format(
        "quorum: the coordinator (rank {}) speaks quorum protocol version {}, this rank {}", from,
        h.version, kVersion));
  if (int64_t(h.world) != world)
    throw bad(fmt::format("world {}, this world has {}", h.world, world));
  if (size_t(h.body) != len - sizeof(h))
    throw bad(fmt::format("body of {} bytes in a message of {}", h.body, len));
  const char* body = static_cast<const char*>(buf) + sizeof(h);
  Down m;
  if (h.type < uint8_t(DownKind::kDecide) || h.type > uint8_t(DownKind::kJoining))
    throw bad(fmt::format("unknown type {}", h.type));
  m.kind = DownKind(h.type);
  switch (m.kind) {
    case DownKind::kDecide:
      decode_decide(h, body, world, from, m.decide);
      break;
    case DownKind::kView:
      decode_view(h, body, world, from, m);
      break;
    case DownKind::kJoining:
      if (h.body != 0) throw bad(fmt::format("JOINING body of {} bytes", h.body));
      if (h.source < 0 || h.source >= world || h.attempt == 0)
        throw bad(fmt::format("JOINING of rank {} (incarnation {})", h.source, h.attempt));
      m.joiner = h.source;
      m.incarnation = h.attempt;
      break;
    case DownKind::kRecover:
      m.step = h.step;
      m.attempt = h.attempt;
      break;
    case DownKind::kFatal:
      if (h.body > kMaxFatalText) throw bad(fmt::format("FATAL text of {} bytes", h.body));
      m.reason.assign(body, h.body);
      break;
    case DownKind::kTakeover:
      if (h.body != bitmap_bytes(world)) throw bad(fmt::format("TAKEOVER body of {} bytes", h.body));
      m.view.epoch = h.epoch;
      m.view.members = get_bitmap(body, world);
      if (m.view.members.empty()) throw bad("TAKEOVER without members");
      break;
    case DownKind::kEvicted:
      // 0: a coordinator that does not say (the reason is only what the rank reports).
      if (h.attempt > uint32_t(qproto::Why::kBehind))
        throw bad(fmt::format("EVICTED for reason {}", h.attempt));
      m.why = h.attempt == 0 ? qproto::Why::kSilent : qproto::Why(h.attempt);
      [[fallthrough]];
    case DownKind::kHeartbeat:
    case DownKind::kBye:
      if (h.body != 0) throw bad(fmt::format("body of {} bytes", h.body));
      break;
  }
  return m;
}

}  // namespace qring::collectives::qwire
