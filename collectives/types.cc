#include "collectives/types.h"

#include <fmt/format.h>

#include "net/error.h"

namespace qring::collectives {

DataType parse_dtype(std::string_view s) {
  if (s == "float32" || s == "float" || s == "f32") return DataType::kFloat32;
  if (s == "float64" || s == "double" || s == "f64") return DataType::kFloat64;
  if (s == "int32" || s == "int") return DataType::kInt32;
  if (s == "int64") return DataType::kInt64;
  if (s == "bfloat16" || s == "bf16") return DataType::kBFloat16;
  throw ConfigError(fmt::format(
      "unknown data type '{}' (expected float32, float64, int32, int64 or bfloat16)", s));
}

RedOp parse_redop(std::string_view s) {
  if (s == "sum") return RedOp::kSum;
  if (s == "avg" || s == "mean") return RedOp::kAvg;
  if (s == "min") return RedOp::kMin;
  if (s == "max") return RedOp::kMax;
  throw ConfigError(fmt::format("unknown reduction '{}' (expected sum, avg, min or max)", s));
}

}  // namespace qring::collectives
