#include "request_table.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace das {

namespace {

[[noreturn]] void fail(const char* what, const std::string& msg) {
    throw std::invalid_argument(std::string(what) + ": " + msg);
}

}  // namespace

RequestTable::RequestTable(Calibrator* chooser, int shadow_gap) : chooser_(chooser), shadow_gap_(shadow_gap) {
    if (chooser == nullptr) throw std::invalid_argument("RequestTable: a chooser is required");
    if (shadow_gap < 0) throw std::invalid_argument("RequestTable: shadow_gap must be >= 0");
}

RequestTable::Request& RequestTable::checked(int slot, const char* what) {
    if (slot < 0 || static_cast<size_t>(slot) >= requests_.size() || !requests_[slot].used) {
        fail(what, "no request in slot " + std::to_string(slot));
    }
    return requests_[slot];
}

void RequestTable::add(int slot, SuffixIndex* live, int32_t seq, const SourceList* sources) {
    if (slot < 0) fail("add", "slot must be >= 0");
    if (live == nullptr || sources == nullptr) fail("add", "a live index and a source list are required");
    if (!live->contains(seq)) fail("add", "sequence " + std::to_string(seq) + " is not in the live index");
    if (sources->indices.size() != sources->kinds.size()) fail("add", "one kind per source index");
    if (static_cast<size_t>(slot) >= requests_.size()) requests_.resize(slot + 1);
    Request& req = requests_[slot];
    if (req.used) fail("add", "slot " + std::to_string(slot) + " is in use");
    req = Request{};
    req.used = true;
    req.live = live;
    req.seq = seq;
    req.sources = sources;
}

void RequestTable::set_sources(int slot, const SourceList* sources) {
    if (sources == nullptr || sources->indices.size() != sources->kinds.size()) {
        fail("set_sources", "a source list with one kind per index is required");
    }
    checked(slot, "set_sources").sources = sources;
}

void RequestTable::remove(int slot) { checked(slot, "remove") = Request{}; }

bool RequestTable::contains(int slot) const {
    return slot >= 0 && static_cast<size_t>(slot) < requests_.size() && requests_[slot].used;
}

void RequestTable::check_rows(const int32_t* slots, size_t n, const TokenTable& table, const int32_t* rows,
                              const int64_t* start, const int64_t* end, const char* what) {
    std::vector<uint8_t> seen(requests_.size(), 0);
    for (size_t r = 0; r < n; ++r) {
        checked(slots[r], what);
        if (seen[slots[r]]++) fail(what, "slot " + std::to_string(slots[r]) + " appears twice");
        if (rows[r] < 0 || static_cast<size_t>(rows[r]) >= table.rows) {
            fail(what, "row " + std::to_string(rows[r]) + " is outside the token table");
        }
        int64_t lo = start != nullptr ? start[r] : 0;
        if (lo < 0 || end[r] < 0 || static_cast<uint64_t>(end[r]) > table.stride) {
            fail(what, "columns [" + std::to_string(lo) + ", " + std::to_string(end[r]) +
                           ") are outside the token table");
        }
        const int32_t* row = table.data + static_cast<size_t>(rows[r]) * table.stride;
        for (int64_t c = lo; start != nullptr && c < end[r]; ++c) {
            if (row[c] < 0) fail(what, "negative token id in row " + std::to_string(rows[r]));
        }
    }
}

void RequestTable::commit(const int32_t* slots, size_t n, const TokenTable& table, const int32_t* rows,
                          const int64_t* start, const int64_t* end, const CommitOutcome& out) {
    check_rows(slots, n, table, rows, start, end, "commit");
    for (size_t r = 0; r < n; ++r) {
        Request& req = requests_[slots[r]];
        out.drafted[r] = out.accepted[r] = out.shadow_drafted[r] = out.shadow_accepted[r] = 0;
        out.source[r] = -1;
        if (end[r] <= start[r]) continue;
        const int32_t* tokens = table.data + static_cast<size_t>(rows[r]) * table.stride + start[r];
        size_t count = static_cast<size_t>(end[r] - start[r]);
        chooser_->observe_choice(req.pending, tokens, count);
        req.pending = Choice{};
        if (!req.proposal.empty()) {
            size_t m = std::min(req.proposal.size(), count - 1), a = 0;
            while (a < m && req.proposal[a] == tokens[a]) ++a;
            out.drafted[r] = static_cast<int32_t>(req.proposal.size());
            out.accepted[r] = static_cast<int32_t>(a);
            out.source[r] = req.proposal_source;
            req.proposal.clear();
            req.proposal_source = -1;
        }
        req.live->extend(req.seq, tokens, count);
        if (req.shadow.empty()) {
            req.shadow_wait -= static_cast<int>(std::min<size_t>(count, 1 << 30));
            continue;
        }
        size_t matched = static_cast<size_t>(req.shadow_matched);
        size_t ahead = std::min(count, req.shadow.size() - matched), same = 0;
        while (same < ahead && req.shadow[matched + same] == tokens[same]) ++same;
        if (same == ahead && matched + ahead < req.shadow.size()) {
            req.shadow_matched = static_cast<int>(matched + ahead);
            continue;
        }
        out.shadow_drafted[r] = static_cast<int32_t>(req.shadow.size());
        out.shadow_accepted[r] = static_cast<int32_t>(matched + same);
        req.shadow.clear();
        req.shadow_matched = 0;
        req.shadow_wait = shadow_gap_;
    }
}

Drafts RequestTable::draft(const int32_t* slots, size_t n, const TokenTable& table, const int32_t* rows,
                           const int64_t* end, const int32_t* k, const double* min_prob,
                           const int32_t* shadow_room, const DraftSettings& settings) {
    check_rows(slots, n, table, rows, nullptr, end, "draft");
    if (!(settings.min_prob >= 0.0 && settings.min_prob <= 1.0) || settings.context < 1 ||
        !(settings.match_factor >= 0.0) || !(settings.prior >= 0.0) || settings.vocab_size < 0) {
        fail("draft", "invalid settings");
    }
    for (size_t r = 0; r < n; ++r) {
        if (!(min_prob[r] >= 0.0)) fail("draft", "min_prob must be >= 0");
    }
    Drafts out;
    out.offsets.assign(n + 1, 0);
    out.sources.assign(n, -1);
    out.match_lens.assign(n, 0);
    out.shadowed.assign(n, 0);
    for (size_t r = 0; r < n; ++r) {
        Request& req = requests_[slots[r]];
        out.offsets[r + 1] = out.offsets[r];
        req.proposal.clear();
        req.proposal_source = -1;
        bool drafts = k[r] > 0 && min_prob[r] <= 1.0;
        bool shadows = k[r] <= 0 && shadow_room[r] > 0 && req.shadow.empty() && req.shadow_wait <= 0;
        if (!drafts && !shadows) continue;
        int64_t lo = std::max<int64_t>(0, end[r] - settings.context);
        const int32_t* context = table.data + static_cast<size_t>(rows[r]) * table.stride + lo;
        // The walks stop on the index's own estimate under settings.min_prob; the row's floor (the budget's price)
        // applies to the calibrated estimate.
        double floor = drafts ? std::max(settings.min_prob, min_prob[r]) : settings.min_prob;
        Choice choice = chooser_->choose(req.sources->indices, req.sources->kinds, context,
                                         static_cast<size_t>(end[r] - lo), drafts ? k[r] : shadow_room[r],
                                         settings.min_prob, settings.match_factor, settings.prior, floor);
        if (!drafts) {  // a shadow draft: the chooser does not learn from it
            if (choice.best >= 0) {
                const std::vector<int32_t>& walk = choice.drafts[choice.best].tokens;
                req.shadow.assign(walk.begin(), walk.begin() + choice.best_len);
                req.shadow_matched = 0;
                out.shadowed[r] = 1;
            }
            continue;
        }
        if (choice.best >= 0) {
            const Draft& best = choice.drafts[choice.best];
            size_t len = static_cast<size_t>(choice.best_len);
            if (settings.vocab_size > 0) {
                len = std::find_if(best.tokens.begin(), best.tokens.begin() + len,
                                   [&](int32_t t) { return t >= settings.vocab_size; }) - best.tokens.begin();
            }
            req.proposal.assign(best.tokens.begin(), best.tokens.begin() + len);
            req.proposal_source = req.sources->kinds[choice.best];
            out.tokens.insert(out.tokens.end(), best.tokens.begin(), best.tokens.begin() + len);
            out.probs.insert(out.probs.end(), best.probs.begin(), best.probs.begin() + len);
            out.offsets[r + 1] += static_cast<int64_t>(len);
            if (len) {
                out.sources[r] = req.proposal_source;
                out.match_lens[r] = best.match_len;
            }
        }
        req.pending = std::move(choice);
    }
    return out;
}

}  // namespace das
