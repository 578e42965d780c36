#pragma once
// The tensor layer (DESIGN.md): TreeTensor, its ops, reductions, construction and optimizer
// math. Includes ATen; for structure alone include treetensor/tree/tree.hpp.

#include "treetensor/tensor/consolidate.hpp"  // IWYU pragma: export
#include "treetensor/tensor/construct.hpp"    // IWYU pragma: export
#include "treetensor/tensor/dispatch.hpp"     // IWYU pragma: export
#include "treetensor/tensor/fuse.hpp"         // IWYU pragma: export
#include "treetensor/tensor/ops.hpp"          // IWYU pragma: export
#include "treetensor/tensor/optim.hpp"        // IWYU pragma: export
#include "treetensor/tensor/reduce.hpp"       // IWYU pragma: export
#include "treetensor/tensor/rounding.hpp"     // IWYU pragma: export
#include "treetensor/tensor/submit.hpp"       // IWYU pragma: export
#include "treetensor/tensor/tree_tensor.hpp"  // IWYU pragma: export
