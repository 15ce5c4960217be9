// memoryos-gpu: per-user BM25 postings (memoryos/postings.h says why and how).
#include "memoryos/postings.h"

#include <algorithm>

namespace memoryos {

namespace {
constexpr int64_t kMinCompact = 4096;  // stale postings below this are not worth a pass
}  // namespace

Postings::Postings(int32_t min_pages) : min_pages_(min_pages < 1 ? 1 : min_pages) {}

void Postings::grow_slots(int64_t num_slots) {
  const size_t n = static_cast<size_t>(num_slots);
  if (n <= gen_.size()) return;
  gen_.resize(n, 0);
  owner_.resize(n, -1);
}

void Postings::grow_users(int32_t u) {
  const size_t need = static_cast<size_t>(u) + 1;
  if (need <= pages_.size()) return;
  const size_t cap = std::max(need, 2 * pages_.size());
  pages_.resize(cap, 0);
  index_.resize(cap);
}

std::vector<int32_t> Postings::write(const int32_t* users, const int64_t* slots, int64_t n,
                                     const int64_t* offsets, const int32_t* ids,
                                     const int32_t* tf) {
  std::vector<int32_t> crossed;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t u = users[i];
    const size_t s = static_cast<size_t>(slots[i]);
    const int64_t a = offsets[i], b = offsets[i + 1];
    if (u < 0 || b == a) continue;  // an empty row: nothing to find, not an indexed page
    grow_users(u);
    owner_[s] = u;
    ++pages_[u];
    UserIndex* ix = index_[u].get();
    if (ix == nullptr) {  // reported until built, once a call
      const bool listed = std::find(crossed.begin(), crossed.end(), u) != crossed.end();
      if (pages_[u] >= min_pages_ && !listed) crossed.push_back(u);
      continue;
    }
    for (int64_t j = a; j < b; ++j) {
      ix->lists[ids[j]].push_back({static_cast<int32_t>(s), tf[j], gen_[s]});
    }
    ix->live += b - a;
  }
  return crossed;
}

void Postings::clear(const int64_t* slots, const int32_t* terms, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const size_t s = static_cast<size_t>(slots[i]);
    if (s >= gen_.size()) continue;
    ++gen_[s];
    const int32_t u = owner_[s];
    if (u < 0) continue;
    owner_[s] = -1;
    --pages_[u];
    UserIndex* ix = index_[u].get();
    if (ix == nullptr) continue;
    ix->live -= terms[i];
    ix->stale += terms[i];
    if (pages_[u] == 0) {
      index_[u].reset();  // the user's MTM emptied (or the user left): nothing to keep
    } else if (ix->stale > ix->live && ix->stale >= kMinCompact) {
      compact(*ix, gen_);
    }
  }
}

void Postings::build(int32_t u, const int64_t* slots, int64_t n, const int64_t* start,
                     const int32_t* count, const int32_t* terms, const int32_t* tf) {
  if (u < 0) return;
  grow_users(u);
  auto ix = std::make_unique<UserIndex>();
  for (int64_t i = 0; i < n; ++i) {
    const size_t s = static_cast<size_t>(slots[i]);
    if (s >= owner_.size() || owner_[s] != u) continue;  // not this user's indexed row
    const int64_t a = start[s];
    for (int32_t j = 0; j < count[s]; ++j) {
      ix->lists[terms[a + j]].push_back({static_cast<int32_t>(s), tf[a + j], gen_[s]});
    }
    ix->live += count[s];
  }
  index_[u] = std::move(ix);
}

void Postings::compact(UserIndex& ix, const std::vector<uint32_t>& gen) {
  for (auto it = ix.lists.begin(); it != ix.lists.end();) {
    std::vector<Posting>& list = it->second;
    list.erase(std::remove_if(list.begin(), list.end(),
                              [&gen](const Posting& p) {
                                return gen[static_cast<size_t>(p.slot)] != p.gen;
                              }),
               list.end());
    if (list.empty()) {
      it = ix.lists.erase(it);
    } else {
      list.shrink_to_fit();
      ++it;
    }
  }
  ix.stale = 0;
}

size_t Postings::nbytes() const {
  size_t total = gen_.capacity() * sizeof(uint32_t) + owner_.capacity() * sizeof(int32_t) +
                 pages_.capacity() * sizeof(int32_t) +
                 index_.capacity() * sizeof(void*);
  for (const auto& ix : index_) {
    if (ix == nullptr) continue;
    // a node per term (key, vector, hash-chain link) besides the bucket array
    const size_t node = sizeof(int32_t) + sizeof(std::vector<Posting>) + 2 * sizeof(void*);
    total += sizeof(UserIndex) + ix->lists.bucket_count() * sizeof(void*) +
             ix->lists.size() * node;
    for (const auto& kv : ix->lists) total += kv.second.capacity() * sizeof(Posting);
  }
  return total;
}

}  // namespace memoryos
