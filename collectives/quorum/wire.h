// Wire format of the quorum all-reduce's control messages (messages.h; version 4).
//
// Up (any rank -> coordinator), 48 bytes: READY (element count, element type and reduction,
// + 8 bytes: the sender's parameter digest, when it sends one; then + 16 bytes, when it sends
// them: two float64, its contribution's squared norm and the squared norm of the previous
// step's result, NaN if none: quorum "auto" estimating the noise scale), HEARTBEAT, REPORT
// (recovery), SUSPECT (a transport error with a rank), BYE (finished), SHARD (+ 1..8
// float64: a part of a sum gathered at the coordinator), HELLO (a rank that rejoins has
// connected to every member), ACCEPT (a member reconnected to it), LEAVE (a joiner whose state
// did not come leaves the view).
// Down (coordinator -> one rank), an 80-byte header and a body: DECIDE (contributor and needer
// bitmaps, per-rank arrival offsets), VIEW (member bitmap, departures, ranks that joined),
// RECOVER, EVICTED, FATAL (the error text), HEARTBEAT, JOINING (reconnect to a new
// incarnation of a rank). Each direction of each (rank, coordinator) pair is one
// stream of exactly tagged messages numbered in send order, so a rank applies the
// coordinator's messages in the order they were sent.
//
// decode_* validate everything (magic, version, world, type, lengths, rank ranges) and throw
// ProtocolError naming the sender: a malformed message never becomes silent garbage.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/quorum/messages.h"

namespace qring::collectives::qwire {

constexpr uint16_t kVersion = 4;

constexpr size_t kUpBytes = 48;
// Decisions an ACK carries at most (the unsettled window is a few steps).
constexpr size_t kMaxKnown = 8;
// float64 values a SHARD carries at most.
constexpr size_t kMaxShardValues = 8;
// Largest up message (the receive buffer every rank posts for every peer).
size_t up_capacity(int world);
// Largest down message for a world of this size (the receive buffer each rank posts).
size_t down_capacity(int world);
constexpr size_t kMaxFatalText = 1024;

std::vector<char> encode_up(int world, const qproto::Up& m);
// Throws ProtocolError (naming `from`) when malformed. Never returns a local kind (kTick,
// kJoin).
qproto::Up decode_up(const void* buf, size_t len, int world, int from);

std::vector<char> encode_down(int world, const qproto::Down& m);
qproto::Down decode_down(const void* buf, size_t len, int world, int from);

}  // namespace qring::collectives::qwire
