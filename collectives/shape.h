// Operation descriptors: 64 bits that every data message of a collective carries as immediate
// data (net::Endpoint, libfabric's remote CQ data: no extra message, no extra byte of
// payload), and that the receiver compares with its own. Ranks that call one collective with a
// different element count, element type, reduction, root, member set or algorithm then fail
// at the first message between them, on both sides, with an error naming the other rank and
// both descriptors, instead of reducing mismatched bytes or stale scratch memory; the engine
// tells every other rank (engine.cc), so the whole communicator fails.
//
//   63 | 62..59 | 58..56 | 55..52 | 51..49 | 48..40 | 39..0
//    1 |  kind  |  algo  |  type  |   op   | extra  | count (mod 2^40)
//
// kind: the protocol (net::Op of its tags); algo: Algo below; extra: the broadcast root, or a
// 9-bit hash of the member list of a ring among some ranks. Bit 63 is set so that a
// descriptor is never 0 ("none"). A transport with fewer than 8 bytes of immediate data gets
// a folded 32-bit word (wire_shape): mismatches are still caught, but the error can only show
// the words.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/types.h"
#include "net/transport/endpoint.h"
#include "net/base/error.h"
#include "net/transport/tags.h"

namespace qring::collectives {

enum class Algo : uint8_t {
  kNone = 0,
  kRing = 1,
  kRecursiveDoubling = 2,
  kHalvingDoubling = 3,
  kChain = 4,          // broadcast
  kDissemination = 5,  // barrier
};

struct Shape {
  net::Op kind = net::Op::kUser;
  Algo algo = Algo::kNone;
  DataType type = DataType::kFloat32;
  RedOp op = RedOp::kSum;
  uint32_t extra = 0;  // 9 bits used
  uint64_t count = 0;  // 40 bits used
};

uint64_t encode_shape(const Shape& s);
Shape decode_shape(uint64_t word);
// "allreduce (ring) of 10 float32, sum"; "broadcast of 3 int64 from rank 2".
std::string describe_shape(uint64_t word);
// "allreduce", "broadcast", ...: the operation a descriptor belongs to.
std::string shape_kind(uint64_t word);
// 9 bits of the ranks of a ring among some members (0: every rank).
uint32_t members_hash(const std::vector<int>& members);
// "rank P called it as <theirs>, rank D as <mine>"; theirs = 0 (a truncated message whose
// descriptor the transport did not report): "rank P sent more than rank D's call (<mine>)
// takes".
std::string mismatch_text(int detector, int peer, uint64_t mine, uint64_t theirs);
// The word as sent over a transport with `data_bytes` of immediate data.
uint64_t wire_shape(uint64_t word, size_t data_bytes);

// A rank's message of collective #seq carried another descriptor than this rank's call.
class ShapeMismatch : public UsageError {
 public:
  ShapeMismatch(const std::string& msg, uint64_t seq, int peer, uint64_t mine, uint64_t theirs)
      : UsageError(msg), seq_(seq), peer_(peer), mine_(mine), theirs_(theirs) {}
  uint64_t seq() const { return seq_; }
  int peer() const { return peer_; }
  uint64_t mine() const { return mine_; }
  uint64_t theirs() const { return theirs_; }

 private:
  uint64_t seq_;
  int peer_;
  uint64_t mine_, theirs_;
};

// A completed receive of one message of collective #seq from `peer`: a descriptor other than
// `expected`, or a message longer than the receive (the same protocol, step and segment, but
// more data than this call expects), is a ShapeMismatch naming both ranks; then a failure
// rethrows (IoError); then fewer bytes than posted is a ProtocolError naming the sender.
// `data_bytes`: the endpoint's immediate data (0: no descriptor to compare).
void check_message(const net::Request& rv, uint64_t expected, size_t data_bytes, int self,
                   const std::string& what, uint64_t seq, int peer);

}  // namespace qring::collectives
