#include "calibrator.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace das {

namespace {

int match_bucket(int match_len) {
    static constexpr int kUpper[] = {1, 2, 3, 5, 8, 12, 20};  // inclusive upper ends of buckets 0..6
    int b = 0;
    while (b < 7 && match_len > kUpper[b]) ++b;
    return b;
}

}  // namespace

Calibrator::Calibrator(int num_kinds, double pseudo_count, double horizon)
    : num_kinds_(num_kinds), pseudo_count_(pseudo_count), horizon_(horizon) {
    if (num_kinds < 1 || !(pseudo_count > 0.0) || !(horizon >= 1.0)) {
        throw std::invalid_argument("Calibrator: need num_kinds >= 1, pseudo_count > 0, horizon >= 1");
    }
    size_t cells = static_cast<size_t>(num_kinds) * kMatchBuckets * kProbBuckets * kAgreeBuckets;
    sums_.assign(cells, 0.0);
    counts_.assign(cells, 0.0);
}

int Calibrator::cell(int kind, int match_len, float first_prob, int agree) const {
    if (kind < 0 || kind >= num_kinds_) throw std::invalid_argument("Calibrator: kind " + std::to_string(kind) + " out of range");
    int p = std::clamp(static_cast<int>(first_prob * kProbBuckets), 0, kProbBuckets - 1);
    int a = std::clamp(agree, 1, kAgreeBuckets) - 1;
    return ((kind * kMatchBuckets + match_bucket(match_len)) * kProbBuckets + p) * kAgreeBuckets + a;
}

double Calibrator::expected(int cell, double score) const {
    return (sums_[cell] + pseudo_count_ * score) / (counts_[cell] + pseudo_count_);
}

void Calibrator::observe(int cell, int accepted) {
    if (counts_[cell] >= horizon_) {
        // Older observations fade geometrically so the table follows a drifting policy.
        double keep = (horizon_ - 1.0) / horizon_;
        sums_[cell] *= keep;
        counts_[cell] *= keep;
    }
    sums_[cell] += accepted;
    counts_[cell] += 1.0;
}

Choice Calibrator::choose(const std::vector<const SuffixIndex*>& indices, const std::vector<int>& kinds,
                          const int32_t* context, size_t n, int max_tokens, double min_prob, double match_factor,
                          double prior) const {
    if (indices.size() != kinds.size()) throw std::invalid_argument("choose: one kind per index");
    Choice choice;
    choice.drafts = speculate_all(indices, context, n, max_tokens, min_prob, match_factor, prior);
    choice.cells.assign(indices.size(), -1);
    double best_value = -1.0;
    for (size_t i = 0; i < choice.drafts.size(); ++i) {
        const Draft& d = choice.drafts[i];
        if (d.tokens.empty()) continue;
        int agree = 0;
        for (const Draft& other : choice.drafts) agree += !other.tokens.empty() && other.tokens[0] == d.tokens[0];
        choice.cells[i] = cell(kinds[i], d.match_len, d.probs[0], agree);
        double value = expected(choice.cells[i], d.score);
        if (value > best_value) {
            best_value = value;
            choice.best = static_cast<int>(i);
        }
    }
    return choice;
}

void Calibrator::observe_choice(const Choice& choice, const int32_t* committed, size_t n) {
    for (size_t i = 0; i < choice.drafts.size(); ++i) {
        if (choice.cells[i] < 0) continue;
        const std::vector<int32_t>& t = choice.drafts[i].tokens;
        size_t k = 0;
        while (k < n && k < t.size() && t[k] == committed[k]) ++k;
        observe(choice.cells[i], static_cast<int>(k));
    }
}

}  // namespace das
