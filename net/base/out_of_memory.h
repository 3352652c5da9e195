// Out of memory as an error that says what was being allocated and how much (issue 44: a 4 MB
// IDX file asked for a 17 GB buffer and qring-train ended with a bare "std::bad_alloc").
//
//   AllocationScope scope("the training images of " + path);   // names what this thread
//   images.resize(n);                                          // allocates while it lives
//
// An allocation that fails throws AllocationFailed, a std::bad_alloc (containers and callers
// that handle bad_alloc see no difference) whose what() reads "out of memory: cannot allocate
// 17179869184 bytes (16.0 GiB) for the training images of FILE (MemAvailable 11.2 GiB)". The
// large-buffer allocator (large_buffer.h) throws it; a program that replaces operator new
// (qring-train) makes every allocation throw it. Formatting it allocates nothing.
#pragma once

#include <cstddef>
#include <new>
#include <string>

namespace qring {

class AllocationFailed : public std::bad_alloc {
 public:
  // `bytes`: the size asked for (0: unknown). Reads the current AllocationScope.
  explicit AllocationFailed(size_t bytes) noexcept;
  const char* what() const noexcept override { return msg_; }
  size_t bytes() const noexcept { return bytes_; }

 private:
  size_t bytes_;
  char msg_[512];
};

// While alive, names what this thread allocates (the innermost scope wins).
class AllocationScope {
 public:
  explicit AllocationScope(std::string what);
  ~AllocationScope();
  AllocationScope(const AllocationScope&) = delete;
  AllocationScope& operator=(const AllocationScope&) = delete;
  // The innermost scope's text, or nullptr.
  static const char* current() noexcept;

 private:
  std::string what_;
  const AllocationScope* outer_;
};

// Runs f() with `what` as the current AllocationScope. A std::bad_alloc from f() that is not
// an AllocationFailed already (Eigen's allocator, a library) leaves as one, naming `what` and
// `bytes` (what f() allocates; 0: unknown): by the time a caller catches it, the scope is gone.
template <class F>
decltype(auto) allocating(std::string what, size_t bytes, F&& f) {
  const AllocationScope scope(std::move(what));
  try {
    return f();
  } catch (const AllocationFailed&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw AllocationFailed(bytes);
  }
}

// The message for any std::bad_alloc: an AllocationFailed's, else "out of memory (...)".
std::string out_of_memory_message(const std::bad_alloc& e);

}  // namespace qring
