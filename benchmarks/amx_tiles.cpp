// Where one core's AMX bf16 rate goes: TDPBF16PS with its operands in tiles, in L1, or one
// operand streamed from L2, against plain AVX-512 reads of the same cache levels. It answers
// "how far is precast's AMX linear kernel (plugins/cpu/bf16_gemm.cpp) from this core's limit,
// and what limits it", independently of precast's own code.
//
//   g++ -O2 -march=native benchmarks/amx_tiles.cpp -o /tmp/amx_tiles && /tmp/amx_tiles
//
// Each step is the kernel's inner step: one A tile (16 rows x 32 bf16 activations), four B
// tiles (16 input pairs x 16 outputs, 256-byte rows as in a packed panel), four TDPBF16PS into
// four C tiles (16 rows x 64 outputs). "A from L2" cycles A through 256 KB (B 32 KB); "B from
// L2" cycles B through 256 KB (A 16 KB); "16 bytes off" starts the arrays 16 bytes past a cache
// line, where glibc puts large std::vector blocks, so every 64-byte tile row spans two lines.
// One thread; median of 5 runs; GFLOP/s and GB/s.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kStepFlops = 4 * 16 * 16 * 32 * 2;  // four TDPBF16PS

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename F>
double median_of_5(F run) {
  std::vector<double> v;
  for (int i = 0; i < 5; ++i) v.push_back(run());
  std::sort(v.begin(), v.end());
  return v[2];
}

// GFLOP/s of `steps` kernel steps, A cycling through a_bytes and B through b_bytes, both
// starting `misalign` bytes past a cache line; prefetch_a: the next step's A lines into L1 first.
double steps_rate(int64_t a_bytes, int64_t b_bytes, bool prefetch_a, int64_t steps, int misalign = 0) {
  std::vector<uint16_t> a_store(a_bytes / 2 + 64, 0x3f80), b_store(b_bytes / 2 + 64, 0x3f80);
  auto start = [misalign](std::vector<uint16_t>& v) {
    return reinterpret_cast<const uint16_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) / 64 * 64 + misalign);
  };
  const uint16_t* a = start(a_store);
  const uint16_t* b = start(b_store);
  const int64_t a_steps = a_bytes / 1024, b_steps = b_bytes / 4096;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    const uint16_t* ak = a + (i % a_steps) * 512;
    const uint16_t* bk = b + (i % b_steps) * 2048;
    if (prefetch_a) {
      const char* next = reinterpret_cast<const char*>(a + ((i + 1) % a_steps) * 512);
      for (int line = 0; line < 16; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(4, ak, 64);
    _tile_loadd(5, bk, 256);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, bk + 32, 256);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, bk + 64, 256);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, bk + 96, 256);
    _tile_dpbf16ps(3, 4, 6);
  }
  return double(steps) * kStepFlops / seconds_since(t0) / 1e9;
}

double compute_only_rate(int64_t steps) {
  std::vector<uint16_t> a(512, 0x3f80), b(2048, 0x3f80);
  _tile_loadd(4, a.data(), 64);
  _tile_loadd(5, b.data(), 256);
  _tile_loadd(6, b.data() + 32, 256);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
  }
  return double(steps) * kStepFlops / seconds_since(t0) / 1e9;
}

// GB/s of AVX-512 reads cycling through `bytes`.
double read_rate(int64_t bytes) {
  std::vector<float> v(bytes / 4, 1.0f);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  const int64_t reps = std::max<int64_t>(1, (int64_t(2) << 30) / bytes);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    for (size_t i = 0; i < v.size(); i += 64) {
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(&v[i]));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(&v[i + 16]));
      s2 = _mm512_add_ps(s2, _mm512_loadu_ps(&v[i + 32]));
      s3 = _mm512_add_ps(s3, _mm512_loadu_ps(&v[i + 48]));
    }
  const double s = seconds_since(t0);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  volatile float sink = lanes[0];  // keeps the reads
  (void)sink;
  return double(reps) * double(bytes) / s / 1e9;
}

}  // namespace

int main() {
  constexpr long kArchRequestXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchRequestXcompPerm, kXfeatureXtiledata) != 0) {
    std::fprintf(stderr, "the kernel refused AMX tile state (no AMX on this CPU, or an old kernel)\n");
    return 1;
  }
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  const int64_t steps = 4000000;
  std::printf("| case | one core |\n| --- | --- |\n");
  std::printf("| TDPBF16PS, operands in tiles | %.0f GFLOP/s |\n",
              median_of_5([&] { return compute_only_rate(steps); }));
  std::printf("| A 16 KB, B 32 KB (L1) | %.0f GFLOP/s |\n",
              median_of_5([&] { return steps_rate(16 << 10, 32 << 10, false, steps); }));
  std::printf("| A 16 KB, B 32 KB (L1), rows 16 bytes off 64 | %.0f GFLOP/s |\n",
              median_of_5([&] { return steps_rate(16 << 10, 32 << 10, false, steps, 16); }));
  std::printf("| A from L2 (256 KB), B 32 KB | %.0f GFLOP/s |\n",
              median_of_5([&] { return steps_rate(256 << 10, 32 << 10, false, steps); }));
  std::printf("| A from L2, next A prefetched into L1 | %.0f GFLOP/s |\n",
              median_of_5([&] { return steps_rate(256 << 10, 32 << 10, true, steps); }));
  std::printf("| B from L2 (256 KB), A 16 KB | %.0f GFLOP/s |\n",
              median_of_5([&] { return steps_rate(16 << 10, 256 << 10, false, steps); }));
  for (int64_t kb : {32, 256, 1024})
    std::printf("| AVX-512 reads of %lld KB | %.0f GB/s |\n", static_cast<long long>(kb),
                median_of_5([&] { return read_rate(kb << 10); }));
  _tile_release();
  return 0;
}
