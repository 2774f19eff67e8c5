// tests/test_tool_flags.cc: the `cpidx` subcommands' flag parser (tools/args.h): integers with
// size suffixes, comma lists of integers and of words, and bad values refused with the flag
// named, leaving the default in place.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../tools/args.h"

namespace {

using cpidx::tools::Flags;

// argv for flags.parse(..., 1): a program name, then the flags.
Flags::Parse parse(Flags& flags, std::vector<std::string> args) {
  std::vector<char*> argv;
  static std::string prog = "prog";
  argv.push_back(prog.data());
  for (std::string& a : args) argv.push_back(a.data());
  return flags.parse(static_cast<int>(argv.size()), argv.data(), 1);
}

TEST(ToolFlags, ListsOfSizesAndWords) {
  std::vector<int64_t> contexts = {8 << 10, 1 << 20};
  std::vector<std::string> modes = {"plain1"};
  int64_t n = 3;
  Flags flags("prog [flags]", "test");
  flags.add("contexts", &contexts, "lengths", 0, 1 << 30).add("modes", &modes, "modes").add("n", &n, "n");
  EXPECT_EQ(parse(flags, {"--contexts=1K,2M,7", "--modes", "cp2,step4", "--n=2G"}), Flags::Parse::kOk);
  EXPECT_EQ(contexts, (std::vector<int64_t>{1024, 2 << 20, 7}));
  EXPECT_EQ(modes, (std::vector<std::string>{"cp2", "step4"}));
  EXPECT_EQ(n, int64_t{2} << 30);
  EXPECT_TRUE(flags.is_set("contexts"));
}

TEST(ToolFlags, BadListsAreRefusedAndLeaveTheDefault) {
  for (const char* bad : {"--contexts=8K,,1M", "--contexts=", "--contexts=8Q", "--contexts=1K,",
                          "--contexts=,1K", "--contexts=99999999999999999999", "--contexts=0",
                          "--contexts=1K,2M"}) {
    std::vector<int64_t> contexts = {8 << 10};
    Flags flags("prog [flags]", "test");
    flags.add("contexts", &contexts, "lengths", 1, 1 << 20);
    EXPECT_EQ(parse(flags, {bad}), Flags::Parse::kError) << bad;
    EXPECT_EQ(contexts, (std::vector<int64_t>{8 << 10})) << bad;
  }
  std::vector<std::string> modes = {"plain1"};
  Flags flags("prog [flags]", "test");
  flags.add("modes", &modes, "modes");
  EXPECT_EQ(parse(flags, {"--modes=cp2,,cp4"}), Flags::Parse::kError);
  EXPECT_EQ(modes, (std::vector<std::string>{"plain1"}));
}

TEST(ToolFlags, IntegersOutsideTheirRangeAreRefusedAndLeaveTheDefault) {
  for (const char* bad : {"--rows=-1", "--rows=17M", "--rows=2G"}) {
    int64_t rows = 5;
    Flags flags("prog [flags]", "test");
    flags.add("rows", &rows, "rows", 0, int64_t{1} << 24);
    EXPECT_EQ(parse(flags, {bad}), Flags::Parse::kError) << bad;
    EXPECT_EQ(rows, 5) << bad;
  }
  int64_t rows = 5;
  Flags flags("prog [flags]", "test");
  flags.add("rows", &rows, "rows", 0, int64_t{1} << 24);
  EXPECT_EQ(parse(flags, {"--rows=16M"}), Flags::Parse::kOk);
  EXPECT_EQ(rows, int64_t{1} << 24);
}

TEST(ToolFlags, BooleanValuesGoAfterTheEqualsSign) {
  bool steal = true;
  Flags flags("prog [flags]", "test");
  flags.add("steal", &steal, "steal");
  EXPECT_EQ(parse(flags, {"--steal=false"}), Flags::Parse::kOk);
  EXPECT_FALSE(steal);
  EXPECT_EQ(parse(flags, {"--steal"}), Flags::Parse::kOk);
  EXPECT_TRUE(steal);
  testing::internal::CaptureStderr();
  EXPECT_EQ(parse(flags, {"--steal", "false"}), Flags::Parse::kError);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("flag --steal takes its value after '=': --steal=false"), std::string::npos)
      << err;
  testing::internal::CaptureStderr();
  EXPECT_EQ(parse(flags, {"--steal=true", "false"}), Flags::Parse::kError);
  EXPECT_NE(testing::internal::GetCapturedStderr().find("unexpected argument 'false'"),
            std::string::npos);
}

TEST(ToolFlags, HelpShowsListDefaultsWithSuffixes) {
  std::vector<int64_t> contexts = {8 << 10, 1 << 20, 3};
  Flags flags("prog [flags]", "test");
  flags.add("contexts", &contexts, "lengths", 1, 1 << 20);
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  flags.print_help(f);
  std::rewind(f);
  std::string text;
  for (int c = std::fgetc(f); c != EOF; c = std::fgetc(f)) text += static_cast<char>(c);
  std::fclose(f);
  EXPECT_NE(text.find("--contexts=N,N,..."), std::string::npos) << text;
  EXPECT_NE(text.find("(default: 8K,1M,3)"), std::string::npos) << text;
}

}  // namespace
