// xdeploy-embed: token ids on stdin -> embeddings on stdout, through xdeploy::Embedder.
//
//   xdeploy-embed ARTIFACT [--provider auto|cpu|cuda|tensorrt] [--threads N] [--batch N] [--pad-to N]
//   xdeploy-embed --providers            (print the library's version and execution providers)
//
// stdin: one sentence per line, its token ids (special tokens included) separated by spaces or commas; a JSON
// array per line ("[101, 7592, 102]") also works. stdout: one line per sentence, dim() floats printed with
// 9 significant digits (float32 round-trips exactly). Errors: one line on stderr, exit 2.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "xdeploy/embedder.hpp"

namespace {

int to_int(const std::string& flag, const char* v) {
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v, &end, 10);
  if (errno || end == v || *end || x < 0 || x > 1 << 20) throw xdeploy::Error(flag + " needs a non-negative integer");
  return static_cast<int>(x);
}

std::vector<int64_t> parse_ids(const std::string& line, size_t lineno) {
  std::vector<int64_t> ids;
  size_t i = 0;
  const size_t n = line.size();
  while (i < n) {
    const char c = line[i];
    if (c == ' ' || c == '\t' || c == ',' || c == '[' || c == ']' || c == '\r') {
      ++i;
      continue;
    }
    size_t j = i;
    if (line[j] == '-') ++j;
    while (j < n && line[j] >= '0' && line[j] <= '9') ++j;
    if (j == i || (j == i + 1 && line[i] == '-') || j - i > 18)
      throw xdeploy::Error("stdin line " + std::to_string(lineno) + ": \"" + line.substr(i, 20) +
                           "\" is not a token id; expected integers separated by spaces or commas");
    ids.push_back(std::stoll(line.substr(i, j - i)));
    i = j;
  }
  if (ids.empty())
    throw xdeploy::Error("stdin line " + std::to_string(lineno) + " has no token ids (every sentence has at least [CLS])");
  return ids;
}

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cerr << "usage: xdeploy-embed ARTIFACT [--provider auto|cpu|cuda|tensorrt] [--threads N] [--batch N] "
                 "[--pad-to N] < ids.txt > vectors.txt\n       xdeploy-embed --providers\n";
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--providers") {
    const auto info = xdeploy::runtime_info();
    std::cout << "onnxruntime " << info.ort_version << " (headers: ORT_API_VERSION " << info.header_api_version
              << ")\n";
    for (const auto& p : info.available_providers) std::cout << p << "\n";
    return 0;
  }
  xdeploy::Options opt;
  const std::string artifact = args[0];
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (i + 1 >= args.size()) throw xdeploy::Error("unknown or incomplete option \"" + a + "\"");
    const char* v = args[++i].c_str();
    if (a == "--provider") opt.provider = v;
    else if (a == "--threads") opt.threads = to_int(a, v);
    else if (a == "--batch") opt.batch_size = to_int(a, v);
    else if (a == "--pad-to") opt.pad_to = to_int(a, v);
    else throw xdeploy::Error("unknown option \"" + a + "\"; expected --provider, --threads, --batch, --pad-to");
  }
  xdeploy::Embedder emb(artifact, opt);
  std::vector<std::vector<int64_t>> ids;
  std::string line;
  for (size_t lineno = 1; std::getline(std::cin, line); ++lineno) ids.push_back(parse_ids(line, lineno));
  if (ids.empty()) throw xdeploy::Error("stdin is empty; expected one line of token ids per sentence");
  const auto vecs = emb.embed(ids);
  std::string out;
  char buf[32];
  for (const auto& v : vecs) {
    for (size_t k = 0; k < v.size(); ++k) {
      std::snprintf(buf, sizeof buf, k ? " %.9g" : "%.9g", static_cast<double>(v[k]));
      out += buf;
    }
    out += '\n';
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::cerr << "xdeploy-embed: " << vecs.size() << " sentences -> " << emb.dim() << "-d (" << emb.pooling().mode
            << " pooling" << (emb.pooling().normalize ? ", L2-normalized" : "") << ") on " << emb.provider()
            << (emb.provider_note().empty() ? "" : " (auto: " + emb.provider_note() + ")") << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const xdeploy::Error& e) {
    std::cerr << "xdeploy-embed: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {  // e.g. Ort::Exception from the library, bad_alloc: still one line
    std::cerr << "xdeploy-embed: error: " << e.what() << "\n";
    return 3;
  }
}
