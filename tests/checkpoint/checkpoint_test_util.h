// Access to the checkpoints scripts/make_test_checkpoint.py --suite writes (the CTest fixture
// checkpoint_make_test_checkpoints), and to the reference weights it writes next to them.
#ifndef MOESERVE_TESTS_CHECKPOINT_CHECKPOINT_TEST_UTIL_H_
#define MOESERVE_TESTS_CHECKPOINT_CHECKPOINT_TEST_UTIL_H_

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moeserve::testing {

// The suite directory: $MOESERVE_TEST_CHECKPOINTS, else the build's (set by CMake).
inline std::string CheckpointSuiteDir() {
  if (const char* env = std::getenv("MOESERVE_TEST_CHECKPOINTS")) return env;
  return MOESERVE_TEST_CHECKPOINTS;
}

inline std::string CheckpointDir(const std::string& name) {
  return CheckpointSuiteDir() + "/" + name;
}

// reference/info.json of a suite checkpoint; fails the test when absent.
inline nlohmann::json CheckpointInfo(const std::string& name) {
  const std::string path = CheckpointDir(name) + "/reference/info.json";
  std::ifstream f(path);
  if (!f) {
    ADD_FAILURE() << "missing " << path << "; run the tests through ctest (fixture "
                  << "checkpoint_make_test_checkpoints) or python3 "
                  << "scripts/make_test_checkpoint.py --suite " << CheckpointSuiteDir();
    return nlohmann::json::object();
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str(), nullptr, false);
}

// A raw reference file (reference/<file>) as `count` elements of T.
template <typename T>
std::vector<T> ReadReference(const std::string& name, const std::string& file, int64_t count) {
  const std::string path = CheckpointDir(name) + "/reference/" + file;
  std::vector<T> out(count);
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(count * sizeof(T)));
  if (!f || f.gcount() != static_cast<std::streamsize>(count * sizeof(T)) ||
      f.peek() != std::char_traits<char>::eof()) {
    ADD_FAILURE() << path << " is missing or does not hold " << count << " x " << sizeof(T)
                  << " bytes";
  }
  return out;
}

}  // namespace moeserve::testing

#endif  // MOESERVE_TESTS_CHECKPOINT_CHECKPOINT_TEST_UTIL_H_
