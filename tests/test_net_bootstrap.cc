#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <thread>

#include "net/bootstrap.h"
#include "net/error.h"

namespace qring::net {
namespace {

using namespace std::chrono_literals;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using Vars = std::map<std::string, std::string>;

BootstrapInfo detect(const Vars& vars) {
  return detect_bootstrap([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const Vars& vars) {
  try {
    detect(vars);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(DetectBootstrap, SingleProcessWhenNothingIsSet) {
  auto b = detect({{"HOME", "/root"}});
  EXPECT_EQ(b.source, "single");
  EXPECT_EQ(b.rank, 0);
  EXPECT_EQ(b.world_size, 1);
  EXPECT_EQ(b.store_port, 0);
}

TEST(DetectBootstrap, ExplicitEnv) {
  auto b = detect({{"QRING_RANK", "2"},
                   {"QRING_WORLD_SIZE", "4"},
                   {"QRING_STORE", "10.0.0.1:1234"},
                   {"QRING_JOB_ID", "launch-9"}});
  EXPECT_EQ(b.source, "env");
  EXPECT_EQ(b.rank, 2);
  EXPECT_EQ(b.world_size, 4);
  EXPECT_EQ(b.local_rank, 2);  // one host assumed without QRING_LOCAL_*
  EXPECT_EQ(b.local_size, 4);
  EXPECT_EQ(b.store_host, "10.0.0.1");
  EXPECT_EQ(b.store_port, 1234);
  EXPECT_EQ(b.job_id, "launch-9");

  b = detect({{"QRING_RANK", "3"},
              {"QRING_WORLD_SIZE", "4"},
              {"QRING_LOCAL_RANK", "1"},
              {"QRING_LOCAL_SIZE", "2"},
              {"QRING_STORE", "localhost:5000"}});
  EXPECT_EQ(b.local_rank, 1);
  EXPECT_EQ(b.local_size, 2);
  EXPECT_EQ(b.job_id, "env");

  b = detect({{"QRING_RANK", "0"}, {"QRING_WORLD_SIZE", "1"}});
  EXPECT_EQ(b.world_size, 1);
  EXPECT_EQ(b.store_port, 0);
}

TEST(DetectBootstrap, ExplicitEnvWinsOverSlurmAndMpi) {
  auto b = detect({{"QRING_RANK", "1"},
                   {"QRING_WORLD_SIZE", "2"},
                   {"QRING_STORE", "h:7"},
                   {"SLURM_PROCID", "5"},
                   {"SLURM_NTASKS", "8"},
                   {"OMPI_COMM_WORLD_RANK", "3"}});
  EXPECT_EQ(b.source, "env");
  EXPECT_EQ(b.rank, 1);
  b = detect({{"SLURM_PROCID", "1"},
              {"SLURM_NTASKS", "2"},
              {"SLURM_JOB_NODELIST", "n1"},
              {"SLURM_JOB_ID", "5"},
              {"OMPI_COMM_WORLD_RANK", "0"},
              {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(b.source, "slurm");
}

TEST(DetectBootstrap, ExplicitEnvErrorsNameTheVariable) {
  Vars ok{{"QRING_RANK", "1"}, {"QRING_WORLD_SIZE", "4"}, {"QRING_STORE", "h:80"}};
  auto with = [&](const std::string& k, const std::string& v) {
    Vars x = ok;
    x[k] = v;
    return x;
  };
  EXPECT_EQ(error_of(ok), "(no error)");
  EXPECT_THAT(error_of(with("QRING_RANK", "abc")), HasSubstr("QRING_RANK='abc' is not an integer"));
  EXPECT_THAT(error_of(with("QRING_RANK", "1x")), HasSubstr("QRING_RANK='1x' is not an integer"));
  EXPECT_THAT(error_of(with("QRING_RANK", "-1")), HasSubstr("QRING_RANK=-1 is out of range"));
  EXPECT_THAT(error_of(with("QRING_RANK", "4")),
              HasSubstr("QRING_RANK=4 is not below QRING_WORLD_SIZE=4"));
  EXPECT_THAT(error_of(with("QRING_WORLD_SIZE", "0")), HasSubstr("QRING_WORLD_SIZE=0"));
  EXPECT_THAT(error_of(with("QRING_STORE", "nohost")), HasSubstr("QRING_STORE='nohost'"));
  EXPECT_THAT(error_of(with("QRING_STORE", "h:70000")), HasSubstr("QRING_STORE port=70000"));
  EXPECT_THAT(error_of(with("QRING_LOCAL_RANK", "4")),
              HasSubstr("QRING_LOCAL_RANK=4 is not below QRING_LOCAL_SIZE=4"));
  EXPECT_THAT(error_of({{"QRING_RANK", "1"}, {"QRING_WORLD_SIZE", "4"}}),
              HasSubstr("QRING_STORE is not"));
  EXPECT_THAT(error_of({{"QRING_RANK", "1"}}), HasSubstr("QRING_WORLD_SIZE is not"));
  EXPECT_THAT(error_of({{"QRING_WORLD_SIZE", "2"}}), HasSubstr("QRING_RANK is not"));
}

Vars slurm_vars() {
  return {{"SLURM_PROCID", "5"},
          {"SLURM_NTASKS", "8"},
          {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "2"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x3),2"},
          {"SLURM_STEP_NODELIST", "node[01-04]"},
          {"SLURM_JOB_NODELIST", "other[1-9]"},
          {"SLURM_JOB_ID", "12345"}};
}

TEST(DetectBootstrap, Slurm) {
  auto b = detect(slurm_vars());
  EXPECT_EQ(b.source, "slurm");
  EXPECT_EQ(b.rank, 5);
  EXPECT_EQ(b.world_size, 8);
  EXPECT_EQ(b.local_rank, 1);
  EXPECT_EQ(b.local_size, 2);
  EXPECT_THAT(b.nodes, ElementsAre("node01", "node02", "node03", "node04"));
  EXPECT_EQ(b.store_host, "node01");
  EXPECT_EQ(b.store_port, 20000 + 12345);
  EXPECT_EQ(b.job_id, "12345");

  Vars v = slurm_vars();
  v["SLURM_STEP_ID"] = "2";
  b = detect(v);
  EXPECT_EQ(b.job_id, "12345.2");
  EXPECT_EQ(b.store_port, 20000 + (12345 + 2 * 4099) % 20000);
  v["QRING_STORE_PORT"] = "5555";
  EXPECT_EQ(detect(v).store_port, 5555);
  v["QRING_STORE"] = "head:6000";
  b = detect(v);
  EXPECT_EQ(b.store_host, "head");
  EXPECT_EQ(b.store_port, 6000);

  // Uneven tasks per node; the job node list when the step one is absent.
  v = slurm_vars();
  v.erase("SLURM_STEP_NODELIST");
  v["SLURM_STEP_TASKS_PER_NODE"] = "3,1";
  v["SLURM_NODEID"] = "1";
  v["SLURM_LOCALID"] = "0";
  b = detect(v);
  EXPECT_EQ(b.local_size, 1);
  EXPECT_EQ(b.nodes.size(), 9u);
  EXPECT_EQ(b.store_host, "other1");

  // One node: the store stays on loopback and every task is local.
  b = detect({{"SLURM_PROCID", "2"},
              {"SLURM_NTASKS", "4"},
              {"SLURM_LOCALID", "2"},
              {"SLURM_JOB_NODELIST", "solo"},
              {"SLURM_JOB_ID", "77"}});
  EXPECT_EQ(b.store_host, "127.0.0.1");
  EXPECT_EQ(b.local_size, 4);
  EXPECT_EQ(b.store_port, 20077);
}

TEST(DetectBootstrap, SlurmErrorsNameTheVariable) {
  auto with = [](const std::string& k, const std::string& v) {
    Vars x = slurm_vars();
    if (v.empty())
      x.erase(k);
    else
      x[k] = v;
    return x;
  };
  EXPECT_THAT(error_of(with("SLURM_PROCID", "8")),
              HasSubstr("SLURM_PROCID=8 is not below SLURM_NTASKS=8"));
  EXPECT_THAT(error_of(with("SLURM_NTASKS", "")), HasSubstr("SLURM_NTASKS is not set"));
  EXPECT_THAT(error_of(with("SLURM_JOB_ID", "abc")), HasSubstr("SLURM_JOB_ID='abc'"));
  EXPECT_THAT(error_of(with("SLURM_JOB_ID", "")), HasSubstr("QRING_STORE_PORT"));
  EXPECT_THAT(error_of(with("SLURM_STEP_NODELIST", "node[4-1]")), HasSubstr("descending"));
  EXPECT_THAT(error_of(with("SLURM_STEP_TASKS_PER_NODE", "2(x3")),
              HasSubstr("SLURM_STEP_TASKS_PER_NODE='2(x3' is malformed"));
  EXPECT_THAT(error_of(with("SLURM_NODEID", "7")), HasSubstr("SLURM_NODEID=7"));
  EXPECT_THAT(error_of(with("SLURM_LOCALID", "2")), HasSubstr("SLURM_LOCALID=2 is not below"));
  Vars v = slurm_vars();
  v.erase("SLURM_STEP_NODELIST");
  v.erase("SLURM_JOB_NODELIST");
  EXPECT_THAT(error_of(v), HasSubstr("SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are unset"));
}

TEST(DetectBootstrap, MpiAndPmi) {
  Vars v{{"OMPI_COMM_WORLD_RANK", "1"},
         {"OMPI_COMM_WORLD_SIZE", "3"},
         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
         {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
         {"MASTER_ADDR", "head"},
         {"MASTER_PORT", "29500"}};
  auto b = detect(v);
  EXPECT_EQ(b.source, "mpi");
  EXPECT_EQ(b.rank, 1);
  EXPECT_EQ(b.world_size, 3);
  EXPECT_EQ(b.local_rank, 0);
  EXPECT_EQ(b.local_size, 1);
  EXPECT_EQ(b.store_host, "head");
  EXPECT_EQ(b.store_port, 29500);
  v["QRING_STORE"] = "other:1";  // QRING_STORE wins over MASTER_*
  b = detect(v);
  EXPECT_EQ(b.store_host, "other");
  EXPECT_EQ(b.store_port, 1);

  b = detect({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"QRING_STORE", "h:9"}});
  EXPECT_EQ(b.source, "mpi");
  EXPECT_EQ(b.rank, 2);
  EXPECT_EQ(b.world_size, 4);

  std::string err = error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_THAT(err, HasSubstr("QRING_STORE=host:port"));
  EXPECT_THAT(err, HasSubstr("MASTER_ADDR and MASTER_PORT"));
  EXPECT_THAT(error_of({{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}, {"QRING_STORE", "h:9"}}),
              HasSubstr("PMI_RANK=4 is not below PMI_SIZE=4"));
  EXPECT_THAT(error_of({{"PMI_RANK", "0"}, {"PMI_SIZE", "two"}}), HasSubstr("PMI_SIZE='two'"));
  EXPECT_THAT(error_of({{"OMPI_COMM_WORLD_RANK", "0"},
                        {"OMPI_COMM_WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "x"}}),
              HasSubstr("MASTER_PORT='x'"));
}

std::string my_hostname() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

int free_port() {
  TcpStoreServer probe("127.0.0.1", 0, 1, "probe");
  return probe.port();
}

TEST(Rendezvous, ThreeRanksOverTcp) {
  constexpr int kWorld = 3;
  int port = free_port();
  std::vector<std::vector<std::string>> hosts(kWorld);
  std::vector<std::string> seen(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      try {
        BootstrapInfo info;
        info.rank = r;
        info.world_size = kWorld;
        info.store_host = "127.0.0.1";
        info.store_port = port;
        info.job_id = "rdv-test";
        info.source = "env";
        if (r != 0) std::this_thread::sleep_for(milliseconds(50 * r));
        Rendezvous rdv(info, deadline_in(5s));
        hosts[r] = rdv.hostnames();
        EXPECT_TRUE(rdv.single_host());
        rdv.store().set(fmt::format("data/{}", r), fmt::format("from {}", r));
        seen[r] = rdv.store().get(fmt::format("data/{}", (r + 1) % kWorld), deadline_in(5s));
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(hosts[r], ElementsAre(my_hostname(), my_hostname(), my_hostname()));
    EXPECT_EQ(seen[r], fmt::format("from {}", (r + 1) % kWorld));
  }
}

TEST(Rendezvous, InProcessOverAGivenStore) {
  MemoryStore store;
  std::vector<std::thread> threads;
  std::vector<size_t> counts(4);
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      BootstrapInfo info;
      info.rank = r;
      info.world_size = 4;
      Rendezvous rdv(info, store, deadline_in(5s));
      counts[r] = rdv.hostnames().size();
      EXPECT_TRUE(rdv.single_host());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_THAT(counts, ElementsAre(4u, 4u, 4u, 4u));
  EXPECT_TRUE(store.check({"exit/0", "exit/1", "exit/2", "exit/3"}));
}

TEST(Rendezvous, SingleProcessNeedsNoStore) {
  Rendezvous rdv(BootstrapInfo{}, deadline_in(1s));
  EXPECT_THAT(rdv.hostnames(), ElementsAre(my_hostname()));
  rdv.store().set("k", "v");
  EXPECT_EQ(rdv.store().get("k", deadline_in(1s)), "v");
}

TEST(Rendezvous, UnreachableStoreNamesHostPortAndRank) {
  BootstrapInfo info;
  info.rank = 2;
  info.world_size = 3;
  info.store_port = free_port();  // nobody serves it
  auto t0 = Clock::now();
  try {
    Rendezvous rdv(info, deadline_in(300ms));
    ADD_FAILURE() << "rendezvous without a store succeeded";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("127.0.0.1:{}", info.store_port)));
    EXPECT_THAT(e.what(), HasSubstr("rank 2"));
  }
  EXPECT_LT(Clock::now() - t0, 1500ms);
}

TEST(Rendezvous, MissingRankTimesOutInsteadOfHanging) {
  // Rank 0 of a world of 2 whose rank 1 never comes: the hostname exchange times out.
  BootstrapInfo info;
  info.world_size = 2;
  info.store_port = free_port();
  auto t0 = Clock::now();
  try {
    Rendezvous rdv(info, deadline_in(300ms));
    ADD_FAILURE() << "rendezvous with a missing rank succeeded";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("host/1"));
  }
  EXPECT_LT(Clock::now() - t0, 1500ms);
}

}  // namespace
}  // namespace qring::net
