// Tag layout (64 bits) shared by every protocol on an endpoint:
//
//   63  60 59  56 55                 32 31                  8 7      0
//   +------+------+---------------------+---------------------+--------+
//   | gen  |  op  |  seq (24 bits)      |  chunk (24 bits)    |  frag  |
//   +------+------+---------------------+---------------------+--------+
//
//   gen   — set by the endpoint: the generation of the pair of ranks, (incarnation of the
//           sender + incarnation of the receiver) mod 16, so that no message of an earlier
//           incarnation of a rank that came back (Endpoint::reset_peer) matches a receive of
//           the new one; callers pass tags with gen = 0
//   op    — which protocol the message belongs to (enum Op below, < 16)
//   seq   — the operation's sequence number (collectives) or step (quorum), mod 2^24
//   chunk — segment / chunk index inside the operation, or a sender's rank for control
//           messages received from any peer, mod 2^24
//   frag  — set by the endpoint when it splits a message above the provider's size limit
//           (fragment index mod 256); callers pass tags with frag = 0.
//
// Each communicator owns its own endpoint, so tags never need a communicator id.
#pragma once

#include <cstdint>

namespace qring::net {

enum class Op : uint8_t {
  kUser = 0,
  kSendRecv = 1,
  kAllreduce = 2,
  kBroadcast = 3,
  kAllgather = 4,
  kReduceScatter = 5,
  kBarrier = 6,
  kQuorumReady = 7,
  kQuorumDecide = 8,
  kQuorumData = 9,
  kQuorumResult = 10,
  kControl = 11,
  kQuorumState = 12,  // a live member's state for a rank that rejoins
  kParamServer = 13,  // asynchronous SGD's pushes and pulls (collectives/param_server.h)
  kHello = 14,  // the settings every rank sends every other when a communicator is created
};
constexpr int kOpBits = 4;
static_assert(static_cast<int>(Op::kHello) < (1 << kOpBits), "op must fit in 4 bits");

constexpr uint64_t kSeqMask = 0xFFFFFFull;
constexpr uint64_t kChunkMask = 0xFFFFFFull;
constexpr uint64_t kFragMask = 0xFFull;
constexpr int kGenShift = 60;
constexpr uint64_t kGenMask = 0xFull << kGenShift;

constexpr uint64_t with_generation(uint64_t tag, uint32_t gen) {
  return (tag & ~kGenMask) | (uint64_t(gen & 0xF) << kGenShift);
}

constexpr uint64_t make_tag(Op op, uint64_t seq, uint64_t chunk = 0) {
  return (uint64_t(static_cast<uint8_t>(op)) << 56) | ((seq & kSeqMask) << 32) |
         ((chunk & kChunkMask) << 8);
}
constexpr Op tag_op(uint64_t tag) {
  return static_cast<Op>((tag >> 56) & 0xF);
}
constexpr uint64_t tag_chunk(uint64_t tag) {
  return (tag >> 8) & kChunkMask;
}
// Ignore mask for "any chunk" (e.g. a coordinator receiving control messages from any rank).
constexpr uint64_t kIgnoreChunk = kChunkMask << 8;

}  // namespace qring::net
