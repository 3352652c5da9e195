#include "collectives/quorum/join_agent.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <sstream>

#include "collectives/engine.h"
#include "collectives/quorum/errors.h"
#include "net/base/error.h"

namespace qring::collectives {

std::string join_key(uint32_t instance, int r, uint32_t inc, int owner) {
  return fmt::format("join/{}/{}.{}/{}", instance, r, inc, owner);
}

std::string join_done_key(uint32_t instance, int coordinator) {
  return fmt::format("join/{}/done/{}", instance, coordinator);
}

std::string join_lost_key(uint32_t instance, int rank) {
  return fmt::format("join/{}/lost/{}", instance, rank);
}

JobEnd read_job_end(net::Store& store, uint32_t instance, int world) {
  using namespace std::chrono_literals;
  JobEnd end;
  for (int p = 0; p < world && !end.finished && end.lost.empty(); ++p) {
    end.finished = store.check({join_done_key(instance, p)});
    if (store.check({join_lost_key(instance, p)}))
      end.lost = store.get(join_lost_key(instance, p), net::deadline_in(2s));
  }
  return end;
}

void refuse_join_to_ended_job(const JobEnd& end, int rank) {
  if (!end.lost.empty())
    throw QuorumLost(fmt::format("rank {}: the job was lost before this incarnation could "
                                 "rejoin it ({})",
                                 rank, end.lost),
                     {});
  if (end.finished)
    throw JobOver(fmt::format("rank {}: the job finished before this incarnation could "
                              "rejoin it",
                              rank));
}

std::string encode_join_value(const JoinValue& v) {
  std::string m = v.members.empty() ? "-" : fmt::format("{}", fmt::join(v.members, ","));
  return fmt::format("{} {} {} {} {}\n{}{}", v.incarnation, v.coordinator, v.epoch, m,
                     v.settings.size(), v.settings, v.address);
}

JoinValue decode_join_value(const std::string& s, int world, const std::string& key) {
  auto bad = [&] {
    return ProtocolError(fmt::format("quorum: malformed rejoin record under '{}'", key));
  };
  const size_t nl = s.find('\n');
  if (nl == std::string::npos) throw bad();
  std::istringstream head(s.substr(0, nl));
  JoinValue v;
  int64_t inc = -1, settings_len = -1;
  std::string members;
  if (!(head >> inc >> v.coordinator >> v.epoch >> members >> settings_len) || inc < 0 ||
      inc > UINT32_MAX || v.coordinator < -1 || v.coordinator >= world || settings_len < 0 ||
      size_t(settings_len) > s.size() - nl - 1)
    throw bad();
  v.incarnation = uint32_t(inc);
  if (members != "-") {
    std::istringstream ms(members);
    std::string item;
    while (std::getline(ms, item, ',')) {
      char* end = nullptr;
      long r = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end || r < 0 || r >= world) throw bad();
      v.members.push_back(int(r));
    }
  }
  v.settings = s.substr(nl + 1, size_t(settings_len));
  v.address = s.substr(nl + 1 + size_t(settings_len));
  return v;
}

namespace {

// The join agent's state (a thread of the quorum all-reduce: see join_agent.h).
struct JoinAgent {
  std::shared_ptr<JoinAgentIo> io;
  net::Store* store;
  Engine* engine;
  int rank, world;
  uint32_t instance, my_inc;
  Clock::time_point last_watch{}, last_done_check{}, last_dead_check{};
  std::vector<char> found_peer;
  Clock::time_point last_warning{};

  JoinAgent(std::shared_ptr<JoinAgentIo> io, net::Store* store, Engine* engine, int rank,
            int world, uint32_t instance, uint32_t my_inc)
      : io(std::move(io)),
        store(store),
        engine(engine),
        rank(rank),
        world(world),
        instance(instance),
        my_inc(my_inc),
        found_peer(size_t(world), 0) {
    found_peer[size_t(rank)] = 1;
  }

  // What the service asks for in one pass (JoinAgentIo's service -> agent part).
  struct Requests {
    std::vector<std::pair<std::string, std::string>> publish;
    std::vector<JoinAgentIo::Fetch> fetch;
    bool coordinating, searching, watch_end;
    std::vector<uint32_t> incs;
    std::vector<char> outside;
    std::vector<std::pair<int, uint32_t>> watch_dead;
  };
  // What a pass could not do yet; the next one tries again.
  struct Retries {
    std::vector<std::pair<std::string, std::string>> publish;
    std::vector<JoinAgentIo::Fetch> fetch;
  };

  void run() {
    using namespace std::chrono_literals;
    while (true) {
      Requests q;
      if (!take_requests(q)) return;
      JoinAgentIo out;
      Retries retry;
      publish_values(q, out, retry);
      fetch_joiners(q, out, retry);
      const auto now = engine->now();
      if (q.coordinating && now - last_watch >= 100ms) {
        last_watch = now;
        watch_incarnations(q, out);
      }
      if ((q.searching || q.watch_end) && now - last_done_check >= 200ms) {
        last_done_check = now;
        check_job_end(out);
      }
      if (q.searching) search_members(out);
      if (!q.watch_dead.empty() && now - last_dead_check >= 100ms) {
        last_dead_check = now;
        look_for_deaths(q, out);
      }
      const bool any = !out.published.empty() || !out.fetched.empty() || !out.found.empty() ||
                       !out.values.empty() || out.finished || !out.lost.empty() ||
                       !out.dead.empty();
      hand_back(out, retry);
      if (any) engine->kick();
      if (!retry.publish.empty()) engine->clock().sleep_until(engine->now() + 20ms);
    }
  }

  void warn(const std::string& what, const std::exception& e) {
    using namespace std::chrono_literals;
    if (engine->now() - last_warning < 5s) return;
    last_warning = engine->now();
    spdlog::warn("rank {}: quorum join agent: {}: {}", rank, what, e.what());
  }

  // Waits up to 20 ms for something to publish; false once the agent is to stop.
  bool take_requests(Requests& q) {
    using namespace std::chrono_literals;
    std::unique_lock<std::mutex> lock(io->mu);
    JoinAgentIo& a = *io;
    engine->clock().wait_until(lock, a.cv, engine->now() + 20ms,
                               [&] { return a.stop || !a.publish.empty(); });
    if (a.stop) return false;
    q.publish.swap(a.publish);
    q.fetch.swap(a.fetch);
    q.coordinating = a.coordinating;
    q.searching = a.searching;
    q.watch_end = a.watch_end;
    q.incs = a.incarnations;
    q.outside = a.outside;
    q.watch_dead = a.watch_dead;
    return true;
  }

  void publish_values(Requests& q, JoinAgentIo& out, Retries& retry) {
    for (auto& [key, value] : q.publish) {
      try {
        store->set(key, value);
        out.published.push_back(key);
      } catch (const std::exception& e) {
        warn(fmt::format("cannot publish '{}'", key), e);
        retry.publish.emplace_back(key, value);
      }
    }
  }

  void fetch_joiners(Requests& q, JoinAgentIo& out, Retries& retry) {
    using namespace std::chrono_literals;
    for (auto& f : q.fetch) {
      try {
        if (store->check({f.key})) {
          out.fetched.emplace_back(f.rank, f.incarnation, store->get(f.key, net::deadline_in(2s)));
          continue;
        }
      } catch (const std::exception& e) {
        warn(fmt::format("cannot read '{}'", f.key), e);
      }
      if (engine->now() < f.until) retry.fetch.push_back(f);
    }
  }

  // The coordinator: new incarnations of the ranks outside its view.
  void watch_incarnations(const Requests& q, JoinAgentIo& out) {
    using namespace std::chrono_literals;
    for (int r = 0; r < world && size_t(r) < q.outside.size(); ++r) {
      if (!q.outside[size_t(r)] || r == rank) continue;
      try {
        const std::string key = net::incarnation_key(r);
        if (!store->check({key})) continue;
        const int64_t n = net::parse_counter(key, store->get(key, net::deadline_in(2s)));
        if (n < 1 || n - 1 <= int64_t(q.incs[size_t(r)]) || n - 1 > int64_t(UINT32_MAX)) continue;
        const uint32_t inc = uint32_t(n - 1);
        // Found once its address is there to fetch.
        if (store->check({join_key(instance, r, inc, r)})) out.found.emplace_back(r, inc);
      } catch (const std::exception& e) {
        warn(fmt::format("cannot look for a new incarnation of rank {}", r), e);
      }
    }
  }

  void check_job_end(JoinAgentIo& out) {
    // The job may have finished, or have been lost, while this rank was away.
    try {
      JobEnd end = read_job_end(*store, instance, world);
      out.finished = end.finished;
      out.lost = std::move(end.lost);
    } catch (const std::exception& e) {
      warn("cannot look for the end of the job", e);
    }
  }

  // The deaths the store witnessed, of the ranks the member asks about (witness.h).
  void look_for_deaths(const Requests& q, JoinAgentIo& out) {
    for (auto [r, inc] : q.watch_dead) {
      try {
        if (store->check({net::dead_key(r, inc)})) out.dead.emplace_back(r, inc);
      } catch (const std::exception& e) {
        warn(fmt::format("cannot look for the death of rank {}", r), e);
      }
    }
  }

  // The joiner: the members' addresses for this incarnation.
  void search_members(JoinAgentIo& out) {
    using namespace std::chrono_literals;
    for (int p = 0; p < world; ++p) {
      if (found_peer[size_t(p)]) continue;
      const std::string key = join_key(instance, rank, my_inc, p);
      try {
        if (!store->check({key})) continue;
        out.values.emplace_back(p, store->get(key, net::deadline_in(2s)));
        found_peer[size_t(p)] = 1;
      } catch (const std::exception& e) {
        warn(fmt::format("cannot read '{}'", key), e);
      }
    }
  }

  void hand_back(JoinAgentIo& out, Retries& retry) {
    std::lock_guard<std::mutex> lock(io->mu);
    JoinAgentIo& a = *io;
    for (auto& k : out.published) a.published.push_back(std::move(k));
    for (auto& f : out.fetched) a.fetched.push_back(std::move(f));
    for (auto& f : out.found) a.found.push_back(f);
    for (auto& v : out.values) a.values.push_back(std::move(v));
    for (auto& d : out.dead) a.dead.push_back(d);
    a.finished = a.finished || out.finished;
    if (a.lost.empty()) a.lost = std::move(out.lost);
    for (auto& p : retry.publish) a.publish.push_back(std::move(p));
    for (auto& f : retry.fetch) a.fetch.push_back(std::move(f));
  }
};

}  // namespace

void run_join_agent(std::shared_ptr<JoinAgentIo> io, net::Store* store, Engine* engine, int rank,
                    int world, uint32_t instance, uint32_t my_inc) {
  JoinAgent(std::move(io), store, engine, rank, world, instance, my_inc).run();
}

}  // namespace qring::collectives
