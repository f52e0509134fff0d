// Implementation of xdeploy::Embedder over the ONNX Runtime C++ API (see include/xdeploy/embedder.hpp).
#include "xdeploy/embedder.hpp"
#include "xdeploy/tokenizer.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <cstdlib>
#include <numeric>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <onnxruntime_cxx_api.h>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace xdeploy {
namespace {

const char* const kHidden = "last_hidden_state";
// plan_batches' cost of one model call, in tokens: CALL_TOKENS of deploy/embedder.py (tests/test_cpp.py checks
// that both pick the same cuts)
constexpr int64_t kCallTokens = 256;
// onnxruntime optimizers a CPU session leaves out, ';'-separated: the Python runner's list
// (deploy/sessions.py ORT_CPU_SLOW_FUSIONS, which says why; tests/test_sessions.py keeps the two equal), so both
// runtimes run the same graph and give the same vectors. The GPU providers keep onnxruntime's whole set.
const char* const kCpuSlowFusions = "SkipLayerNormFusion";

void check_batching(const std::string& mode) {
  if (mode != "cost" && mode != "fixed")
    throw Error("batching \"" + mode + "\" is not supported; expected cost or fixed");
}

// The C++ wrapper reads OrtGetApiBase()->GetApi(ORT_API_VERSION); a library older than the headers returns
// nullptr there, so it is initialised by hand (ORT_API_MANUAL_INIT) and refused with a clear message.
void init_api() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    const OrtApiBase* base = OrtGetApiBase();
    const OrtApi* api = base ? base->GetApi(ORT_API_VERSION) : nullptr;
    if (!api) {
      error = std::string("the ONNX Runtime library (") + (base ? base->GetVersionString() : "?") +
              ") does not provide C API version " + std::to_string(ORT_API_VERSION) +
              " of the headers this program was built with; use a library at least as new as the headers";
      return;
    }
    Ort::InitApi(api);
  });
  if (!error.empty()) throw Error(error);
}

Ort::Env& env() {
  static Ort::Env e(ORT_LOGGING_LEVEL_ERROR, "xdeploy");
  return e;
}

[[noreturn]] void bad(const fs::path& manifest, const std::string& what) {
  throw Error("invalid manifest " + manifest.string() + ": " + what);
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// ------------------------------------------------------------------------------------------------ text ----

// The Python Embedder's cut of very long lines (deploy/embedder.py, tokenize): beyond `cap` characters (code
// points), keep the prefix up to the last space or newline inside the first `cap` characters (the first `cap`
// characters when there is none). The model sees max_length tokens only; this keeps tokenizing cost bounded.
std::string cut_line(const std::string& s, size_t chars, size_t cap) {
  if (chars <= cap) return s;
  size_t bytes = 0;  // byte length of the first `cap` code points
  for (size_t k = 0; k < cap; ++k) {
    const unsigned c = static_cast<unsigned char>(s[bytes]);
    bytes += c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : 4;
  }
  size_t k = std::string::npos;
  for (size_t j = bytes; j-- > 0;)
    if (s[j] == ' ' || s[j] == '\n') {
      k = j;
      break;
    }
  return (k != std::string::npos && k > 0) ? s.substr(0, k) : s.substr(0, bytes);
}

}  // namespace

RuntimeInfo runtime_info() {
  init_api();
  RuntimeInfo info;
  info.ort_version = Ort::GetVersionString();
  info.header_api_version = ORT_API_VERSION;
  info.available_providers = Ort::GetAvailableProviders();
  return info;
}

struct Embedder::Impl {
  fs::path dir;
  Options opt;
  Pooling pooling;
  int max_length = 0, seq_max = 0, dim = 0, batch_max = 0, vocab = 0;
  std::string model_file;  // graph file, relative to dir (checked to lie inside it)
  std::vector<std::string> inputs;  // graph input names in order, subset of input_ids/attention_mask/token_type_ids
  std::string provider, provider_note;  // the provider in use; why "auto" skipped the ones before it
  json axes;                               // the manifest's axes (TensorRT profile shapes)
  std::string graph_sha, precision;        // model graph sha256 (engine cache key), artifact precision
  json probes;                             // the manifest's "probes" section (null: made before probes existed)
  json tolerance;                          // the manifest's tolerances[precision] (atol, rtol, cosine)
  std::vector<std::string> int8_proven_for;  // int8 artifacts: the CPU classes graph "model" is exact on
  std::string probe_note;                  // why the probes did not run ("" when they ran and passed)
  std::unique_ptr<Ort::Session> session;
  std::string tokenizer_file;  // tokenizer/tokenizer.json (relative to dir), "" when the artifact has none
  std::unique_ptr<Tokenizer> tokenizer;  // read on the first text call: the id API does not need it
  std::mutex tok_mu;
  std::mutex mu;  // Ort::Session::Run is thread-safe, but one embed() at a time keeps memory bounded

  void read_manifest() {
    const fs::path mpath = dir / "manifest.json";
    if (!fs::is_directory(dir)) throw Error("artifact directory " + dir.string() + " does not exist");
    std::ifstream f(mpath);
    if (!f) throw Error(dir.string() + " is not an xdeploy artifact: it has no manifest.json");
    json m;
    try {
      m = json::parse(f);
    } catch (const json::exception& e) {
      bad(mpath, std::string("not JSON (") + first_line(e.what()) + ")");
    }
    try {
      if (!m.is_object()) bad(mpath, "not a JSON object");
      if (m.value("format", "") != "xdeploy-artifact") bad(mpath, "format is not \"xdeploy-artifact\"");
      const json& g = m.at("graphs").at("model");
      const std::string file = g.at("file").get<std::string>();
      const fs::path model = fs::weakly_canonical(dir / file);
      const fs::path root = fs::weakly_canonical(dir);
      auto rel = model.lexically_relative(root);
      if (file.empty() || fs::path(file).is_absolute() || rel.empty() || *rel.begin() == "..")
        bad(mpath, "graph file \"" + file + "\" points outside the artifact directory");
      if (!fs::is_regular_file(model)) bad(mpath, "graph file \"" + file + "\" is missing");
      model_file = file;
      for (const json& t : g.at("inputs")) {
        const std::string name = t.at("name").get<std::string>();
        if (name != "input_ids" && name != "attention_mask" && name != "token_type_ids")
          throw Error("artifact " + dir.string() + " is not a text encoder: its graph takes input \"" + name +
                      "\"; expected input_ids, attention_mask, token_type_ids");
        if (name == "input_ids") vocab = t.value("high", 0);
        inputs.push_back(name);
      }
      if (!has(inputs, "input_ids")) throw Error("artifact " + dir.string() + " is not a text encoder: no input_ids");
      bool found = false;
      for (const json& t : g.at("outputs")) {
        if (t.at("name").get<std::string>() != kHidden) continue;
        const json& dims = t.at("dims");
        if (!dims.is_array() || dims.size() != 3 || !dims.back().is_number_integer())
          bad(mpath, "last_hidden_state must have dims [batch, seq, d]");
        dim = dims.back().get<int>();
        found = true;
      }
      if (!found) throw Error("artifact " + dir.string() + " is not a text encoder: no last_hidden_state output");
      axes = m.at("axes");
      precision = m.value("precision", "fp32");
      if (precision == "int8" || precision == "int8-dynamic") {
        // export/saturation.py's proof for graph "model" (absent in artifacts made before it: proven for nothing)
        const json* sat = nullptr;
        if (m.contains("conversion") && m.at("conversion").is_object() && m.at("conversion").contains("model") &&
            m.at("conversion").at("model").is_object() && m.at("conversion").at("model").contains("saturation"))
          sat = &m.at("conversion").at("model").at("saturation");
        if (sat != nullptr && sat->is_object() && sat->contains("proven_for")) {
          if (!sat->at("proven_for").is_array()) bad(mpath, "conversion.model.saturation.proven_for must be a list");
          for (const json& c : sat->at("proven_for")) int8_proven_for.push_back(c.get<std::string>());
        }
      }
      probes = m.contains("probes") ? m.at("probes") : json();
      if (!probes.is_null()) {
        if (!probes.is_object() || !probes.contains("cases") || !probes.at("cases").is_array())
          bad(mpath, "probes must be an object with a cases list");
        tolerance = m.at("tolerances").at(precision);  // export writes every precision's
        for (const char* k : {"atol", "rtol", "cosine"})
          if (!tolerance.contains(k) || !tolerance.at(k).is_number()) bad(mpath, "tolerances need atol, rtol, cosine");
      }
      if (m.contains("files") && m.at("files").is_object() && m.at("files").contains(file) &&
          m.at("files").at(file).is_string())
        graph_sha = m.at("files").at(file).get<std::string>();
      batch_max = m.at("axes").at("batch").at("max").get<int>();
      seq_max = m.at("axes").at("seq").at("max").get<int>();
      max_length = seq_max;
      const json& p = m.contains("pooling") ? m.at("pooling") : json();
      if (p.is_object()) {
        pooling.mode = p.value("mode", "cls");
        pooling.normalize = p.value("normalize", false);
        if (p.contains("max_length") && p.at("max_length").is_number_integer())
          max_length = std::min(seq_max, p.at("max_length").get<int>());
      } else if (!p.is_null()) {
        bad(mpath, "pooling must be an object or null");
      }
      if (pooling.mode != "mean" && pooling.mode != "cls" && pooling.mode != "max")
        bad(mpath, "pooling mode \"" + pooling.mode + "\" is not mean, cls or max");
      if (dim <= 0 || batch_max <= 0 || max_length < 2) bad(mpath, "non-positive dims or axes");
      // the tokenizer (tokenizer.json, read by src/wordpiece.cpp); a tokenizer graph from `xdeploy export
      // --tokenizer-graph` is a Python/Triton option and not used here
      std::string tdir = "tokenizer";
      if (m.contains("foreign") && m.at("foreign").is_object() && m.at("foreign").contains("tokenizer_dir") &&
          m.at("foreign").at("tokenizer_dir").is_string())
        tdir = m.at("foreign").at("tokenizer_dir").get<std::string>();
      const std::string tf = (fs::path(tdir) / "tokenizer.json").string();
      const fs::path tpath = fs::weakly_canonical(dir / tf);
      const auto trel = tpath.lexically_relative(root);
      if (!(fs::path(tdir).is_absolute() || trel.empty() || *trel.begin() == "..") && fs::is_regular_file(tpath))
        tokenizer_file = tf;
    } catch (const json::exception& e) {
      bad(mpath, std::string("missing or mistyped field (") + first_line(e.what()) + ")");
    }
  }

  // TensorRT EP options: one optimization profile from the manifest's axes (every input is [batch, seq]) and
  // an engine + timing cache keyed by the graph's sha256, so a new shape does not rebuild an engine and a
  // changed model never loads a stale one. Q/DQ int8 artifacts need trt_int8_enable (no calibration table:
  // TensorRT takes the scales from the Q/DQ nodes); fp32 stays fp32 (no trt_fp16_enable).
  std::map<std::string, std::string> tensorrt_options() const {
    const fs::path mpath = dir / "manifest.json";
    if (graph_sha.size() < 16) bad(mpath, "files[\"" + model_file + "\"] must hold the graph's sha256 (engine cache key)");
    auto shapes = [&](const char* which) {
      std::string s;
      try {
        for (const auto& n : inputs)
          s += (s.empty() ? "" : ",") + n + ":" + std::to_string(axes.at("batch").at(which).get<int>()) + "x" +
               std::to_string(axes.at("seq").at(which).get<int>());
      } catch (const json::exception&) {
        bad(mpath, std::string("axes batch/seq need integer min, opt and max (") + which + ")");
      }
      return s;
    };
    fs::path cache = opt.trt_cache_dir;
    if (cache.empty()) {
      const char* xdg = std::getenv("XDG_CACHE_HOME");
      const char* home = std::getenv("HOME");
      cache = xdg && *xdg ? fs::path(xdg) : fs::path(home ? home : ".") / ".cache";
      cache = cache / "xdeploy" / "ort-trt-cpp";
    }
    cache /= "model-" + graph_sha.substr(0, 16);
    std::error_code ec;
    fs::create_directories(cache, ec);  // the TensorRT EP creates one directory level only
    if (ec) throw Error("cannot create the TensorRT engine cache directory " + cache.string() + ": " + ec.message());
    return {{"device_id", "0"},
            {"trt_engine_cache_enable", "1"},
            {"trt_engine_cache_path", cache.string()},
            {"trt_timing_cache_enable", "1"},
            {"trt_timing_cache_path", cache.string()},
            {"trt_int8_enable", precision == "int8" ? "1" : "0"},
            {"trt_profile_min_shapes", shapes("min")},
            {"trt_profile_opt_shapes", shapes("opt")},
            {"trt_profile_max_shapes", shapes("max")}};
  }

  // Append one provider to `so`; throws Ort::Exception when this library cannot (e.g. a build without it, or a
  // provider library whose dependencies such as libnvinfer are missing).
  void append_provider(Ort::SessionOptions& so, const std::string& want) const {
    const OrtApi& api = Ort::GetApi();
    if (want == "cuda" || want == "tensorrt") {
      if (want == "tensorrt") {
        OrtTensorRTProviderOptionsV2* trt = nullptr;
        Ort::ThrowOnError(api.CreateTensorRTProviderOptions(&trt));
        std::unique_ptr<OrtTensorRTProviderOptionsV2, decltype(api.ReleaseTensorRTProviderOptions)> hold(
            trt, api.ReleaseTensorRTProviderOptions);
        std::vector<std::string> keys, values;
        for (const auto& [k, v] : tensorrt_options()) keys.push_back(k), values.push_back(v);
        std::vector<const char*> kp, vp;
        for (size_t i = 0; i < keys.size(); ++i) kp.push_back(keys[i].c_str()), vp.push_back(values[i].c_str());
        Ort::ThrowOnError(api.UpdateTensorRTProviderOptions(trt, kp.data(), vp.data(), kp.size()));
        so.AppendExecutionProvider_TensorRT_V2(*trt);
      }
      // CUDA: the provider itself, or after TensorRT for the nodes TensorRT does not take
      OrtCUDAProviderOptionsV2* cuda = nullptr;
      Ort::ThrowOnError(api.CreateCUDAProviderOptions(&cuda));
      std::unique_ptr<OrtCUDAProviderOptionsV2, decltype(api.ReleaseCUDAProviderOptions)> hold2(
          cuda, api.ReleaseCUDAProviderOptions);
      so.AppendExecutionProvider_CUDA_V2(*cuda);
    } else {
      so.AddConfigEntry("optimization.disable_specified_optimizers", kCpuSlowFusions);
    }
  }

  Ort::SessionOptions session_options() const {
    Ort::SessionOptions so;
    so.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
    so.SetIntraOpNumThreads(opt.threads);
    so.SetInterOpNumThreads(1);
    so.SetLogSeverityLevel(3);
    return so;
  }

  // "auto" tries TensorRT, then CUDA, then the CPU, and keeps the first one whose provider can be appended and
  // whose session opens: ORT lists TensorrtExecutionProvider even where libnvinfer is missing, and a CUDA build
  // lists CUDA on machines without a GPU, so being listed proves nothing. provider() says which was chosen and
  // provider_note() why the ones before it were skipped. An explicit provider that fails is an error.
  void open_session() {
    const std::map<std::string, std::string> names = {{"cpu", "CPUExecutionProvider"},
                                                      {"cuda", "CUDAExecutionProvider"},
                                                      {"tensorrt", "TensorrtExecutionProvider"}};
    const auto avail = Ort::GetAvailableProviders();
    std::vector<std::string> candidates;
    if (opt.provider == "auto") {
      candidates = {"tensorrt", "cuda", "cpu"};
    } else {
      auto it = names.find(opt.provider);
      if (it == names.end())
        throw Error("unknown provider \"" + opt.provider + "\"; expected one of: auto, cpu, cuda, tensorrt");
      if (!has(avail, it->second)) {
        std::string list;
        for (const auto& a : avail) list += (list.empty() ? "" : ", ") + a;
        throw Error("provider \"" + opt.provider + "\" is not in this ONNX Runtime library (it has: " + list + ")");
      }
      candidates = {opt.provider};
    }
    const fs::path model = dir / model_file;
    for (const auto& want : candidates) {
      Ort::SessionOptions so = session_options();
      try {
        append_provider(so, want);
        session = std::make_unique<Ort::Session>(env(), model.c_str(), so);
        provider = want;
        break;
      } catch (const std::exception& e) {  // Ort::Exception from onnxruntime, Error from tensorrt_options()
        const std::string why = first_line(e.what());
        if (want == "cpu" || candidates.size() == 1) {
          if (want == "cpu") throw Error("onnxruntime cannot load " + model.string() + ": " + why);
          throw Error("provider \"" + want + "\" failed to start: " + why);
        }
        provider_note += (provider_note.empty() ? "" : "; ") + want + " unavailable (" + why + ")";
      }
    }
    // The ONNX file must take exactly the inputs the manifest declares (a swapped model.onnx would not).
    Ort::AllocatorWithDefaultOptions alloc;
    std::vector<std::string> got;
    for (size_t i = 0; i < session->GetInputCount(); ++i) got.push_back(session->GetInputNameAllocated(i, alloc).get());
    if (got != inputs) {
      std::string a, b;
      for (const auto& s : got) a += (a.empty() ? "" : ", ") + s;
      for (const auto& s : inputs) b += (b.empty() ? "" : ", ") + s;
      throw Error(model_file + " of " + dir.string() + " takes inputs [" + a + "] but its manifest declares [" + b + "]");
    }
    bool out_ok = false;
    for (size_t i = 0; i < session->GetOutputCount(); ++i)
      out_ok |= std::string(session->GetOutputNameAllocated(i, alloc).get()) == kHidden;
    if (!out_ok) throw Error("model.onnx of " + dir.string() + " has no output last_hidden_state");
  }

  // One padded batch: rows `idx` of `ids`, padded to length s. Writes pooled rows into out[idx[r]].
  void run_batch(const std::vector<std::vector<int64_t>>& ids, const std::vector<size_t>& idx, int64_t s,
                 std::vector<std::vector<float>>& out) {
    const int64_t b = static_cast<int64_t>(idx.size());
    std::vector<int64_t> input_ids(b * s, 0), mask(b * s, 0), types(b * s, 0);  // [b, s]; pad id 0, masked
    for (int64_t r = 0; r < b; ++r) {
      const auto& row = ids[idx[r]];
      std::copy(row.begin(), row.end(), input_ids.begin() + r * s);
      std::fill(mask.begin() + r * s, mask.begin() + r * s + static_cast<int64_t>(row.size()), 1);
    }
    const std::vector<float> hidden = run_hidden(input_ids, mask, types, b, s);
    pool_rows(hidden, ids, idx, s, out);
  }

  // The graph on [b, s] int64 inputs (the ones it takes, by name) -> last_hidden_state [b, s, dim] as float32.
  std::vector<float> run_hidden(std::vector<int64_t>& input_ids, std::vector<int64_t>& mask,
                                std::vector<int64_t>& types, int64_t b, int64_t s) {
    const std::array<int64_t, 2> shape{b, s};
    auto mem = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    std::vector<Ort::Value> feeds;
    std::vector<const char*> names;
    for (const auto& n : inputs) {
      auto& buf = n == "input_ids" ? input_ids : n == "attention_mask" ? mask : types;
      feeds.push_back(Ort::Value::CreateTensor<int64_t>(mem, buf.data(), buf.size(), shape.data(), shape.size()));
      names.push_back(n.c_str());
    }
    const char* out_name = kHidden;
    std::vector<Ort::Value> res;
    try {
      res = session->Run(Ort::RunOptions{nullptr}, names.data(), feeds.data(), feeds.size(), &out_name, 1);
    } catch (const Ort::Exception& e) {
      throw Error("onnxruntime failed on a batch of shape [" + std::to_string(b) + ", " + std::to_string(s) +
                  "]: " + first_line(e.what()));
    }
    auto ti = res[0].GetTensorTypeAndShapeInfo();
    const auto oshape = ti.GetShape();  // [b, s, d]
    if (oshape.size() != 3 || oshape[0] != b || oshape[1] != s || oshape[2] != dim)
      throw Error("model.onnx returned last_hidden_state of an unexpected shape");
    // float16 artifacts may keep float16 outputs: widen to float32 first (same as numpy's astype in Python)
    std::vector<float> hidden(static_cast<size_t>(b * s * dim));
    if (ti.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      const float* p = res[0].GetTensorData<float>();
      std::copy(p, p + hidden.size(), hidden.begin());
    } else if (ti.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      const Ort::Float16_t* p = res[0].GetTensorData<Ort::Float16_t>();
      for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = p[i].ToFloat();
    } else {
      throw Error("model.onnx returns last_hidden_state of an element type other than float32/float16");
    }
    return hidden;
  }

  void pool_rows(const std::vector<float>& hidden, const std::vector<std::vector<int64_t>>& ids,
                 const std::vector<size_t>& idx, int64_t s, std::vector<std::vector<float>>& out) const {
    const int64_t b = static_cast<int64_t>(idx.size());
    for (int64_t r = 0; r < b; ++r) {
      const int64_t n = static_cast<int64_t>(ids[idx[r]].size());
      const float* h = hidden.data() + r * s * dim;  // [s, d] of row r; tokens 0..n-1 are real
      std::vector<float> v(dim, 0.0f);
      if (pooling.mode == "cls") {
        std::copy(h, h + dim, v.begin());
      } else if (pooling.mode == "max") {
        std::fill(v.begin(), v.end(), -1e9f);
        for (int64_t t = 0; t < n; ++t)
          for (int k = 0; k < dim; ++k) v[k] = std::max(v[k], h[t * dim + k]);
      } else {  // mean over real tokens
        for (int64_t t = 0; t < n; ++t)
          for (int k = 0; k < dim; ++k) v[k] += h[t * dim + k];
        for (int k = 0; k < dim; ++k) v[k] /= static_cast<float>(n);
      }
      if (pooling.normalize) {
        double sq = 0.0;
        for (float x : v) sq += static_cast<double>(x) * x;
        const float norm = static_cast<float>(std::max(std::sqrt(sq), 1e-12));
        for (float& x : v) x /= norm;
      }
      out[idx[r]] = std::move(v);
    }
  }

  // ------------------------------------------------------------------------------------------ golden probes ----

  // A raw little-endian array of the probes (export/probes.py): `count` elements of T, the file inside the artifact.
  template <typename T>
  std::vector<T> read_raw(const json& rel_json, size_t count) const {
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "probe files are little-endian");
    const fs::path mpath = dir / "manifest.json";
    const std::string rel = rel_json.get<std::string>();
    const fs::path f = fs::weakly_canonical(dir / rel);
    const auto r = f.lexically_relative(fs::weakly_canonical(dir));
    if (rel.empty() || fs::path(rel).is_absolute() || r.empty() || *r.begin() == "..")
      bad(mpath, "probe file \"" + rel + "\" points outside the artifact directory");
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    if (ec) throw Error("golden probe file " + f.string() + " is missing");
    if (size != count * sizeof(T))
      throw Error("golden probe file " + f.string() + " has " + std::to_string(size) + " bytes; its manifest shape "
                  "needs " + std::to_string(count * sizeof(T)));
    std::vector<T> v(count);
    std::ifstream in(f, std::ios::binary);
    if (!in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(size)))
      throw Error("cannot read golden probe file " + f.string());
    return v;
  }

  static std::string cpu_model() {
    std::ifstream f("/proc/cpuinfo");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
    return "unknown CPU";
  }

  // How this CPU adds int8 products, as core/fingerprint.py int8_dot names it (CPUID: right under an emulator too).
  static std::string int8_class() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("amx-int8")) return "amx";
    if (__builtin_cpu_supports("avx512vnni") || __builtin_cpu_supports("avxvnni")) return "vnni";
    if (__builtin_cpu_supports("avx2") || __builtin_cpu_supports("avx512f")) return "avx2";
#endif
    return "unknown";
  }

  // An int8 artifact on onnxruntime's CPU provider where its int8 weights are not proven exact: refused (a verdict,
  // ProbeFailure: exit 1), as the Python ort runner refuses it (deploy/saturation_guard.py). The GPU providers
  // accumulate int8 in int32.
  void check_int8_class() {
    if ((precision != "int8" && precision != "int8-dynamic") || provider != "cpu" || opt.allow_saturation) return;
    const std::string cls = int8_class();
    if (cls == "unknown" || std::find(int8_proven_for.begin(), int8_proven_for.end(), cls) != int8_proven_for.end())
      return;
    std::string proven;
    for (const std::string& c : int8_proven_for) proven += (proven.empty() ? "" : ", ") + c;
    const std::string what = proven.empty() ? "carries no proof that its int8 weights cannot saturate (made before "
                                              "xdeploy recorded one: re-export it)"
                                            : "is proven exact only on CPU classes [" + proven + "]";
    throw ProbeFailure("artifact " + dir.string() + " (" + precision + ") " + what + "; this CPU (" + cpu_model() +
                       ") is class " + cls +
                       " (no VNNI or AMX: int8 products added in saturating int16 pairs), where its int8 weights "
                       "can be clipped into wrong outputs; expected an artifact exported with --int8-weight-bits 7 "
                       "(the default), or pass --allow-saturation");
  }

  // Graph "model"'s probe cases (their raw copies) through the session, judged as parity judges an output
  // (deploy/metrics.py compare): no NaN/Inf, and every real token's value within atol + rtol*|ref| or the cosine
  // over the real tokens >= the tolerance's. Throws ProbeFailure naming the case, the cosine and the machine.
  void check_probes() {
    if (!opt.verify) {
      probe_note = "golden probes not checked (--no-verify): its outputs on this machine are unverified";
      return;
    }
    if (probes.is_null()) {
      probe_note = "artifact " + dir.string() + " has no golden probes (exported before xdeploy wrote them): running "
                   "it unverified; re-export it to have it checked where it runs";
      return;
    }
    const fs::path mpath = dir / "manifest.json";
    const double atol = tolerance.at("atol").get<double>(), rtol = tolerance.at("rtol").get<double>(),
                 min_cos = tolerance.at("cosine").get<double>();
    int checked = 0;
    try {
      for (const json& c : probes.at("cases")) {
        if (c.at("graph").get<std::string>() != "model" || !c.contains("raw")) continue;
        const json& raw = c.at("raw");
        std::map<std::string, std::vector<int64_t>> feeds{{"input_ids", {}}, {"attention_mask", {}},
                                                          {"token_type_ids", {}}};
        int64_t b = 0, s = 0;
        for (const auto& n : inputs) {
          const json& t = c.at("inputs").at(n);
          const auto shape = t.at("shape").get<std::vector<int64_t>>();
          if (t.at("dtype").get<std::string>() != "int64" || shape.size() != 2 || shape[0] < 1 || shape[1] < 1)
            bad(mpath, "probe input \"" + n + "\" must be int64 [batch, seq]");
          b = shape[0], s = shape[1];
          feeds[n] = read_raw<int64_t>(raw.at(n), static_cast<size_t>(b * s));
        }
        for (auto& [n, v] : feeds)
          if (v.empty()) v.assign(static_cast<size_t>(b * s), n == "attention_mask" ? 1 : 0);  // not a graph input
        const json& o = c.at("outputs").at(kHidden);
        if (o.at("dtype").get<std::string>() != "float32" ||
            o.at("shape").get<std::vector<int64_t>>() != std::vector<int64_t>{b, s, dim})
          bad(mpath, "probe output last_hidden_state must be float32 [batch, seq, d]");
        const auto ref = read_raw<float>(raw.at(kHidden), static_cast<size_t>(b * s * dim));
        const auto got = run_hidden(feeds["input_ids"], feeds["attention_mask"], feeds["token_type_ids"], b, s);
        size_t nonfinite = 0, n = 0, within = 0;
        double dot = 0, nr = 0, nc = 0;
        for (int64_t i = 0; i < b * s * dim; ++i) {
          const double x = got[i], r = ref[i];
          if (!std::isfinite(x)) {  // counted everywhere: even padded positions must stay finite
            ++nonfinite;
            continue;
          }
          if (!feeds["attention_mask"][i / dim] || !std::isfinite(r) || std::fabs(r) >= 1e30) continue;
          ++n;
          within += std::fabs(x - r) <= atol + rtol * std::fabs(r);
          dot += x * r, nr += r * r, nc += x * x;
        }
        const double cos = (nr == 0 && nc == 0) ? 1.0 : (nr == 0 || nc == 0) ? 0.0 : dot / std::sqrt(nr * nc);
        if (nonfinite || (within != n && cos < min_cos)) {
          char num[64];
          std::snprintf(num, sizeof num, "%.6f", cos);
          std::ostringstream why;
          why << "artifact " << dir.string() << " fails its golden probes here: graph 'model' output '" << kHidden
              << "': cosine " << num << " (needs >= " << min_cos << " or |d| <= " << atol << " + " << rtol
              << "*|ref|; " << nonfinite << " NaN/Inf; case " << c.at("name").get<std::string>() << ") on onnxruntime "
              << provider << " at " << precision << " tolerance; machine: " << cpu_model()
              << "; pass --no-verify (Options::verify = false) to run it anyway";
          throw ProbeFailure(why.str());
        }
        ++checked;
      }
    } catch (const json::exception& e) {
      bad(mpath, std::string("probes: missing or mistyped field (") + first_line(e.what()) + ")");
    }
    if (!checked)
      probe_note = "artifact " + dir.string() + " has no golden probes this runtime reads (raw cases of graph "
                   "\"model\"): running it unverified";
  }

  // ------------------------------------------------------------------------------------------- tokenizer ----
  void open_tokenizer() {
    if (tokenizer) return;
    if (tokenizer_file.empty())
      throw Error("artifact " + dir.string() + " has no tokenizer/tokenizer.json; export it from a checkpoint "
                  "with a tokenizer for text input, or pass token ids");
    tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_file((dir / tokenizer_file).string()));
    if (vocab > 0 && tokenizer->vocab_size() > static_cast<size_t>(vocab))
      throw Error("tokenizer " + (dir / tokenizer_file).string() + " has ids up to " +
                  std::to_string(tokenizer->vocab_size() - 1) + " but the model's vocabulary ends at " +
                  std::to_string(vocab - 1));
  }

  // The Python Embedder's tokenize(): validate, cut very long lines, tokenize (HF tokenizers' behaviour, in C++),
  // re-tokenize a cut line whole when its prefix held no more than max_length tokens (a whitespace-heavy line),
  // and count the truncated inputs exactly.
  std::vector<std::vector<int64_t>> tokenize(const std::vector<std::string>& texts, std::vector<size_t>* truncated) {
    std::vector<size_t> chars(texts.size(), 0);
    for (size_t i = 0; i < texts.size(); ++i) {
      const size_t bad_at = invalid_utf8(texts[i], &chars[i]);
      if (bad_at != std::string::npos) throw InvalidUtf8(i, bad_at);
    }
    {
      std::lock_guard<std::mutex> lock(tok_mu);
      open_tokenizer();
    }
    const size_t cap = static_cast<size_t>(std::max(4096, 64 * max_length));
    const size_t limit = static_cast<size_t>(max_length);
    std::vector<std::vector<int64_t>> ids(texts.size());
    if (truncated) truncated->clear();
    for (size_t i = 0; i < texts.size(); ++i) {
      Encoding e;
      if (chars[i] > cap) {
        e = tokenizer->encode(cut_line(texts[i], chars[i], cap), limit);
        if (e.tokens <= limit) e = tokenizer->encode(texts[i], limit);
      } else {
        e = tokenizer->encode(texts[i], limit);
      }
      if (truncated && e.tokens > limit) truncated->push_back(i);
      ids[i] = std::move(e.ids);
    }
    return ids;
  }
};

std::vector<Batch> plan_batches(const std::vector<int64_t>& sorted_lengths, int batch_size, int d, int pad_to,
                                int64_t smax, const std::string& batching) {
  check_batching(batching);
  if (batch_size < 1 || pad_to < 1 || d < 1) throw Error("plan_batches needs batch_size, pad_to and d >= 1");
  const size_t n = sorted_lengths.size(), bs = static_cast<size_t>(batch_size);
  std::vector<int64_t> padded(n);
  for (size_t i = 0; i < n; ++i) padded[i] = std::min((sorted_lengths[i] + pad_to - 1) / pad_to * pad_to, smax);
  std::vector<Batch> plan;
  if (batching == "fixed") {
    for (size_t a = 0; a < n; a += bs) plan.push_back({a, std::min(a + bs, n), padded[std::min(a + bs, n) - 1]});
    return plan;
  }
  // dynamic programming over the sorted lengths in integer units of 1/(3d) token, exactly as Python does
  const int64_t call = 3 * int64_t{d} * kCallTokens;
  std::vector<int64_t> best(n + 1, 0);
  std::vector<size_t> cut(n + 1, 0);
  for (size_t i = 1; i <= n; ++i) {
    const int64_t p = padded[i - 1], per_row = 3 * int64_t{d} * p + 2 * p * p;
    bool first = true;
    for (size_t j = i > bs ? i - bs : 0; j < i; ++j) {  // the last batch is inputs j..i-1, padded to input i-1
      const int64_t c = best[j] + call + static_cast<int64_t>(i - j) * per_row;
      if (first || c < best[i]) best[i] = c, cut[i] = j, first = false;  // the first minimum, as numpy's argmin
    }
  }
  for (size_t i = n; i > 0; i = cut[i]) plan.push_back({cut[i], i, padded[i - 1]});
  std::reverse(plan.begin(), plan.end());
  return plan;
}

Embedder::Embedder(const std::string& artifact_dir, const Options& options) : impl_(std::make_unique<Impl>()) {
  init_api();
  impl_->dir = fs::path(artifact_dir);
  impl_->opt = options;
  if (options.batch_size < 1) throw Error("batch size must be >= 1");
  if (options.pad_to < 1) throw Error("pad_to must be >= 1");
  check_batching(options.batching);  // at construction, not at the first embed
  if (options.threads < 0) throw Error("threads must be >= 0");
  impl_->read_manifest();
  impl_->open_session();
  impl_->check_int8_class();
  impl_->check_probes();
}

Embedder::~Embedder() = default;

std::vector<std::vector<float>> Embedder::embed(const std::vector<std::vector<int64_t>>& ids) {
  Impl& m = *impl_;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i].empty() || static_cast<int>(ids[i].size()) > m.max_length)
      throw Error("input " + std::to_string(i) + " has " + std::to_string(ids[i].size()) + " token ids; expected 1.." +
                  std::to_string(m.max_length) + " (tokenize with truncation to max_length)");
    for (int64_t t : ids[i])
      if (t < 0 || (m.vocab > 0 && t >= m.vocab))
        throw Error("input " + std::to_string(i) + " holds token id " + std::to_string(t) + " outside 0.." +
                    std::to_string(m.vocab - 1));
  }
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<std::vector<float>> out(ids.size());
  std::vector<size_t> order(ids.size());
  std::iota(order.begin(), order.end(), 0);
  // shortest first, ties in input order: the same batches as the Python Embedder (Python's sort is stable)
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ids[a].size() < ids[b].size(); });
  std::vector<int64_t> lengths(order.size());
  for (size_t k = 0; k < order.size(); ++k) lengths[k] = static_cast<int64_t>(ids[order[k]].size());
  const int bs = std::min(m.opt.batch_size, m.batch_max);
  for (const Batch& b : plan_batches(lengths, bs, m.dim, m.opt.pad_to, m.seq_max, m.opt.batching)) {
    std::vector<size_t> idx(order.begin() + b.start, order.begin() + b.stop);
    m.run_batch(ids, idx, b.length, out);
  }
  return out;
}

std::vector<std::vector<float>> Embedder::embed(const std::vector<std::string>& texts) {
  if (texts.empty()) return {};
  return embed(impl_->tokenize(texts, nullptr));
}

std::vector<std::vector<int64_t>> Embedder::tokenize(const std::vector<std::string>& texts,
                                                     std::vector<size_t>* truncated) {
  return impl_->tokenize(texts, truncated);
}

bool Embedder::has_tokenizer() const { return !impl_->tokenizer_file.empty(); }

int Embedder::dim() const { return impl_->dim; }
int Embedder::max_length() const { return impl_->max_length; }
const Pooling& Embedder::pooling() const { return impl_->pooling; }
const std::string& Embedder::provider() const { return impl_->provider; }
const std::string& Embedder::provider_note() const { return impl_->provider_note; }
const std::string& Embedder::probe_note() const { return impl_->probe_note; }

}  // namespace xdeploy
