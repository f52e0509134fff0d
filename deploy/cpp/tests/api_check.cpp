// API checks of xdeploy::Embedder that the CLI cannot reach (run by tests/test_cpp.py):
//   xdeploy-embed-check ARTIFACT      (an artifact with tokenizer/tokenizer.json)
//   xdeploy-embed-check --plan BATCH D PAD_TO SMAX cost|fixed < lengths   (ascending; prints "start stop length"
//                                     per batch of plan_batches, compared with the Python planner's)
// empty lists give empty results (text and ids), invalid UTF-8 throws InvalidUtf8 naming the input and byte,
// a 1 MB line gives one unit vector, and tokenize() reports it as truncated. Prints "ok" or the first failure.
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "xdeploy/embedder.hpp"

namespace {
int failures = 0;
void check(bool cond, const std::string& what) {
  if (!cond) {
    std::cout << "FAILED: " << what << "\n";
    ++failures;
  }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc == 7 && std::string(argv[1]) == "--plan") {
    std::vector<int64_t> lengths;
    for (int64_t x; std::cin >> x;) lengths.push_back(x);
    try {
      for (const auto& b : xdeploy::plan_batches(lengths, std::stoi(argv[2]), std::stoi(argv[3]), std::stoi(argv[4]),
                                                 std::stoll(argv[5]), argv[6]))
        std::cout << b.start << " " << b.stop << " " << b.length << "\n";
    } catch (const std::exception& e) {
      std::cerr << "error: " << e.what() << "\n";
      return 2;
    }
    return 0;
  }
  if (argc != 2) {
    std::cerr << "usage: xdeploy-embed-check ARTIFACT\n";
    return 2;
  }
  try {
    xdeploy::Embedder emb(argv[1]);
    check(emb.has_tokenizer(), "the artifact has a tokenizer");
    check(emb.embed(std::vector<std::string>{}).empty(), "embed of an empty text list is empty");
    check(emb.embed(std::vector<std::vector<int64_t>>{}).empty(), "embed of an empty id list is empty");
    check(emb.tokenize({}).empty(), "tokenize of an empty list is empty");
    try {
      emb.embed(std::vector<std::string>{"fine", "bad \xff here"});
      check(false, "invalid UTF-8 throws");
    } catch (const xdeploy::InvalidUtf8& e) {
      check(e.input == 1 && e.byte == 4, std::string("InvalidUtf8 names input 1, byte 4: ") + e.what());
    }
    std::string big;
    while (big.size() < (1u << 20)) big += "lorem ipsum dolor sit amet ";
    std::vector<size_t> truncated;
    const auto ids = emb.tokenize({big, "short"}, &truncated);
    check(ids.size() == 2 && static_cast<int>(ids[0].size()) == emb.max_length(), "a 1 MB line is cut to max_length");
    check(truncated == std::vector<size_t>{0}, "the 1 MB line is reported truncated");
    const auto v = emb.embed(std::vector<std::string>{big});
    double sq = 0;
    for (float x : v.at(0)) sq += static_cast<double>(x) * x;
    check(v.size() == 1 && static_cast<int>(v[0].size()) == emb.dim() && std::fabs(std::sqrt(sq) - 1.0) < 1e-4,
          "a 1 MB line gives one unit vector");
  } catch (const std::exception& e) {
    std::cout << "FAILED: unexpected exception: " << e.what() << "\n";
    return 1;
  }
  if (failures) return 1;
  std::cout << "ok\n";
  return 0;
}
