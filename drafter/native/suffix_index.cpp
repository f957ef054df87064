#include "suffix_index.h"

#include <algorithm>
#include <stdexcept>

namespace das {

namespace {

uint64_t mix(uint64_t x) {
    // splitmix64 finaliser: parent ids and token ids are both small and dense, so they need scrambling.
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

constexpr size_t kInitialSlots = 1024;  // power of two
constexpr double kMaxLoad = 0.7;

}  // namespace

SuffixIndex::SuffixIndex(int max_depth) : max_depth_(max_depth) {
    if (max_depth < 1 || max_depth > kMaxDepthLimit) {
        throw std::invalid_argument("max_depth must be in [1, " + std::to_string(kMaxDepthLimit) + "], got " +
                                    std::to_string(max_depth));
    }
    nodes_.emplace_back();  // the root: empty string, no label
    slots_.assign(kInitialSlots, Slot{0, kNone});
}

// ---- (parent, token) -> child map -------------------------------------------------------------------------

size_t SuffixIndex::home(int32_t parent, int32_t token) const {
    uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
    return static_cast<size_t>(mix(key)) & (slots_.size() - 1);
}

int32_t SuffixIndex::find_child(int32_t parent, int32_t token) const {
    const size_t mask = slots_.size() - 1;
    for (size_t i = home(parent, token);; i = (i + 1) & mask) {
        const Slot& s = slots_[i];
        if (s.child == kNone) return kNone;
        if (s.token == token && nodes_[s.child].parent == parent) return s.child;
    }
}

size_t SuffixIndex::slot_of(int32_t parent, int32_t token, int32_t child) const {
    const size_t mask = slots_.size() - 1;
    for (size_t i = home(parent, token);; i = (i + 1) & mask) {
        if (slots_[i].child == child) return i;
        if (slots_[i].child == kNone) throw std::logic_error("suffix index: edge missing from the child map");
    }
}

void SuffixIndex::insert_edge(int32_t parent, int32_t token, int32_t child) {
    if (static_cast<double>(used_slots_ + 1) > kMaxLoad * static_cast<double>(slots_.size())) grow_slots();
    const size_t mask = slots_.size() - 1;
    size_t i = home(parent, token);
    while (slots_[i].child != kNone) i = (i + 1) & mask;
    slots_[i] = Slot{token, child};
    ++used_slots_;
}

void SuffixIndex::erase_slot(size_t i) {
    // Backward-shift deletion keeps probe chains unbroken without tombstones. An entry's home is recomputed from
    // its child's parent, so callers erase an edge before re-parenting its child.
    const size_t mask = slots_.size() - 1;
    slots_[i].child = kNone;
    --used_slots_;
    for (size_t j = (i + 1) & mask; slots_[j].child != kNone; j = (j + 1) & mask) {
        size_t k = home(nodes_[slots_[j].child].parent, slots_[j].token);
        bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            slots_[i] = slots_[j];
            slots_[j].child = kNone;
            i = j;
        }
    }
}

void SuffixIndex::grow_slots() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.size() * 2, Slot{0, kNone});
    const size_t mask = slots_.size() - 1;
    for (const Slot& s : old) {
        if (s.child == kNone) continue;
        size_t i = home(nodes_[s.child].parent, s.token);
        while (slots_[i].child != kNone) i = (i + 1) & mask;
        slots_[i] = s;
    }
}

// ---- nodes ------------------------------------------------------------------------------------------------

int32_t SuffixIndex::alloc_node() {
    if (!free_nodes_.empty()) {
        int32_t id = free_nodes_.back();
        free_nodes_.pop_back();
        nodes_[id] = Node{};
        return id;
    }
    if (nodes_.size() >= static_cast<size_t>(INT32_MAX)) throw std::length_error("suffix index: too many nodes");
    nodes_.emplace_back();
    return static_cast<int32_t>(nodes_.size() - 1);
}

void SuffixIndex::free_node(int32_t node) {
    int32_t old_seq = nodes_[node].seq;
    nodes_[node] = Node{};
    if (old_seq != kNone) {
        --sequences_[old_seq].label_refs;
        release_storage_if_unused(old_seq);
    }
    free_nodes_.push_back(node);
}

void SuffixIndex::set_label(int32_t node, int32_t seq, int32_t pos, int len) {
    Node& n = nodes_[node];
    int32_t old_seq = n.seq;
    ++sequences_[seq].label_refs;
    n.seq = seq;
    n.pos = pos;
    n.len = static_cast<uint8_t>(len);
    if (old_seq != kNone) {
        --sequences_[old_seq].label_refs;
        release_storage_if_unused(old_seq);
    }
}

void SuffixIndex::release_storage_if_unused(int32_t seq_id) {
    Sequence& s = sequences_[seq_id];
    if (s.removed && s.label_refs == 0) {
        std::vector<int32_t>().swap(s.tokens);
    }
}

bool SuffixIndex::better(int32_t a, int32_t b) const {
    const Node& x = nodes_[a];
    const Node& y = nodes_[b];
    return x.count > y.count || (x.count == y.count && first_token(a) < first_token(b));
}

void SuffixIndex::offer_best(int32_t parent, int32_t child) {
    if (parent == kRoot) return;  // drafts never start at the root, so its best child is never read
    int32_t& best = nodes_[parent].best_child;
    if (best == kNone || (best != child && better(child, best))) best = child;
}

void SuffixIndex::rescan_best(int32_t parent) {
    if (parent == kRoot) return;
    int32_t best = kNone;
    for (int32_t c = nodes_[parent].first_child; c != kNone; c = nodes_[c].next_sibling) {
        if (best == kNone || better(c, best)) best = c;
    }
    nodes_[parent].best_child = best;
}

void SuffixIndex::link_child(int32_t parent, int32_t child) {
    Node& c = nodes_[child];
    c.parent = parent;
    c.prev_sibling = kNone;
    c.next_sibling = nodes_[parent].first_child;
    if (c.next_sibling != kNone) nodes_[c.next_sibling].prev_sibling = child;
    nodes_[parent].first_child = child;
    nodes_[parent].child_sum += c.count;
    insert_edge(parent, first_token(child), child);
    offer_best(parent, child);
}

void SuffixIndex::unlink_child(int32_t child) {
    Node& c = nodes_[child];
    int32_t parent = c.parent;
    erase_slot(slot_of(parent, first_token(child), child));
    if (c.prev_sibling != kNone) {
        nodes_[c.prev_sibling].next_sibling = c.next_sibling;
    } else {
        nodes_[parent].first_child = c.next_sibling;
    }
    if (c.next_sibling != kNone) nodes_[c.next_sibling].prev_sibling = c.prev_sibling;
    nodes_[parent].child_sum -= c.count;
    c.parent = c.prev_sibling = c.next_sibling = kNone;
    if (nodes_[parent].best_child == child) rescan_best(parent);
}

void SuffixIndex::replace_child(int32_t old_child, int32_t new_child) {
    // new_child takes old_child's place under its parent; both start with the same token.
    Node& o = nodes_[old_child];
    Node& n = nodes_[new_child];
    int32_t parent = o.parent;
    slots_[slot_of(parent, first_token(old_child), old_child)].child = new_child;
    n.parent = parent;
    n.prev_sibling = o.prev_sibling;
    n.next_sibling = o.next_sibling;
    if (o.prev_sibling != kNone) {
        nodes_[o.prev_sibling].next_sibling = new_child;
    } else {
        nodes_[parent].first_child = new_child;
    }
    if (o.next_sibling != kNone) nodes_[o.next_sibling].prev_sibling = new_child;
    nodes_[parent].child_sum += n.count - o.count;
    o.parent = o.prev_sibling = o.next_sibling = kNone;
    if (nodes_[parent].best_child == old_child) nodes_[parent].best_child = new_child;
}

// ---- sequences --------------------------------------------------------------------------------------------

SuffixIndex::Sequence& SuffixIndex::checked_sequence(int32_t seq_id, const char* what) {
    if (seq_id < 0 || static_cast<size_t>(seq_id) >= sequences_.size() || sequences_[seq_id].removed) {
        throw std::invalid_argument(std::string(what) + ": unknown sequence id " + std::to_string(seq_id));
    }
    return sequences_[seq_id];
}

bool SuffixIndex::contains(int32_t seq_id) const {
    return seq_id >= 0 && static_cast<size_t>(seq_id) < sequences_.size() && !sequences_[seq_id].removed;
}

int32_t SuffixIndex::new_sequence() {
    if (sequences_.size() >= static_cast<size_t>(INT32_MAX)) throw std::length_error("suffix index: too many sequences");
    sequences_.emplace_back();
    ++live_sequences_;
    return static_cast<int32_t>(sequences_.size() - 1);
}

std::vector<int32_t> SuffixIndex::sequence(int32_t seq_id) const {
    if (!contains(seq_id)) throw std::invalid_argument("sequence: unknown sequence id " + std::to_string(seq_id));
    return sequences_[seq_id].tokens;
}

void SuffixIndex::extend(int32_t seq_id, const int32_t* tokens, size_t n) {
    Sequence& s = checked_sequence(seq_id, "extend");
    if (s.sealed) throw std::invalid_argument("extend: sequence " + std::to_string(seq_id) + " is sealed");
    for (size_t i = 0; i < n; ++i) {
        if (tokens[i] < 0) {
            throw std::invalid_argument("extend: token id " + std::to_string(tokens[i]) + " at position " +
                                        std::to_string(i) + " is negative");
        }
    }
    if (s.tokens.size() + n > static_cast<size_t>(INT32_MAX)) throw std::length_error("extend: sequence too long");
    for (size_t i = 0; i < n; ++i) append_token(seq_id, tokens[i]);
    stored_tokens_ += static_cast<int64_t>(n);
}

void SuffixIndex::seal(int32_t seq_id) {
    Sequence& s = checked_sequence(seq_id, "seal");
    s.sealed = true;
    std::vector<int32_t>().swap(s.cursors);
    s.tokens.shrink_to_fit();
}

void SuffixIndex::append_token(int32_t seq_id, int32_t token) {
    const int32_t pos = static_cast<int32_t>(sequences_[seq_id].tokens.size());
    sequences_[seq_id].tokens.push_back(token);
    std::vector<int32_t>& cursors = sequences_[seq_id].cursors;
    cursors.push_back(kRoot);
    ++nodes_[kRoot].count;  // the new suffix; the root's child_sum follows in advance()
    // Longest suffix first, as each cursor may relabel or fuse nodes that only its own suffix ends at.
    for (int32_t& cursor : cursors) cursor = advance(seq_id, cursor, token, pos);
    if (nodes_[cursors.front()].depth >= max_depth_) cursors.erase(cursors.begin());
}

int32_t SuffixIndex::advance(int32_t seq_id, int32_t x, int32_t token, int32_t pos) {
    // The suffix ending at node x (on its boundary) grows by `token`, stored at sequences_[seq_id].tokens[pos].
    const int32_t c = find_child(x, token);
    if (c == kNone) {
        if (x != kRoot && nodes_[x].first_child == kNone && nodes_[x].count == 1) {
            // x is a leaf that only this suffix reaches: lengthen its label instead of adding a node.
            int len = nodes_[x].len + 1;
            set_label(x, seq_id, pos + 1 - len, len);
            ++nodes_[x].depth;
            return x;
        }
        int32_t leaf = alloc_node();
        nodes_[leaf].count = 1;
        nodes_[leaf].depth = static_cast<uint8_t>(nodes_[x].depth + 1);
        set_label(leaf, seq_id, pos, 1);
        link_child(x, leaf);
        return leaf;
    }
    if (x != kRoot && nodes_[x].count == nodes_[c].count + 1) {
        // Only this suffix ends at x and every other path through x continues into c: move x's boundary one
        // token down instead of splitting c, so a suffix following an existing path creates no node.
        int len = nodes_[x].len + 1;
        if (nodes_[c].len == 1) {
            // c is swallowed whole: c takes x's place (keeping its children) and x goes away.
            erase_slot(slot_of(x, token, c));
            nodes_[x].first_child = kNone;
            nodes_[c].count = nodes_[x].count;
            replace_child(x, c);
            set_label(c, seq_id, pos + 1 - len, len);
            free_node(x);
            return c;
        }
        erase_slot(slot_of(x, token, c));
        ++nodes_[c].pos;
        --nodes_[c].len;
        insert_edge(x, first_token(c), c);
        set_label(x, seq_id, pos + 1 - len, len);
        ++nodes_[x].depth;
        return x;
    }
    if (nodes_[c].len == 1) {
        ++nodes_[c].count;
        ++nodes_[x].child_sum;
        offer_best(x, c);
        return c;
    }
    // Split c after its first token so this suffix ends on a boundary; the upper part u carries one more path.
    int32_t u = alloc_node();
    nodes_[u].count = nodes_[c].count + 1;
    nodes_[u].depth = static_cast<uint8_t>(nodes_[x].depth + 1);
    set_label(u, seq_id, pos, 1);
    replace_child(c, u);
    offer_best(x, u);
    ++nodes_[c].pos;
    --nodes_[c].len;
    link_child(u, c);
    return u;
}

void SuffixIndex::remove(int32_t seq_id) {
    Sequence& s = checked_sequence(seq_id, "remove");
    const int32_t n = static_cast<int32_t>(s.tokens.size());
    std::vector<int32_t> path;
    path.reserve(static_cast<size_t>(max_depth_));
    for (int32_t j = 0; j < n; ++j) {
        const int target = std::min(max_depth_, n - j);
        const int32_t* suffix = sequences_[seq_id].tokens.data() + j;
        path.clear();
        int32_t node = kRoot;
        int depth = 0;
        while (depth < target) {
            node = find_child(node, suffix[depth]);
            if (node == kNone) throw std::logic_error("suffix index: a stored suffix is missing");
            path.push_back(node);
            depth = nodes_[node].depth;
        }
        if (depth != target) throw std::logic_error("suffix index: a stored suffix ends inside an edge");
        --nodes_[kRoot].count;
        for (int32_t p : path) {
            --nodes_[p].count;
            --nodes_[nodes_[p].parent].child_sum;
        }
        // Bottom-up, so a node is freed only after the (also emptied) children below it on this path.
        for (auto it = path.rbegin(); it != path.rend(); ++it) {
            int32_t parent = nodes_[*it].parent;
            if (nodes_[*it].count == 0) {
                unlink_child(*it);
                free_node(*it);
            } else if (nodes_[parent].best_child == *it) {
                rescan_best(parent);
            }
        }
    }
    Sequence& t = sequences_[seq_id];  // free_node never reallocates sequences_, but be explicit after the loop
    t.removed = true;
    std::vector<int32_t>().swap(t.cursors);
    --live_sequences_;
    stored_tokens_ -= n;
    release_storage_if_unused(seq_id);
}

// ---- queries ----------------------------------------------------------------------------------------------

bool SuffixIndex::locate(const int32_t* pattern, int length, bool continuing, int32_t* node_out,
                         int* offset_out) const {
    int32_t node = kRoot;
    int offset = 0;
    int done = 0;
    while (done < length) {
        int32_t child = find_child(node, pattern[done]);
        if (child == kNone) return false;
        const Node& c = nodes_[child];
        const int32_t* lab = label(c);
        int take = std::min<int>(c.len, length - done);
        for (int i = 1; i < take; ++i) {
            if (lab[i] != pattern[done + i]) return false;
        }
        done += take;
        node = child;
        offset = take;
    }
    if (continuing && offset == nodes_[node].len && nodes_[node].child_sum == 0) return false;
    *node_out = node;
    *offset_out = offset;
    return true;
}

int64_t SuffixIndex::count(const int32_t* pattern, size_t n) const {
    if (n == 0 || n > static_cast<size_t>(max_depth_)) return 0;
    int32_t node;
    int offset;
    if (!locate(pattern, static_cast<int>(n), false, &node, &offset)) return 0;
    return nodes_[node].count;
}

Draft SuffixIndex::speculate(const int32_t* context, size_t n, int max_tokens, double min_prob, double match_factor,
                             double prior) const {
    Draft draft;
    if (n == 0 || max_tokens <= 0) return draft;
    const int cap = std::max(1, std::min<int>(static_cast<int>(std::min<size_t>(n, max_depth_)),
                                              max_depth_ - max_tokens));
    // "Occurs and continues" is monotone in the suffix length (if w t occurs, so does w[1:] t), so the longest such
    // suffix is found by binary search: O(log D) walks instead of the D walks of trying every length.
    int lo = 0, hi = cap;
    int32_t node = kRoot;
    int offset = 0;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        int32_t nd;
        int off;
        if (locate(context + n - mid, mid, true, &nd, &off)) {
            lo = mid;
            node = nd;
            offset = off;
        } else {
            hi = mid - 1;
        }
    }
    if (lo == 0) return draft;
    draft.match_len = lo;
    if (match_factor > 0.0) {
        // A short match is weak evidence, however deterministic its continuation looks.
        max_tokens = std::min(max_tokens, static_cast<int>(match_factor * lo + 1e-9));
    }
    draft.tokens.reserve(static_cast<size_t>(max_tokens));
    draft.probs.reserve(static_cast<size_t>(max_tokens));
    double prob = 1.0;
    int depth = lo;
    while (static_cast<int>(draft.tokens.size()) < max_tokens && depth < max_depth_) {
        const Node& cur = nodes_[node];
        int32_t token;
        double hits, total;
        if (offset < cur.len) {
            token = label(cur)[offset];  // inside an edge every occurrence continues the same way
            hits = total = cur.count;
            ++offset;
        } else {
            int32_t child = cur.best_child;
            if (child == kNone) break;
            token = first_token(child);
            hits = nodes_[child].count;
            total = cur.child_sum;
            node = child;
            offset = 1;
        }
        prob *= hits / (total + prior);
        if (prob < min_prob) break;
        draft.tokens.push_back(token);
        draft.probs.push_back(static_cast<float>(prob));
        draft.score += static_cast<float>(prob);
        ++depth;
    }
    return draft;
}

int64_t SuffixIndex::memory_bytes() const {
    int64_t total = static_cast<int64_t>(sizeof(*this));
    total += static_cast<int64_t>(nodes_.capacity() * sizeof(Node));
    total += static_cast<int64_t>(free_nodes_.capacity() * sizeof(int32_t));
    total += static_cast<int64_t>(slots_.capacity() * sizeof(Slot));
    total += static_cast<int64_t>(sequences_.capacity() * sizeof(Sequence));
    for (const Sequence& s : sequences_) {
        total += static_cast<int64_t>((s.tokens.capacity() + s.cursors.capacity()) * sizeof(int32_t));
    }
    return total;
}

std::vector<Draft> speculate_all(const std::vector<const SuffixIndex*>& indices, const int32_t* context, size_t n,
                                 int max_tokens, double min_prob, double match_factor, double prior) {
    std::vector<Draft> drafts;
    drafts.reserve(indices.size());
    for (const SuffixIndex* index : indices) {
        drafts.push_back(index->speculate(context, n, max_tokens, min_prob, match_factor, prior));
    }
    return drafts;
}

// ---- integrity --------------------------------------------------------------------------------------------

std::string SuffixIndex::check_node(int32_t node, int depth_before) const {
    const Node& nd = nodes_[node];
    auto where = [&](const char* what) { return "node " + std::to_string(node) + ": " + what; };
    if (node != kRoot) {
        if (nd.count <= 0) return where("count <= 0");
        if (nd.len < 1) return where("empty label");
        if (nd.depth != depth_before + nd.len) return where("depth != parent depth + label length");
        if (nd.depth > max_depth_) return where("deeper than max_depth");
        if (nd.seq < 0 || static_cast<size_t>(nd.seq) >= sequences_.size()) return where("label sequence invalid");
        if (static_cast<size_t>(nd.pos) + nd.len > sequences_[nd.seq].tokens.size()) return where("label out of range");
    }
    int64_t child_sum = 0;
    int32_t best = kNone;
    int32_t prev = kNone;
    for (int32_t c = nd.first_child; c != kNone; c = nodes_[c].next_sibling) {
        if (nodes_[c].parent != node) return where("child's parent pointer is wrong");
        if (nodes_[c].prev_sibling != prev) return where("sibling list is broken");
        if (find_child(node, first_token(c)) != c) return where("child not found through the child map");
        child_sum += nodes_[c].count;
        if (best == kNone || better(c, best)) best = c;
        std::string err = check_node(c, nd.depth);
        if (!err.empty()) return err;
        prev = c;
    }
    if (child_sum > nd.count) return where("children count more paths than the node");
    if (child_sum != nd.child_sum) return where("child_sum is stale");
    if (node != kRoot && nd.best_child != best) return where("best child is stale");
    return "";
}

std::string SuffixIndex::check_integrity() const {
    std::string err = check_node(kRoot, 0);
    if (!err.empty()) return err;
    std::vector<int32_t> refs(sequences_.size(), 0);
    int64_t edges = 0;
    for (size_t i = 1; i < nodes_.size(); ++i) {
        if (nodes_[i].seq != kNone) ++refs[nodes_[i].seq];
        if (nodes_[i].parent != kNone) ++edges;
    }
    for (size_t s = 0; s < sequences_.size(); ++s) {
        if (refs[s] != sequences_[s].label_refs) return "sequence " + std::to_string(s) + ": label_refs is stale";
    }
    if (edges != used_slots_) return "child map size differs from the number of edges";
    if (nodes_[kRoot].count != stored_tokens_) return "root count differs from the stored token count";
    return "";
}

}  // namespace das
