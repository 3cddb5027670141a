// Linked into every test binary: points the tests at this build's source tree, executable and
// reference python, unless the environment already says otherwise. (ctest's per-test
// ENVIRONMENT loses all but the first variable through gtest_discover_tests.)
#include <cstdlib>

namespace {
const bool kEnvSet = [] {
  setenv("SHARDLM_SOURCE_DIR", SHARDLM_SOURCE_DIR_DEFAULT, 0);
  setenv("SHARDLM_BINARY", SHARDLM_BINARY_DEFAULT, 0);
  setenv("SHARDLM_PYTHON", SHARDLM_PYTHON_DEFAULT, 0);
  return true;
}();
}  // namespace
