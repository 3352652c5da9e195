// Training checkpoints: one binary file per checkpoint, written atomically.
//
// File layout (little-endian):
//   0   8  magic "QRINGCK\0"
//   8   4  format version (1)
//   12  4  reserved, 0
//   16  8  payload length P
//   24  P  payload
//   24+P 4 CRC-32 (zlib) of bytes [0, 24 + P)
// Payload: u64 step, i64 epoch, i64 batch index, u64 config fingerprint, u32 world, u32 rank,
// then four length-prefixed (u64 count) arrays: params (f32), velocity (f32), carry (f32),
// rng state (bytes), and a length-prefixed UTF-8 metadata string (JSON by convention).
//
// save_checkpoint writes <path>.tmp, fsyncs it, renames it over <path> and fsyncs the
// directory, so a crash leaves either the old or the new file, never a torn one.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "train/dataset.h"

namespace qring::train {

struct CheckpointState {
  uint64_t step = 0;      // optimizer steps completed
  DataPosition position;  // where the sharder continues
  uint64_t config_fingerprint = 0;
  uint32_t world = 1;
  uint32_t rank = 0;
  std::vector<float> params;
  std::vector<float> velocity;  // optimizer momentum buffer
  std::vector<float> carry;     // late-policy carry buffer (empty when unused)
  std::vector<uint8_t> rng_state;
  std::string meta;
  bool operator==(const CheckpointState&) const = default;
};

// Throws qring::Error (naming the path and the failing call) if the file cannot be written.
// `before_rename`, when given, runs once the temporary file is complete and synced but not
// yet renamed into place (fault tests kill a rank there).
void save_checkpoint(const std::string& path, const CheckpointState& state,
                     const std::function<void()>& before_rename = {});

// Throws qring::DataError naming the file and the problem (missing, not a regular file,
// truncated, bad magic, unsupported version, CRC mismatch, inconsistent lengths). The size
// and the header are checked before the body is read: a file larger than `max_bytes` (0: no
// limit) or whose header disagrees with its size costs neither the time nor the memory of
// reading it (issue 44: a 1 GiB sparse file had been read whole first, 10 s and 1.1 GB).
CheckpointState load_checkpoint(const std::string& path, uint64_t max_bytes = 0);

// The largest file a checkpoint of a model of `n_params` parameters can be: parameters,
// momentum and carry, an RNG state and metadata of up to 1 MiB each.
uint64_t max_checkpoint_bytes(size_t n_params);

// The file's bytes without the file: the state a live member sends to a rank that rejoins.
// decode_checkpoint checks them as load_checkpoint does, naming `what` in its errors.
// A checkpoint's content without owning it (spans into live buffers), so that the state sent
// to a rejoining rank is encoded straight from the model and optimizer, in one copy.
struct CheckpointView {
  uint64_t step = 0;
  DataPosition position;
  uint64_t config_fingerprint = 0;
  uint32_t world = 1;
  uint32_t rank = 0;
  std::span<const float> params, velocity, carry;
  std::span<const uint8_t> rng_state;
  std::string_view meta;
};
CheckpointView view_of(const CheckpointState& state);
// The content of a view, copied (the inverse of view_of).
CheckpointState state_of(const CheckpointView& view);
// The exact size encode_checkpoint() gives for this content.
size_t encoded_checkpoint_size(const CheckpointView& state);

std::vector<uint8_t> encode_checkpoint(const CheckpointState& state);
std::vector<uint8_t> encode_checkpoint(const CheckpointView& state);
// Into `out`, replacing what it held; no allocation when its capacity suffices.
void encode_checkpoint_into(const CheckpointView& state, std::vector<char>& out);
CheckpointState decode_checkpoint(const std::vector<uint8_t>& bytes, const std::string& what);
// The same checks without a copy: the view's arrays point into `bytes`, which must outlive
// it and start at a 4-byte boundary (a rejoining rank restores the state it received where
// it lies, instead of copying it into fresh memory first).
CheckpointView decode_checkpoint_view(std::span<const uint8_t> bytes, const std::string& what);

// <dir>/ckpt-<step, 12 digits>.qck
std::string checkpoint_path(const std::string& dir, uint64_t step);

// The largest step a checkpoint name may carry (the trainer counts steps in int64).
inline constexpr uint64_t kMaxCheckpointStep = uint64_t(std::numeric_limits<int64_t>::max());

// The steps of the checkpoint_path() files in dir, newest first. Other names are ignored:
// temporary files, and names whose step is past kMaxCheckpointStep or not in the form
// checkpoint_path() writes (ckpt-99999999999999999999.qck, ckpt-0000000000007.qck).
std::vector<uint64_t> checkpoint_steps(const std::string& dir);

// The checkpoint_path() file with the highest step in dir, if any (checkpoint_steps()).
std::optional<std::string> latest_checkpoint(const std::string& dir);

}  // namespace qring::train
