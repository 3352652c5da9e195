// libFuzzer target: the rendezvous store server's frames and requests (net/rendezvous/tcp_store.cc),
// fed through store_server_feed (no sockets). Byte 0 chooses the connection's state: even =
// before JOIN (what anyone who reaches the port can send), odd = a joined rank 0 (SET, GET,
// WAIT, ADD, CHECK, MISSING ... with arbitrary keys and values). Any exception or sanitizer
// report is a finding: the server must answer or drop a connection, never crash.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <spdlog/spdlog.h>

#include "net/rendezvous/store.h"

// The parsers log what they reject; at fuzzing rates that is noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool joined = data[0] & 1;
  const int world = 1 + (data[0] >> 1) % 4;
  qring::net::store_server_feed(
      std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1), joined, world);
  return 0;
}
