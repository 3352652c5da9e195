// qring-mpi-bench: the reference baseline. The same sweep, data, check, table and JSON as
// qring-bench (collectives/bench/bench_common.h), through OpenMPI's MPI_Allreduce,
// MPI_Bcast, MPI_Allgather, MPI_Reduce_scatter_block and MPI_Barrier.
//
//   mpirun -np 4 qring-mpi-bench --op allreduce -b 4K -e 256M -f 4 --json mpi.json
//
// MPI has no average: --redop avg runs MPI_SUM and divides locally, inside the timed loop.
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "collectives/bench/bench_common.h"

namespace qring::bench {
namespace {

MPI_Datatype mpi_type(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return MPI_FLOAT;
    case DataType::kFloat64:
      return MPI_DOUBLE;
    case DataType::kInt32:
      return MPI_INT32_T;
    case DataType::kInt64:
      return MPI_INT64_T;
    case DataType::kBFloat16:
      break;
  }
  throw ConfigError("MPI has no bfloat16 type");
}

MPI_Op mpi_op(RedOp op) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg:
      return MPI_SUM;
    case RedOp::kMin:
      return MPI_MIN;
    case RedOp::kMax:
      return MPI_MAX;
  }
  return MPI_SUM;
}

void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw IoError(fmt::format("{} failed: {}", call, std::string(msg, size_t(len))));
}

// Divides `count` elements in place by n, in their own type (integers truncate), as the
// expectation in bench_common.h does.
void divide(void* buf, DataType t, size_t count, int n) {
  switch (t) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] /= float(n);
      break;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] /= double(n);
      break;
    }
    case DataType::kInt32: {
      auto* p = static_cast<int32_t*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] /= n;
      break;
    }
    case DataType::kInt64: {
      auto* p = static_cast<int64_t*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] /= n;
      break;
    }
    case DataType::kBFloat16:
      break;
  }
}

class MpiBackend {
 public:
  explicit MpiBackend(const Options& o) : o_(o), type_(mpi_type(o.dtype)), op_(mpi_op(o.redop)) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string provider() const { return "openmpi"; }
  void barrier() { check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }
  double reduce_over_ranks(double v, RedOp op) {
    double out = 0;
    check_mpi(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, mpi_op(op), MPI_COMM_WORLD), "MPI_Allreduce");
    return out;
  }
  // Every rank's pid and processor name, gathered at rank 0.
  std::vector<RankInfo> rank_infos() {
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    MPI_Get_processor_name(name, &len);
    std::vector<char> names(rank_ == 0 ? size_t(size_) * MPI_MAX_PROCESSOR_NAME : 1);
    std::vector<long> pids(rank_ == 0 ? size_t(size_) : 1);
    long pid = long(getpid());
    check_mpi(MPI_Gather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(),
                         MPI_MAX_PROCESSOR_NAME, MPI_CHAR, 0, MPI_COMM_WORLD),
              "MPI_Gather");
    check_mpi(MPI_Gather(&pid, 1, MPI_LONG, pids.data(), 1, MPI_LONG, 0, MPI_COMM_WORLD),
              "MPI_Gather");
    std::vector<RankInfo> out;
    if (rank_ != 0) return out;
    for (int r = 0; r < size_; ++r) {
      const char* n = names.data() + size_t(r) * MPI_MAX_PROCESSOR_NAME;
      out.push_back({r, pids[size_t(r)], std::string(n, strnlen(n, MPI_MAX_PROCESSOR_NAME))});
    }
    return out;
  }
  std::string algorithm(BenchOp, size_t) const { return "mpi"; }
  int64_t sum_over_ranks(int64_t v) {
    int64_t out = 0;
    check_mpi(MPI_Allreduce(&v, &out, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
    return out;
  }
  size_t reduce_scatter_in_place_offset(size_t /*count*/) const { return 0; }
  void register_buffer(const void*, size_t) {}

  void run(BenchOp op, const void* send, void* recv, size_t count, bool in_place) {
    const int c = checked_count(count);
    switch (op) {
      case BenchOp::kAllreduce:
        check_mpi(
            MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, c, type_, op_, MPI_COMM_WORLD),
            "MPI_Allreduce");
        if (o_.redop == RedOp::kAvg) divide(recv, o_.dtype, count, size_);
        break;
      case BenchOp::kBroadcast:
        check_mpi(MPI_Bcast(recv, c, type_, o_.root, MPI_COMM_WORLD), "MPI_Bcast");
        break;
      case BenchOp::kAllgather:
        check_mpi(
            MPI_Allgather(in_place ? MPI_IN_PLACE : send, c, type_, recv, c, type_, MPI_COMM_WORLD),
            "MPI_Allgather");
        break;
      case BenchOp::kReduceScatter:
        check_mpi(MPI_Reduce_scatter_block(in_place ? MPI_IN_PLACE : send, recv, c, type_, op_,
                                           MPI_COMM_WORLD),
                  "MPI_Reduce_scatter_block");
        if (o_.redop == RedOp::kAvg) divide(recv, o_.dtype, count, size_);
        break;
      case BenchOp::kBarrier:
        barrier();
        break;
      default:
        throw ConfigError(
            fmt::format("--op {} is not supported by the MPI benchmark", op_name(op)));
    }
  }

 private:
  static int checked_count(size_t count) {
    if (count > size_t(INT32_MAX))
      throw ConfigError(fmt::format("{} elements exceed MPI's int count", count));
    return int(count);
  }
  const Options& o_;
  MPI_Datatype type_;
  MPI_Op op_;
  int rank_ = 0;
  int size_ = 1;
};

int bench_main(int argc, char** argv, int rank) {
  Options o;
  if (auto rc = parse_args(argc, argv, /*mpi=*/true, o, /*report=*/rank == 0)) return *rc;
  // Rank 0 writes --json: it checks it can before the sweep, and every rank learns the answer.
  int bad_path = 0;
  if (rank == 0 && !o.json_path.empty()) {
    try {
      cli::check_output_path("--json", o.json_path);
    } catch (const ConfigError& e) {
      std::fprintf(stderr, "qring-mpi-bench: %s\n", e.what());
      bad_path = 1;
    }
  }
  check_mpi(MPI_Bcast(&bad_path, 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Bcast");
  if (bad_path) return 2;
  MpiBackend be(o);
  Sweep<MpiBackend> sweep(be, o);
  int64_t wrong = 0;
  auto write = [&] {
    if (rank != 0 || o.json_path.empty()) return;
    std::vector<nlohmann::json> rows = sweep.rows();
    add_provenance(rows, sweep.ranks());
    write_json(o.json_path, rows);
  };
  try {
    wrong = sweep.run("qring-mpi-bench");
  } catch (const ConfigError& e) {
    if (rank == 0) std::fprintf(stderr, "qring-mpi-bench: %s\n", e.what());
    return 2;
  } catch (...) {
    write();
    throw;
  }
  write();
  if (wrong > 0) {
    if (rank == 0)
      std::fprintf(stderr, "qring-mpi-bench: %lld wrong elements\n", static_cast<long long>(wrong));
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace qring::bench

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int rc = 0;
  try {
    rc = qring::bench::bench_main(argc, argv, rank);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qring-mpi-bench: rank %d: error: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 3);
    return 3;
  }
  MPI_Finalize();
  return rc;
}
