// The BERT-family tokenizer of include/xdeploy/tokenizer.hpp: Hugging Face tokenizers' AddedVocabulary split,
// BertNormalizer, BertPreTokenizer, WordPiece and the post-processor's special tokens, over utf8proc's Unicode
// data with generated overrides where Hugging Face's Rust crates carry other Unicode versions.
#include "xdeploy/tokenizer.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <utf8proc.h>

namespace xdeploy {
namespace {

using json = nlohmann::json;
using u32 = uint32_t;

// Overrides of utf8proc's data where Hugging Face tokenizers' own tables differ (generated; see the file).
struct Mapping {
  u32 cp;
  u32 n;
  u32 to[4];
};
#include "hf_unicode_compat.inc"

template <size_t N>
bool in_sorted(const u32 (&table)[N], u32 c) {
  // every table ends with the sentinel 0xFFFFFFFF (no zero-length arrays in C++)
  return std::binary_search(table, table + N - 1, c);
}

template <size_t N>
const Mapping* find_mapping(const Mapping (&table)[N], u32 c) {
  const Mapping* end = table + N - 1;
  const Mapping* m = std::lower_bound(table, end, c, [](const Mapping& a, u32 x) { return a.cp < x; });
  return (m != end && m->cp == c) ? m : nullptr;
}

// ---------------------------------------------------------------------------------- character classes ----
// Each is Hugging Face's definition (tokenizers/src/normalizers/bert.rs, pre_tokenizers/bert.rs) over utf8proc's
// categories, flipped where Hugging Face's tables (the unicode_categories crate) say otherwise.

// Rust's char::is_whitespace: the Unicode White_Space property.
bool is_white_space(u32 c) {
  const bool ws = (c >= 0x9 && c <= 0xD) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
                  (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
                  c == 0x3000;
  return ws != in_sorted(kSpaceFlip, c);
}

// unicode_categories' is_other(): Cc, Cf or Co (not Cn, not Cs).
bool is_other(u32 c) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  const bool o = cat == UTF8PROC_CATEGORY_CC || cat == UTF8PROC_CATEGORY_CF || cat == UTF8PROC_CATEGORY_CO;
  return o != in_sorted(kOtherFlip, c);
}

bool is_mark_nonspacing(u32 c) {
  const bool mn = utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_MN;
  return mn != in_sorted(kMnFlip, c);
}

// BertPreTokenizer: ASCII punctuation or a P* category.
bool is_punctuation(u32 c) {
  bool p;
  if (c < 0x80) {
    p = (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
  } else {
    const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
    p = cat >= UTF8PROC_CATEGORY_PC && cat <= UTF8PROC_CATEGORY_PO;
  }
  return p != in_sorted(kPunctFlip, c);
}

// BertNormalizer's "chinese character": HF's exact ranges (CJK Unified Ideographs and extensions A-E,
// compatibility ideographs and their supplement).
bool is_chinese_char(u32 c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// Canonical decomposition of one code point (recursive, Hangul included), before reordering.
void decompose(u32 c, std::vector<u32>& out) {
  if (c < 0xC0) {  // nothing below U+00C0 decomposes
    out.push_back(c);
    return;
  }
  if (const Mapping* m = find_mapping(kNfdOverride, c)) {
    out.insert(out.end(), m->to, m->to + m->n);
    return;
  }
  utf8proc_int32_t buf[8];
  int boundclass = 0;
  const auto n = utf8proc_decompose_char(static_cast<utf8proc_int32_t>(c), buf, 8, UTF8PROC_DECOMPOSE, &boundclass);
  if (n <= 0 || n > 8) {
    out.push_back(c);
    return;
  }
  for (utf8proc_ssize_t k = 0; k < n; ++k) out.push_back(static_cast<u32>(buf[k]));
}

int combining_class(u32 c) {
  return c < 0x300 ? 0 : utf8proc_get_property(static_cast<utf8proc_int32_t>(c))->combining_class;
}

// NFD: decompose, then order every run of non-starters by combining class (stable).
void nfd(std::vector<u32>& s) {
  std::vector<u32> out;
  out.reserve(s.size() + s.size() / 4);
  for (u32 c : s) decompose(c, out);
  for (size_t i = 1; i < out.size(); ++i) {
    const int cc = combining_class(out[i]);
    if (cc == 0) continue;
    size_t j = i;
    while (j > 0) {
      const int pc = combining_class(out[j - 1]);
      if (pc == 0 || pc <= cc) break;
      std::swap(out[j - 1], out[j]);
      --j;
    }
  }
  s.swap(out);
}

// Rust's char::to_lowercase (full mapping: U+0130 gives two code points).
void lowercase(u32 c, std::vector<u32>& out) {
  if (c < 0x80) {
    out.push_back(c >= 'A' && c <= 'Z' ? c + 32 : c);
    return;
  }
  if (const Mapping* m = find_mapping(kLowerOverride, c)) {
    out.insert(out.end(), m->to, m->to + m->n);
    return;
  }
  out.push_back(static_cast<u32>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
}

// ---------------------------------------------------------------------------------------------- UTF-8 ----

void decode(std::string_view s, std::vector<u32>& out) {  // s is valid UTF-8 (checked before)
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    if (c < 0x80) {
      out.push_back(c);
      i += 1;
    } else if ((c >> 5) == 0x6) {
      out.push_back(((c & 0x1F) << 6) | (p[i + 1] & 0x3F));
      i += 2;
    } else if ((c >> 4) == 0xE) {
      out.push_back(((c & 0x0F) << 12) | ((p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F));
      i += 3;
    } else {
      out.push_back(((c & 0x07) << 18) | ((p[i + 1] & 0x3F) << 12) | ((p[i + 2] & 0x3F) << 6) | (p[i + 3] & 0x3F));
      i += 4;
    }
  }
}

void encode_utf8(u32 c, std::string& out) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

// The length of the UTF-8 sequence starting with byte b (valid input).
size_t seq_len(unsigned char b) { return b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : 4; }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

size_t invalid_utf8(std::string_view s, size_t* chars) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0, count = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {  // fast path: ASCII
      ++i, ++count;
      continue;
    }
    size_t len = (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > n) return i;
    unsigned cp = len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return i;
    i += len;
    ++count;
  }
  if (chars) *chars = count;
  return std::string_view::npos;
}

struct Tokenizer::Impl {
  std::string origin;
  // normalizer
  bool normalize = false, clean_text = false, chinese = false, strip_accents = false, lower = false;
  // WordPiece
  std::unordered_map<std::string, int64_t> vocab;
  int64_t unk = 0;
  std::string prefix = "##";
  size_t max_chars = 100;
  // added tokens, matched in the raw text (normalized: false)
  struct Added {
    std::string content;
    int64_t id;
    bool lstrip, rstrip;
  };
  std::vector<Added> added;
  bool first_byte[256] = {};
  // post-processor: ids before and after the sequence
  std::vector<int64_t> before, after;
  size_t size = 0;

  [[noreturn]] void refuse(const std::string& what) const {
    throw Error("tokenizer " + origin + ": " + what);
  }

  void read(const json& tj) {
    if (!tj.is_object()) refuse("not a JSON object");
    // model
    const json& m = tj.at("model");
    const std::string mtype = m.is_object() ? m.value("type", "") : "";
    if (mtype != "WordPiece")
      refuse("model type \"" + mtype + "\" is not supported; expected WordPiece (a BERT-family tokenizer)");
    if (!m.at("vocab").is_object()) refuse("model vocab is not an object of token: id");
    for (const auto& [tok, id] : m.at("vocab").items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0) refuse("vocab id of \"" + tok + "\" is not a non-negative integer");
      vocab.emplace(tok, id.get<int64_t>());
      size = std::max(size, static_cast<size_t>(id.get<int64_t>()) + 1);
    }
    const std::string unk_token = m.at("unk_token").get<std::string>();
    auto u = vocab.find(unk_token);
    if (u == vocab.end()) refuse("unk_token \"" + unk_token + "\" is not in the vocabulary");
    unk = u->second;
    prefix = m.value("continuing_subword_prefix", std::string("##"));
    const json& mc = m.contains("max_input_chars_per_word") ? m.at("max_input_chars_per_word") : json(100);
    max_chars = mc.get<size_t>();
    // normalizer
    const json& n = tj.contains("normalizer") ? tj.at("normalizer") : json();
    if (!n.is_null()) {
      const std::string ntype = n.is_object() ? n.value("type", "") : "";
      if (ntype != "BertNormalizer")
        refuse("normalizer type \"" + ntype + "\" is not supported; expected BertNormalizer or null");
      normalize = true;
      clean_text = n.value("clean_text", true);
      chinese = n.value("handle_chinese_chars", true);
      lower = n.value("lowercase", true);
      const json& sa = n.contains("strip_accents") ? n.at("strip_accents") : json();
      strip_accents = sa.is_null() ? lower : sa.get<bool>();  // HF: strip_accents null follows lowercase
    }
    // pre-tokenizer
    const json& p = tj.contains("pre_tokenizer") ? tj.at("pre_tokenizer") : json();
    const std::string ptype = p.is_object() ? p.value("type", "") : (p.is_null() ? "null" : "");
    if (ptype != "BertPreTokenizer")
      refuse("pre_tokenizer type \"" + ptype + "\" is not supported; expected BertPreTokenizer");
    // added tokens
    if (tj.contains("added_tokens") && !tj.at("added_tokens").is_null()) {
      for (const json& a : tj.at("added_tokens")) {
        Added t{a.at("content").get<std::string>(), a.at("id").get<int64_t>(), a.value("lstrip", false),
                a.value("rstrip", false)};
        if (t.content.empty()) refuse("an added token is empty");
        if (invalid_utf8(t.content) != std::string_view::npos) refuse("added token " + std::to_string(t.id) + " is not UTF-8");
        if (a.value("normalized", !a.value("special", false)))
          refuse("added token \"" + t.content + "\" has \"normalized\": true; only tokens matched in the raw text "
                 "(\"normalized\": false) are supported");
        if (a.value("single_word", false))
          refuse("added token \"" + t.content + "\" has \"single_word\": true; expected false");
        if (t.id < 0) refuse("added token \"" + t.content + "\" has a negative id");
        size = std::max(size, static_cast<size_t>(t.id) + 1);
        first_byte[static_cast<unsigned char>(t.content[0])] = true;
        added.push_back(std::move(t));
      }
    }
    // post-processor
    const json& pp = tj.contains("post_processor") ? tj.at("post_processor") : json();
    if (!pp.is_null()) {
      const std::string type = pp.is_object() ? pp.value("type", "") : "";
      if (type == "TemplateProcessing") {
        bool seen = false;
        for (const json& piece : pp.at("single")) {
          if (piece.contains("Sequence")) {
            if (seen || piece.at("Sequence").at("id").get<std::string>() != "A")
              refuse("post_processor's single template must hold sequence A once");
            seen = true;
          } else {
            const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
            const json& ids = pp.at("special_tokens").at(name).at("ids");
            for (const json& id : ids) (seen ? after : before).push_back(id.get<int64_t>());
          }
        }
        if (!seen) refuse("post_processor's single template has no sequence A");
      } else if (type == "BertProcessing") {
        before.push_back(pp.at("cls").at(1).get<int64_t>());
        after.push_back(pp.at("sep").at(1).get<int64_t>());
      } else {
        refuse("post_processor type \"" + type + "\" is not supported; expected TemplateProcessing, BertProcessing "
               "or null");
      }
      for (int64_t id : before) size = std::max(size, static_cast<size_t>(id) + 1);
      for (int64_t id : after) size = std::max(size, static_cast<size_t>(id) + 1);
    }
  }

  // HF BertNormalizer on one segment (code points in, code points out).
  void normalize_cps(std::vector<u32>& s) const {
    if (!normalize) return;
    std::vector<u32> t;
    t.reserve(s.size() + 8);
    for (u32 c : s) {
      if (clean_text) {
        if (c == 0 || c == 0xFFFD || (c != '\t' && c != '\n' && c != '\r' && is_other(c))) continue;
        if (c == '\t' || c == '\n' || c == '\r' || is_white_space(c)) c = ' ';
      }
      if (chinese && is_chinese_char(c)) {
        t.push_back(' ');
        t.push_back(c);
        t.push_back(' ');
      } else {
        t.push_back(c);
      }
    }
    if (strip_accents) {
      nfd(t);
      t.erase(std::remove_if(t.begin(), t.end(), [](u32 c) { return c >= 0x300 && is_mark_nonspacing(c); }), t.end());
    }
    if (lower) {
      s.clear();
      for (u32 c : t) lowercase(c, s);
    } else {
      s.swap(t);
    }
  }

  // BertPreTokenizer: words split at whitespace (removed) and at punctuation (each its own word).
  template <typename F>
  void pre_tokenize(const std::vector<u32>& s, F&& word) const {
    std::string cur;
    std::string one;
    for (u32 c : s) {
      if (is_white_space(c)) {
        if (!cur.empty()) word(cur), cur.clear();
      } else if (is_punctuation(c)) {
        if (!cur.empty()) word(cur), cur.clear();
        one.clear();
        encode_utf8(c, one);
        word(one);
      } else {
        encode_utf8(c, cur);
      }
    }
    if (!cur.empty()) word(cur);
  }

  // WordPiece: greedy longest match first; a word with no full cover, or longer than max_chars, is [UNK].
  void wordpiece(const std::string& w, std::vector<int64_t>& ids) const {
    size_t chars = 0;
    for (unsigned char b : w) chars += (b & 0xC0) != 0x80;
    if (chars > max_chars) {
      ids.push_back(unk);
      return;
    }
    const size_t mark = ids.size();
    std::string key;
    size_t start = 0;
    while (start < w.size()) {
      size_t end = w.size();
      int64_t found = -1;
      while (end > start) {
        key.assign(start > 0 ? prefix : std::string());
        key.append(w, start, end - start);
        auto it = vocab.find(key);
        if (it != vocab.end()) {
          found = it->second;
          break;
        }
        do --end;  // back to the previous character boundary
        while (end > start && (static_cast<unsigned char>(w[end]) & 0xC0) == 0x80);
      }
      if (found < 0) {
        ids.resize(mark);
        ids.push_back(unk);
        return;
      }
      ids.push_back(found);
      start = end;
    }
  }

  // AddedVocabulary::find_matches: leftmost-longest matches of the added tokens in the raw text, with lstrip /
  // rstrip taking the whitespace beside them; `segment(begin, end)` for the text between, `token(id)` for each.
  template <typename S, typename T>
  void split_added(std::string_view text, S&& segment, T&& token) const {
    size_t from = 0;  // start of the pending segment
    size_t i = 0;
    while (i < text.size()) {
      const Added* best = nullptr;
      if (first_byte[static_cast<unsigned char>(text[i])])
        for (const Added& a : added)
          if (text.compare(i, a.content.size(), a.content) == 0 && (!best || a.content.size() > best->content.size()))
            best = &a;
      if (!best) {
        i += seq_len(static_cast<unsigned char>(text[i]));
        continue;
      }
      size_t start = i, stop = i + best->content.size();
      if (best->lstrip) {
        size_t k = start;
        while (k > from) {  // whitespace before the match, not already taken by an earlier match
          size_t b = k - 1;
          while (b > from && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
          std::vector<u32> cp;
          decode(text.substr(b, k - b), cp);
          if (!is_white_space(cp[0])) break;
          k = b;
        }
        start = k;
      }
      if (best->rstrip) {
        while (stop < text.size()) {
          const size_t len = seq_len(static_cast<unsigned char>(text[stop]));
          std::vector<u32> cp;
          decode(text.substr(stop, len), cp);
          if (!is_white_space(cp[0])) break;
          stop += len;
        }
      }
      if (from < start) segment(text.substr(from, start - from));
      token(best->id);
      from = i = stop;
    }
    if (from < text.size()) segment(text.substr(from));
  }

  void model_ids(std::string_view text, std::vector<int64_t>& ids) const {
    std::vector<u32> cps;
    split_added(
        text,
        [&](std::string_view seg) {
          cps.clear();
          decode(seg, cps);
          normalize_cps(cps);
          pre_tokenize(cps, [&](const std::string& w) { wordpiece(w, ids); });
        },
        [&](int64_t id) { ids.push_back(id); });
  }
};

Tokenizer::Tokenizer(std::string_view json_text, const std::string& origin) {
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  if (std::string(utf8proc_unicode_version()) != kCompatUnicodeVersion)
    throw Error("utf8proc's Unicode " + std::string(utf8proc_unicode_version()) + " is not the " +
                kCompatUnicodeVersion + " that src/hf_unicode_compat.inc was generated for; regenerate it with "
                "deploy/cpp/tools/gen_hf_unicode_compat.py");
  json tj;
  try {
    tj = json::parse(json_text);
  } catch (const json::exception& e) {
    throw Error("tokenizer " + origin + " is not JSON (" + first_line(e.what()) + ")");
  }
  try {
    impl->read(tj);
  } catch (const json::exception& e) {
    throw Error("tokenizer " + origin + ": missing or mistyped field (" + first_line(e.what()) + ")");
  }
  impl_ = std::move(impl);
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("tokenizer file " + path + " cannot be read");
  std::stringstream ss;
  ss << f.rdbuf();
  return Tokenizer(ss.str(), path);
}

Encoding Tokenizer::encode(std::string_view utf8, size_t max_length) const {
  const size_t bad = invalid_utf8(utf8);
  if (bad != std::string_view::npos) throw InvalidUtf8(0, bad);
  const Impl& m = *impl_;
  Encoding e;
  std::vector<int64_t> body;
  m.model_ids(utf8, body);
  const size_t extra = m.before.size() + m.after.size();
  e.tokens = body.size() + extra;
  if (max_length > 0 && e.tokens > max_length) {
    if (max_length < extra)
      throw Error("max_length " + std::to_string(max_length) + " leaves no room for the " + std::to_string(extra) +
                  " special tokens");
    body.resize(max_length - extra);  // longest_first with one sequence, direction right: keep its first tokens
  }
  e.ids.reserve(body.size() + extra);
  e.ids.insert(e.ids.end(), m.before.begin(), m.before.end());
  e.ids.insert(e.ids.end(), body.begin(), body.end());
  e.ids.insert(e.ids.end(), m.after.begin(), m.after.end());
  return e;
}

std::vector<std::string> Tokenizer::words(std::string_view utf8) const {
  const size_t bad = invalid_utf8(utf8);
  if (bad != std::string_view::npos) throw InvalidUtf8(0, bad);
  const Impl& m = *impl_;
  std::vector<std::string> out;
  std::vector<u32> cps;
  m.split_added(
      utf8,
      [&](std::string_view seg) {
        cps.clear();
        decode(seg, cps);
        m.normalize_cps(cps);
        m.pre_tokenize(cps, [&](const std::string& w) { out.push_back(w); });
      },
      [&](int64_t id) {
        for (const auto& a : m.added)
          if (a.id == id) out.push_back(a.content);
      });
  return out;
}

size_t Tokenizer::vocab_size() const { return impl_->size; }
size_t Tokenizer::num_special() const { return impl_->before.size() + impl_->after.size(); }
std::string Tokenizer::unicode_version() { return utf8proc_unicode_version(); }
std::string Tokenizer::compat_unicode_version() { return kCompatUnicodeVersion; }

void Tokenizer::dump_unicode(std::string& out) {
  char buf[32];
  for (u32 c = 0; c <= 0x10FFFF; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    const auto ci = static_cast<utf8proc_int32_t>(c);
    std::snprintf(buf, sizeof buf, "%X %d ", c, static_cast<int>(utf8proc_category(ci)));
    out += buf;
    utf8proc_int32_t d[8];
    int bc = 0;
    auto n = utf8proc_decompose_char(ci, d, 8, UTF8PROC_DECOMPOSE, &bc);
    for (utf8proc_ssize_t k = 0; k < n; ++k) {
      std::snprintf(buf, sizeof buf, k ? ",%X" : "%X", static_cast<unsigned>(d[k]));
      out += buf;
    }
    std::snprintf(buf, sizeof buf, " %X\n", static_cast<unsigned>(utf8proc_tolower(ci)));
    out += buf;
  }
}

}  // namespace xdeploy
