#include "collectives/shape.h"

#include <fmt/format.h>

#include "net/base/fnv1a.h"

namespace qring::collectives {

namespace {

constexpr uint64_t kMarker = uint64_t(1) << 63;
constexpr uint64_t kCountMask = (uint64_t(1) << 40) - 1;

const char* kind_name(net::Op k) {
  switch (k) {
    case net::Op::kAllreduce: return "allreduce";
    case net::Op::kBroadcast: return "broadcast";
    case net::Op::kAllgather: return "allgather";
    case net::Op::kReduceScatter: return "reduce_scatter";
    case net::Op::kBarrier: return "barrier";
    case net::Op::kQuorumData: return "quorum ring";
    case net::Op::kQuorumResult: return "quorum result";
    default: return "operation";
  }
}

const char* algo_name(Algo a) {
  switch (a) {
    case Algo::kRing: return "ring";
    case Algo::kRecursiveDoubling: return "recursive doubling";
    case Algo::kHalvingDoubling: return "halving-doubling";
    case Algo::kChain: return "chain";
    case Algo::kDissemination: return "dissemination";
    case Algo::kNone: break;
  }
  return "?";
}

}  // namespace

uint64_t encode_shape(const Shape& s) {
  return kMarker | (uint64_t(uint8_t(s.kind) & 0xF) << 59) | (uint64_t(uint8_t(s.algo) & 0x7) << 56) |
         (uint64_t(uint8_t(s.type) & 0xF) << 52) | (uint64_t(uint8_t(s.op) & 0x7) << 49) |
         (uint64_t(s.extra & 0x1FF) << 40) | (s.count & kCountMask);
}

Shape decode_shape(uint64_t w) {
  Shape s;
  s.kind = net::Op((w >> 59) & 0xF);
  s.algo = Algo((w >> 56) & 0x7);
  s.type = DataType((w >> 52) & 0xF);
  s.op = RedOp((w >> 49) & 0x7);
  s.extra = uint32_t((w >> 40) & 0x1FF);
  s.count = w & kCountMask;
  return s;
}

std::string describe_shape(uint64_t w) {
  if (w == 0) return "no descriptor";
  if (!(w & kMarker))
    return fmt::format("descriptor {:#x}", w);  // a folded word (short immediate data)
  const Shape s = decode_shape(w);
  if (s.kind == net::Op::kBarrier) return "barrier";
  const bool typed = uint8_t(s.type) <= uint8_t(DataType::kBFloat16);
  const std::string type = typed ? std::string(to_string(s.type)) : fmt::format("type {}", int(s.type));
  std::string out = fmt::format("{} ({}) of {} {}", kind_name(s.kind), algo_name(s.algo), s.count, type);
  switch (s.kind) {
    case net::Op::kAllreduce:
    case net::Op::kReduceScatter:
    case net::Op::kQuorumData:
      out += fmt::format(", {}", uint8_t(s.op) <= uint8_t(RedOp::kMax)
                                     ? std::string(to_string(s.op))
                                     : fmt::format("op {}", int(s.op)));
      break;
    case net::Op::kBroadcast:
      out += fmt::format(" from rank {}", s.extra);
      return out;
    default:
      break;
  }
  if (s.extra) out += fmt::format(", member set {:#05x}", s.extra);
  return out;
}

std::string shape_kind(uint64_t w) {
  if (!(w & kMarker)) return "operation";
  return kind_name(decode_shape(w).kind);
}

uint32_t members_hash(const std::vector<int>& members) {
  if (members.empty()) return 0;
  // FNV-1a's constants, over whole 32-bit rank numbers instead of bytes (the wire value).
  uint64_t h = kFnv1aOffset;
  for (int r : members) {
    h ^= uint64_t(uint32_t(r));
    h *= kFnv1aPrime;
  }
  const uint32_t v = uint32_t((h ^ (h >> 29) ^ (h >> 47)) & 0x1FF);
  return v ? v : 1;  // 0 means "every rank"
}

uint64_t wire_shape(uint64_t word, size_t data_bytes) {
  if (data_bytes >= 8 || word == 0) return word;
  if (data_bytes == 0) return 0;
  const uint64_t mask = (uint64_t(1) << (8 * data_bytes)) - 1;
  uint64_t f = word;
  for (size_t shift = 8 * data_bytes; shift < 64; shift += 8 * data_bytes) f ^= word >> shift;
  return (f & mask) | (uint64_t(1) << (8 * data_bytes - 1));  // never 0
}

std::string mismatch_text(int detector, int peer, uint64_t mine, uint64_t theirs) {
  if (theirs == 0)
    return fmt::format("rank {} sent more than rank {}'s call ({}) takes", peer, detector,
                       describe_shape(mine));
  return fmt::format("rank {} called it as {}, rank {} as {}", peer, describe_shape(theirs),
                     detector, describe_shape(mine));
}

void check_message(const net::Request& rv, uint64_t expected, size_t data_bytes, int self,
                   const std::string& what, uint64_t seq, int peer) {
  const uint64_t want = wire_shape(expected, data_bytes);
  const bool other = data_bytes > 0 && rv.data != want &&
                     (rv.state == net::RequestState::kDone || rv.data != 0);
  if (other || rv.truncated) {
    const uint64_t theirs = rv.data == want ? 0 : rv.data;
    throw ShapeMismatch(fmt::format("rank {}: {} #{}: ranks disagree on the operation: {}", self,
                                    what, seq, mismatch_text(self, peer, want, theirs)),
                        seq, peer, want, theirs);
  }
  net::throw_if_failed(rv, what);
  if (rv.bytes != rv.len)
    throw ProtocolError(fmt::format("rank {}: {} #{}: rank {} sent {} bytes, expected {}", self,
                                    what, seq, peer, rv.bytes, rv.len));
}

}  // namespace qring::collectives
