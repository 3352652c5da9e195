// Rejoin's store side (docs/design.md, "Rejoin"): the records a rank publishes in the
// rendezvous store about a join, and the join agent, a thread of the quorum all-reduce that
// does the store look-ups (they may block, so they stay off the engine). It publishes what the
// engine asks, fetches the addresses of joiners for it (members), looks for new incarnations
// of the ranks outside the view every 100 ms (the coordinator), and looks for the members'
// addresses (a joiner) and for the end of the job, and every 100 ms for the deaths the store
// witnessed of the few ranks the member asks about (witness.h). Store errors are logged and
// retried; they never stop the job (a rank that cannot rejoin stays out).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "collectives/clock.h"
#include "net/rendezvous/store.h"

namespace qring::collectives {

class Engine;

// What rank `owner` publishes about the join of incarnation `inc` of rank `r` -- the joiner
// its address, each member its address for the joiner -- under
// "join/<instance>/<r>.<inc>/<owner>" (a key of `owner`: net/rendezvous/store.h).
std::string join_key(uint32_t instance, int r, uint32_t inc, int owner);
// Set by the rank that coordinated the end of the job: a rank that comes back later learns
// that there is nothing to rejoin.
std::string join_done_key(uint32_t instance, int coordinator);
// Set by a rank whose quorum all-reduce ended with a timeout (QuorumLost, QuorumTimeout, a
// ring given up: the job is lost), with why: a rank that comes back later
// fails at once naming it, instead of waiting for a coordinator that no longer exists.
std::string join_lost_key(uint32_t instance, int rank);

// The end of the job as the store records it (join_done_key, join_lost_key of any rank).
struct JobEnd {
  bool finished = false;
  std::string lost;  // why the job was lost; empty: it was not
};
// Reads it (store errors throw, as the store's calls do).
JobEnd read_job_end(net::Store& store, uint32_t instance, int world);
// A new incarnation of `rank` about to rejoin: QuorumLost naming why when the job was lost,
// JobOver when it finished (errors.h): nothing is left to rejoin. Rejoin::exchange checks the
// same while the join runs; qring-train checks it first, before it loads its data.
void refuse_join_to_ended_job(const JobEnd& end, int rank);

// The value of a join key: "<incarnation> <coordinator> <epoch> <members, comma-separated>
// <length of the settings>" (the publisher's, as it knows them; the joiner: "-1 0 -"), then
// after a newline its communicator settings (Communicator::settings_text, compared as at a
// communicator's creation) and its address (net::Endpoint::published_address).
struct JoinValue {
  uint32_t incarnation = 0;
  int coordinator = -1;
  uint64_t epoch = 0;
  std::vector<int> members;
  std::string settings;
  std::string address;
};
std::string encode_join_value(const JoinValue& v);
// ProtocolError naming `key` when malformed.
JoinValue decode_join_value(const std::string& s, int world, const std::string& key);

// The hand-off between the engine (the member's rejoin part) and the join agent's thread.
struct JoinAgentIo {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  // engine -> agent
  std::vector<std::pair<std::string, std::string>> publish;  // key, value
  struct Fetch {
    int rank;
    uint32_t incarnation;
    std::string key;
    Clock::time_point until;
  };
  std::vector<Fetch> fetch;            // a joiner's address (members)
  bool coordinating = false;           // watch the incarnations of the ranks outside the view
  std::vector<uint32_t> incarnations;  // per rank, as the coordinator knows them
  std::vector<char> outside;           // per rank: not in the coordinator's view
  bool searching = false;              // the joiner: look for the members' addresses
  bool watch_end = false;              // the joiner: until it has its state, watch for the end
  std::vector<std::pair<int, uint32_t>> watch_dead;  // (rank, incarnation): witnessed dead?
  // agent -> engine
  bool finished = false;  // the joiner: the job has ended (join_done_key)
  std::string lost;       // the joiner: why the job was lost (join_lost_key; empty: it was not)
  std::vector<std::string> published;
  std::vector<std::tuple<int, uint32_t, std::string>> fetched;  // joiner, incarnation, value
  std::vector<std::pair<int, uint32_t>> found;                  // new incarnations
  std::vector<std::pair<int, std::string>> values;              // the joiner: member, value
  std::vector<std::pair<int, uint32_t>> dead;                   // deaths the store witnessed
};

// The agent's loop, until io->stop. Kicks `engine` when it hands something back.
void run_join_agent(std::shared_ptr<JoinAgentIo> io, net::Store* store, Engine* engine, int rank,
                    int world, uint32_t instance, uint32_t my_inc);

}  // namespace qring::collectives
