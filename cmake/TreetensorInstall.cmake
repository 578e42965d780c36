# install() rules and a CMake package config: find_package(treetensor CONFIG REQUIRED).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(DIRECTORY include/treetensor DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS treetensor treetensor_tree treetensor_distributed EXPORT treetensorTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT treetensorTargets NAMESPACE treetensor::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/treetensor)

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/treetensorConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/treetensorConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/treetensor)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/treetensorConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/treetensorConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/treetensorConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/treetensor)
