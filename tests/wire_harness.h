// Helpers for the tests of the quorum's wire codec (collectives/quorum/wire.h): encode an up
// message as a given kind, decode one and say which kind it was.
#pragma once

#include <vector>

#include "collectives/quorum/wire.h"

namespace qring::testing {

inline std::vector<char> encode_as(int world, collectives::qproto::Up::Kind kind,
                                   collectives::qproto::Up m) {
  m.kind = kind;
  return collectives::qwire::encode_up(world, m);
}

inline collectives::qproto::Up decode_as(const void* buf, size_t len, int world, int from,
                                         collectives::qproto::Up::Kind* kind) {
  collectives::qproto::Up m = collectives::qwire::decode_up(buf, len, world, from);
  *kind = m.kind;
  return m;
}

}  // namespace qring::testing
