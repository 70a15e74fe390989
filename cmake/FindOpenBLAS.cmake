# Finds OpenBLAS and provides the imported target OpenBLAS::OpenBLAS (with cblas.h).
# The OpenMP build is preferred: it shares the OpenMP thread pool of our element-wise loops and of
# oneDNN, where the pthreads build's spinning threads would fight them for the cores.
find_path(OpenBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas-openmp openblas-pthread openblas NO_CACHE)
find_library(OpenBLAS_LIBRARY NAMES openblas PATH_SUFFIXES openblas-openmp openblas-pthread NO_CACHE)
foreach(variant openblas-openmp openblas-pthread)
  if(EXISTS "/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/${variant}/libopenblas.so")
    set(OpenBLAS_LIBRARY "/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/${variant}/libopenblas.so")
    set(OpenBLAS_INCLUDE_DIR "/usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/${variant}")
    break()
  endif()
endforeach()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(OpenBLAS REQUIRED_VARS OpenBLAS_LIBRARY OpenBLAS_INCLUDE_DIR)
if(OpenBLAS_FOUND AND NOT TARGET OpenBLAS::OpenBLAS)
  add_library(OpenBLAS::OpenBLAS UNKNOWN IMPORTED)
  set_target_properties(OpenBLAS::OpenBLAS PROPERTIES
    IMPORTED_LOCATION "${OpenBLAS_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${OpenBLAS_INCLUDE_DIR}")
endif()
