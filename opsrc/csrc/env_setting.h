// Run-time switches of the kernels: environment variables read by the host code (each setting
// is read once, by a function-local static at its use).
#pragma once

#include <cstdlib>
#include <initializer_list>

namespace cudadoctor_ops {

// -1 when `name` is unset or empty, 0 when its value starts with '0', else 1.
inline int env_switch(const char* name) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return -1;
  return e[0] == '0' ? 0 : 1;
}

// The integer value of environment variable `name` when it is one of `allowed`; `fallback` when
// it is unset, empty or anything else.
inline int env_choice(const char* name, std::initializer_list<int> allowed, int fallback) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return fallback;
  const int v = std::atoi(e);
  for (int a : allowed)
    if (v == a) return v;
  return fallback;
}

// The integer value of environment variable `name` when it is in 1 .. max; 0 when it is unset,
// empty or anything else.
inline int env_positive_int(const char* name, int max) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return 0;
  const int v = std::atoi(e);
  return v >= 1 && v <= max ? v : 0;
}

}  // namespace cudadoctor_ops
