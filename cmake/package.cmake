# qring as an installable library (docs/python.md, "C++"): `cmake --install build --prefix P`
# installs the public headers (P/include/qring), libqring.so and libqring.a (the objects of
# qring_net and qring_collectives), the CMake package (find_package(qring): qring::qring, the
# shared library, and qring::qring_static) and P/lib/pkgconfig/qring.pc.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

if(NOT TARGET qring_collectives)
  return()
endif()

find_package(OpenSSL REQUIRED COMPONENTS Crypto)  # imported in net/ only (directory scope)
set(QRING_LIB_DEPS PkgConfig::FABRIC spdlog::spdlog fmt::fmt Threads::Threads OpenSSL::Crypto
    OpenMP::OpenMP_CXX)
set(QRING_INCLUDE_INTERFACE $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/qring>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)

# The shared library (the Python module links it) and the static one, both named qring.
add_library(qring SHARED $<TARGET_OBJECTS:qring_net> $<TARGET_OBJECTS:qring_collectives>)
add_library(qring_static STATIC $<TARGET_OBJECTS:qring_net> $<TARGET_OBJECTS:qring_collectives>)
set_target_properties(qring_static PROPERTIES OUTPUT_NAME qring EXPORT_NAME qring_static)
set_target_properties(qring PROPERTIES VERSION ${PROJECT_VERSION}
                      SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
target_link_libraries(qring PRIVATE ${QRING_LIB_DEPS})
target_link_libraries(qring_static PUBLIC ${QRING_LIB_DEPS})
foreach(t qring qring_static)
  target_include_directories(${t} INTERFACE ${QRING_INCLUDE_INTERFACE})
  target_compile_features(${t} INTERFACE cxx_std_20)
endforeach()

# The public headers: the session (one call to a communicator), the communicator, the quorum
# all-reduce and its options and membership, straggler models, bootstrap and rendezvous, the
# endpoint interface, errors -- and what they include. qring.h includes them all.
set(QRING_PUBLIC_HEADERS
    collectives/session.h collectives/communicator.h collectives/types.h
    collectives/straggler.h collectives/quorum/quorum.h collectives/clock.h
    collectives/options.h collectives/work.h collectives/quorum/errors.h
    collectives/quorum/membership.h collectives/quorum/reports.h
    net/rendezvous/bootstrap.h net/rendezvous/store.h net/transport/endpoint.h
    net/transport/fabric_endpoint.h net/transport/tags.h net/base/error.h)
foreach(h ${QRING_PUBLIC_HEADERS})
  get_filename_component(dir ${h} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${h} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/qring/${dir}
          COMPONENT qring)
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/collectives/qring.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/qring
        COMPONENT qring)

install(TARGETS qring EXPORT qringTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        COMPONENT qring)
install(TARGETS qring_static EXPORT qringStaticTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        COMPONENT qring)
set(QRING_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/qring)
install(EXPORT qringTargets NAMESPACE qring:: DESTINATION ${QRING_CMAKE_DIR} COMPONENT qring)
install(EXPORT qringStaticTargets NAMESPACE qring:: DESTINATION ${QRING_CMAKE_DIR}
        COMPONENT qring)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/qringConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/qringConfig.cmake
                              INSTALL_DESTINATION ${QRING_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/qringConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/qringConfig.cmake ${PROJECT_BINARY_DIR}/qringConfigVersion.cmake
        DESTINATION ${QRING_CMAKE_DIR} COMPONENT qring)

configure_file(${PROJECT_SOURCE_DIR}/cmake/qring.pc.in ${PROJECT_BINARY_DIR}/qring.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/qring.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
        COMPONENT qring)

# The programs, so that an installed tree can launch jobs (qring-launch, qring-store).
foreach(t qring-launch qring-store qring-bench qring-train)
  if(TARGET ${t})
    install(TARGETS ${t} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT qring)
  endif()
endforeach()
