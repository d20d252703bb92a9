#include "kv_cache_manager.h"

#include <algorithm>

#include "check.h"

namespace precast {

KvCacheManager::KvCacheManager(int num_blocks, int tokens_per_block, bool enable_prefix_reuse)
    : tokens_per_block_(tokens_per_block), prefix_reuse_(enable_prefix_reuse), blocks_(num_blocks) {
  PRECAST_CHECK(num_blocks > 0 && tokens_per_block > 0, "need at least one block of at least one token");
  free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);  // hand out block 0 first
}

uint64_t KvCacheManager::chain_hash(uint64_t parent_hash, const TokenId* tokens, int n) {
  // splitmix64 steps over (parent, tokens): cheap, well mixed. Collisions are harmless:
  // a hit is accepted only if the stored tokens and parent match exactly.
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  uint64_t h = mix(parent_hash ^ 0x5bd1e995ULL);
  for (int i = 0; i < n; ++i) h = mix(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

int KvCacheManager::match_prefix(RequestId id, const std::vector<TokenId>& tokens, bool reuse) {
  PRECAST_CHECK(!tables_.count(id), "request " << id << " already has blocks");
  Table& table = tables_[id];
  if (!prefix_reuse_ || !reuse || tokens.empty()) return 0;
  const int B = tokens_per_block_;
  const int max_blocks = (int(tokens.size()) - 1) / B;  // leave the last token to compute
  uint64_t parent_hash = 0;
  int parent = -1;
  for (int i = 0; i < max_blocks; ++i) {
    const TokenId* chunk = tokens.data() + i * B;
    uint64_t h = chain_hash(parent_hash, chunk, B);
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    Block& blk = blocks_[it->second];
    if (blk.parent != parent || !std::equal(blk.tokens.begin(), blk.tokens.end(), chunk)) break;
    if (blk.ref_count++ == 0) evictable_.erase(blk.lru_pos);
    table.blocks.push_back(it->second);
    parent = it->second;
    parent_hash = h;
  }
  table.num_registered = int(table.blocks.size());
  return table.num_registered * B;
}

void KvCacheManager::count_prefix_lookup(int num_prompt_tokens, int num_cached_tokens) {
  if (!prefix_reuse_ || num_prompt_tokens == 0) return;
  prefix_query_tokens_ += num_prompt_tokens;
  prefix_hit_tokens_ += num_cached_tokens;
  reused_blocks_ += num_cached_tokens / tokens_per_block_;
}

int KvCacheManager::take_block() {
  int b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    b = evictable_.front();  // least recently used cached block
    evictable_.pop_front();
    unregister(b);
  }
  PRECAST_CHECK(blocks_[b].ref_count == 0, "allocating a referenced block " << b);
  blocks_[b].ref_count = 1;
  return b;
}

void KvCacheManager::unregister(int block) {
  Block& blk = blocks_[block];
  if (!blk.registered) return;
  auto it = by_hash_.find(blk.hash);
  if (it != by_hash_.end() && it->second == block) by_hash_.erase(it);
  if (record_events_) events_.push_back({false, blk.hash, false, 0, {}});
  blk.registered = false;
  blk.parent = -1;
  blk.tokens.clear();
}

bool KvCacheManager::allocate(RequestId id, int num_tokens) {
  Table& table = tables_[id];
  const int need = blocks_needed(num_tokens) - int(table.blocks.size());
  if (need <= 0) return true;
  if (need > num_allocatable_blocks()) return false;
  for (int i = 0; i < need; ++i) table.blocks.push_back(take_block());
  return true;
}

void KvCacheManager::commit(RequestId id, const std::vector<TokenId>& tokens, int num_computed) {
  if (!prefix_reuse_) return;
  auto it = tables_.find(id);
  PRECAST_CHECK(it != tables_.end(), "commit for unknown request " << id);
  Table& table = it->second;
  const int B = tokens_per_block_;
  const int full = std::min<int>(num_computed / B, int(table.blocks.size()));
  while (table.num_registered < full) {
    const int i = table.num_registered++;
    const int parent = i == 0 ? -1 : table.blocks[i - 1];
    const Block* parent_blk = parent < 0 ? nullptr : &blocks_[parent];
    if (parent_blk && !parent_blk->registered) continue;  // chain broken: later blocks cannot be found
    const uint64_t h = chain_hash(parent_blk ? parent_blk->hash : 0, tokens.data() + i * B, B);
    if (by_hash_.count(h)) continue;  // same content already cached in another block
    Block& blk = blocks_[table.blocks[i]];
    blk.registered = true;
    blk.hash = h;
    blk.parent = parent;
    blk.tokens.assign(tokens.begin() + i * B, tokens.begin() + (i + 1) * B);
    by_hash_[h] = table.blocks[i];
    if (record_events_)
      events_.push_back({true, h, parent_blk != nullptr, parent_blk ? parent_blk->hash : 0, blk.tokens});
  }
}

void KvCacheManager::free(RequestId id) {
  auto it = tables_.find(id);
  if (it == tables_.end()) return;
  // Release the tail first so that, among one request's blocks, the end of the prompt is
  // evicted before its beginning (a beginning is more likely to be shared).
  const std::vector<int>& blocks = it->second.blocks;
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) release_block(*b);
  tables_.erase(it);
}

void KvCacheManager::truncate(RequestId id, int num_tokens) {
  auto it = tables_.find(id);
  PRECAST_CHECK(it != tables_.end(), "truncate for unknown request " << id);
  Table& table = it->second;
  const int keep = blocks_needed(num_tokens);
  while (int(table.blocks.size()) > keep) {
    release_block(table.blocks.back());
    table.blocks.pop_back();
  }
  table.num_registered = std::min(table.num_registered, int(table.blocks.size()));
}

// One table's reference to `block` dropped: an unreferenced block is cached (registered) or free.
void KvCacheManager::release_block(int block) {
  Block& blk = blocks_[block];
  PRECAST_CHECK(blk.ref_count > 0, "freeing unreferenced block " << block);
  if (--blk.ref_count > 0) return;
  if (blk.registered) {
    blk.lru_pos = evictable_.insert(evictable_.end(), block);
  } else {
    free_.push_back(block);
  }
}

const std::vector<int>& KvCacheManager::block_table(RequestId id) const {
  auto it = tables_.find(id);
  PRECAST_CHECK(it != tables_.end(), "no blocks for request " << id);
  return it->second.blocks;
}

KvCacheStats KvCacheManager::stats() const {
  KvCacheStats s;
  s.max_blocks = num_blocks();
  s.free_blocks = num_allocatable_blocks();
  s.used_blocks = num_blocks() - s.free_blocks;
  s.cached_blocks = int(by_hash_.size());
  s.reused_blocks = reused_blocks_;
  s.prefix_query_tokens = prefix_query_tokens_;
  s.prefix_hit_tokens = prefix_hit_tokens_;
  s.tokens_per_block = tokens_per_block_;
  return s;
}

void KvCacheManager::check_integrity() const {
  std::vector<int> refs(blocks_.size(), 0);
  for (const auto& [id, table] : tables_) {
    PRECAST_CHECK(table.num_registered <= int(table.blocks.size()), "request " << id << " registered past its table");
    for (int b : table.blocks) {
      PRECAST_CHECK(b >= 0 && b < num_blocks(), "bad block id " << b);
      ++refs[b];
    }
  }
  std::vector<int> where(blocks_.size(), 0);  // 1 free, 2 evictable
  for (int b : free_) {
    PRECAST_CHECK(where[b] == 0, "block " << b << " twice in the free list");
    where[b] = 1;
  }
  for (int b : evictable_) {
    PRECAST_CHECK(where[b] == 0, "block " << b << " both free and evictable");
    where[b] = 2;
  }
  for (int b = 0; b < num_blocks(); ++b) {
    const Block& blk = blocks_[b];
    PRECAST_CHECK(blk.ref_count == refs[b],
                  "block " << b << " ref_count " << blk.ref_count << " but in " << refs[b] << " tables");
    if (blk.ref_count > 0) PRECAST_CHECK(where[b] == 0, "referenced block " << b << " is on a free list");
    if (blk.ref_count == 0) PRECAST_CHECK(where[b] != 0, "block " << b << " is lost (unreferenced, on no list)");
    if (where[b] == 1) PRECAST_CHECK(!blk.registered, "free block " << b << " still registered");
    if (where[b] == 2) PRECAST_CHECK(blk.registered, "evictable block " << b << " is not registered");
    if (blk.registered) {
      auto it = by_hash_.find(blk.hash);
      PRECAST_CHECK(it != by_hash_.end() && it->second == b, "registered block " << b << " missing from the hash map");
      PRECAST_CHECK(int(blk.tokens.size()) == tokens_per_block_, "registered block " << b << " is not full");
    }
  }
  for (const auto& [h, b] : by_hash_) PRECAST_CHECK(blocks_[b].registered && blocks_[b].hash == h, "stale hash entry");
}

}  // namespace precast
