# FindPCRE2
# ---------
# The 8-bit PCRE2 library (Debian: libpcre2-dev), used by the tokenizer's pre-tokenizer
# regexes. Uses pkg-config's libpcre2-8 when available, plain find_path/find_library otherwise.
#
# Defines PCRE2_FOUND, PCRE2_VERSION and the imported target PCRE2::8BIT (the name PCRE2's own
# CMake package exports, so either can satisfy `target_link_libraries(... PCRE2::8BIT)`).
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(PC_PCRE2 QUIET libpcre2-8)
endif()

find_path(PCRE2_INCLUDE_DIR NAMES pcre2.h HINTS ${PC_PCRE2_INCLUDE_DIRS})
find_library(PCRE2_LIBRARY NAMES pcre2-8 HINTS ${PC_PCRE2_LIBRARY_DIRS})
set(PCRE2_VERSION "${PC_PCRE2_VERSION}")

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(PCRE2
  REQUIRED_VARS PCRE2_LIBRARY PCRE2_INCLUDE_DIR
  VERSION_VAR PCRE2_VERSION)

if(PCRE2_FOUND AND NOT TARGET PCRE2::8BIT)
  add_library(PCRE2::8BIT UNKNOWN IMPORTED)
  set_target_properties(PCRE2::8BIT PROPERTIES
    IMPORTED_LOCATION "${PCRE2_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${PCRE2_INCLUDE_DIR}")
endif()
mark_as_advanced(PCRE2_INCLUDE_DIR PCRE2_LIBRARY)
