// xdeploy-tokenize: texts -> token ids with the C++ tokenizer (include/xdeploy/tokenizer.hpp), no model needed.
//
//   xdeploy-tokenize TOKENIZER [--max-length N] [--words] [--records] < texts
//   xdeploy-tokenize --unicode-version | --unicode-dump
//
// TOKENIZER: a tokenizer.json, or an artifact directory (its tokenizer/tokenizer.json). stdin: one text per line
// (a trailing "\r" dropped), or with --records length-prefixed texts (4-byte little-endian length, then the
// bytes: any byte may occur, newlines and NUL included), which is how tests/test_tokenizer_exact.py feeds
// thousands of strings to one process. stdout: one line per text: its ids, space-separated; with --records the
// line is "TOKENS<TAB>IDS" (TOKENS: the count before truncation) or "!" and the one-line error (invalid UTF-8);
// with --words the normalized, pre-tokenized words WordPiece sees, each as hex UTF-8, space-separated.
// --unicode-dump prints utf8proc's raw data per code point for tools/gen_hf_unicode_compat.py.
// Errors: one line on stderr, exit 2.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "xdeploy/tokenizer.hpp"

namespace {

std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string o;
  for (unsigned char c : s) o += d[c >> 4], o += d[c & 15];
  return o;
}

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cerr << "usage: xdeploy-tokenize TOKENIZER_JSON|ARTIFACT [--max-length N] [--words] [--records] < texts\n"
                 "       xdeploy-tokenize --unicode-version | --unicode-dump\n";
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--unicode-version") {
    std::cout << "utf8proc Unicode " << xdeploy::Tokenizer::unicode_version() << " (overrides generated for "
              << xdeploy::Tokenizer::compat_unicode_version() << ")\n";
    return 0;
  }
  if (args[0] == "--unicode-dump") {
    std::string out;
    xdeploy::Tokenizer::dump_unicode(out);
    std::fwrite(out.data(), 1, out.size(), stdout);
    return 0;
  }
  std::filesystem::path path = args[0];
  if (std::filesystem::is_directory(path))
    path = std::filesystem::exists(path / "tokenizer" / "tokenizer.json") ? path / "tokenizer" / "tokenizer.json"
                                                                          : path / "tokenizer.json";
  size_t max_length = 0;
  bool words = false, records = false;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--words") words = true;
    else if (args[i] == "--records") records = true;
    else if (args[i] == "--max-length" && i + 1 < args.size()) {
      const std::string& v = args[++i];
      if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos || v.size() > 9)
        throw xdeploy::Error("--max-length needs a non-negative integer");
      max_length = std::stoul(v);
    } else {
      throw xdeploy::Error("unknown or incomplete option \"" + args[i] + "\"; expected --max-length N, --words, --records");
    }
  }
  const auto tok = xdeploy::Tokenizer::from_file(path.string());
  std::string data((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  std::vector<std::string> texts;
  if (records) {
    for (size_t at = 0; at < data.size();) {
      if (at + 4 > data.size()) throw xdeploy::Error("--records: stdin ends inside a length prefix");
      const auto* p = reinterpret_cast<const unsigned char*>(data.data() + at);
      const size_t n = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<size_t>(p[3]) << 24);
      if (at + 4 + n > data.size()) throw xdeploy::Error("--records: stdin ends inside a record");
      texts.emplace_back(data, at + 4, n);
      at += 4 + n;
    }
  } else {
    for (size_t start = 0; start < data.size();) {
      size_t end = data.find('\n', start);
      if (end == std::string::npos) end = data.size();
      std::string line = data.substr(start, end - start);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      texts.push_back(std::move(line));
      start = end + 1;
    }
  }
  std::string out;
  for (size_t i = 0; i < texts.size(); ++i) {
    try {
      if (words) {
        const auto w = tok.words(texts[i]);
        for (size_t k = 0; k < w.size(); ++k) out += (k ? " " : "") + hex(w[k]);
      } else {
        const auto e = tok.encode(texts[i], max_length);
        if (records) out += std::to_string(e.tokens) + "\t";
        for (size_t k = 0; k < e.ids.size(); ++k) out += (k ? " " : "") + std::to_string(e.ids[k]);
      }
    } catch (const xdeploy::InvalidUtf8& e) {
      if (!records) throw xdeploy::Error("stdin line " + std::to_string(i + 1) + " is not valid UTF-8 (byte " +
                                         std::to_string(e.byte) + " of the line)");
      out += "!text " + std::to_string(i) + " is not valid UTF-8 (byte " + std::to_string(e.byte) + ")";
    }
    out += '\n';
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "xdeploy-tokenize: error: " << e.what() << "\n";
    return 2;
  }
}
