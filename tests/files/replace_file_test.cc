// Replacing a file through a temporary of its own: never through a name someone else left there.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "files/replace_file.h"

namespace shardlm::files {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class ReplaceFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("replace_file_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::set<std::string> names() const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.insert(e.path().filename().string());
    return out;
  }
  fs::path dir_;
};

// A link at the name a fixed-name writer would use (PATH.tmp) is neither followed nor removed:
// the file it points at keeps its bytes.
TEST_F(ReplaceFile, LeavesAPlantedLinkAndItsTargetAlone) {
  const fs::path victim = dir_ / "victim", target = dir_ / "out.json";
  std::ofstream(victim) << "precious";
  fs::create_symlink(victim, dir_ / "out.json.tmp");
  replace_file(target.string(), "new\n");
  EXPECT_EQ(slurp(target), "new\n");
  EXPECT_EQ(slurp(victim), "precious");
  EXPECT_TRUE(fs::is_symlink(dir_ / "out.json.tmp"));
  EXPECT_EQ(names(), (std::set<std::string>{"victim", "out.json", "out.json.tmp"}));
}

TEST_F(ReplaceFile, ReplacesWholeAndLeavesNoTemporary) {
  const fs::path target = dir_ / "f";
  replace_file(target.string(), "a much longer first text\n");
  replace_file(target.string(), "b\n");
  EXPECT_EQ(slurp(target), "b\n");
  EXPECT_EQ(names(), (std::set<std::string>{"f"}));
}

TEST_F(ReplaceFile, FailuresNameThePathAndLeaveNothing) {
  try {
    replace_file((dir_ / "missing" / "f").string(), "x");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find((dir_ / "missing" / "f").string()), std::string::npos) << e.what();
  }
  fs::create_directory(dir_ / "d");
  EXPECT_THROW(replace_file((dir_ / "d").string(), "x"), std::runtime_error);
  EXPECT_EQ(names(), (std::set<std::string>{"d"}));
  EXPECT_TRUE(fs::is_empty(dir_ / "d"));
}

// Two temporaries for one target at once (two threads, two ranks) never share a name.
TEST_F(ReplaceFile, TemporariesOfOneTargetDiffer) {
  const std::string target = (dir_ / "t").string();
  std::string a, b;
  const int fa = create_temporary(target, a, O_WRONLY), fb = create_temporary(target, b, O_WRONLY);
  ASSERT_GE(fa, 0);
  ASSERT_GE(fb, 0);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.rfind(target + ".tmp-", 0), 0u) << a;
  write_all(fa, "from a");
  commit_temporary(fa, a, target);
  ::close(fb);
  ::unlink(b.c_str());
  EXPECT_EQ(slurp(target), "from a");
  EXPECT_EQ(names(), (std::set<std::string>{"t"}));
}

}  // namespace
}  // namespace shardlm::files
