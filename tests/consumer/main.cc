// A program against the installed qring (tests/consumer/CMakeLists.txt): from the launcher's
// environment to a communicator in one call, then steps of the quorum all-reduce with
// quorum = world - 1. Rank r contributes r + 1 in every element; every rank checks that the
// result is the mean over the step's contributors. Exit status 0 when all steps are right.
#include <qring/qring.h>

#include <cstdio>
#include <vector>

int main() {
  namespace qc = qring::collectives;
  try {
    qc::Session session;
    const int rank = session.rank(), world = session.size();
    qc::QuorumOptions qo;
    qo.quorum = world > 1 ? world - 1 : 1;
    const size_t n = 1000;
    qc::QuorumAllreduce q(session.comm(), n, qo);
    int wrong = 0;
    for (uint64_t step = 0; step < 5; ++step) {
      std::vector<float> grad(n, float(rank + 1));
      q.contribute(step, grad.data(), n);
      qc::QuorumResult r = q.wait(step, grad.data());
      double expect = 0;
      for (int p = 0; p < world; ++p)
        if (r.contains(p)) expect += p + 1;
      expect /= r.count;
      for (float v : grad) wrong += v != float(expect);
      std::printf("rank %d step %llu contributors %d mean %.3f\n", rank,
                  static_cast<unsigned long long>(step), r.count, double(grad[0]));
    }
    return wrong == 0 ? 0 : 1;
  } catch (const qring::Error& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 2;
  }
}
