#pragma once
// Scratch arrays on a cache line's boundary: a vector load of 32 or 64 bytes at a multiple of its
// width then never straddles two lines. The attention's per-query scratch (q, acc, m, l; paged_decode.h)
// came from malloc at 16 bytes; left there, no longer cleared, its 64 decode rows of the 1.7B shape
// ran 0.96-0.97x (three paired runs, benchmarks/kernel_ab.py), aligned 1.01-1.06x.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace aligned {

constexpr int64_t kLine = 64;

struct Free {
  void operator()(void* p) const { std::free(p); }
};

// n values of T, uninitialised, starting on a 64-byte boundary (nullptr for n = 0).
template <typename T>
std::unique_ptr<T[], Free> array(int64_t n) {
  if (n <= 0) return std::unique_ptr<T[], Free>(nullptr);
  const int64_t bytes = (n * static_cast<int64_t>(sizeof(T)) + kLine - 1) / kLine * kLine;
  T* p = static_cast<T*>(std::aligned_alloc(kLine, static_cast<size_t>(bytes)));
  if (p == nullptr) throw std::bad_alloc();
  return std::unique_ptr<T[], Free>(p);
}

}  // namespace aligned
