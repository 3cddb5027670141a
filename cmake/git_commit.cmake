# Writes OUT: `#define SHARDLM_GIT_COMMIT "<12-hex commit>[-dirty]"` for the checkout at SRC
# ("unknown" outside a git checkout). Run at every build; OUT is rewritten only when it changes, so
# only the file that includes it recompiles, and only after a commit or a change to tracked files.
execute_process(COMMAND git -C "${SRC}" rev-parse --short=12 HEAD OUTPUT_VARIABLE commit
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT commit)
  set(commit "unknown")
else()
  execute_process(COMMAND git -C "${SRC}" status --porcelain --untracked-files=no OUTPUT_VARIABLE changed
                  ERROR_QUIET)
  if(changed)
    string(APPEND commit "-dirty")
  endif()
endif()
file(WRITE "${OUT}.new" "#define SHARDLM_GIT_COMMIT \"${commit}\"\n")
file(COPY_FILE "${OUT}.new" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.new")
