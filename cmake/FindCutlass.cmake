# Finds the CUTLASS 3.x/4.x C++ headers (header-only; we use CUTLASS through its API).
#
# Looked for, in order: -DMOESERVE_CUTLASS_DIR=<dir> (or the environment variable of the same
# name), where <dir> holds include/cutlass/cutlass.h; then the PyPI package `nvidia-cutlass`
# (scripts/setup.sh installs it), whose headers sit in cutlass_library/source/include.
#
# Sets Cutlass_FOUND, CUTLASS_INCLUDE_DIRS (include/ and tools/util/include/ where present) and
# CUTLASS_VERSION (e.g. 4.2.0).
if(NOT MOESERVE_CUTLASS_DIR AND DEFINED ENV{MOESERVE_CUTLASS_DIR})
  set(MOESERVE_CUTLASS_DIR "$ENV{MOESERVE_CUTLASS_DIR}")
endif()

set(_cutlass_roots)
if(MOESERVE_CUTLASS_DIR)
  list(APPEND _cutlass_roots "${MOESERVE_CUTLASS_DIR}")
else()
  # The python3 on PATH: the one scripts/setup.sh pip-installs into.
  find_program(MOESERVE_PYTHON3 NAMES python3)
  if(MOESERVE_PYTHON3)
    # find_spec does not import the package (importing it pulls in cuda-python).
    execute_process(
      COMMAND "${MOESERVE_PYTHON3}" -c
              "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(os.path.dirname(s.origin), 'source') if s else '')"
      OUTPUT_VARIABLE _cutlass_py_root
      OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_cutlass_py_root)
      list(APPEND _cutlass_roots "${_cutlass_py_root}")
    endif()
  endif()
endif()

find_path(CUTLASS_INCLUDE_DIR cutlass/cutlass.h PATHS ${_cutlass_roots} PATH_SUFFIXES include
          NO_DEFAULT_PATH)
if(CUTLASS_INCLUDE_DIR)
  file(STRINGS "${CUTLASS_INCLUDE_DIR}/cutlass/version.h" _cutlass_ver REGEX
       "#define CUTLASS_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*" "\\1" _maj "${_cutlass_ver}")
  string(REGEX REPLACE ".*CUTLASS_MINOR ([0-9]+).*" "\\1" _min "${_cutlass_ver}")
  string(REGEX REPLACE ".*CUTLASS_PATCH ([0-9]+).*" "\\1" _pat "${_cutlass_ver}")
  set(CUTLASS_VERSION "${_maj}.${_min}.${_pat}")
  set(CUTLASS_INCLUDE_DIRS "${CUTLASS_INCLUDE_DIR}")
  get_filename_component(_cutlass_root "${CUTLASS_INCLUDE_DIR}" DIRECTORY)
  if(EXISTS "${_cutlass_root}/tools/util/include")
    list(APPEND CUTLASS_INCLUDE_DIRS "${_cutlass_root}/tools/util/include")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Cutlass REQUIRED_VARS CUTLASS_INCLUDE_DIR
                                  VERSION_VAR CUTLASS_VERSION)
mark_as_advanced(CUTLASS_INCLUDE_DIR)
