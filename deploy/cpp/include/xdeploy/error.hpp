// xdeploy C++ runtime: the exceptions every part of it throws (one-line messages).
#pragma once

#include <stdexcept>
#include <string>

namespace xdeploy {

// Every user-caused problem (bad artifact, bad tokenizer.json, bad ids, unavailable provider) is one of these,
// with a one-line message.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The artifact's golden probes fail on this machine and provider: refused (the CLI exits 1, like `xdeploy verify`).
class ProbeFailure : public Error {
 public:
  using Error::Error;
};

// Text input i is not valid UTF-8; `byte` is the offset of the first invalid sequence in it.
class InvalidUtf8 : public Error {
 public:
  InvalidUtf8(size_t input_index, size_t byte_offset)
      : Error("input " + std::to_string(input_index) + " is not valid UTF-8 (byte " + std::to_string(byte_offset) + ")"),
        input(input_index),
        byte(byte_offset) {}
  size_t input, byte;
};

}  // namespace xdeploy
