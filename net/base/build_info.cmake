# Writes OUT, the C++ source that holds the commit this tree is at (net/base/build_info.h),
# rewriting it only when the commit or the tree's cleanliness changed (so nothing is rebuilt
# otherwise). Run at every build: cmake -DSRC=<source dir> -DOUT=<file> -P build_info.cmake
execute_process(COMMAND git -C "${SRC}" rev-parse HEAD RESULT_VARIABLE rc
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit "unknown")
else()
  # Uncommitted changes to tracked files make the binary something no commit describes.
  execute_process(COMMAND git -C "${SRC}" status --porcelain --untracked-files=no
                  RESULT_VARIABLE rc OUTPUT_VARIABLE changes ERROR_QUIET)
  if(rc EQUAL 0 AND NOT changes STREQUAL "")
    string(APPEND commit "+dirty")
  endif()
endif()
set(text "// Written by net/base/build_info.cmake at build time.\nnamespace qring::build::detail {\nextern const char* const kCommit;\nconst char* const kCommit = \"${commit}\";\n}  // namespace qring::build::detail\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
else()
  set(old "")
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
