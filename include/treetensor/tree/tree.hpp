#pragma once
// The tree layer (DESIGN.md): Tree<T> and its algorithms. Standard library only, so code that
// needs structure alone compiles in about a second.

#include "treetensor/tree/algorithms.hpp"      // IWYU pragma: export
#include "treetensor/tree/core.hpp"            // IWYU pragma: export
#include "treetensor/tree/flatten.hpp"         // IWYU pragma: export
#include "treetensor/tree/internal_error.hpp"  // IWYU pragma: export
#include "treetensor/tree/operators.hpp"       // IWYU pragma: export
#include "treetensor/tree/path.hpp"            // IWYU pragma: export
#include "treetensor/tree/print.hpp"           // IWYU pragma: export
#include "treetensor/tree/zip.hpp"             // IWYU pragma: export
#include "treetensor/tree/zip_rules.hpp"       // IWYU pragma: export
