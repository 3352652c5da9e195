// libFuzzer target: the quorum all-reduce's control messages (collectives/quorum/wire.cc):
// READY / HEARTBEAT / REPORT / SUSPECT / BYE / ACK / SHARD up, DECIDE / VIEW / RECOVER /
// EVICTED / FATAL / HEARTBEAT / BYE / TAKEOVER down. Byte 0 picks the world size (1..64) and
// the direction. A malformed message must be a ProtocolError, nothing else; one that decodes
// must encode back to bytes that decode to the same message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <spdlog/spdlog.h>

#include "collectives/quorum/wire.h"
#include "net/base/error.h"

namespace wire = qring::collectives::qwire;

// The parsers log what they reject; at fuzzing rates that is noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int world = 1 + (data[0] & 63);
  const bool down = data[0] & 64;
  const int from = world > 1 ? (data[0] >> 7) % world : 0;
  const char* msg = reinterpret_cast<const char*>(data) + 1;
  const size_t len = size - 1;
  try {
    if (down) {
      qring::collectives::qproto::Down m = wire::decode_down(msg, len, world, from);
      std::vector<char> again = wire::encode_down(world, m);
      qring::collectives::qproto::Down back = wire::decode_down(again.data(), again.size(), world, from);
      if (back.kind != m.kind || wire::encode_down(world, back) != again) std::abort();
    } else {
      qring::collectives::qproto::Up e = wire::decode_up(msg, len, world, from);
      std::vector<char> again = wire::encode_up(world, e);
      qring::collectives::qproto::Up back = wire::decode_up(again.data(), again.size(), world, from);
      if (back.kind != e.kind || wire::encode_up(world, back) != again) std::abort();
    }
  } catch (const qring::ProtocolError&) {
  }
  return 0;
}
