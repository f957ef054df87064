// Depth-limited suffix trie with occurrence counts over many token sequences.
//
// Semantics (what the pure-Python reference in tests/drafter/reference_index.py implements naively):
//   occ(w)   = number of positions j over all stored sequences s with s[j : j+|w|] == w, for 1 <= |w| <= D.
//   next(w)  = sum over tokens t of occ(w t): the occurrences of w that continue (a sequence's unfinished tail
//              and sequence ends do not count).
//   P(t | w) = occ(w t) / (next(w) + prior)    (prior: a pseudo-count that discounts thin evidence; 0 = empirical).
//   speculate(context, K, min_prob, match_factor, prior): w = the longest suffix of the context, at most
//   max(1, min(|context|, D - K)) tokens, with next(w) > 0 (monotone in |w|, so binary search finds it); then
//   greedily append the token t maximising occ(w t) (ties: smaller token id) while |w| < D, at most
//   K' = K (or min(K, floor(match_factor * |w|)) when match_factor > 0) tokens, and while the cumulative
//   probability stays >= min_prob.
//
// Layout: a path-compressed trie. A node's edge label is a slice (seq, pos, len) of a stored sequence, so memory
// is O(number of branch points), not O(N * D). Invariant: every suffix path ends on a node boundary, so counts are
// constant along an edge. A live sequence keeps one cursor per unfinished suffix (at most D); appending a token
// advances each cursor by one token, so append is O(D) hash lookups. Costs: append O(D); speculate
// O(log D) walks of at most D tokens to find the match plus O(K) for the draft; remove O(len * nodes per path).
//
// Threading: not thread-safe. One index belongs to one thread at a time; the Python bindings keep the GIL held
// for every call, so concurrent Python threads are serialised and never race.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace das {

struct Draft {
    std::vector<int32_t> tokens;
    // probs[i]: estimated probability that tokens[0..i] are all accepted (product of conditionals).
    std::vector<float> probs;
    float score = 0.0f;  // sum of probs: the expected number of accepted tokens.
    int match_len = 0;   // length of the context suffix that was matched.
};

class SuffixIndex {
public:
    static constexpr int kMaxDepthLimit = 255;  // labels and depths are stored in one byte

    explicit SuffixIndex(int max_depth);

    int max_depth() const { return max_depth_; }

    // Starts a new, empty live sequence and returns its id (ids are dense and never reused).
    int32_t new_sequence();
    // Appends tokens to a live sequence. Throws std::invalid_argument on a bad id, a sealed or removed sequence,
    // or a negative token id; nothing is changed in that case.
    void extend(int32_t seq_id, const int32_t* tokens, size_t n);
    // Marks a sequence finished: frees its cursors; no more appends.
    void seal(int32_t seq_id);
    // Removes every suffix of the sequence. Its token storage is freed once no edge label refers to it.
    void remove(int32_t seq_id);

    // Only the last max(1, min(n, D - max_tokens)) context tokens are read.
    Draft speculate(const int32_t* context, size_t n, int max_tokens, double min_prob, double match_factor = 0.0,
                    double prior = 0.0) const;

    // occ(w) for 1 <= |w| <= D (0 otherwise). For tests and diagnostics.
    int64_t count(const int32_t* pattern, size_t n) const;

    bool contains(int32_t seq_id) const;
    std::vector<int32_t> sequence(int32_t seq_id) const;
    int64_t num_sequences() const { return live_sequences_; }
    int64_t num_tokens() const { return stored_tokens_; }
    int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size() - free_nodes_.size()); }
    // Bytes held: node array, hash table, token storage (including storage retained by labels), cursors.
    int64_t memory_bytes() const;
    // Empty string when every structural invariant holds, else a description of the first violation.
    std::string check_integrity() const;

private:
    static constexpr int32_t kNone = -1;
    static constexpr int32_t kRoot = 0;

    struct Node {
        int32_t count = 0;         // occ of this node's string
        int32_t child_sum = 0;     // sum of the children's counts: next() of this node's string
        int32_t seq = kNone;       // label = sequences_[seq].tokens[pos : pos + len]
        int32_t pos = 0;
        int32_t parent = kNone;
        int32_t first_child = kNone;
        int32_t next_sibling = kNone;
        int32_t prev_sibling = kNone;
        int32_t best_child = kNone;  // max count, ties to the smaller first token; unused at the root
        uint8_t len = 0;
        uint8_t depth = 0;         // string depth at the end of the label
    };

    struct Sequence {
        std::vector<int32_t> tokens;
        std::vector<int32_t> cursors;  // nodes where the unfinished suffixes end, longest first
        int32_t label_refs = 0;        // edge labels pointing into tokens
        bool sealed = false;
        bool removed = false;
    };

    // Open-addressing (linear probing) map from (parent, first token) to child. Slots hold the token and the child;
    // the parent is checked through the child node, which keeps a slot at 8 bytes.
    struct Slot {
        int32_t token;
        int32_t child;  // kNone = empty
    };

    int max_depth_;
    std::vector<Node> nodes_;
    std::vector<int32_t> free_nodes_;
    std::vector<Sequence> sequences_;
    std::vector<Slot> slots_;
    int64_t used_slots_ = 0;
    int64_t live_sequences_ = 0;
    int64_t stored_tokens_ = 0;

    const int32_t* label(const Node& n) const { return sequences_[n.seq].tokens.data() + n.pos; }
    int32_t first_token(int32_t node) const { return *label(nodes_[node]); }

    size_t home(int32_t parent, int32_t token) const;
    int32_t find_child(int32_t parent, int32_t token) const;
    size_t slot_of(int32_t parent, int32_t token, int32_t child) const;
    void insert_edge(int32_t parent, int32_t token, int32_t child);
    void erase_slot(size_t i);
    void grow_slots();

    int32_t alloc_node();
    void free_node(int32_t node);
    void set_label(int32_t node, int32_t seq, int32_t pos, int len);
    void link_child(int32_t parent, int32_t child);
    void unlink_child(int32_t child);
    void replace_child(int32_t old_child, int32_t new_child);
    bool better(int32_t a, int32_t b) const;
    void offer_best(int32_t parent, int32_t child);
    void rescan_best(int32_t parent);

    void append_token(int32_t seq_id, int32_t token);
    int32_t advance(int32_t seq_id, int32_t cursor, int32_t token, int32_t pos);
    void release_storage_if_unused(int32_t seq_id);
    Sequence& checked_sequence(int32_t seq_id, const char* what);

    // Walks the pattern from the root. Returns false if it does not occur; else node and tokens of its label used.
    // With `continuing`, also false when no occurrence of the pattern continues (next(pattern) == 0).
    bool locate(const int32_t* pattern, int length, bool continuing, int32_t* node, int* offset) const;
    std::string check_node(int32_t node, int depth_before) const;
};

// One draft per index for the same context (empty where an index has no continuing match): one call per decode
// step per request, whatever the number of sources.
std::vector<Draft> speculate_all(const std::vector<const SuffixIndex*>& indices, const int32_t* context, size_t n,
                                 int max_tokens, double min_prob, double match_factor, double prior);

}  // namespace das
