// The in-flight requests' drafter state, stepped a whole batch per call (drafter/history.py's hot path).
//
// Each request (a slot, chosen by the caller) writes its output into one live sequence of its problem and drafts
// from its problem's sources. Per step the engine calls commit() with every row's newly committed tokens and then
// draft() with every row's draft length: one call each for the batch, instead of a handful of Python calls per
// request. Tokens are read in place from the engine's token table (row-major int32, one row per batch row).
//
// Per request the table keeps:
//   * the candidates of its last proposal (every source's draft), scored against the committed tokens for the
//     source chooser (calibrator.h);
//   * its last proposal, scored the way a verifier accepts it: the common prefix with the committed tokens, at
//     most all but the last one (a verification step commits the accepted draft tokens plus one token of its own);
//   * a shadow draft: a proposal nobody verifies, followed over the next committed tokens until its first wrong
//     token (drafter/history.py explains why it measures acceptance at no cost). One at a time, and the next only
//     `shadow_gap` committed tokens after one settles.
// Costs per row: commit O(max_depth) per committed token (the live index) plus O(candidate tokens); draft one
// Calibrator::choose (O(sources * max_depth) for the matches, O(K) per walk) for a row with K > 0 or a shadow
// draft starting, O(1) otherwise.
//
// Lifetimes: the table holds raw pointers to the live indexes and source lists it was given; the caller keeps
// them alive while any slot refers to them (the Python bindings hold references). Threading: as SuffixIndex.
#pragma once

#include <cstdint>
#include <vector>

#include "calibrator.h"
#include "suffix_index.h"

namespace das {

// The indexes a request of one problem drafts from and their calibrator kinds (one per index).
struct SourceList {
    std::vector<const SuffixIndex*> indices;
    std::vector<int> kinds;
};

// A row-major int32 token table: row r holds data[r * stride : (r + 1) * stride].
struct TokenTable {
    const int32_t* data;
    size_t rows;
    size_t stride;
};

// Per batch row, what commit() found (arrays of the batch's length, filled by commit).
struct CommitOutcome {
    int32_t* drafted;          // tokens of the row's last proposal (0 if it had none)
    int32_t* accepted;         // of those, the ones the committed tokens confirm
    int32_t* source;           // the last proposal's source kind, -1 if none
    int32_t* shadow_drafted;   // a shadow draft these tokens settled: its length, else 0
    int32_t* shadow_accepted;  // and its tokens that were the committed ones
};

// The drafter settings a draft() call applies to every row.
struct DraftSettings {
    double min_prob;      // floor on a draft token's cumulative probability (the per-row floor is the max)
    double match_factor;  // draft at most match_factor * matched tokens (0: no cap)
    double prior;         // pseudo-count discounting thin evidence
    int context;          // context tokens read before each row's end (the index depth)
    int vocab_size;       // a draft is cut before its first token >= vocab_size (0: no cut)
};

// Per batch row, the draft draft() proposed: tokens[offset[r] : offset[r + 1]] and their probabilities.
struct Drafts {
    std::vector<int32_t> tokens;
    std::vector<float> probs;
    std::vector<int64_t> offsets;     // rows + 1 entries
    std::vector<int32_t> sources;     // the chosen source kind, -1 where no draft
    std::vector<int32_t> match_lens;  // the chosen draft's matched context tokens, 0 where no draft
    std::vector<uint8_t> shadowed;    // 1 where a shadow draft started
};

class RequestTable {
public:
    RequestTable(Calibrator* chooser, int shadow_gap);

    // Registers a request under `slot` (replacing nothing: the slot must be free).
    void add(int slot, SuffixIndex* live, int32_t seq, const SourceList* sources);
    void set_sources(int slot, const SourceList* sources);
    void remove(int slot);
    bool contains(int slot) const;

    // Row r of the batch is request slots[r]; its committed tokens are table row rows[r], columns start[r] to
    // end[r] (none when end[r] <= start[r]). Feeds them into the live sequence, scores the last candidates for the
    // chooser, the last proposal (then forgotten) and the shadow draft. Every argument is checked before anything
    // changes (std::invalid_argument).
    void commit(const int32_t* slots, size_t n, const TokenTable& table, const int32_t* rows, const int64_t* start,
                const int64_t* end, const CommitOutcome& out);

    // Row r's context is table row rows[r], the `settings.context` tokens before column end[r]. With k[r] > 0:
    // the chooser's pick of at most k[r] tokens above max(settings.min_prob, min_prob[r]) (its candidates are
    // scored at the next commit); else, with shadow_room[r] > 0, a shadow draft of at most that many tokens may
    // start. Checked before anything changes.
    Drafts draft(const int32_t* slots, size_t n, const TokenTable& table, const int32_t* rows, const int64_t* end,
                 const int32_t* k, const double* min_prob, const int32_t* shadow_room,
                 const DraftSettings& settings);

private:
    struct Request {
        bool used = false;
        SuffixIndex* live = nullptr;
        int32_t seq = -1;
        const SourceList* sources = nullptr;
        Choice pending;                    // candidates of the last proposal (cells -1: none)
        std::vector<int32_t> proposal;     // the last proposal's tokens, scored at the next commit
        int32_t proposal_source = -1;
        std::vector<int32_t> shadow;       // the unsettled shadow draft (empty: none)
        int shadow_matched = 0;
        int shadow_wait = 0;               // tokens to commit before the next shadow draft may start
    };

    Calibrator* chooser_;
    int shadow_gap_;
    std::vector<Request> requests_;

    Request& checked(int slot, const char* what);
    void check_rows(const int32_t* slots, size_t n, const TokenTable& table, const int32_t* rows,
                    const int64_t* start, const int64_t* end, const char* what);
};

}  // namespace das
