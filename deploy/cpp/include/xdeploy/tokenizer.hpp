// xdeploy C++ runtime: a BERT-family tokenizer that gives the same ids as Hugging Face `tokenizers` on the same
// tokenizer.json (src/wordpiece.cpp). What it implements, read from the file and refused when it is anything else:
//
//   added tokens   (the "added_tokens" list, matched in the raw text before normalization, leftmost-longest,
//                   with lstrip / rstrip; tokens with "normalized": true or "single_word": true are refused)
//   normalizer     BertNormalizer (clean_text, handle_chinese_chars, strip_accents: null = follow lowercase,
//                   lowercase) or null
//   pre_tokenizer  BertPreTokenizer (split on whitespace, isolate punctuation)
//   model          WordPiece (vocab, unk_token, continuing_subword_prefix, max_input_chars_per_word)
//   post_processor TemplateProcessing (its "single" template) or BertProcessing (cls, sep) or null
//   truncation     to max_length tokens, special tokens included: the sequence keeps its first tokens (right)
//
// Unicode data comes from utf8proc (normalization, categories, case); where Hugging Face's Rust crates use older
// Unicode tables than utf8proc, generated overrides (src/hf_unicode_compat.inc, from
// tools/gen_hf_unicode_compat.py) make the C++ side follow Hugging Face. tests/test_tokenizer_exact.py checks every
// code point and a seeded fuzz corpus against Hugging Face.
//
//   auto tok = xdeploy::Tokenizer::from_file("artifacts/minilm/tokenizer/tokenizer.json");
//   xdeploy::Encoding e = tok.encode("Café au lait", 256);   // e.ids: [CLS] ... [SEP]; e.tokens: before truncation
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xdeploy/error.hpp"

namespace xdeploy {

struct Encoding {
  std::vector<int64_t> ids;  // special tokens included, truncated to max_length
  size_t tokens = 0;         // how many ids there were before truncation (> ids.size() when truncated)
};

class Tokenizer {
 public:
  // `json_text`: the content of a tokenizer.json; `origin` names it in error messages. Throws Error (one line)
  // on anything that is not a supported BERT-family tokenizer.
  Tokenizer(std::string_view json_text, const std::string& origin);
  static Tokenizer from_file(const std::string& path);

  // One UTF-8 text -> ids. max_length 0: no truncation. Invalid UTF-8 throws InvalidUtf8 (input 0, byte offset).
  Encoding encode(std::string_view utf8, size_t max_length = 0) const;
  // What WordPiece sees: the normalized, pre-tokenized words (added tokens appear as their content).
  std::vector<std::string> words(std::string_view utf8) const;

  size_t vocab_size() const;   // the largest id + 1 (model vocabulary and added tokens)
  size_t num_special() const;  // ids the post-processor adds to one sequence ([CLS] and [SEP]: 2)

  // Unicode version of the linked utf8proc, and the one src/hf_unicode_compat.inc was generated against.
  static std::string unicode_version();
  static std::string compat_unicode_version();
  // The raw utf8proc data of every code point, one line each (tools/gen_hf_unicode_compat.py reads it):
  // "cp category nfd lower" in hex, sequences comma-separated. Written to `out`.
  static void dump_unicode(std::string& out);

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;  // immutable once built: encode() is thread-safe, copies are cheap
};

// Byte offset of the first invalid UTF-8 sequence in s (strict, like Python: no overlong forms, no surrogates,
// nothing above U+10FFFF), or std::string::npos. *chars (when given) gets the number of code points.
size_t invalid_utf8(std::string_view s, size_t* chars = nullptr);

}  // namespace xdeploy
