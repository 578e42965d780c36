// Anchors the shared precompiled ATen header (see treetensor_pch in CMakeLists.txt).
