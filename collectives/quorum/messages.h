// The quorum all-reduce's control messages, one type per direction: what a rank sends up to
// the coordinator (Up) and what the coordinator sends down (Down). The coordinator's state
// machine takes Ups and returns Downs (coordinator.h), the wire codec encodes exactly these
// (wire.h), and the members apply them: a DECIDE is the same object from the decision to the
// member that runs the step. Kinds carry their wire numbers (protocol version: wire.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace qring::collectives::qproto {

struct View {
  uint64_t epoch = 0;
  std::vector<int> members;  // sorted
  bool has(int r) const;
  int size() const { return int(members.size()); }
};

enum class Status : uint8_t { kOk = 0, kTimeout = 1, kMismatch = 2, kSkipped = 3 };

// kLeft: the rank said it leaves (LEAVE: a joiner that could not get its state).
// kDied: the rendezvous store witnessed its death (witness.h).
// kBehind: alive, but the oldest result it lacks was decided more than max_lag ago (it
// catches up by rejoining with a live member's state, not by every result it missed).
enum class Why : uint8_t {
  kSilent = 1,
  kMissedSteps = 2,
  kUnreachable = 3,
  kRestarted = 4,
  kLeft = 5,
  kDied = 6,
  kBehind = 7
};
const char* to_string(Why w);

struct Departure {
  int rank = -1;
  Why why = Why::kSilent;
  double silent_ms = 0;  // time since the coordinator last heard from it
};

// A rank that enters a view by rejoining: from `step` on it is a member; `donor` sends it
// the state after step - 1.
struct Joined {
  int rank = -1;
  uint32_t incarnation = 0;
  uint64_t step = 0;
  int donor = -1;
  bool operator==(const Joined&) const = default;
};

// The element type and reduction of a contribution as READY carries them.
constexpr uint32_t layout_of(uint8_t type, bool mean) {
  return (uint32_t(type) << 8) | (mean ? 1u : 0u);
}

struct Decision {
  uint64_t step = 0;
  uint32_t attempt = 0;  // 0: first decision; > 0: after a recovery
  uint64_t epoch = 0;    // the view that decided it
  Status status = Status::kOk;
  int quorum = 0;        // the quorum in force
  std::vector<int> contributors;  // S(t), sorted
  // attempt > 0 and source >= 0: `source` holds the result and sends it to `needers`
  // (S(t) unchanged). attempt > 0 and source < 0: a new reduction among `contributors`.
  int source = -1;
  std::vector<int> needers;
  std::vector<int64_t> offsets_us;  // per rank: arrival after the step's first, -1 = none
  int64_t decide_us = 0;
  int bad_rank = -1;  // kMismatch: who sent another count or layout, and those
  uint64_t bad_count = 0;
  uint32_t bad_layout = 0;
  int64_t settled = -1;  // every live member has completed every step <= settled
};

// A decision a rank knows of (takeover): the highest attempt it saw for a step that is not
// settled yet, with that attempt's contributors.
struct Known {
  uint64_t step = 0;
  uint32_t attempt = 0;
  bool skipped = false;
  std::vector<int> contributors;
};

// Up: any rank -> the coordinator (48 bytes on the wire, some with a tail). Three kinds never
// travel: kTick (time passes), kJoin (the coordinator's join agent found a new incarnation)
// and kDied (it found a death the store witnessed).
struct Up {
  enum class Kind : uint8_t {
    kTick = 0,
    kReady = 1,      // `from` contributed to `step` (count, layout; digest when it sends one)
    kHeartbeat = 2,  // alive (with `completed`, as every message)
    kReport = 3,     // recovery of `step`/`attempt`: `have` its result, or `absent` from it
    kSuspect = 4,    // `from` had a transport error with rank `suspect`
    kBye = 5,        // `from` finished the job (its silence from now on is no failure)
    kAck = 6,        // `from` accepts `epoch` with the receiver as coordinator (+ `known`)
    kDeposed = 7,    // to a rank that still acts as coordinator: another one took over
    kShard = 8,      // part `attempt` of `count` parts of the report keyed `step` (+ values)
    kHello = 9,      // incarnation `count` of `from` rejoins: it reaches every member
    kAccept = 10,    // `from` reconnected to incarnation `count` of rank `suspect`
    kWarm = 11,      // a joiner's first message to a member: opens their connection
    kJoin = 12,      // local: incarnation `count` of rank `from` is in the store
    kLeave = 13,     // `from` leaves the view now (a joiner whose state did not come)
    kDied = 14,      // local: the store witnessed the death of incarnation `count` of `from`
  } kind = Kind::kTick;
  Up() = default;
  explicit Up(Kind k) : kind(k) {}
  int from = -1;
  uint64_t step = 0;       // kReady, kReport, kShard
  uint64_t count = 0;      // kReady: elements; kShard: parts; kHello, kAccept, kJoin, kDied: incarnation
  uint32_t layout = 0;     // kReady: element type and reduction (layout_of)
  int64_t completed = -1;  // highest step `from` has completed (every step before it too)
  uint32_t attempt = 0;    // kReport; kShard: the part
  bool have = false;       // kReport: `from` holds the final result of `step`
  bool absent = false;     // kReport: `from` joined after `step` (takes no part in it)
  int suspect = -1;        // kSuspect, kAccept: the rank it concerns
  uint64_t epoch = 0;      // kAck
  std::vector<Known> known;  // kAck: decisions `from` saw that may not be settled
  // kReady: a digest of the sender's replicated state before the step (a parameter checksum);
  // the coordinator stops the job when two ranks' digests of one step differ.
  std::optional<uint64_t> digest;
  // kReady, quorum "auto" with the noise scale estimated (Config::auto_estimate): the squared
  // norm of the sender's contribution to `step`, and of the result of step - 1 as it received
  // it (the same on every rank). They feed the estimate (noise_scale.h).
  std::optional<double> grad_sq, prev_mean_sq;
  std::vector<double> values;  // kShard (kept by the member host, not by the coordinator)
};
// What the coordinator's state machine takes: the Ups and its local events.
using Event = Up;

// Down: the coordinator -> the members of its view (an 80-byte header and a body).
struct Down {
  enum class Kind : uint8_t {
    kDecide = 1,     // `decide`
    kView = 2,       // the new `view`, who `left` and who `joined`
    kRecover = 3,    // a member was lost while `step` (`attempt`) may be unfinished
    kEvicted = 4,    // to rank `to`, which is not a member
    kFatal = 5,      // the job stops: `reason`
    kHeartbeat = 6,  // the coordinator is alive
    kBye = 7,        // the coordinator finished the job
    kTakeover = 8,   // a member proposes itself for `view` (epoch, members) after silence
    kJoining = 9,    // reconnect to incarnation `incarnation` of rank `joiner`
  } kind = Kind::kHeartbeat;
  Down() = default;
  explicit Down(Kind k) : kind(k) {}
  Decision decide;
  View view;
  std::vector<Departure> left;
  std::vector<Joined> joined;
  uint64_t step = 0;         // kRecover
  uint32_t attempt = 0;      // kRecover
  int to = -1;               // kEvicted (where it goes; not on the wire)
  Why why = Why::kSilent;    // kEvicted: why it left the view
  std::string reason;        // kFatal: the error every member reports
  int joiner = -1;           // kJoining
  uint32_t incarnation = 0;  // kJoining
};

}  // namespace qring::collectives::qproto
