// consumer TOKENIZER_JSON [ARTIFACT]: prints the ONNX Runtime version, then the ids of each stdin line; with an
// ARTIFACT also the first 3 values of each line's vector. Built against the installed package only.
#include <iostream>
#include <string>
#include <vector>

#include "xdeploy/embedder.hpp"
#include "xdeploy/tokenizer.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: consumer TOKENIZER_JSON [ARTIFACT] < lines\n";
    return 2;
  }
  try {
    std::cout << "onnxruntime " << xdeploy::runtime_info().ort_version << "\n";
    const auto tok = xdeploy::Tokenizer::from_file(argv[1]);
    std::vector<std::string> lines;
    for (std::string line; std::getline(std::cin, line);) lines.push_back(line);
    for (const auto& l : lines) {
      const auto e = tok.encode(l, 256);
      for (size_t k = 0; k < e.ids.size(); ++k) std::cout << (k ? " " : "") << e.ids[k];
      std::cout << "\n";
    }
    if (argc > 2) {
      xdeploy::Embedder emb(argv[2]);
      for (const auto& v : emb.embed(lines)) std::cout << v[0] << " " << v[1] << " " << v[2] << "\n";
    }
  } catch (const xdeploy::Error& e) {
    std::cerr << "consumer: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
