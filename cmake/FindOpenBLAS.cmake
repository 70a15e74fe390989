# Finds OpenBLAS and provides the imported target OpenBLAS::OpenBLAS (headers with cblas.h).
# Debian ships an OpenBLASConfig.cmake that only sets variables; wrap them, or search by hand.
find_package(OpenBLAS CONFIG QUIET)
if(NOT OpenBLAS_LIBRARIES)
  find_path(OpenBLAS_INCLUDE_DIRS cblas.h PATH_SUFFIXES openblas-pthread openblas)
  find_library(OpenBLAS_LIBRARIES NAMES openblas)
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(OpenBLAS REQUIRED_VARS OpenBLAS_LIBRARIES OpenBLAS_INCLUDE_DIRS)
if(OpenBLAS_FOUND AND NOT TARGET OpenBLAS::OpenBLAS)
  add_library(OpenBLAS::OpenBLAS UNKNOWN IMPORTED)
  set_target_properties(OpenBLAS::OpenBLAS PROPERTIES
    IMPORTED_LOCATION "${OpenBLAS_LIBRARIES}"
    INTERFACE_INCLUDE_DIRECTORIES "${OpenBLAS_INCLUDE_DIRS}")
endif()
