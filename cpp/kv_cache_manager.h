// KV cache manager: owns block ids and their accounting (the runner owns the memory).
//
// A request's KV lives in fixed-size blocks of `tokens_per_block` tokens, listed in its
// block table. Full blocks are registered under a hash of (parent block's hash, the
// block's token ids), so a later request whose prompt starts with the same tokens maps
// the same blocks instead of recomputing them (prefix reuse). Block states:
//
//   free        no content anyone wants             -> free_ (stack)
//   referenced  in >= 1 block table (ref_count > 0) -> shared by every table holding it
//   cached      content registered, ref_count == 0  -> evictable_ (LRU; front is oldest)
//
// Allocation takes free blocks first, then evicts the least recently used cached block.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <utility>
#include <vector>

#include "request.h"

namespace precast {

struct KvCacheStats {
  int max_blocks = 0;
  int free_blocks = 0;        // allocatable now: free + cached-but-unreferenced
  int used_blocks = 0;        // referenced by at least one request
  int cached_blocks = 0;      // holding registered content (referenced or not)
  int64_t reused_blocks = 0;  // blocks served from the prefix cache, cumulative
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int tokens_per_block = 0;
  double hit_rate() const { return prefix_query_tokens ? double(prefix_hit_tokens) / prefix_query_tokens : 0.0; }
};

// A change in what the prefix cache holds, for KV-aware routers (runtime/server/kv_events.py):
// a full block registered under `hash` (after `parent_hash`, if any), or one dropped.
struct KvEvent {
  bool stored = true;  // false: removed
  uint64_t hash = 0;
  bool has_parent = false;
  uint64_t parent_hash = 0;
  std::vector<TokenId> tokens;  // stored blocks only
};

class KvCacheManager {
 public:
  KvCacheManager(int num_blocks, int tokens_per_block, bool enable_prefix_reuse);

  // Record KvEvents from now on (off by default: nothing is recorded or paid for).
  void record_events(bool on) { record_events_ = on; }
  // The events since the last call, oldest first.
  std::vector<KvEvent> take_events() { return std::exchange(events_, {}); }

  // Attach the cached blocks that hold a prefix of `tokens` to the (new) request and return
  // how many tokens they cover. At least one token is always left to compute, because the
  // model must produce logits for the last prompt token. Counts nothing in the statistics:
  // a request may be matched again after a failed admission or a preemption. With `reuse`
  // false nothing is attached (a request that needs every prompt position computed).
  int match_prefix(RequestId id, const std::vector<TokenId>& tokens, bool reuse = true);

  // Count one admitted request's prompt in the prefix-cache statistics: `num_prompt_tokens`
  // looked up, `num_cached_tokens` of them served from the cache (match_prefix's result).
  // The scheduler calls it once per request, at its first admission.
  void count_prefix_lookup(int num_prompt_tokens, int num_cached_tokens);

  // Grow the request's block table to hold `num_tokens` tokens. All or nothing: returns
  // false, changing nothing, when there are not enough allocatable blocks.
  bool allocate(RequestId id, int num_tokens);

  // Register the request's blocks that became full now that `num_computed` of `tokens`
  // have their KV written, so later requests can reuse them.
  void commit(RequestId id, const std::vector<TokenId>& tokens, int num_computed);

  // Drop the request's references; registered blocks stay cached until evicted.
  void free(RequestId id);

  // Release the request's blocks past those `num_tokens` tokens need (speculative decoding's
  // rejected draft positions), last block first.
  void truncate(RequestId id, int num_tokens);

  const std::vector<int>& block_table(RequestId id) const;
  bool has_request(RequestId id) const { return tables_.count(id) != 0; }
  int blocks_needed(int num_tokens) const { return (num_tokens + tokens_per_block_ - 1) / tokens_per_block_; }
  int num_allocatable_blocks() const { return int(free_.size() + evictable_.size()); }
  int num_blocks() const { return int(blocks_.size()); }
  int tokens_per_block() const { return tokens_per_block_; }
  KvCacheStats stats() const;

  // Recount every block's state from scratch and compare with the bookkeeping; throws on mismatch.
  void check_integrity() const;

 private:
  struct Block {
    int ref_count = 0;
    bool registered = false;
    uint64_t hash = 0;
    int parent = -1;  // previous block in the chain, -1 for a first block
    std::vector<TokenId> tokens;
    std::list<int>::iterator lru_pos;  // valid while cached and unreferenced
  };
  struct Table {
    std::vector<int> blocks;
    int num_registered = 0;  // leading blocks already registered (or matched)
  };

  static uint64_t chain_hash(uint64_t parent_hash, const TokenId* tokens, int n);
  void release_block(int block);
  int take_block();
  void unregister(int block);

  int tokens_per_block_;
  bool prefix_reuse_;
  std::vector<Block> blocks_;
  std::vector<int> free_;
  std::list<int> evictable_;
  std::unordered_map<uint64_t, int> by_hash_;
  std::unordered_map<RequestId, Table> tables_;
  int64_t reused_blocks_ = 0;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
  bool record_events_ = false;
  std::vector<KvEvent> events_;
};

}  // namespace precast
