// The native draft core of RACER and its two ablations (racer_batch/drafters/native/__init__.py): the retrieval
// automaton (drafters/automaton.py), the copy-logit store and logits tree (drafters/copy_logits.py), the trie
// builder (drafters/base.py) and TreeDrafter's propose/update (drafters/methods.py), batched over streams, plus
// the flattening, greedy acceptance and tree mask of engine/tree.py and engine/decoder.py.
//
// Exactness: every draft equals the Python drafters' node for node. Python dicts iterate in insertion order and
// candidates() breaks heap ties by discovery order, so each trie node keeps its children on an intrusive doubly
// linked list in insertion order (a child evicted and re-created goes to the end, as a deleted and re-inserted
// dict key does); the (parent, token) -> child lookup is a separate open-addressing hash table. Node ids, the
// recency list, pins, failure links and eviction follow automaton.py step by step.
//
// Threads: every batch call locks the states it touches (in address order, so two calls never deadlock) and
// runs without the GIL. Bad inputs throw std::invalid_argument (ValueError in Python) before anything changes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using i32 = std::int32_t;
using i64 = std::int64_t;
using u16 = std::uint16_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;
using I64Convert = py::array_t<i64, py::array::c_style | py::array::forcecast>;

// An int64 array argument: a C-contiguous, aligned, native-order int64 ndarray is read in place through its own
// fields (no PyArray_FromAny: after a CPU forward has evicted the caches, pybind11's array_t conversion cost ~1 us
// per argument, ~11 us for ten); anything else (lists, other dtypes, strided views) is converted as
// array_t<int64, c_style | forcecast> would, and the converted array is kept alive here.
struct I64Array {
  py::object keep;  // the array read (borrowed or converted)
  const i64* ptr = nullptr;
  i64 nd = 0;
  i64 dims[4] = {0, 0, 0, 0};  // the first four extents (checks read ndim() before any shape(k))

  const i64* data() const { return ptr; }
  i64 ndim() const { return nd; }
  i64 shape(i64 k) const { return k < 4 ? dims[k] : 0; }

  // From a numpy array object already known to be int64 (borrowed or converted).
  static I64Array of(py::handle arr) {
    I64Array a;
    const auto* ap = py::detail::array_proxy(arr.ptr());
    a.keep = py::reinterpret_borrow<py::object>(arr);
    a.ptr = reinterpret_cast<const i64*>(ap->data);
    a.nd = ap->nd;
    for (int k = 0; k < ap->nd && k < 4; ++k) a.dims[k] = i64(ap->dimensions[k]);
    return a;
  }
};

}  // namespace

namespace pybind11::detail {
template <>
struct type_caster<I64Array> {
  PYBIND11_TYPE_CASTER(I64Array, const_name("numpy.ndarray[numpy.int64]"));

  bool load(handle src, bool convert);

  static handle cast(const I64Array& a, return_value_policy, handle) { return a.keep.inc_ref(); }
};
}  // namespace pybind11::detail

namespace {

// Whether `h` can be read in place as an I64Array (int64 of this machine's `long`, native order, C-contiguous,
// aligned).
bool readable_in_place(py::handle h) {
  const auto& api = py::detail::npy_api::get();
  if (!api.PyArray_Check_(h.ptr())) return false;
  const auto* ap = py::detail::array_proxy(h.ptr());
  const auto* dp = py::detail::array_descriptor_proxy(ap->descr);
  static const int int64_num = py::dtype::of<i64>().num();
  constexpr int need = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_;
  return dp->type_num == int64_num && (dp->byteorder == '=' || dp->byteorder == '|') && (ap->flags & need) == need;
}

}  // namespace

bool pybind11::detail::type_caster<I64Array>::load(handle src, bool convert) {
  if (readable_in_place(src)) {
    value = I64Array::of(src);
    return true;
  }
  if (!convert && !I64Convert::check_(src)) return false;
  I64Convert arr = I64Convert::ensure(src);
  if (!arr) {
    PyErr_Clear();
    return false;
  }
  value = I64Array::of(arr);
  return true;
}

namespace {

constexpr i32 kRoot = 0;             // node id of the trie root; also the sentinel of the recency list
constexpr i64 kSourceRetrieval = 1;  // values.SOURCE_RETRIEVAL
constexpr i64 kSourceLogits = 2;     // values.SOURCE_LOGITS

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

inline u64 mix64(u64 h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

inline u64 key_hash(i32 parent, i32 token) { return mix64((u64(u32(parent)) << 32) | u64(u32(token))); }

// ------------------------------------------------------------------------------------------------ child index

// (parent, token) -> child id. Linear probing over slots holding node ids only: a slot's key is read from the
// owner's arrays through `keys` (keys.parent(x), keys.token(x)), so an entry must be erased while its node still
// carries its key. Backward-shift deletion, no tombstones; load factor <= 1/2.
class ChildIndex {
 public:
  void clear() {
    std::fill(slots_.begin(), slots_.end(), -1);
    count_ = 0;
  }

  template <class Keys>
  i32 find(i32 parent, i32 token, const Keys& keys) const {
    if (slots_.empty()) return -1;
    for (u64 i = key_hash(parent, token) & mask_;; i = (i + 1) & mask_) {
      const i32 x = slots_[i];
      if (x < 0) return -1;
      if (keys.parent(x) == parent && keys.token(x) == token) return x;
    }
  }

  template <class Keys>
  void insert(i32 node, const Keys& keys) {
    if ((count_ + 1) * 2 > slots_.size()) rehash(slots_.empty() ? 16 : slots_.size() * 2, keys);
    place(node, keys);
    ++count_;
  }

  template <class Keys>
  void erase(i32 node, const Keys& keys) {
    u64 i = key_hash(keys.parent(node), keys.token(node)) & mask_;
    while (slots_[i] != node) i = (i + 1) & mask_;
    slots_[i] = -1;
    --count_;
    for (u64 j = (i + 1) & mask_; slots_[j] >= 0; j = (j + 1) & mask_) {
      const i32 y = slots_[j];
      const u64 home = key_hash(keys.parent(y), keys.token(y)) & mask_;
      // y may move into the hole at i unless its home lies cyclically in (i, j]
      const bool stays = (i < j) ? (home > i && home <= j) : (home > i || home <= j);
      if (!stays) {
        slots_[i] = y;
        slots_[j] = -1;
        i = j;
      }
    }
  }

  size_t bytes() const { return slots_.capacity() * sizeof(i32); }

 private:
  template <class Keys>
  void place(i32 node, const Keys& keys) {
    u64 i = key_hash(keys.parent(node), keys.token(node)) & mask_;
    while (slots_[i] >= 0) i = (i + 1) & mask_;
    slots_[i] = node;
  }

  template <class Keys>
  void rehash(size_t n, const Keys& keys) {
    std::vector<i32> old;
    old.swap(slots_);
    slots_.assign(n, -1);
    mask_ = n - 1;
    for (i32 x : old)
      if (x >= 0) place(x, keys);
  }

  std::vector<i32> slots_;
  u64 mask_ = 0;
  size_t count_ = 0;
};

// ------------------------------------------------------------------------------------------------ automaton

struct alignas(64) Node {  // one cache line each: std::vector allocates it 64-byte aligned (C++17 aligned new)
  i64 freq;         // windows that passed through the node
  i32 token;        // token on the edge from the parent
  i32 parent;
  i32 depth;
  i32 fail;         // failure link: node of the longest proper suffix present
  i32 nref;         // nodes whose failure link points here
  i32 pinned;       // open cursors holding the node among their growing windows
  i32 states;       // open cursors whose matching state is the node
  i32 first_child, last_child, prev_sib, next_sib;  // children in insertion order
};

static_assert(sizeof(Node) == 64, "a node is one cache line");

// A node's place on the recency list, kept apart from the node: the list's walks (the relabelling of order labels
// below, the eviction scan) and moves read 16 bytes per node, four nodes per cache line, instead of a node's line
// and its label's (measured on an Intel Xeon: Spec-Bench prompts into the automaton 14% faster, warm or cold).
struct Link {
  u64 ord;   // order label (Automaton::label)
  i32 prv;   // toward the front
  i32 nxt;   // toward the tail
};

static_assert(sizeof(Link) == 16, "four links per cache line");

struct Cursor {
  std::vector<i32> active{kRoot};  // active[j]: node of the text's last j tokens (the growing windows)
  i32 state = kRoot;
};

// Per thread, per token: the generation of the grouping that last saw the token and its group there (a
// grouping of children by token in O(children), shared by every state a thread drafts for).
struct TokenStamps {
  std::vector<u32> stamp, group_of;
  u32 gen = 0;
  u32 next() {
    if (++gen == 0) {  // wrapped: forget every old stamp
      std::fill(stamp.begin(), stamp.end(), 0);
      gen = 1;
    }
    return gen;
  }
};

TokenStamps& token_stamps(i32 vocab) {
  thread_local TokenStamps t;
  if (t.stamp.size() < size_t(vocab)) {
    t.stamp.assign(size_t(vocab), 0);
    t.group_of.assign(size_t(vocab), 0);
    t.gen = 0;
  }
  return t;
}

struct HeapItem {
  i64 score;
  i32 depth, seq, token, parent, off, cnt;  // off/cnt: the pooled trie nodes in the automaton's pool
};

// a pops after b (std heap functions keep the "largest" on top: the best score, then shallowest, then oldest)
inline bool pops_after(const HeapItem& a, const HeapItem& b) {
  if (a.score != b.score) return a.score < b.score;
  if (a.depth != b.depth) return a.depth > b.depth;
  return a.seq > b.seq;
}

class Automaton {
 public:
  Automaton(i32 vocab, i32 max_nodes, i32 ngram, i32 min_border_depth)
      : vocab_(vocab), max_nodes_(max_nodes), ngram_(ngram), min_depth_(std::max(2, min_border_depth)) {
    nodes_.push_back(blank_node());
    links_.push_back(Link{0, kRoot, kRoot});  // the root's label: the front; the list is empty
    nodes_[kRoot].states = 1;  // the automaton's own cursor (automaton.py), always at the trie root
  }

  i64 num_nodes() const { return i64(nodes_.size()) - 1; }
  i64 num_evicted() const { return num_evicted_; }
  i64 num_scanned() const { return num_scanned_; }
  i64 num_relabelled() const { return num_relabelled_; }
  // kFrontStride unless a test sets another (>= 1; 1 packs the front so that relabelling runs often)
  void set_front_stride(u64 stride) { front_stride_ = stride; }
  size_t bytes() const {
    return nodes_.capacity() * sizeof(Node) + links_.capacity() * sizeof(Link) + index_.bytes();
  }

  void open(Cursor& c) { nodes_[c.state].states += 1; }

  void close(Cursor& c) {  // close_cursor
    start_text(c);
    nodes_[c.state].states -= 1;
    released(c.state);
    c.state = kRoot;
  }

  void start_text(Cursor& c) {
    for (size_t j = 1; j < c.active.size(); ++j) unpin(c.active[j]);
    c.active.assign(1, kRoot);
  }

  void reset_state(Cursor& c) { set_state(c, kRoot); }

  void extend(Cursor& c, const i64* tokens, i64 n) {
    for (i64 i = 0; i < n; ++i) extend_one(c, i32(tokens[i]));
  }

  // Moves the cursor's state by one token; the borders (deepest first) go to `borders` when given.
  void advance(Cursor& c, i32 t, std::vector<i32>* borders);

  // Best-first pooled continuations below `borders`, at most `budget` (> 0) of them.
  void candidates(const std::vector<i32>& borders, i64 budget, std::vector<i32>& out_tokens,
                  std::vector<i32>& out_parents);

  struct Keys {
    const Node* n;
    i32 parent(i32 x) const { return n[x].parent; }
    i32 token(i32 x) const { return n[x].token; }
  };

 private:
  static Node blank_node() {
    Node n{};
    n.token = -1;
    n.parent = -1;
    n.first_child = n.last_child = n.prev_sib = n.next_sib = -1;
    return n;
  }
  Keys keys() const { return Keys{nodes_.data()}; }
  i32 child(i32 parent, i32 token) const { return index_.find(parent, token, keys()); }

  void set_state(Cursor& c, i32 v) {
    const i32 old = c.state;
    nodes_[old].states -= 1;
    nodes_[v].states += 1;
    c.state = v;
    released(old);
  }

  void unlink_recency(i32 x) {
    const Link& lx = links_[x];
    links_[lx.prv].nxt = lx.nxt;
    links_[lx.nxt].prv = lx.prv;
  }

  void link_behind(i32 x, i32 a) {  // put x just behind a on the recency list
    const i32 n = links_[a].nxt;
    links_[x].prv = a;
    links_[x].nxt = n;
    links_[a].nxt = x;
    links_[n].prv = x;
    label(x);
  }

  // Order labels (an order-maintenance list): behind(x, y) <=> x lies nearer the tail than y, in O(1), so a
  // node that turns evictable is placed against the resume node without walking the list. A new label is the
  // midpoint of its neighbours'; where they are adjacent, the smallest window of nodes around it whose label
  // span gives every node a gap of at least 64 x (window size) is relabelled evenly (amortised O(log n) per
  // insertion, as in Bender et al., "Two simplified algorithms for maintaining order in a list", ESA 2002).
  //
  // Nearly every insertion is at the list's front: a node touched or made goes just behind its parent, which the
  // same token touched just before, so each token's chain of windows enters right behind the root. Midpoints
  // alone would halve the root's gap at every token and pack the front's labels, and each relabelling there
  // had to walk hundreds of nodes toward the tail to find room (measured: a relabelling per ~17 prompt tokens,
  // ~660 nodes each, a third of the automaton's time). So a node placed right behind the root takes the label
  // kFrontStride below its successor's, as a timestamp counting down: the chain entering behind it halves a gap
  // of 2^28, room for 28 levels against ngram's <= ~10 per token. Labels stay ordered and distinct either way,
  // so behind() and the eviction order are unchanged; after ~2^34 front insertions the labels reach the root's 0
  // and midpoints (with relabelling) take over again.
  static constexpr u64 kOrdEnd = u64(1) << 62;  // the label past the tail
  static constexpr u64 kFrontStride = u64(1) << 28;
  u64 ord_after(i32 x) const { return links_[x].nxt == kRoot ? kOrdEnd : links_[links_[x].nxt].ord; }
  bool behind(i32 x, i32 y) const { return links_[x].ord > links_[y].ord; }

  void label(i32 x) {
    const u64 lo = links_[links_[x].prv].ord, hi = ord_after(x);
    if (links_[x].prv == kRoot && hi > front_stride_) {
      links_[x].ord = hi - front_stride_;
      return;
    }
    if (hi - lo >= 2) {
      links_[x].ord = lo + (hi - lo) / 2;
      return;
    }
    relabel_around(x);
  }

  void relabel_around(i32 x) {
    i32 first = x, last = x;  // the window [first .. last] along the list, x inside
    u64 count = 1;
    for (;;) {
      for (u64 g = count; g > 0; --g) {  // grow the window by about its size on each side
        if (links_[first].prv != kRoot) {
          first = links_[first].prv;
          ++count;
        }
        if (links_[last].nxt != kRoot) {
          last = links_[last].nxt;
          ++count;
        }
      }
      const u64 lo = links_[links_[first].prv].ord, hi = ord_after(last);
      const u64 gap = (hi - lo) / (count + 1);
      if (gap >= 64 * count || (links_[first].prv == kRoot && links_[last].nxt == kRoot)) {
        u64 v = lo;
        for (i32 y = first;; y = links_[y].nxt) {
          v += gap;
          links_[y].ord = v;
          if (y == last) break;
        }
        num_relabelled_ += i64(count);
        return;
      }
    }
  }

  bool evictable(i32 x) const {
    const Node& n = nodes_[x];
    return n.first_child < 0 && n.nref == 0 && n.pinned == 0 && n.states == 0;
  }

  void unpin(i32 x) {
    nodes_[x].pinned -= 1;
    released(x);
  }

  // A pin or a state of x was dropped: if x became evictable behind the resume node, the next scan starts at x
  // (every node behind x lies behind the resume node, so none of them is evictable). A resume node at the root:
  // the whole list lies behind it.
  void released(i32 x) {
    if (resume_ < 0 || x == resume_ || !evictable(x)) return;
    if (resume_ == kRoot || behind(x, resume_)) resume_ = x;
  }

  void touch(i32 x, i32 a) {  // move x just behind its parent a (a move toward the front)
    if (links_[x].prv != a) {
      // the resume node moving toward the front: the scan starts at its front-side neighbour instead (the
      // nodes behind that one are those that were behind the resume node; x, ahead now, is scanned later)
      if (x == resume_) resume_ = links_[x].prv;
      unlink_recency(x);
      link_behind(x, a);
    }
  }

  void append_child(i32 a, i32 x) {
    Node& na = nodes_[a];
    Node& nx = nodes_[x];
    nx.prev_sib = na.last_child;
    nx.next_sib = -1;
    if (na.last_child >= 0)
      nodes_[na.last_child].next_sib = x;
    else
      na.first_child = x;
    na.last_child = x;
  }

  void remove_child(i32 x) {
    Node& nx = nodes_[x];
    Node& na = nodes_[nx.parent];
    if (nx.prev_sib >= 0)
      nodes_[nx.prev_sib].next_sib = nx.next_sib;
    else
      na.first_child = nx.next_sib;
    if (nx.next_sib >= 0)
      nodes_[nx.next_sib].prev_sib = nx.prev_sib;
    else
      na.last_child = nx.prev_sib;
  }

  i32 grow() {
    if (nodes_.size() == nodes_.capacity())
      nodes_.reserve(std::min<size_t>(size_t(max_nodes_) + 1, std::max<size_t>(64, nodes_.size() * 2)));
    if (links_.size() == links_.capacity()) links_.reserve(nodes_.capacity());
    nodes_.push_back(blank_node());
    links_.push_back(Link{0, kRoot, kRoot});
    return i32(nodes_.size() - 1);
  }

  i32 evict_lru_leaf();
  void extend_one(Cursor& c, i32 t);
  void new_node(i32 x, i32 t, i32 a, i32 depth, i32 shorter);
  void push_groups(i32 off, i32 cnt, i32 depth, i32 parent_idx);
  void push_children_of_one(i32 m, i32 depth, i32 parent_idx);

  i32 vocab_, max_nodes_, ngram_, min_depth_;
  std::vector<Node> nodes_;
  std::vector<Link> links_;  // the recency list; order labels grow from the front (the root: 0) to the tail
  ChildIndex index_;
  i64 num_evicted_ = 0;
  i64 num_scanned_ = 0;  // nodes the eviction scans visited
  i64 num_relabelled_ = 0;  // order labels rewritten by relabel_around
  i32 resume_ = -1;  // where the next eviction scan may start (-1: at the tail); see evict_lru_leaf
  u64 front_stride_ = kFrontStride;
  // scratch
  std::vector<i32> fresh_, chain_;
  std::vector<HeapItem> heap_;
  std::vector<i32> pool_;
  struct Group {
    i32 token, count, off, fill;
  };
  std::vector<Group> groups_;
  i32 seq_ = 0;
};

// The scan resumes where the previous one stopped (``resume_``, kept across tokens, rows and calls): every node
// behind the resume node is unevictable. A node turns evictable only when (a) an eviction frees the victim's
// parent or failure target, which sit ahead of the victim (the recency invariants), so at or ahead of the new
// resume node; or (b) a pin or a state is dropped (``unpin``, ``set_state``, ``close``), where ``released``
// moves the resume node back to the node if it lies behind (order labels tell in O(1)). A node moved or created
// behind the resume node is pinned or given a state before the next scan, and the resume node itself moving
// toward the front hands the hint to its front-side neighbour. The victim is therefore the one a scan from the
// tail would find (as automaton.py's).
i32 Automaton::evict_lru_leaf() {
  i32 x = resume_ >= 0 ? resume_ : links_[kRoot].prv;
  while (x != kRoot) {
    const Node& n = nodes_[x];
    ++num_scanned_;
    if (n.first_child < 0 && n.nref == 0 && n.pinned == 0 && n.states == 0) break;
    x = links_[x].prv;
  }
  if (x == kRoot) return -1;
  resume_ = links_[x].prv;
  unlink_recency(x);
  index_.erase(x, keys());
  remove_child(x);
  nodes_[nodes_[x].fail].nref -= 1;
  ++num_evicted_;
  return x;
}

void Automaton::new_node(i32 x, i32 t, i32 a, i32 depth, i32 shorter) {
  Node& n = nodes_[x];
  n.token = t;
  n.parent = a;
  n.depth = depth;
  n.fail = shorter;
  n.freq = 1;
  n.first_child = n.last_child = -1;
  nodes_[shorter].nref += 1;
  append_child(a, x);
  index_.insert(x, keys());
  link_behind(x, a);
}

void Automaton::extend_one(Cursor& c, i32 t) {
  const std::vector<i32>& old = c.active;
  fresh_.assign(1, kRoot);
  i32 shorter = kRoot;  // node of the window one token shorter: the failure target of a new node
  const size_t len = old.size();
  for (size_t k = 1; k <= len; ++k) {  // k: length of the window after adding t
    const i32 a = old[k - 1];
    i32 x = child(a, t);
    if (x < 0) {
      x = (nodes_.size() <= size_t(max_nodes_)) ? grow() : evict_lru_leaf();
      if (x < 0) break;  // every leaf is in use: drop this window and the longer ones
      new_node(x, t, a, i32(k), shorter);
    } else {
      nodes_[x].freq += 1;
      touch(x, a);
    }
    nodes_[x].pinned += 1;
    fresh_.push_back(x);
    shorter = x;
  }
  for (size_t j = 1; j < len; ++j) unpin(old[j]);
  if (fresh_.size() > size_t(ngram_)) {  // the window of length ngram is complete
    unpin(fresh_.back());
    fresh_.pop_back();
  }
  c.active.swap(fresh_);
}

void Automaton::advance(Cursor& c, i32 t, std::vector<i32>* borders) {
  i32 v = kRoot;
  bool found = false;
  for (i32 s = c.state; s != kRoot; s = nodes_[s].fail) {
    const i32 x = child(s, t);
    if (x >= 0) {
      v = x;
      found = true;
      break;
    }
  }
  if (!found) {
    const i32 x = child(kRoot, t);
    if (x >= 0) v = x;
  }
  chain_.clear();  // the matches, deepest first
  for (i32 x = v; x != kRoot; x = nodes_[x].fail) chain_.push_back(x);
  for (auto it = chain_.rbegin(); it != chain_.rend(); ++it) touch(*it, nodes_[*it].parent);
  set_state(c, v);
  if (borders != nullptr) {
    borders->clear();
    for (i32 x : chain_)
      if (nodes_[x].depth >= min_depth_) borders->push_back(x);
  }
}

// One heap item per token among the children of the nodes pool_[off, off + cnt), in order of first appearance
// (the dict `groups` of automaton.candidates); each item's nodes are laid out contiguously at the pool's end.
void Automaton::push_groups(i32 off, i32 cnt, i32 depth, i32 parent_idx) {
  TokenStamps& st = token_stamps(vocab_);
  const u32 gen = st.next();
  groups_.clear();
  for (i32 i = 0; i < cnt; ++i)
    for (i32 x = nodes_[pool_[size_t(off + i)]].first_child; x >= 0; x = nodes_[x].next_sib) {
      const i32 tok = nodes_[x].token;
      if (st.stamp[size_t(tok)] != gen) {
        st.stamp[size_t(tok)] = gen;
        st.group_of[size_t(tok)] = u32(groups_.size());
        groups_.push_back(Group{tok, 0, 0, 0});
      }
      groups_[st.group_of[size_t(tok)]].count += 1;
    }
  i32 end = i32(pool_.size());
  for (Group& g : groups_) {
    g.off = end;
    end += g.count;
  }
  pool_.resize(size_t(end));
  for (i32 i = 0; i < cnt; ++i)
    for (i32 x = nodes_[pool_[size_t(off + i)]].first_child; x >= 0; x = nodes_[x].next_sib) {
      Group& g = groups_[st.group_of[size_t(nodes_[x].token)]];
      pool_[size_t(g.off + g.fill++)] = x;
    }
  for (const Group& g : groups_) {
    i64 score = 0;
    for (i32 i = 0; i < g.count; ++i) score += nodes_[pool_[size_t(g.off + i)]].freq;
    heap_.push_back(HeapItem{score, depth, seq_++, g.token, parent_idx, g.off, g.count});
    std::push_heap(heap_.begin(), heap_.end(), pops_after);
  }
}

// The children of one node have distinct tokens: one item each (the single-node branch of candidates).
void Automaton::push_children_of_one(i32 m, i32 depth, i32 parent_idx) {
  for (i32 x = nodes_[m].first_child; x >= 0; x = nodes_[x].next_sib) {
    pool_.push_back(x);
    heap_.push_back(HeapItem{nodes_[x].freq, depth, seq_++, nodes_[x].token, parent_idx, i32(pool_.size() - 1), 1});
    std::push_heap(heap_.begin(), heap_.end(), pops_after);
  }
}

void Automaton::candidates(const std::vector<i32>& borders, i64 budget, std::vector<i32>& out_tokens,
                           std::vector<i32>& out_parents) {
  out_tokens.clear();
  out_parents.clear();
  if (budget <= 0 || borders.empty()) return;
  heap_.clear();
  pool_.assign(borders.begin(), borders.end());
  seq_ = 0;
  push_groups(0, i32(borders.size()), 1, -1);
  while (!heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end(), pops_after);
    const HeapItem it = heap_.back();
    heap_.pop_back();
    const i32 idx = i32(out_tokens.size());
    out_tokens.push_back(it.token);
    out_parents.push_back(it.parent);
    if (idx + 1 >= budget) break;
    if (it.cnt == 1)
      push_children_of_one(pool_[size_t(it.off)], it.depth + 1, idx);
    else
      push_groups(it.off, it.cnt, it.depth + 1, idx);
  }
}

// ------------------------------------------------------------------------------------------------ stores

// [vocab, k] table of the target's last top-k predictions after each token (-1: unknown).
struct Store {
  Store(i32 vocab, i32 k) : k(k), table(size_t(vocab) * size_t(k), -1) {}
  const i32* row(i32 tok) const { return &table[size_t(tok) * size_t(k)]; }
  void write(i32 tok, const i64* src) {
    i32* dst = &table[size_t(tok) * size_t(k)];
    for (i32 j = 0; j < k; ++j) dst[j] = src[j] < 0 ? -1 : i32(src[j]);
  }
  i32 k;
  std::vector<i32> table;
};

// A row's own layer over the shared store: the rows of the tokens this row wrote, found through a small
// open-addressing table keyed by token (equal to a full [vocab, k] table whose unwritten rows are -1, since only
// rows with a known first entry are ever written; a few KB per row instead of vocab * k entries).
struct OwnLayer {
  explicit OwnLayer(i32 k) : k(k) {}
  i32 find(i32 tok) const {  // index of the token's row, -1 none
    if (slots.empty()) return -1;
    for (u64 i = mix64(u64(u32(tok))) & mask;; i = (i + 1) & mask) {
      const std::pair<i32, i32>& e = slots[i];
      if (e.first == tok) return e.second;
      if (e.first < 0) return -1;
    }
  }
  const i32* row(i32 tok) const {
    const i32 r = find(tok);
    return r < 0 ? nullptr : &rows[size_t(r) * size_t(k)];
  }
  void write(i32 tok, const i64* src) {
    i32 r = find(tok);
    if (r < 0) {
      if ((count + 1) * 2 > slots.size()) rehash(slots.empty() ? 64 : slots.size() * 2);
      r = i32(count++);
      place(tok, r);
      rows.resize(rows.size() + size_t(k));
    }
    i32* dst = &rows[size_t(r) * size_t(k)];
    for (i32 j = 0; j < k; ++j) dst[j] = src[j] < 0 ? -1 : i32(src[j]);
  }
  size_t bytes() const { return slots.capacity() * sizeof(slots[0]) + rows.capacity() * sizeof(i32); }

  i32 k;
  size_t count = 0;
  u64 mask = 0;
  std::vector<std::pair<i32, i32>> slots;  // (token or -1, index of its row in `rows`)
  std::vector<i32> rows;                   // [count, k]

 private:
  void place(i32 tok, i32 idx) {
    u64 i = mix64(u64(u32(tok))) & mask;
    while (slots[i].first >= 0) i = (i + 1) & mask;
    slots[i] = {tok, idx};
  }
  void rehash(size_t n) {
    std::vector<std::pair<i32, i32>> old;
    old.swap(slots);
    slots.assign(n, {-1, -1});
    mask = n - 1;
    for (const auto& e : old)
      if (e.first >= 0) place(e.first, e.second);
  }
};

// CopyLogitStore.update over rows [0, n) of tokens / topk [n, kp] (rows whose first entry is < 0 skipped).
template <class Target>
void store_update(Target& target, const i64* tokens, const i64* topk, i64 n, i64 kp) {
  for (i64 i = 0; i < n; ++i) {
    const i64* src = topk + i * kp;
    if (src[0] >= 0) target.write(i32(tokens[i]), src);
  }
}

// ------------------------------------------------------------------------------------------------ builder

// TrieBuilder: one draft tree in creation order, (parent, token) duplicates merged (sources OR-ed).
struct Builder {
  std::vector<i32> token, parent, depth;
  std::vector<i64> source;
  i64 capacity = 1;
  ChildIndex index;

  struct Keys {
    const i32* p;
    const i32* t;
    i32 parent(i32 x) const { return p[x]; }
    i32 token(i32 x) const { return t[x]; }
  };
  Keys keys() const { return Keys{parent.data(), token.data()}; }

  void reset(i32 root, i64 cap) {
    token.assign(1, root);
    parent.assign(1, -1);
    depth.assign(1, 0);
    source.assign(1, 0);
    capacity = std::max<i64>(1, cap);
    index.clear();
  }
  i64 size() const { return i64(token.size()); }
  bool full() const { return size() >= capacity; }

  i32 add(i32 p, i32 t, i64 src) {
    const i32 found = index.find(p, t, keys());
    if (found >= 0) {
      source[size_t(found)] |= src;
      return found;
    }
    if (full()) return -1;
    const i32 node = i32(token.size());
    token.push_back(t);
    parent.push_back(p);
    depth.push_back(depth[size_t(p)] + 1);
    source.push_back(src);
    index.insert(node, keys());
    return node;
  }
};

inline i64 child_breadth(i64 parent_breadth, i32 rank, i32 parent_depth) {
  const i64 shift = i64(rank) + (parent_depth != 0 ? 1 : 0);
  return shift >= 62 ? 1 : std::max<i64>(1, parent_breadth >> shift);
}

// grow_logits_tree: breadth-first from the root until the builder is full.
void grow_logits(Builder& b, const Store& store, const OwnLayer* own, i64 max_breadth, i64 max_depth,
                 std::vector<std::pair<i32, i64>>& queue) {
  queue.clear();
  queue.emplace_back(0, max_breadth);
  for (size_t head = 0; head < queue.size(); ++head) {
    const i32 node = queue[head].first;
    const i64 breadth = queue[head].second;
    const i32 depth = b.depth[size_t(node)];
    if (depth >= max_depth) continue;
    const i32 tok = b.token[size_t(node)];
    const i32* row = own != nullptr ? own->row(tok) : nullptr;
    if (row == nullptr) row = store.row(tok);
    const i64 lim = std::min<i64>(breadth, store.k);
    for (i32 rank = 0; rank < lim; ++rank) {
      const i32 t = row[rank];
      if (t < 0) break;
      const i32 c = b.add(node, t, kSourceLogits);
      if (c < 0) return;
      queue.emplace_back(c, child_breadth(breadth, rank, depth));
    }
  }
}

// ------------------------------------------------------------------------------------------------ state

struct Row {
  Cursor cursor;
  std::unique_ptr<OwnLayer> own;
  bool started = false;
};

struct Params {
  i64 vocab, k, max_nodes, ngram, min_border_depth, max_breadth;
  bool use_retrieval, use_logits, own_layers;
};

void check_params(const Params& p) {
  if (p.vocab < 1 || p.vocab > (i64(1) << 30)) bad("vocab_size must be in [1, 2**30], got " + std::to_string(p.vocab));
  if (p.k < 1 || p.k > 4096) bad("k must be in [1, 4096], got " + std::to_string(p.k));
  if (p.max_breadth < 1) bad("max_breadth must be >= 1, got " + std::to_string(p.max_breadth));
  if (!p.use_retrieval) return;
  if (p.max_nodes < 1 || p.max_nodes > (i64(1) << 30))
    bad("max_nodes must be in [1, 2**30], got " + std::to_string(p.max_nodes));
  if (p.ngram < 2 || p.ngram > 4096) bad("ngram must be in [2, 4096], got " + std::to_string(p.ngram));
  if (p.min_border_depth < 1 || p.min_border_depth > p.ngram)
    bad("min_border_depth must be in [1, ngram=" + std::to_string(p.ngram) + "], got " +
        std::to_string(p.min_border_depth));
}

class DraftCore {
 public:
  explicit DraftCore(const Params& p) : p_(p) {
    check_params(p);
    if (p.use_retrieval)
      automaton_ = std::make_unique<Automaton>(i32(p.vocab), i32(p.max_nodes), i32(p.ngram), i32(p.min_border_depth));
    if (p.use_logits) store_ = std::make_unique<Store>(i32(p.vocab), i32(p.k));
  }

  std::mutex mu;

  const Params& params() const { return p_; }
  bool freed() const { return freed_; }
  Automaton* automaton() { return automaton_.get(); }
  Store* store() { return store_.get(); }

  void check_alive() const {
    if (freed_) bad("native draft state was freed and cannot be reused");
  }

  i64 open_row() {
    check_alive();
    const i64 h = next_row_++;
    Row& r = rows_[h];
    if (automaton_) automaton_->open(r.cursor);
    return h;
  }

  void close_row(i64 h) {
    if (freed_) return;
    auto it = rows_.find(h);
    if (it == rows_.end()) return;
    if (automaton_) automaton_->close(it->second.cursor);
    rows_.erase(it);
  }

  Row& row(i64 h) {
    check_alive();
    auto it = rows_.find(h);
    if (it == rows_.end())
      bad("row " + std::to_string(h) + (h >= 0 && h < next_row_ ? " was closed" : " was never opened"));
    return it->second;
  }

  // TreeDrafter.start (arrays validated by the caller).
  void start(Row& r, const i64* ids, i64 n, const i64* topk, i64 kp) {
    if (store_ && p_.own_layers) r.own = std::make_unique<OwnLayer>(i32(p_.k));
    if (store_ && topk != nullptr && n > 0) {
      store_update(*store_, ids, topk, n, kp);
      if (r.own) store_update(*r.own, ids, topk, n, kp);
    }
    if (automaton_) {  // prefill_automaton
      automaton_->start_text(r.cursor);
      automaton_->extend(r.cursor, ids, n);
      automaton_->reset_state(r.cursor);
      for (i64 i = std::max<i64>(0, n - p_.ngram); i < n; ++i) automaton_->advance(r.cursor, i32(ids[i]), nullptr);
    }
    r.started = true;
  }

  void free_all() {
    rows_.clear();
    automaton_.reset();
    store_.reset();
    freed_ = true;
  }

  i64 num_nodes() const { return automaton_ ? automaton_->num_nodes() : 0; }
  i64 num_evicted() const { return automaton_ ? automaton_->num_evicted() : 0; }
  i64 num_scanned() const { return automaton_ ? automaton_->num_scanned() : 0; }
  i64 num_relabelled() const { return automaton_ ? automaton_->num_relabelled() : 0; }
  void set_front_stride(i64 stride) {
    check_alive();
    if (stride < 1) bad("front_stride must be >= 1, got " + std::to_string(stride));
    if (automaton_) automaton_->set_front_stride(u64(stride));
  }
  i64 num_rows() const { return i64(rows_.size()); }
  i64 memory_bytes() const {
    size_t n = automaton_ ? automaton_->bytes() : 0;
    if (store_) n += store_->table.capacity() * sizeof(i32);
    for (const auto& kv : rows_)
      if (kv.second.own) n += kv.second.own->bytes();
    return i64(n);
  }

 private:
  Params p_;
  bool freed_ = false;
  std::unique_ptr<Automaton> automaton_;
  std::unique_ptr<Store> store_;
  std::unordered_map<i64, Row> rows_;
  i64 next_row_ = 0;
};

// Locks the distinct states of a batch in address order (two batch calls never deadlock).
class MultiLock {
 public:
  explicit MultiLock(const std::vector<DraftCore*>& states) {
    bool one = !states.empty();
    for (const DraftCore* s : states) one = one && s == states[0];
    if (one) {  // the rows of one job share its state (the common case): one lock, nothing allocated
      one_ = &states[0]->mu;
      one_->lock();
      return;
    }
    std::vector<DraftCore*> order(states);
    std::sort(order.begin(), order.end());
    order.erase(std::unique(order.begin(), order.end()), order.end());
    locks_.reserve(order.size());
    for (DraftCore* s : order) locks_.emplace_back(s->mu);
  }
  ~MultiLock() {
    if (one_ != nullptr) one_->unlock();
  }
  MultiLock(const MultiLock&) = delete;
  MultiLock& operator=(const MultiLock&) = delete;

 private:
  std::mutex* one_ = nullptr;
  std::vector<std::unique_lock<std::mutex>> locks_;
};

// ------------------------------------------------------------------------------------------------ validation

std::vector<DraftCore*> cores_of(const py::sequence& states) {
  const size_t n = size_t(py::len(states));
  std::vector<DraftCore*> out;
  out.reserve(n);
  PyObject* last = nullptr;  // rows of one job repeat their state: cast each distinct run once
  for (size_t i = 0; i < n; ++i) {
    py::object s = states[i];
    if (s.ptr() != last) {
      if (!py::isinstance<DraftCore>(s)) bad("states[" + std::to_string(i) + "] is not a native draft state");
      out.push_back(s.cast<DraftCore*>());
      last = s.ptr();
    } else {
      out.push_back(out.back());
    }
  }
  return out;
}

void check_1d(const I64Array& a, i64 n, const char* name) {
  if (a.ndim() != 1 || (n >= 0 && a.shape(0) != n))
    bad(std::string(name) + " must be a 1-D array" + (n >= 0 ? " of length " + std::to_string(n) : std::string()) +
        ", got shape " + (a.ndim() == 1 ? "(" + std::to_string(a.shape(0)) + ",)" : std::to_string(a.ndim()) + "-D"));
}

// t[0, n) must be token ids; `base`: the index of t[0] in the named array (for the message).
void check_tokens(const i64* t, i64 n, i64 vocab, const char* name, i64 base = 0) {
  for (i64 i = 0; i < n; ++i)
    if (t[i] < 0 || t[i] >= vocab)
      bad(std::string(name) + "[" + std::to_string(base + i) + "] = " + std::to_string(t[i]) +
          " is not a token id in [0, " + std::to_string(vocab) + ")");
}

// rows [lo, hi) of topk [*, kp] whose first entry is >= 0: their first k entries must be < vocab.
void check_topk(const i64* topk, i64 lo, i64 hi, i64 kp, i64 k, i64 vocab, const char* name) {
  if (kp < k) bad(std::string(name) + " has " + std::to_string(kp) + " columns, the store needs k=" + std::to_string(k));
  for (i64 i = lo; i < hi; ++i) {
    const i64* r = topk + i * kp;
    if (r[0] < 0) continue;
    for (i64 j = 0; j < k; ++j)
      if (r[j] >= vocab)
        bad(std::string(name) + "[" + std::to_string(i) + ", " + std::to_string(j) + "] = " + std::to_string(r[j]) +
            " is not a token id below vocab_size=" + std::to_string(vocab));
  }
}

void check_cu(const i64* cu, i64 b, i64 total, const char* name, bool nonempty) {
  if (cu[0] != 0 || cu[b] != total)
    bad(std::string(name) + " must start at 0 and end at " + std::to_string(total) + ", got " + std::to_string(cu[0]) +
        " .. " + std::to_string(cu[b]));
  for (i64 i = 0; i < b; ++i)
    if (cu[i + 1] < cu[i] + (nonempty ? 1 : 0))
      bad(std::string(name) + " must be " + (nonempty ? "strictly increasing" : "non-decreasing") + ", broken at " +
          std::to_string(i));
}

// cu [B + 1] over R rows, each stream non-empty, local parents: -1 at the stream's first row, else in [0, j)
// (``forest``: -1 allowed at any row, a node that sees only itself, as a padded tree's padding rows).
void check_trees(const I64Array& cu, const I64Array& parents, i64 b, bool forest = false) {
  check_1d(cu, b + 1, "cu");
  const i64 r = parents.ndim() == 1 ? parents.shape(0) : -1;
  check_1d(parents, r, "parents");
  check_cu(cu.data(), b, r, "cu", true);
  const i64* c = cu.data();
  const i64* p = parents.data();
  for (i64 s = 0; s < b; ++s)
    for (i64 j = 0; j < c[s + 1] - c[s]; ++j) {
      const i64 v = p[c[s] + j];
      if (j == 0 ? v != -1 : ((v < 0 && !(forest && v == -1)) || v >= j))
        bad("parents[" + std::to_string(c[s] + j) + "] = " + std::to_string(v) + ": node " + std::to_string(j) +
            " of stream " + std::to_string(s) + " needs " + (j == 0 ? "-1 (a root)" : "a local parent in [0, node)"));
    }
}

// ------------------------------------------------------------------------------------------------ propose

struct Scratch {
  Builder builder;
  std::vector<i32> borders, cand_tokens, cand_parents, where, by_depth;
  std::vector<i64> new_of_old;
  std::vector<std::pair<i32, i64>> queue;
};

struct FlatOut {
  std::vector<i64> cu, tokens, parents, depths, sources, order;
};

// TreeDrafter.propose of one stream into s.builder.
void propose_one(DraftCore& st, Row& row, i32 root, i64 cap, i64 max_depth, Scratch& s) {
  Builder& b = s.builder;
  b.reset(root, cap);
  Automaton* a = st.automaton();
  if (a != nullptr) {
    a->advance(row.cursor, root, &s.borders);
    if (!s.borders.empty() && cap > 1 && max_depth > 0) {
      a->candidates(s.borders, cap - 1, s.cand_tokens, s.cand_parents);
      const size_t n = s.cand_tokens.size();
      s.where.assign(n, -1);  // candidate index -> builder node (-1: dropped)
      for (size_t i = 0; i < n; ++i) {
        const i32 par = s.cand_parents[i];
        const i32 pnode = par < 0 ? 0 : s.where[size_t(par)];
        if (pnode < 0 || b.depth[size_t(pnode)] >= max_depth) continue;
        s.where[i] = b.add(pnode, s.cand_tokens[i], kSourceRetrieval);
      }
    }
  }
  if (st.store() != nullptr && !b.full())
    grow_logits(b, *st.store(), row.own.get(), st.params().max_breadth, max_depth, s.queue);
}

// flatten_tree's breadth-first order (a stable sort of creation order by depth), appended to `out`.
void flatten_into(const Builder& b, Scratch& s, FlatOut& out) {
  const size_t n = b.token.size();
  i32 max_d = 0;
  for (i32 d : b.depth) max_d = std::max(max_d, d);
  s.by_depth.assign(size_t(max_d) + 2, 0);
  for (i32 d : b.depth) s.by_depth[size_t(d) + 1] += 1;
  for (size_t d = 1; d < s.by_depth.size(); ++d) s.by_depth[d] += s.by_depth[d - 1];
  s.new_of_old.resize(n);
  const size_t base = out.tokens.size();
  out.tokens.resize(base + n);
  out.parents.resize(base + n);
  out.depths.resize(base + n);
  out.sources.resize(base + n);
  out.order.resize(base + n);
  for (size_t old = 0; old < n; ++old) {
    const i64 pos = s.by_depth[size_t(b.depth[old])]++;
    s.new_of_old[old] = pos;
    out.order[base + size_t(pos)] = i64(old);
  }
  for (size_t j = 0; j < n; ++j) {
    const size_t old = size_t(out.order[base + j]);
    out.tokens[base + j] = b.token[old];
    out.depths[base + j] = b.depth[old];
    out.sources[base + j] = b.source[old];
    out.parents[base + j] = b.parent[old] < 0 ? -1 : s.new_of_old[size_t(b.parent[old])];
  }
  out.cu.push_back(i64(out.tokens.size()));
}

struct Streams {
  const std::vector<DraftCore*>& states;
  std::vector<Row*>& rows;  // the calling thread's buffer, refilled by its next resolve
};

// Resolves every stream's (state, row) under the locks; the rows must be open and started. The rows go into a
// per-thread buffer (no allocation per step; no call resolves twice while it uses the result).
Streams resolve(const std::vector<DraftCore*>& states, const i64* rows) {
  thread_local std::vector<Row*> buf;
  buf.clear();
  Streams s{states, buf};
  for (size_t i = 0; i < states.size(); ++i) {
    try {
      Row& r = states[i]->row(rows[i]);
      if (!r.started) bad("row " + std::to_string(rows[i]) + " was not started (call start first)");
      s.rows.push_back(&r);
    } catch (const std::invalid_argument& e) {
      bad("stream " + std::to_string(i) + ": " + e.what());
    }
  }
  return s;
}

void check_stream(i64 root, i64 cap, i64 max_depth, const DraftCore& st, i64 i) {
  if (root >= 0 && root < st.params().vocab && cap >= 1 && max_depth >= 0) return;
  const std::string tag = "stream " + std::to_string(i) + ": ";
  if (root < 0 || root >= st.params().vocab)
    bad(tag + "root " + std::to_string(root) + " is not a token id in [0, " + std::to_string(st.params().vocab) + ")");
  if (cap < 1) bad(tag + "capacity must be >= 1, got " + std::to_string(cap));
  bad(tag + "max_depth must be >= 0, got " + std::to_string(max_depth));
}

py::array_t<i64> to_array(const std::vector<i64>& v) {
  py::array_t<i64> a(py::ssize_t(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(i64));
  return a;
}

// Every stream's draft tree, flattened into `out` (emptied first; propose_batch and StepContext::propose, their
// arguments checked); returns the tuple (cu, tokens, parents, depths, sources, order) of int64 arrays.
// `lean`: sources and order are None (a quiet context's caller reads them only through its commit).
py::tuple propose_impl(const std::vector<DraftCore*>& states, const i64* rows, const i64* roots, const i64* caps,
                       const i64* depths, FlatOut& out, bool lean = false) {
  const i64 b = i64(states.size());
  for (auto* v : {&out.tokens, &out.parents, &out.depths, &out.sources, &out.order}) v->clear();
  {
    py::gil_scoped_release nogil;
    MultiLock lock(states);
    const Streams s = resolve(states, rows);
    for (i64 i = 0; i < b; ++i) check_stream(roots[i], caps[i], depths[i], *states[size_t(i)], i);
    thread_local Scratch scratch;
    out.cu.assign(1, 0);
    for (i64 i = 0; i < b; ++i) {
      propose_one(*states[size_t(i)], *s.rows[size_t(i)], i32(roots[i]), caps[i], depths[i], scratch);
      flatten_into(scratch.builder, scratch, out);
    }
  }
  return py::make_tuple(to_array(out.cu), to_array(out.tokens), to_array(out.parents), to_array(out.depths),
                        lean ? py::object(py::none()) : py::object(to_array(out.sources)),
                        lean ? py::object(py::none()) : py::object(to_array(out.order)));
}

py::tuple propose_batch(const py::sequence& states_in, const I64Array& rows, const I64Array& roots,
                        const I64Array& caps, const I64Array& depths) {
  const std::vector<DraftCore*> states = cores_of(states_in);
  const i64 b = i64(states.size());
  check_1d(rows, b, "rows");
  check_1d(roots, b, "roots");
  check_1d(caps, b, "capacities");
  check_1d(depths, b, "max_depths");
  FlatOut out;
  return propose_impl(states, rows.data(), roots.data(), caps.data(), depths.data(), out);
}

// ------------------------------------------------------------------------------------------------ update

struct UpdateArgs {
  const i64 *cu, *tokens, *topk, *committed, *cu_c;
  i64 kp;
};

void check_update(const Streams& s, const UpdateArgs& u) {
  for (size_t i = 0; i < s.states.size(); ++i) {
    const Params& p = s.states[i]->params();
    check_tokens(u.tokens + u.cu[i], u.cu[i + 1] - u.cu[i], p.vocab, "node_tokens", u.cu[i]);
    check_tokens(u.committed + u.cu_c[i], u.cu_c[i + 1] - u.cu_c[i], p.vocab, "committed", u.cu_c[i]);
    if (p.use_logits && u.cu[i + 1] > u.cu[i])
      check_topk(u.topk, u.cu[i], u.cu[i + 1], u.kp, p.k, p.vocab, "node_topk");
  }
}

void update_one(DraftCore& st, Row& row, const UpdateArgs& u, size_t i) {
  const i64 lo = u.cu[i], n = u.cu[i + 1] - u.cu[i];
  if (st.store() != nullptr && n > 0) {
    store_update(*st.store(), u.tokens + lo, u.topk + lo * u.kp, n, u.kp);
    if (row.own) store_update(*row.own, u.tokens + lo, u.topk + lo * u.kp, n, u.kp);
  }
  Automaton* a = st.automaton();
  const i64 c0 = u.cu_c[i], m = u.cu_c[i + 1] - u.cu_c[i];
  if (a != nullptr && m > 0) {
    a->extend(row.cursor, u.committed + c0, m);
    for (i64 j = 0; j + 1 < m; ++j) a->advance(row.cursor, i32(u.committed[c0 + j]), nullptr);
  }
}

void update_batch(const py::sequence& states_in, const I64Array& rows, const I64Array& cu, const I64Array& tokens,
                  const I64Array& topk, const I64Array& committed, const I64Array& cu_c) {
  const std::vector<DraftCore*> states = cores_of(states_in);
  const i64 b = i64(states.size());
  check_1d(rows, b, "rows");
  check_1d(cu, b + 1, "cu");
  check_1d(tokens, -1, "node_tokens");
  check_1d(committed, -1, "committed");
  check_1d(cu_c, b + 1, "cu_committed");
  if (topk.ndim() != 2 || topk.shape(0) != tokens.shape(0))
    bad("node_topk must be 2-D [R=" + std::to_string(tokens.shape(0)) + ", k'], got " + std::to_string(topk.ndim()) +
        "-D with " + std::to_string(topk.ndim() ? topk.shape(0) : 0) + " rows");
  check_cu(cu.data(), b, tokens.shape(0), "cu", false);
  check_cu(cu_c.data(), b, committed.shape(0), "cu_committed", false);
  const UpdateArgs u{cu.data(), tokens.data(), topk.data(), committed.data(), cu_c.data(), i64(topk.shape(1))};
  py::gil_scoped_release nogil;
  MultiLock lock(states);
  const Streams s = resolve(states, rows.data());
  check_update(s, u);
  for (size_t i = 0; i < states.size(); ++i) update_one(*states[i], *s.rows[i], u, i);
}

// ------------------------------------------------------------------------------------------------ start

void start_row(DraftCore& st, i64 h, const I64Array& ids, const py::object& topk_obj) {
  check_1d(ids, -1, "prompt_ids");
  const i64 n = ids.shape(0);
  I64Array topk;
  const bool has_topk = !topk_obj.is_none();
  if (has_topk) {
    topk = topk_obj.cast<I64Array>();
    if (topk.ndim() != 2 || topk.shape(0) != n)
      bad("prompt_topk must be 2-D [P=" + std::to_string(n) + ", k'], got " + std::to_string(topk.ndim()) + "-D");
  }
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(st.mu);
  Row& r = st.row(h);
  if (r.started) bad("row " + std::to_string(h) + " was already started");
  const Params& p = st.params();
  check_tokens(ids.data(), n, p.vocab, "prompt_ids");
  if (has_topk && p.use_logits && n > 0) check_topk(topk.data(), 0, n, topk.shape(1), p.k, p.vocab, "prompt_topk");
  st.start(r, ids.data(), n, has_topk ? topk.data() : nullptr, has_topk ? i64(topk.shape(1)) : 0);
}

// ------------------------------------------------------------------------------------------------ acceptance

struct AcceptScratch {
  std::vector<i64> depth, deepest, up;
  std::vector<char> leaf;
};

// engine/tree.py's accept_greedy on one stream's tree (rows [lo, lo + n) of the flat arrays, local parents):
// appends the accepted path (local nodes, root first) to `path` and returns its last node. Of several longest
// paths the first leaf in flattened order wins, as in the Python.
i64 accept_one(const i64* par, const i64* tok, const i64* ch, i64 lo, i64 n, AcceptScratch& a, std::vector<i64>& path) {
  a.depth.assign(size_t(n), 0);
  a.deepest.assign(size_t(n), 0);  // deepest node on the path to j whose whole path matches the choices
  a.leaf.assign(size_t(n), 1);
  for (i64 j = 1; j < n; ++j) {
    const i64 p = par[lo + j];
    a.depth[size_t(j)] = a.depth[size_t(p)] + 1;
    a.leaf[size_t(p)] = 0;
    const bool ok = a.deepest[size_t(p)] == p && tok[lo + j] == ch[lo + p];
    a.deepest[size_t(j)] = ok ? j : a.deepest[size_t(p)];
  }
  i64 best = 0, run = -1;
  for (i64 j = 0; j < n; ++j)
    if (a.leaf[size_t(j)] && a.depth[size_t(a.deepest[size_t(j)])] > run) {
      run = a.depth[size_t(a.deepest[size_t(j)])];
      best = a.deepest[size_t(j)];
    }
  a.up.clear();
  for (i64 x = best; x >= 0; x = par[lo + x]) a.up.push_back(x);
  path.insert(path.end(), a.up.rbegin(), a.up.rend());
  return best;
}

py::tuple accept_greedy_batch(const I64Array& cu, const I64Array& parents, const I64Array& tokens,
                              const I64Array& choices) {
  const i64 b = cu.ndim() == 1 ? cu.shape(0) - 1 : -1;
  if (b < 0) bad("cu must be a 1-D array of length B + 1");
  check_trees(cu, parents, b);
  const i64 r = parents.shape(0);
  check_1d(tokens, r, "tokens");
  check_1d(choices, r, "choices");
  std::vector<i64> path, cu_path(size_t(b) + 1, 0), bonus(static_cast<size_t>(b), 0);
  {
    py::gil_scoped_release nogil;
    const i64 *c = cu.data(), *par = parents.data(), *tok = tokens.data(), *ch = choices.data();
    AcceptScratch a;
    for (i64 s = 0; s < b; ++s) {
      const i64 best = accept_one(par, tok, ch, c[s], c[s + 1] - c[s], a, path);
      cu_path[size_t(s) + 1] = i64(path.size());
      bonus[size_t(s)] = ch[c[s] + best];
    }
  }
  return py::make_tuple(to_array(path), to_array(cu_path), to_array(bonus));
}

// ------------------------------------------------------------------------------------------------ commit

// Finish codes of commit_greedy_batch (engine/stops.py's reasons checked by id; the Python maps them back).
constexpr i64 kGoesOn = 0, kEos = 1, kLength = 2, kContext = 3, kUnchecked = -1;

struct CommitArgs {
  const i64 *cu, *par, *tok, *ch, *src, *order, *topk, *limits, *eos;  // limits [B, 3]: left_len, left_room, checked
  i64 kp, n_eos;
  i64 left_len(i64 s) const { return limits[3 * s]; }
  i64 left_room(i64 s) const { return limits[3 * s + 1]; }
  bool checked(i64 s) const { return limits[3 * s + 2] != 0; }
};

struct CommitOut {
  std::vector<i64> path, cu_path, bonus, block, emitted, finish, counts, created, moved;
  void clear() {
    for (auto* v : {&path, &cu_path, &bonus, &block, &emitted, &finish, &counts, &created, &moved}) v->clear();
  }
};

// StopChecker.push over one stream's block (accepted draft tokens, then the bonus) by token id: per token, an
// EOS id -> eos, else max_new_tokens reached -> length, else the context full -> context (stop strings are the
// caller's: such rows are not checked here). Returns how many tokens were taken and sets `finish`.
i64 check_block(const i64* block, i64 n, const CommitArgs& a, i64 s, i64& finish) {
  const i64 *e0 = a.eos + s * a.n_eos, *e1 = e0 + a.n_eos;  // the row's EOS ids (-1: padding)
  for (i64 j = 0; j < n; ++j) {
    if (std::find(e0, e1, block[j]) != e1) finish = kEos;
    else if (j + 1 >= a.left_len(s)) finish = kLength;
    else if (j + 1 >= a.left_room(s)) finish = kContext;
    if (finish != kGoesOn) return j + 1;
  }
  return n;
}

// Accepted draft nodes of one stream by source (columns retrieval alone, logits alone, both, neither; a
// retrieval/logits flag mixed with another drafter's counts in none), over path positions 1 .. accepted.
void count_sources(const CommitArgs& a, i64 lo, const i64* path, i64 accepted, i64* counts) {
  for (i64 k = 1; k <= accepted; ++k) {
    const i64 src = a.src[lo + path[k]], rl = src & (kSourceRetrieval | kSourceLogits);
    if (rl == 0) counts[3] += 1;
    else if (src == rl) counts[rl - 1] += 1;
  }
}

// One stream's acceptance, block, stop checks, source counts, created indices and moved KV rows into `o`.
void commit_one(const CommitArgs& a, i64 s, AcceptScratch& sc, CommitOut& o) {
  const i64 lo = a.cu[s], p0 = i64(o.path.size());
  const i64 best = accept_one(a.par, a.tok, a.ch, lo, a.cu[s + 1] - lo, sc, o.path);
  const i64 plen = i64(o.path.size()) - p0;
  const i64* path = o.path.data() + p0;
  o.cu_path.push_back(i64(o.path.size()));
  o.bonus.push_back(a.ch[lo + best]);
  const i64 b0 = i64(o.block.size());
  for (i64 k = 1; k < plen; ++k) o.block.push_back(a.tok[lo + path[k]]);
  o.block.push_back(a.ch[lo + best]);
  i64 finish = a.checked(s) ? kGoesOn : kUnchecked;
  const i64 emitted = a.checked(s) ? check_block(o.block.data() + b0, plen, a, s, finish) : plen;
  o.emitted.push_back(emitted);
  o.finish.push_back(finish);
  const size_t c0 = o.counts.size();
  o.counts.resize(c0 + 4, 0);
  count_sources(a, lo, path, std::min(plen - 1, emitted), o.counts.data() + c0);
  for (i64 k = 1; k < plen; ++k) o.created.push_back(a.order[lo + path[k]]);
  for (i64 k = 0; k < plen; ++k)
    if (path[k] != k) o.moved.insert(o.moved.end(), {s, path[k], k});
}

// The engine's per-row telemetry table (engine/telemetry.py ``Telemetry``), written in place where given: ``table``
// [N, C >= 8] float64 (columns steps, emitted, accepted, retrieval, logits, both, other, tree_tokens first),
// ``hist`` [N, H] int64 (accepted-length histogram, the last bin counting longer lengths), ``tids`` [B] rows.
struct Tel {
  double* table = nullptr;
  i64* hist = nullptr;
  std::vector<i64> tids;
  i64 cols = 0, bins = 0;
};

Tel tel_of(const py::object& obj, i64 b) {
  Tel t;
  if (obj.is_none()) return t;
  const py::tuple tup = obj.cast<py::tuple>();
  if (tup.size() != 3) bad("telemetry must be (table, hist, tids)");
  py::array table = tup[0].cast<py::array>(), hist = tup[1].cast<py::array>();
  const I64Array tids = tup[2].cast<I64Array>();
  const auto ok = [](const py::array& a) { return a.ndim() == 2 && (a.flags() & py::array::c_style) && a.writeable(); };
  if (!ok(table) || !table.dtype().is(py::dtype::of<double>()) || table.shape(1) < 8)
    bad("telemetry table must be a writeable C-contiguous float64 [N, C >= 8] array");
  if (!ok(hist) || !hist.dtype().is(py::dtype::of<i64>()) || hist.shape(0) != table.shape(0) || hist.shape(1) < 1)
    bad("telemetry hist must be a writeable C-contiguous int64 [N, H] array with the table's N");
  check_1d(tids, b, "telemetry tids");
  for (i64 i = 0; i < b; ++i)
    if (tids.data()[i] < 0 || tids.data()[i] >= table.shape(0))
      bad("telemetry tids[" + std::to_string(i) + "] = " + std::to_string(tids.data()[i]) + " is not a row");
  t.table = static_cast<double*>(table.mutable_data());
  t.hist = static_cast<i64*>(hist.mutable_data());
  t.tids.assign(tids.data(), tids.data() + b);
  t.cols = i64(table.shape(1));
  t.bins = i64(hist.shape(1));
  return t;
}

// Adds one step of every stream to the telemetry table (the counts of engine/step.py ``Stepper._observe``).
void count_step(const Tel& t, const CommitArgs& a, const CommitOut& o, i64 b) {
  for (i64 s = 0; s < b; ++s) {
    const size_t z = size_t(s);
    const i64 plen = o.cu_path[z + 1] - o.cu_path[z], emitted = o.emitted[z];
    const i64 accepted = std::min(plen - 1, emitted);
    double* row = t.table + t.tids[z] * t.cols;
    row[0] += 1.0;
    row[1] += double(emitted);
    row[2] += double(accepted);
    for (size_t j = 0; j < 4; ++j) row[3 + j] += double(o.counts[4 * z + j]);
    row[7] += double(a.cu[s + 1] - a.cu[s]);
    t.hist[t.tids[z] * t.bins + std::min(accepted, t.bins - 1)] += 1;
  }
}

// The KV cache a commit keeps the accepted rows of, in place (engine/kv_cache.py's layout): ``kv`` [L, 2, S, H, P, D]
// of any element type, C-contiguous and writeable; each stream's slot and committed length (its tree's rows sit at
// positions start .. start + T - 1 of its slot).
struct Keep {
  char* base = nullptr;
  i64 planes = 0, slots = 0, heads = 0, positions = 0, row = 0;  // planes = L * 2; row: bytes of one position
  const i64 *slot = nullptr, *start = nullptr;                   // [B] each (read before any advance)
  py::object keep_kv;
  I64Array slot_arr, start_arr;
};

// The layout fields of ``kv`` into `k` (ValueError where it is not a writeable C-contiguous 6-D array).
void kv_layout(const py::object& obj, Keep& k) {
  py::array kv = obj.cast<py::array>();
  if (kv.ndim() != 6 || kv.shape(1) != 2 || !(kv.flags() & py::array::c_style) || !kv.writeable())
    bad("kv must be a writeable C-contiguous [L, 2, S, H, P, D] array");
  k.planes = i64(kv.shape(0)) * 2;
  k.slots = i64(kv.shape(2));
  k.heads = i64(kv.shape(3));
  k.positions = i64(kv.shape(4));
  k.row = i64(kv.shape(5)) * i64(kv.itemsize());
  k.base = static_cast<char*>(kv.mutable_data());
  k.keep_kv = kv;
}

// Every stream's slot inside the cache and its tree (rows cu[s] .. cu[s + 1] after its start) inside its slot.
void check_keep(const Keep& k, const i64* cu, i64 b) {
  for (i64 s = 0; s < b; ++s) {
    const i64 sl = k.slot[s], st = k.start[s];
    if (sl < 0 || sl >= k.slots) bad("kv slots[" + std::to_string(s) + "] = " + std::to_string(sl) + " is not a slot");
    if (st < 0 || st + (cu[s + 1] - cu[s]) > k.positions)
      bad("kv starts[" + std::to_string(s) + "] = " + std::to_string(st) + ": the tree does not fit in " +
          std::to_string(k.positions) + " positions");
  }
}

Keep keep_of(const py::object& obj, const I64Array& cu, i64 b) {
  Keep k;
  if (obj.is_none()) return k;
  const py::tuple tup = obj.cast<py::tuple>();
  if (tup.size() != 3) bad("kv must be (kv, slots, starts)");
  kv_layout(tup[0], k);
  k.slot_arr = tup[1].cast<I64Array>();
  k.start_arr = tup[2].cast<I64Array>();
  check_1d(k.slot_arr, b, "kv slots");
  check_1d(k.start_arr, b, "kv starts");
  k.slot = k.slot_arr.data();
  k.start = k.start_arr.data();
  check_keep(k, cu.data(), b);
  return k;
}

// Moves every stream's accepted rows down in place (the moves of ``CommitOut::moved``: stream, source node,
// destination index along its path), in every layer, key/value and head. A stream's moves come in ascending
// destination with source >= destination, so no source is an earlier move's destination.
void keep_rows(const Keep& k, const CommitOut& o) {
  // the moves read the starts before the advance (the same array where the caller passes it for both)
  for (size_t m = 0; m + 2 < o.moved.size(); m += 3) {
    const size_t s = size_t(o.moved[m]);
    const i64 src = k.start[s] + o.moved[m + 1], dst = k.start[s] + o.moved[m + 2];
    for (i64 lc = 0; lc < k.planes; ++lc)
      for (i64 h = 0; h < k.heads; ++h) {
        char* plane = k.base + (((lc * k.slots + k.slot[s]) * k.heads + h) * k.positions) * k.row;
        std::memmove(plane + dst * k.row, plane + src * k.row, size_t(k.row));
      }
  }
}

// An int64 array the call writes in place: read in place (no converted copy, whose writes would be lost) and
// writeable, else ValueError naming it.
i64* writeable_i64(const py::object& obj, const I64Array& a, const char* name) {
  if (!readable_in_place(obj) || a.keep.ptr() != obj.ptr() ||
      !(py::detail::array_proxy(obj.ptr())->flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_))
    bad(std::string(name) + " must be a writeable C-contiguous int64 array (the call writes it in place)");
  return const_cast<i64*>(a.data());
}

// Each stream's next root, committed length, draft depth and limits, rewritten in place after a commit (all null:
// not asked for).
struct Advance {
  i64 *roots = nullptr, *starts = nullptr, *depths = nullptr, *left = nullptr;  // left: limits [B, 3]
};

// The per-step arrays of a commit, checked: the flat trees (cu [B + 1], parents, tokens, choices, sources, order
// [R]) and topk [R, k']; limits / eos as given (checked by the caller).
CommitArgs step_args(const I64Array& cu, const I64Array& parents, const I64Array& tokens, const I64Array& choices,
                     const I64Array& sources, const I64Array& order, const I64Array& topk, i64 b, const i64* limits,
                     const i64* eos, i64 n_eos) {
  check_trees(cu, parents, b);
  const i64 r = parents.shape(0);
  check_1d(tokens, r, "tokens");
  check_1d(choices, r, "choices");
  check_1d(sources, r, "sources");
  check_1d(order, r, "order");
  if (topk.ndim() != 2 || topk.shape(0) != r)
    bad("topk must be 2-D [R=" + std::to_string(r) + ", k'], got " + std::to_string(topk.ndim()) + "-D");
  return CommitArgs{cu.data(),    parents.data(), tokens.data(), choices.data(), sources.data(),
                    order.data(), topk.data(),    limits,        eos,            i64(topk.shape(1)),
                    n_eos};
}

void check_limits(const I64Array& limits, const I64Array& eos, i64 b) {
  if (limits.ndim() != 2 || limits.shape(0) != b || limits.shape(1) != 3)
    bad("limits must be 2-D [B=" + std::to_string(b) + ", 3], got " + std::to_string(limits.ndim()) + "-D");
  if (eos.ndim() != 2 || eos.shape(0) != b)
    bad("eos must be 2-D [B=" + std::to_string(b) + ", E], got " + std::to_string(eos.ndim()) + "-D");
}

// The commit of one step (commit_greedy_batch and StepContext::commit, their arguments checked): acceptance, stop
// checks, the drafters' update, the telemetry counts, the KV rows kept and the plan advanced, as documented there.
// `quiet`: where every stream was checked and updated here, none ended and the KV rows were kept, return None (the
// caller reads nothing of such a step: no arrays are built).
py::object commit_impl(const std::vector<DraftCore*>& states, const i64* rows, const CommitArgs& a, const Tel& tel,
                       const Keep& keep, const Advance& adv, const std::vector<PyObject*>* token_lists = nullptr,
                       bool quiet = false) {
  const i64 b = i64(states.size());
  thread_local CommitOut o;  // refilled by every commit on this thread (its vectors keep their capacity)
  o.clear();
  bool all_checked = true;
  {
    py::gil_scoped_release nogil;
    MultiLock lock(states);
    const Streams st = resolve(states, rows);
    thread_local AcceptScratch sc;
    o.cu_path.assign(1, 0);
    for (i64 s = 0; s < b; ++s) commit_one(a, s, sc, o);
    // the drafters learn only when every stream was checked here (else the caller updates them all after its
    // own stop checks, in stream order, as update_batch: a shared state's updates stay in the same order)
    for (i64 s = 0; s < b; ++s) all_checked = all_checked && a.checked(s);
    if (all_checked) {
      thread_local std::vector<i64> comm, cu_c;  // each stream's emitted tokens (block[: emitted])
      comm.clear();
      cu_c.assign(size_t(b) + 1, 0);
      for (i64 s = 0; s < b; ++s) {
        const i64* blk = o.block.data() + o.cu_path[size_t(s)];
        comm.insert(comm.end(), blk, blk + o.emitted[size_t(s)]);
        cu_c[size_t(s) + 1] = i64(comm.size());
      }
      const UpdateArgs u{a.cu, a.tok, a.topk, comm.data(), cu_c.data(), a.kp};
      check_update(st, u);  // every input checked before any state changes
      for (size_t s = 0; s < states.size(); ++s) update_one(*states[s], *st.rows[s], u, s);
      if (tel.table != nullptr) count_step(tel, a, o, b);
    }
    if (keep.base != nullptr) keep_rows(keep, o);
    if (adv.depths != nullptr)
      for (i64 s = 0; s < b; ++s) {
        const size_t z = size_t(s);
        const i64 e = o.emitted[z];
        adv.roots[s] = o.block[size_t(o.cu_path[z + 1] - 1)];
        adv.starts[s] += o.cu_path[z + 1] - o.cu_path[z];
        adv.left[3 * s] -= e;
        adv.left[3 * s + 1] -= e;
        adv.depths[s] -= e;
      }
  }
  i64 ended = 0;  // checked streams a stop rule ended
  for (i64 s = 0; s < b; ++s) ended += o.finish[size_t(s)] > 0 ? 1 : 0;
  if (token_lists != nullptr)  // each checked stream's emitted tokens onto its StopChecker's list
    for (i64 s = 0; s < b; ++s) {
      PyObject* lst = (*token_lists)[size_t(s)];
      if (lst == nullptr || !a.checked(s)) continue;
      const i64* blk = o.block.data() + o.cu_path[size_t(s)];
      for (i64 j = 0; j < o.emitted[size_t(s)]; ++j) {
        py::object tok = py::reinterpret_steal<py::object>(PyLong_FromLongLong(blk[j]));
        if (!tok || PyList_Append(lst, tok.ptr()) != 0) throw py::error_already_set();
      }
    }
  if (quiet && all_checked && ended == 0 && keep.base != nullptr) return py::none();
  const i64 nm = i64(o.moved.size() / 3);
  py::array_t<i64> counts({b, i64(4)}), moved({nm, i64(3)});
  if (b) std::memcpy(counts.mutable_data(), o.counts.data(), o.counts.size() * sizeof(i64));
  if (nm) std::memcpy(moved.mutable_data(), o.moved.data(), o.moved.size() * sizeof(i64));
  return py::make_tuple(to_array(o.path), to_array(o.cu_path), to_array(o.bonus), to_array(o.block),
                        to_array(o.emitted), to_array(o.finish), counts, to_array(o.created), moved, all_checked,
                        ended);
}

// ``advance`` = (roots, starts, depths) into `adv` (each a writeable int64 [B] read in place), with ``limits``.
Advance advance_of(const py::object& advance, const py::object& limits_obj, const I64Array& limits, i64 b,
                   I64Array (&keep)[3]) {
  Advance adv;
  if (advance.is_none()) return adv;
  const py::tuple tup = advance.cast<py::tuple>();
  if (tup.size() != 3) bad("advance must be (roots, starts, depths)");
  const char* names[3] = {"advance roots", "advance starts", "advance depths"};
  i64* ptrs[3];
  for (size_t j = 0; j < 3; ++j) {
    keep[j] = tup[j].cast<I64Array>();
    check_1d(keep[j], b, names[j]);
    ptrs[j] = writeable_i64(tup[j], keep[j], names[j]);
  }
  adv.roots = ptrs[0];
  adv.starts = ptrs[1];
  adv.depths = ptrs[2];
  adv.left = writeable_i64(limits_obj, limits, "limits (with advance)");
  return adv;
}

py::object commit_greedy_batch(const py::sequence& states_in, const I64Array& rows, const I64Array& cu,
                              const I64Array& parents, const I64Array& tokens, const I64Array& choices,
                              const I64Array& sources, const I64Array& order, const I64Array& topk,
                              const py::object& limits_obj, const I64Array& eos, const py::object& telemetry,
                              const py::object& kv, const py::object& advance) {
  const I64Array limits = limits_obj.cast<I64Array>();
  const std::vector<DraftCore*> states = cores_of(states_in);
  const i64 b = i64(states.size());
  check_1d(rows, b, "rows");
  check_limits(limits, eos, b);
  const CommitArgs a =
      step_args(cu, parents, tokens, choices, sources, order, topk, b, limits.data(), eos.data(), i64(eos.shape(1)));
  const Tel tel = tel_of(telemetry, b);
  const Keep keep = keep_of(kv, cu, b);
  I64Array adv_arrays[3];
  const Advance adv = advance_of(advance, limits_obj, limits, b, adv_arrays);
  return commit_impl(states, rows.data(), a, tel, keep, adv);
}

// ------------------------------------------------------------------------------------------------ step context

// What every step of a run over the same streams passes to propose_batch and commit_greedy_batch, parsed and
// checked once (engine/step_plan.py's StepPlan): the states and row handles, each stream's root, committed length and draft
// depth (advanced in place by every commit), its limits and EOS ids, the telemetry table and the KV cache with each
// stream's slot. The arrays are held (kept alive) and read or written in place.
class StepContext {
 public:
  StepContext(const py::sequence& states, const I64Array& rows, const py::object& roots, const py::object& starts,
              const py::object& depths, const py::object& limits, const I64Array& eos, const py::object& telemetry,
              const py::object& slots, const py::object& tokens, const py::object& result_type)
      : states_(cores_of(states)), b_(i64(states_.size())), held_(py::list(states)), limits_(limits.cast<I64Array>()),
        eos_(eos) {
    check_1d(rows, b_, "rows");
    rows_.assign(rows.data(), rows.data() + b_);
    check_limits(limits_, eos_, b_);
    adv_ = advance_of(py::make_tuple(roots, starts, depths), limits, limits_, b_, adv_arrays_);
    set_telemetry(telemetry);
    if (!slots.is_none()) {
      keep_.slot_arr = slots.cast<I64Array>();
      check_1d(keep_.slot_arr, b_, "kv slots");
      keep_.slot = keep_.slot_arr.data();
      keep_.start = adv_.starts;
    }
    if (!result_type.is_none()) {  // a tuple subclass (the Python Commit) the commit's tuple is returned as
      if (!PyType_Check(result_type.ptr()) ||
          !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(result_type.ptr()), &PyTuple_Type))
        bad("result_type must be a tuple subclass");
      result_type_ = result_type;
    }
    if (!tokens.is_none()) {  // each stream's StopChecker token list (None for a stream the caller checks)
      held_lists_ = py::list(tokens);
      if (i64(py::len(held_lists_)) != b_) bad("tokens must hold one list (or None) per stream");
      for (i64 s = 0; s < b_; ++s) {
        py::handle h = held_lists_[size_t(s)];
        if (h.is_none()) {
          if (limits_.data()[3 * s + 2] != 0) bad("tokens[" + std::to_string(s) + "]: a checked stream needs its list");
          lists_.push_back(nullptr);
        } else {
          if (!PyList_Check(h.ptr())) bad("tokens[" + std::to_string(s) + "] must be a list or None");
          lists_.push_back(h.ptr());
        }
      }
    }
  }

  // The telemetry arrays (table, hist, tids) or None, again after the table was replaced.
  void set_telemetry(const py::object& telemetry) {
    tel_ = tel_of(telemetry, b_);
    held_tel_ = telemetry;
  }

  // The step clock: a writeable float64 [5] array (None: none) that fast_commit(choices, topk, t0, t1, t2, t3) adds
  // each step's milliseconds to: [0] propose (t1 - t0), [1] scores (t3 - t2), [2] the commit (t3 to its end, on
  // the clock time.perf_counter reads: CLOCK_MONOTONIC), [3] steps, [4] forward and scores (t3 - t1).
  void set_clock(const py::object& acc) {
    if (acc.is_none()) {
      clock_ = nullptr;
      held_clock_ = py::none();
      return;
    }
    auto arr = py::cast<py::array>(acc);
    if (!arr.dtype().is(py::dtype::of<double>()) || arr.ndim() != 1 || arr.shape(0) < 5 || !arr.writeable() ||
        !(arr.flags() & py::array::c_style))
      bad("clock must be a writeable C-contiguous float64 array of at least 5 elements");
    clock_ = static_cast<double*>(arr.mutable_data());
    held_clock_ = acc;
  }

  void tick(double t0, double t1, double t2, double t3) {
    if (clock_ == nullptr) return;
    const double now =
        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    clock_[0] += (t1 - t0) * 1e3;
    clock_[1] += (t3 - t2) * 1e3;
    clock_[2] += (now - t3) * 1e3;
    clock_[3] += 1.0;
    clock_[4] += (t3 - t1) * 1e3;
  }

  // Whether a commit with nothing for its caller to read returns None (commit_impl's `quiet`): the caller then
  // needs neither the arrays nor the created indices (no capacity tuner), only whether some stream ended; a
  // propose then gives no sources and order (None: the commit reads its own copy).
  void set_quiet(bool quiet) { quiet_ = quiet; }

  // The KV cache (a writeable C-contiguous [L, 2, S, H, P, D] array) whose rows every commit keeps, again after the
  // buffer was replaced; None: the caller keeps them. Needs the slots given at construction.
  void set_kv(const py::object& kv) {
    if (kv.is_none()) {
      keep_.base = nullptr;
      keep_.keep_kv = py::none();
      return;
    }
    if (keep_.slot == nullptr) bad("set_kv: the context was made without kv slots");
    Keep k = keep_;
    kv_layout(kv, k);
    keep_ = k;
  }

  // Every stream's tree from the context's roots and depths; the trees are kept for the next commit.
  py::tuple propose(const I64Array& caps) {
    check_1d(caps, b_, "capacities");
    proposed_ = false;
    py::tuple out = propose_impl(states_, rows_.data(), adv_.roots, caps.data(), adv_.depths, last_, quiet_);
    proposed_ = true;
    return out;
  }

  // The commit of the trees the last propose made, given the target's argmax at every node (choices [R]) and
  // its top-k ids (topk [R, k']).
  py::object commit(const I64Array& choices, const I64Array& topk) {
    if (!proposed_) bad("commit needs a propose first (each proposed batch of trees is committed once)");
    const i64 r = i64(last_.tokens.size());
    check_1d(choices, r, "choices");
    if (topk.ndim() != 2 || topk.shape(0) != r)
      bad("topk must be 2-D [R=" + std::to_string(r) + ", k'], got " + std::to_string(topk.ndim()) + "-D");
    const CommitArgs a{last_.cu.data(),    last_.parents.data(), last_.tokens.data(), choices.data(),
                       last_.sources.data(), last_.order.data(), topk.data(),         limits_.data(),
                       eos_.data(),        i64(topk.shape(1)),   i64(eos_.shape(1))};
    if (keep_.base != nullptr) check_keep(keep_, last_.cu.data(), b_);
    proposed_ = false;
    py::object out =
        commit_impl(states_, rows_.data(), a, tel_, keep_, adv_, lists_.empty() ? nullptr : &lists_, quiet_);
    if (!result_type_ || out.is_none()) return out;
    // tuple.__new__(result_type, out) at the C level: no Python frame on the step's path
    const py::tuple args = py::make_tuple(out);
    PyObject* obj = PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(result_type_.ptr()), args.ptr(), nullptr);
    if (obj == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::tuple>(obj);
  }

  // ``propose`` / ``commit`` as plain CPython functions bound to this context (METH_FASTCALL, no pybind11
  // dispatch: its per-call overload and type lookups cost ~5-8 µs each after a forward, measured at B = 1 on
  // SmolLM2-135M); `self` is a capsule holding the context and a reference to its Python object.
  static PyObject* fast_propose(PyObject* self, PyObject* const* args, Py_ssize_t n);
  static PyObject* fast_commit(PyObject* self, PyObject* const* args, Py_ssize_t n);

 private:
  std::vector<DraftCore*> states_;
  i64 b_;
  py::list held_;  // the states
  std::vector<i64> rows_;
  I64Array limits_, eos_, adv_arrays_[3];
  Advance adv_;
  Tel tel_;
  py::object held_tel_;
  Keep keep_;
  py::list held_lists_;
  std::vector<PyObject*> lists_;  // borrowed from held_lists_
  FlatOut last_;                  // the trees of the last propose (the next commit's)
  py::object result_type_;        // what commit returns its tuple as (None: a plain tuple)
  bool proposed_ = false;
  bool quiet_ = false;
  double* clock_ = nullptr;  // set_clock's array, held by held_clock_
  py::object held_clock_;
};

StepContext* context_of(PyObject* capsule) {
  return static_cast<StepContext*>(PyCapsule_GetPointer(capsule, "racer_batch.StepContext"));
}

I64Array i64_arg(PyObject* obj) {
  py::detail::make_caster<I64Array> caster;
  if (!caster.load(py::handle(obj), true)) bad("an argument is not convertible to an int64 array");
  return py::detail::cast_op<I64Array>(std::move(caster));
}

// Runs `fn` as a CPython function body: ValueError for the draft core's argument errors, the Python error as it is.
template <class F>
PyObject* as_c_call(F&& fn) {
  try {
    return fn().release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyObject* StepContext::fast_propose(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  return as_c_call([&]() -> py::object {
    if (n != 1) bad("propose takes (capacities)");
    return context_of(self)->propose(i64_arg(args[0]));
  });
}

PyObject* StepContext::fast_commit(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  return as_c_call([&]() -> py::object {
    if (n != 2 && n != 6) bad("commit takes (choices, topk) or (choices, topk, t0, t1, t2, t3)");
    double t[4] = {0, 0, 0, 0};
    for (Py_ssize_t i = 2; i < n; ++i) {
      t[i - 2] = PyFloat_AsDouble(args[i]);
      if (t[i - 2] == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    }
    StepContext* ctx = context_of(self);
    py::object out = ctx->commit(i64_arg(args[0]), i64_arg(args[1]));
    if (n == 6) ctx->tick(t[0], t[1], t[2], t[3]);
    return out;
  });
}

PyMethodDef kFastPropose = {"propose", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
                                           &StepContext::fast_propose)),
                            METH_FASTCALL, "StepContext.propose without pybind11 dispatch"};
PyMethodDef kFastCommit = {"commit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
                                         &StepContext::fast_commit)),
                           METH_FASTCALL, "StepContext.commit without pybind11 dispatch"};

// `def` bound to the StepContext Python object `self` (kept alive by the capsule the function holds).
py::object bind_fast(const py::object& self, PyMethodDef* def) {
  StepContext* ctx = self.cast<StepContext*>();
  PyObject* cap = PyCapsule_New(ctx, "racer_batch.StepContext", [](PyObject* c) {
    Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(c)));
  });
  if (cap == nullptr) throw py::error_already_set();
  Py_INCREF(self.ptr());
  PyCapsule_SetContext(cap, self.ptr());
  PyObject* fn = PyCFunction_NewEx(def, cap, nullptr);
  Py_DECREF(cap);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

// ------------------------------------------------------------------------------------------------ mask

template <class T>
void fill_mask(T* m, i64 s, const i64* cu, const i64* par, const i64* starts, i64 b, T zero, T neg) {
  for (i64 q = 0; q < b; ++q) {
    const i64 lo = cu[q], n = cu[q + 1] - cu[q], st = starts[q];
    for (i64 j = 0; j < n; ++j) {
      T* row = m + (lo + j) * s;
      std::fill(row, row + st, zero);
      std::fill(row + st, row + s, neg);
      for (i64 x = j; x >= 0; x = par[lo + x]) row[st + x] = zero;
    }
  }
}

// mask [R, S] with 2- or 4-byte elements (float32, or float16/bfloat16 as raw bits), written in place.
void fill_tree_mask(py::array mask, const I64Array& cu, const I64Array& parents, const I64Array& starts, u32 zero_bits,
                    u32 neg_bits) {
  const i64 b = cu.ndim() == 1 ? cu.shape(0) - 1 : -1;
  if (b < 0) bad("cu must be a 1-D array of length B + 1");
  check_trees(cu, parents, b, true);
  check_1d(starts, b, "starts");
  const i64 r = parents.shape(0);
  const py::ssize_t item = mask.itemsize();
  if (mask.ndim() != 2 || mask.shape(0) != r || (item != 2 && item != 4))
    bad("mask must be 2-D [R=" + std::to_string(r) + ", S] of 2- or 4-byte floats");
  if (!(mask.flags() & py::array::c_style) || !mask.writeable()) bad("mask must be C-contiguous and writable");
  const i64 s = mask.shape(1);
  for (i64 q = 0; q < b; ++q)
    if (starts.data()[q] < 0 || starts.data()[q] + cu.data()[q + 1] - cu.data()[q] > s)
      bad("starts[" + std::to_string(q) + "] = " + std::to_string(starts.data()[q]) + " plus its tree of " +
          std::to_string(cu.data()[q + 1] - cu.data()[q]) + " rows does not fit in the mask's " + std::to_string(s) +
          " columns");
  void* data = mask.mutable_data();
  py::gil_scoped_release nogil;
  if (item == 4) {
    float zero, neg;
    std::memcpy(&zero, &zero_bits, 4);
    std::memcpy(&neg, &neg_bits, 4);
    fill_mask<float>(static_cast<float*>(data), s, cu.data(), parents.data(), starts.data(), b, zero, neg);
  } else {
    fill_mask<u16>(static_cast<u16*>(data), s, cu.data(), parents.data(), starts.data(), b, u16(zero_bits), u16(neg_bits));
  }
}

}  // namespace

PYBIND11_MODULE(racer_draft_core, m) {
  m.doc() = "RACER's native draft core (racer_batch/drafters/native)";
  m.def("reads_in_place", [](py::handle h) { return readable_in_place(h); },
        "Whether an int64 argument given as `h` is read in place (else converted first); for tests.");
  py::class_<DraftCore>(m, "DraftCore")
      .def(py::init([](i64 vocab, i64 k, i64 max_nodes, i64 ngram, i64 min_border_depth, bool use_retrieval,
                       bool use_logits, i64 max_breadth, bool own_layers) {
             return new DraftCore(Params{vocab, k, max_nodes, ngram, min_border_depth, max_breadth, use_retrieval,
                                         use_logits, own_layers && use_logits});
           }),
           py::kw_only(), py::arg("vocab_size"), py::arg("k"), py::arg("max_nodes"), py::arg("ngram"),
           py::arg("min_border_depth"), py::arg("use_retrieval"), py::arg("use_logits"), py::arg("max_breadth"),
           py::arg("own_layers"))
      .def("open_row",
           [](DraftCore& s) {
             std::lock_guard<std::mutex> lock(s.mu);
             return s.open_row();
           })
      .def("close_row",
           [](DraftCore& s, i64 h) {
             std::lock_guard<std::mutex> lock(s.mu);
             s.close_row(h);
           })
      .def("start", &start_row, py::arg("row"), py::arg("prompt_ids"), py::arg("prompt_topk") = py::none())
      .def("free",
           [](DraftCore& s) {
             std::lock_guard<std::mutex> lock(s.mu);
             s.free_all();
           })
      .def_property_readonly("freed", [](DraftCore& s) { return s.freed(); })
      .def_property_readonly("num_nodes",
                             [](DraftCore& s) {
                               std::lock_guard<std::mutex> lock(s.mu);
                               return s.num_nodes();
                             })
      .def_property_readonly("num_evicted",
                             [](DraftCore& s) {
                               std::lock_guard<std::mutex> lock(s.mu);
                               return s.num_evicted();
                             })
      .def_property_readonly("num_scanned",
                             [](DraftCore& s) {
                               std::lock_guard<std::mutex> lock(s.mu);
                               return s.num_scanned();
                             })
      .def_property_readonly("num_relabelled",
                             [](DraftCore& s) {
                               std::lock_guard<std::mutex> lock(s.mu);
                               return s.num_relabelled();
                             })
      .def("set_front_stride",
           [](DraftCore& s, i64 stride) {
             std::lock_guard<std::mutex> lock(s.mu);
             s.set_front_stride(stride);
           },
           py::arg("stride"),
           "For tests: the order labels' stride at the recency list's front (default 2**28, Automaton::label); 1 "
           "packs the front's labels so that they are rewritten often. Raises ValueError below 1 or on a freed state.")
      .def_property_readonly("num_rows",
                             [](DraftCore& s) {
                               std::lock_guard<std::mutex> lock(s.mu);
                               return s.num_rows();
                             })
      .def("store_row",
           [](DraftCore& s, i64 tok) {
             std::lock_guard<std::mutex> lock(s.mu);
             const Store* st = s.store();
             if (st == nullptr) throw py::value_error("this draft state has no copy-logit store");
             i64 vocab = i64(st->table.size() / size_t(st->k));
             if (tok < 0 || tok >= vocab) throw py::value_error("token id out of the vocabulary");
             py::array_t<i64> out(st->k);
             const i32* row = st->row(i32(tok));
             for (i32 j = 0; j < st->k; ++j) out.mutable_at(j) = row[j];
             return out;
           },
           py::arg("token"))
      .def("store_table",
           [](DraftCore& s) {
             std::lock_guard<std::mutex> lock(s.mu);
             const Store* st = s.store();
             if (st == nullptr) throw py::value_error("this draft state has no copy-logit store");
             const i64 vocab = i64(st->table.size() / size_t(st->k));
             py::array_t<i32> out({vocab, i64(st->k)});
             std::copy(st->table.begin(), st->table.end(), out.mutable_data());
             return out;
           })
      .def("load_store",
           [](DraftCore& s, const I64Array& tokens, const I64Array& rows) {
             std::lock_guard<std::mutex> lock(s.mu);
             Store* st = s.store();
             if (st == nullptr) throw py::value_error("this draft state has no copy-logit store");
             const i64 vocab = i64(st->table.size() / size_t(st->k)), n = tokens.ndim() == 1 ? tokens.shape(0) : -1;
             if (n < 0 || rows.ndim() != 2 || rows.shape(0) != n || rows.shape(1) != st->k)
               throw py::value_error("load_store needs tokens [n] and rows [n, k=" + std::to_string(st->k) + "]");
             for (i64 i = 0; i < n; ++i)
               if (tokens.data()[i] < 0 || tokens.data()[i] >= vocab) throw py::value_error("token id out of the vocabulary");
             store_update(*st, tokens.data(), rows.data(), n, st->k);
           },
           py::arg("tokens"), py::arg("rows"))
      .def_property_readonly("store_known",
                             [](DraftCore& s) {
                               std::lock_guard<std::mutex> lock(s.mu);
                               const Store* st = s.store();
                               i64 n = 0;
                               if (st == nullptr) return n;
                               for (size_t i = 0; i < st->table.size(); i += size_t(st->k)) n += st->table[i] >= 0;
                               return n;
                             })
      .def_property_readonly("memory_bytes", [](DraftCore& s) {
        std::lock_guard<std::mutex> lock(s.mu);
        return s.memory_bytes();
      });
  m.def("propose_batch", &propose_batch);
  m.def("update_batch", &update_batch);
  m.def("accept_greedy_batch", &accept_greedy_batch);
  m.def("commit_greedy_batch", &commit_greedy_batch, py::arg("states"), py::arg("rows"), py::arg("cu"),
        py::arg("parents"), py::arg("tokens"), py::arg("choices"), py::arg("sources"), py::arg("order"),
        py::arg("topk"), py::arg("limits"), py::arg("eos"), py::arg("telemetry") = py::none(),
        py::arg("kv") = py::none(), py::arg("advance") = py::none());
  m.def("fill_tree_mask", &fill_tree_mask);
  py::class_<StepContext>(m, "StepContext")
      .def(py::init<const py::sequence&, const I64Array&, const py::object&, const py::object&, const py::object&,
                    const py::object&, const I64Array&, const py::object&, const py::object&, const py::object&,
                    const py::object&>(),
           py::arg("states"), py::arg("rows"), py::arg("roots"), py::arg("starts"), py::arg("depths"),
           py::arg("limits"), py::arg("eos"), py::arg("telemetry"), py::arg("slots"), py::arg("tokens") = py::none(),
           py::arg("result_type") = py::none())
      .def("set_telemetry", &StepContext::set_telemetry)
      .def("set_kv", &StepContext::set_kv)
      .def("set_quiet", &StepContext::set_quiet)
      .def("set_clock", &StepContext::set_clock)
      .def("propose", &StepContext::propose)
      .def("commit", &StepContext::commit)
      .def_property_readonly("fast_propose", [](py::object self) { return bind_fast(self, &kFastPropose); },
                             "propose as a plain CPython function bound to this context (no pybind11 dispatch)")
      .def_property_readonly("fast_commit", [](py::object self) { return bind_fast(self, &kFastCommit); },
                             "commit as a plain CPython function bound to this context (no pybind11 dispatch)");
}
