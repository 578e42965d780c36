#pragma once
// PyTorch's names of dtypes, shared by printing, files and collectives' messages.

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace treetensor {

/// PyTorch's name of `t` without the "torch." prefix, as str(torch.float32) gives it:
/// "float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64",
/// "bool", "complex64", "complex128". std::nullopt for any other dtype (callers decide: the
/// checkpoint writer refuses it, messages fall back to c10::toString).
std::optional<std::string> torch_dtype_name(c10::ScalarType t);

}  // namespace treetensor
