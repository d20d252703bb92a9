// Paged attention over a packed batch, reading K/V in place through block tables.
//
// Cache layout per layer: [num_blocks][num_kv_heads] tiles of tokens_per_block tokens.
// K tiles are stored d-major, [head_dim][tokens_per_block], so that 16 consecutive keys'
// element d is one vector: scores for 16 keys come out of broadcast-FMAs over d with no
// horizontal sums. V tiles are token-major, [tokens_per_block][head_dim]. Elements are
// float32, or E4M3 bytes with one K and one V scale per layer (fp8 KV cache: k = byte value
// * k_scale). Token position p of a sequence lives in block block_table[p /
// tokens_per_block], column / row p % tokens_per_block. bf16 caches, for engines that
// multiply on a bf16 dot-product unit, store pairs instead (kBf16 below,
// paged_attention_bf16.cpp).
//
// One kernel serves both phases: a context (prefill) chunk is several query tokens of a
// sequence, a decode step is one. Query token t of a sequence attends to positions
// [lo, context_len + t] (causal), lo = context_len + t - window + 1 with a sliding window.
// Every score is one FMA chain over d in order, every output one chain over keys in
// order, and key j always sits in softmax lane j % 16: the result for a query row does
// not depend on which other rows share its tile (batch invariance, chunked prefill).
#pragma once

#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace precast {

// What a cache element is. kBf16 tiles hold pairs for the bf16 dot-product units
// (bf16_gemm.h): K [head_dim / 2][tokens_per_block][2], the pair (k[d], k[d + 1]) of each
// token side by side; V [tokens_per_block / 2][head_dim][2], the pair (v_t[d], v_t+1[d]) of two
// consecutive tokens side by side. 16 keys' pairs are one 64-byte row either way: an AMX
// B tile row or one VDPBF16PS operand.
enum class KvElement { kFloat32, kE4M3, kBf16 };
int kv_element_bytes(KvElement element);
// Whether a bf16 cache works for this shape on this process's dot-product unit: blocks of a
// multiple of 32 tokens (one AMX step of keys, aligned to absolute positions) and heads of a
// multiple of 32 elements.
bool bf16_kv_supported(int tokens_per_block, int head_dim);

struct PagedKvLayer {
  void* k = nullptr;
  void* v = nullptr;
  int tokens_per_block = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  KvElement element = KvElement::kFloat32;
  float k_scale = 1.0f;  // kE4M3 only
  float v_scale = 1.0f;
  int64_t tile_index(int block, int kv_head) const {
    return (int64_t(block) * num_kv_heads + kv_head) * tokens_per_block * head_dim;
  }
  template <class T>
  T* k_tile(int block, int kv_head) const {
    return static_cast<T*>(k) + tile_index(block, kv_head);
  }
  template <class T>
  T* v_tile(int block, int kv_head) const {
    return static_cast<T*>(v) + tile_index(block, kv_head);
  }
};

struct AttentionSequence {
  const int* block_table = nullptr;
  int context_len = 0;   // positions already cached before this step
  int num_tokens = 0;    // query tokens this step (their K/V already written)
  int token_offset = 0;  // first query row in the packed batch
};

// Store one token's K and V (num_kv_heads x head_dim each) at `position` (rounded to the element).
void write_kv(const PagedKvLayer& cache, const int* block_table, int position, const float* k, const float* v);

// out[t, h * head_dim ...] for every query token t and head h; q rows have `q_stride` floats.
// Scores are q.k * scale, then softcap * tanh(score / softcap) when softcap > 0 (Gemma 2).
void paged_attention(ThreadPool& pool, const PagedKvLayer& cache, const std::vector<AttentionSequence>& seqs,
                     const float* q, int64_t q_stride, int num_heads, int window, float scale, float softcap,
                     float* out);

// paged_attention for a kBf16 cache (paged_attention_bf16.cpp): q and the probabilities are
// rounded to bf16, products accumulate in float32.
void paged_attention_bf16(ThreadPool& pool, const PagedKvLayer& cache, const std::vector<AttentionSequence>& seqs,
                          const float* q, int64_t q_stride, int num_heads, int window, float scale, float softcap,
                          float* out);
void write_kv_bf16(const PagedKvLayer& cache, const int* block_table, int position, const float* k, const float* v);

}  // namespace precast
