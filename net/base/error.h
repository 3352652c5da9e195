// qring's error hierarchy and policy (see docs/design.md, "Errors").
//
//   qring::Error              root of everything qring throws
//   ├─ UsageError             the caller did something wrong (bad argument, wrong step,
//   │                         wrong buffer size, operation on a broken communicator)
//   ├─ ConfigError            bad configuration / command line / environment
//   ├─ ProtocolError          a malformed, truncated or mismatched wire message
//   │                         (version, world size, job id, duplicate rank ...)
//   ├─ IoError                the transport failed: the communicator is broken, rebuild it
//   │  ├─ FabricError         a libfabric call returned -FI_E*
//   │  └─ TimeoutError        a deadline expired; names what was awaited and from whom
//   └─ DataError              bad input data (dataset files, checkpoints)
#pragma once

#include <stdexcept>
#include <string>

namespace qring {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
class UsageError : public Error {
 public:
  using Error::Error;
};
class ConfigError : public Error {
 public:
  using Error::Error;
};
class ProtocolError : public Error {
 public:
  using Error::Error;
};
class IoError : public Error {
 public:
  using Error::Error;
};
class FabricError : public IoError {
 public:
  FabricError(const std::string& call, int ret, const char* file, int line);
  int code() const { return code_; }

 private:
  int code_;
};
class TimeoutError : public IoError {
 public:
  using IoError::IoError;
};
class DataError : public Error {
 public:
  using Error::Error;
};

}  // namespace qring

// Wraps a libfabric call returning 0 or -FI_E*: throws FabricError naming the call, the
// fi_strerror text and file:line.
#define QRING_FI_CHECK(call)                                                                     \
  do {                                                                                           \
    int qring_fi_ret_ = static_cast<int>(call);                                                  \
    if (qring_fi_ret_ < 0) throw ::qring::FabricError(#call, qring_fi_ret_, __FILE__, __LINE__); \
  } while (0)
