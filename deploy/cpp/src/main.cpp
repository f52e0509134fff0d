// xdeploy-embed: sentences (--text) or token ids on stdin -> embeddings on stdout, through xdeploy::Embedder.
//
//   xdeploy-embed ARTIFACT --text [--print-ids] [--provider auto|cpu|cuda|tensorrt] [--threads N] [--batch N]
//   xdeploy-embed ARTIFACT [--provider ...] [--threads N] [--batch N] [--pad-to N] [--batching cost|fixed] [--no-verify]   (token ids)
//   xdeploy-embed --providers            (print the library's version and execution providers)
//
// stdin with --text: one sentence per line, UTF-8 (a final newline ends the last line; a trailing "\r" is
// dropped, as `xdeploy embed` does); the C++ tokenizer tokenizes it from the artifact's tokenizer/tokenizer.json
// exactly as Hugging Face tokenizers does (include/xdeploy/tokenizer.hpp).
// --print-ids prints the token ids instead of vectors; --time N embeds (with --print-ids: tokenizes) the input N
// more times and prints the seconds of each call on stderr (studies/text_embed_bench.py). Without --text: one sentence per line as token ids
// (special tokens included) separated by spaces or commas; a JSON array per line ("[101, 7592, 102]") also works.
// stdout: one line per sentence, dim() floats printed with 9 significant digits (float32 round-trips exactly).
// --no-verify skips the artifact's golden probes (checked at load; a failing one refuses the artifact: exit 1).
// --allow-saturation runs an int8 artifact on a CPU its manifest does not prove it exact on (x86 without VNNI or
// AMX; refused otherwise: exit 1).
// Errors: one line on stderr, exit 2.
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
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

// All of stdin split into lines like `xdeploy embed` (commands/embed.py read_lines): "\n" ends a line, a final
// newline does not start an empty one, a trailing "\r" is dropped. Bytes are kept as they are (UTF-8 is checked
// by the Embedder, which names the input; the line number is the input index + 1).
std::vector<std::string> read_text_lines() {
  std::string data((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  if (data.empty()) throw xdeploy::Error("stdin is empty; expected one sentence per line");
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= data.size()) {
    size_t end = data.find('\n', start);
    if (end == std::string::npos) end = data.size();
    if (end == data.size() && start == data.size()) break;  // the final newline ended the last line
    std::string line = data.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    start = end + 1;
  }
  return lines;
}

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cerr << "usage: xdeploy-embed ARTIFACT --text [--print-ids] [options] < sentences.txt > vectors.txt\n"
                 "       xdeploy-embed ARTIFACT [--provider auto|cpu|cuda|tensorrt] [--threads N] [--batch N] "
                 "[--pad-to N] [--batching cost|fixed] [--no-verify] [--allow-saturation] < ids.txt > vectors.txt\n       xdeploy-embed --providers\n";
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
  bool text = false, print_ids = false;
  int time_reps = 0;  // --time N: embed the input N more times and print the seconds of each call (benchmarks)
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--text") {
      text = true;
      continue;
    }
    if (a == "--print-ids") {
      print_ids = true;
      continue;
    }
    if (a == "--no-verify") {
      opt.verify = false;
      continue;
    }
    if (a == "--allow-saturation") {
      opt.allow_saturation = true;
      continue;
    }
    if (i + 1 >= args.size()) throw xdeploy::Error("unknown or incomplete option \"" + a + "\"");
    const char* v = args[++i].c_str();
    if (a == "--provider") opt.provider = v;
    else if (a == "--threads") opt.threads = to_int(a, v);
    else if (a == "--batch") opt.batch_size = to_int(a, v);
    else if (a == "--pad-to") opt.pad_to = to_int(a, v);
    else if (a == "--batching") opt.batching = v;
    else if (a == "--time") time_reps = to_int(a, v);
    else throw xdeploy::Error("unknown option \"" + a + "\"; expected --text, --print-ids, --provider, --threads, "
                              "--batch, --pad-to, --batching, --no-verify, --allow-saturation");
  }
  if (print_ids && !text) throw xdeploy::Error("--print-ids needs --text");
  xdeploy::Embedder emb(artifact, opt);
  if (!emb.probe_note().empty())
    std::cerr << "xdeploy-embed: " << (opt.verify ? "notice: " : "warning: ") << emb.probe_note() << "\n";
  std::vector<std::vector<float>> vecs;
  std::string out;
  if (text) {
    if (!emb.has_tokenizer())
      throw xdeploy::Error("artifact " + artifact + " has no tokenizer/tokenizer.json; export it from a checkpoint "
                           "with a tokenizer for --text, or pass token ids");
    const auto lines = read_text_lines();
    try {
      if (print_ids) {
        std::vector<size_t> truncated;
        if (time_reps > 0) {  // steady-state tokenize() time (studies/text_embed_bench.py), after one warm-up call
          emb.tokenize(lines);
          std::string times;
          for (int r = 0; r < time_reps; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            emb.tokenize(lines);
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            times += (r ? " " : "") + std::to_string(dt);
          }
          std::cerr << "xdeploy-embed: seconds per tokenize() call: " << times << "\n";
        }
        for (const auto& row : emb.tokenize(lines, &truncated)) {
          for (size_t k = 0; k < row.size(); ++k) out += (k ? " " : "") + std::to_string(row[k]);
          out += '\n';
        }
        std::fwrite(out.data(), 1, out.size(), stdout);
        std::cerr << "xdeploy-embed: " << lines.size() << " sentences tokenized, " << truncated.size()
                  << " truncated to " << emb.max_length() << " tokens\n";
        return 0;
      }
      vecs = emb.embed(lines);
      if (time_reps > 0) {  // steady-state text->vector time of one embed() call, first call (warm-up) excluded
        std::string times;
        for (int r = 0; r < time_reps; ++r) {
          const auto t0 = std::chrono::steady_clock::now();
          vecs = emb.embed(lines);
          const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          times += (r ? " " : "") + std::to_string(dt);
        }
        std::cerr << "xdeploy-embed: seconds per embed() call: " << times << "\n";
      }
    } catch (const xdeploy::InvalidUtf8& e) {  // name the stdin line, as `xdeploy embed` does
      throw xdeploy::Error("stdin line " + std::to_string(e.input + 1) + " is not valid UTF-8 (byte " +
                           std::to_string(e.byte) + " of the line)");
    }
  } else {
    std::vector<std::vector<int64_t>> ids;
    std::string line;
    for (size_t lineno = 1; std::getline(std::cin, line); ++lineno) ids.push_back(parse_ids(line, lineno));
    if (ids.empty()) throw xdeploy::Error("stdin is empty; expected one line of token ids per sentence");
    vecs = emb.embed(ids);
  }
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
  } catch (const xdeploy::ProbeFailure& e) {  // a verdict, not a usage error: exit 1 like `xdeploy verify`
    std::cerr << "xdeploy-embed: error: " << e.what() << "\n";
    return 1;
  } catch (const xdeploy::Error& e) {
    std::cerr << "xdeploy-embed: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {  // e.g. Ort::Exception from the library, bad_alloc: still one line
    std::cerr << "xdeploy-embed: error: " << e.what() << "\n";
    return 3;
  }
}
