// Element types and reduction operators of the collectives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace qring::collectives {

enum class DataType : uint8_t { kFloat32, kFloat64, kInt32, kInt64, kBFloat16 };
enum class RedOp : uint8_t { kSum, kAvg, kMin, kMax };

// Header-only, so that qring-mpi-bench can use them without linking qring.
constexpr size_t dtype_size(DataType t) {
  switch (t) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kBFloat16: return 2;
  }
  return 1;
}
constexpr std::string_view to_string(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBFloat16: return "bfloat16";
  }
  return "?";
}
constexpr std::string_view to_string(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "sum";
    case RedOp::kAvg: return "avg";
    case RedOp::kMin: return "min";
    case RedOp::kMax: return "max";
  }
  return "?";
}
// The names users write for them (qring-bench --dtype / --redop, qring-mpi-bench):
// "float32"/"float"/"f32", "float64"/"double"/"f64", "int32", "int64", "bfloat16"/"bf16";
// "sum", "avg", "min", "max". nullopt for anything else (the caller names the flag).
constexpr std::optional<DataType> parse_dtype(std::string_view s) {
  if (s == "float32" || s == "float" || s == "f32") return DataType::kFloat32;
  if (s == "float64" || s == "double" || s == "f64") return DataType::kFloat64;
  if (s == "int32") return DataType::kInt32;
  if (s == "int64") return DataType::kInt64;
  if (s == "bfloat16" || s == "bf16") return DataType::kBFloat16;
  return std::nullopt;
}
constexpr std::optional<RedOp> parse_redop(std::string_view s) {
  if (s == "sum") return RedOp::kSum;
  if (s == "avg") return RedOp::kAvg;
  if (s == "min") return RedOp::kMin;
  if (s == "max") return RedOp::kMax;
  return std::nullopt;
}

// bfloat16 <-> float32 (round to nearest even; NaN stays NaN).
inline float bf16_to_float(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return uint16_t((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

}  // namespace qring::collectives
