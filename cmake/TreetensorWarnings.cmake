# Warnings for our own targets: -Wall -Wextra, clean with GCC 12. LibTorch headers are system
# headers (imported targets), so their warnings stay out of the way.
function(treetensor_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
endfunction()
