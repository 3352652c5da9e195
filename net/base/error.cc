#include "net/base/error.h"

#include <fmt/format.h>
#include <rdma/fi_errno.h>

namespace qring {

FabricError::FabricError(const std::string& call, int ret, const char* file, int line)
    : IoError(fmt::format("{} failed: {} ({}) at {}:{}", call, fi_strerror(-ret), ret, file, line)),
      code_(ret) {}

}  // namespace qring
