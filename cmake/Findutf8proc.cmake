# Findutf8proc
# ------------
# utf8proc (Debian: libutf8proc-dev), the tokenizer's NFC normalizer. Uses pkg-config's
# libutf8proc when available, plain find_path/find_library otherwise.
#
# Defines utf8proc_FOUND, utf8proc_VERSION and the imported target utf8proc::utf8proc (the name
# utf8proc's own CMake package exports).
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(PC_utf8proc QUIET libutf8proc)
endif()

find_path(utf8proc_INCLUDE_DIR NAMES utf8proc.h HINTS ${PC_utf8proc_INCLUDE_DIRS})
find_library(utf8proc_LIBRARY NAMES utf8proc HINTS ${PC_utf8proc_LIBRARY_DIRS})
set(utf8proc_VERSION "${PC_utf8proc_VERSION}")

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(utf8proc
  REQUIRED_VARS utf8proc_LIBRARY utf8proc_INCLUDE_DIR
  VERSION_VAR utf8proc_VERSION)

if(utf8proc_FOUND AND NOT TARGET utf8proc::utf8proc)
  add_library(utf8proc::utf8proc UNKNOWN IMPORTED)
  set_target_properties(utf8proc::utf8proc PROPERTIES
    IMPORTED_LOCATION "${utf8proc_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${utf8proc_INCLUDE_DIR}")
endif()
mark_as_advanced(utf8proc_INCLUDE_DIR utf8proc_LIBRARY)
