// xdeploy C++ embedding runtime: an exported encoder artifact (manifest.json + model.onnx) -> sentence vectors.
//
//   xdeploy::Embedder emb("artifacts/minilm");
//   std::vector<std::string> texts{"a sentence", "une phrase"};                     // UTF-8
//   std::vector<std::vector<float>> v = emb.embed(texts);                          // [n][d], L2-normalized
//   std::vector<std::vector<float>> w = emb.embed({{101, 7592, 2088, 102}});       // token ids
//
// Text (UTF-8) is tokenized in C++ from the artifact's tokenizer/tokenizer.json (xdeploy/tokenizer.hpp: the
// same ids as Hugging Face tokenizers, which the Python Embedder and the Triton ensemble run). Long lines are cut
// at whitespace before tokenizing exactly as the Python Embedder does.
// Token ids may also come from the caller, special tokens included and truncated to max_length(). Pooling (mean / cls / max) and L2 normalization follow
// the manifest's "pooling" record exactly like the Python Embedder; artifacts without one use CLS, unnormalized.
// Batches are length-sorted, cut (plan_batches) and padded as in Python (same defaults), so both run the same shapes.
//
// Golden probes: at load the artifact's probes for graph "model" (probes/raw/*.bin: inputs and the PyTorch fp32
// last_hidden_state, written by `xdeploy export`; deploy/probes.py is the Python side) are run and judged like
// parity does (|d| <= atol + rtol*|ref| everywhere, or cosine >= the artifact's tolerance, over the real tokens; no
// NaN/Inf). A failure throws ProbeFailure (one line); Options::verify = false skips the check; an artifact made
// before probes existed loads with probe_note() saying it was not checked. Nothing is cached: two tiny runs.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "xdeploy/error.hpp"

namespace xdeploy {

struct Options {
  std::string provider = "auto";  // auto | cpu | cuda | tensorrt  (auto: the first of tensorrt > cuda > cpu that starts)
  int threads = 0;                // intra-op threads, 0 = ONNX Runtime's default (all cores)
  int batch_size = 32;            // sentences per model call (capped by the artifact's batch axis)
  int pad_to = 1;                 // pad each batch's length to a multiple of this (1: to its longest, as Python)
  std::string batching = "cost";  // cost | fixed: how length-sorted inputs are cut into batches (plan_batches)
  std::string trt_cache_dir;      // TensorRT engine/timing cache root ("": $XDG_CACHE_HOME/xdeploy/ort-trt-cpp)
  bool verify = true;  // run the artifact's golden probes at load (a failure throws ProbeFailure)
  // run an int8 artifact on the CPU even where its int8 weights are not proven exact (x86 without VNNI or AMX
  // adds int8 products in saturating int16 pairs; the manifest's conversion.model.saturation.proven_for)
  bool allow_saturation = false;
};

struct Pooling {
  std::string mode = "cls";  // mean | cls | max
  bool normalize = false;
};

// Version facts checked at start-up: the headers' ORT_API_VERSION must be <= the library's API version.
struct RuntimeInfo {
  std::string ort_version;       // the loaded library, e.g. "1.31.1"
  int header_api_version = 0;    // ORT_API_VERSION of the headers compiled against
  std::vector<std::string> available_providers;
};

RuntimeInfo runtime_info();

// One model call of a plan: inputs [start, stop) of the length-sorted order, padded to `length` tokens.
struct Batch {
  size_t start = 0, stop = 0;
  int64_t length = 0;
};

// The Python Embedder's plan_batches (deploy/embedder.py), the same cut for the same input: `sorted_lengths`
// ascending; "fixed" = batches of batch_size; "cost" = the cut minimizing the modelled cost (one call = 256
// tokens, a token padded to L costs 1 + 2L/(3d)), at most batch_size rows a batch. Throws Error on a bad mode.
std::vector<Batch> plan_batches(const std::vector<int64_t>& sorted_lengths, int batch_size, int d, int pad_to,
                                int64_t smax, const std::string& batching = "cost");

class Embedder {
 public:
  explicit Embedder(const std::string& artifact_dir, const Options& options = Options());
  ~Embedder();
  Embedder(const Embedder&) = delete;
  Embedder& operator=(const Embedder&) = delete;

  // ids[i]: token ids of sentence i (1..max_length ids, each in 0..vocab-1). Returns [n][dim()].
  std::vector<std::vector<float>> embed(const std::vector<std::vector<int64_t>>& ids);
  // so that embed({{101, 7592, 102}}) means ids (a braced list would otherwise also fit the text overload)
  std::vector<std::vector<float>> embed(std::initializer_list<std::vector<int64_t>> ids) {
    return embed(std::vector<std::vector<int64_t>>(ids));
  }

  // texts[i]: sentence i in UTF-8 (invalid UTF-8 is an Error naming the input). Returns [n][dim()]; an empty
  // list gives an empty result. Needs an artifact with tokenizer/tokenizer.json (has_tokenizer()).
  std::vector<std::vector<float>> embed(const std::vector<std::string>& texts);

  // The token ids embed(texts) feeds the model ([CLS] ... [SEP], truncated to max_length()); indices of the
  // inputs that were longer than max_length tokens go to *truncated when given.
  std::vector<std::vector<int64_t>> tokenize(const std::vector<std::string>& texts,
                                             std::vector<size_t>* truncated = nullptr);
  bool has_tokenizer() const;

  int dim() const;
  int max_length() const;
  const Pooling& pooling() const;
  const std::string& provider() const;  // the execution provider actually used
  const std::string& provider_note() const;  // why "auto" fell back past TensorRT / CUDA ("" if it did not)
  // "" when the golden probes ran and passed; otherwise why they did not run (verify off, an artifact without
  // probes). A failing probe never gets here: the constructor throws ProbeFailure.
  const std::string& probe_note() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace xdeploy
