#include "train/config_limits.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "net/base/error.h"

namespace qring::train {
namespace {

// Where in `text` byte i is, for an error message.
std::string position(std::string_view text, size_t i) {
  size_t line = 1, col = 1;
  for (size_t k = 0; k < i; ++k) {
    if (text[k] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return fmt::format("line {}, column {}", line, col);
}

const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

}  // namespace

void check_toml_limits(std::string_view text, const std::string& name) {
  if (text.size() > kMaxConfigBytes)
    throw ConfigError(fmt::format("{}: {} bytes, more than the limit of {} bytes", name,
                                  text.size(), kMaxConfigBytes));
  enum class In { kCode, kComment, kBasic, kLiteral, kMultiBasic, kMultiLiteral };
  In in = In::kCode;
  size_t depth = 0, parts = 1;
  auto starts = [&](size_t i, std::string_view s) { return text.substr(i, s.size()) == s; };
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    switch (in) {
      case In::kComment:
        if (ch == '\n') in = In::kCode;
        continue;
      case In::kBasic:
        if (ch == '\\') ++i;
        else if (ch == '"' || ch == '\n') in = In::kCode;
        continue;
      case In::kLiteral:
        if (ch == '\'' || ch == '\n') in = In::kCode;
        continue;
      case In::kMultiBasic:
        if (ch == '\\') ++i;
        else if (starts(i, "\"\"\"")) in = In::kCode, i += 2;
        continue;
      case In::kMultiLiteral:
        if (starts(i, "'''")) in = In::kCode, i += 2;
        continue;
      case In::kCode:
        break;
    }
    switch (ch) {
      case '#':
        in = In::kComment;
        break;
      case '"':
        in = starts(i, "\"\"\"") ? (i += 2, In::kMultiBasic) : In::kBasic;
        break;
      case '\'':
        in = starts(i, "'''") ? (i += 2, In::kMultiLiteral) : In::kLiteral;
        break;
      case '[':
      case '{':
        if (++depth > kMaxTomlNesting)
          throw ConfigError(fmt::format(
              "{}: arrays or inline tables nested deeper than {} levels at {} (a qring "
              "configuration needs 2)",
              name, kMaxTomlNesting, position(text, i)));
        parts = 1;
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        parts = 1;
        break;
      case '.':
        if (++parts > kMaxTomlKeyParts)
          throw ConfigError(fmt::format("{}: a dotted key of more than {} parts at {}", name,
                                        kMaxTomlKeyParts, position(text, i)));
        break;
      case '=':
      case ',':
      case '\n':
        parts = 1;
        break;
      default:
        break;
    }
  }
}

std::string read_config_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; the check below refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    throw ConfigError(fmt::format("config file '{}': cannot open: {}", path, std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    throw ConfigError(fmt::format("config file '{}': cannot stat: {}", path, std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    throw ConfigError(fmt::format("config file '{}': {}, not a regular file", path,
                                  file_kind(st.st_mode)));
  if (uint64_t(st.st_size) > kMaxConfigBytes)
    throw ConfigError(fmt::format("config file '{}': {} bytes, more than the limit of {} bytes",
                                  path, st.st_size, kMaxConfigBytes));
  // Read at most one byte past the limit: the file may have grown since fstat.
  std::string text(kMaxConfigBytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw ConfigError(fmt::format("config file '{}': read failed: {}", path, std::strerror(errno)));
    if (n == 0) break;
    got += size_t(n);
  }
  if (got > kMaxConfigBytes)
    throw ConfigError(fmt::format("config file '{}': more than the limit of {} bytes", path,
                                  kMaxConfigBytes));
  text.resize(got);
  return text;
}

}  // namespace qring::train
