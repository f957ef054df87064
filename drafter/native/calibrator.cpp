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

int pos_bucket(int pos) {
    static constexpr int kUpper[] = {0, 1, 2, 3, 5, 8};  // inclusive upper ends of buckets 0..5
    int b = 0;
    while (b < 6 && pos > kUpper[b]) ++b;
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
    size_t token_cells =
        static_cast<size_t>(num_kinds) * kMatchBuckets * kPosBuckets * kCondBuckets * kTokenAgreeBuckets;
    token_sums_.assign(token_cells, 0.0);
    token_counts_.assign(token_cells, 0.0);
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

void Calibrator::fade(double& sum, double& count) const {
    if (count >= horizon_) {
        // Older observations fade geometrically so the table follows a drifting policy.
        double keep = (horizon_ - 1.0) / horizon_;
        sum *= keep;
        count *= keep;
    }
}

void Calibrator::observe(int cell, int accepted) {
    fade(sums_[cell], counts_[cell]);
    sums_[cell] += accepted;
    counts_[cell] += 1.0;
}

int Calibrator::token_cell(int kind, int match_len, int pos, double cond, int agree) const {
    if (kind < 0 || kind >= num_kinds_) {
        throw std::invalid_argument("Calibrator: kind " + std::to_string(kind) + " out of range");
    }
    int c = std::clamp(static_cast<int>(cond * kCondBuckets), 0, kCondBuckets - 1);
    int a = std::clamp(agree, 0, kTokenAgreeBuckets - 1);
    return (((kind * kMatchBuckets + match_bucket(match_len)) * kPosBuckets + pos_bucket(pos)) * kCondBuckets + c) *
               kTokenAgreeBuckets + a;
}

double Calibrator::token_prob(int cell, double cond) const {
    return (token_sums_[cell] + kTokenPseudoCount * cond) / (token_counts_[cell] + kTokenPseudoCount);
}

void Calibrator::observe_token(int cell, bool accepted) {
    fade(token_sums_[cell], token_counts_[cell]);
    token_sums_[cell] += accepted ? 1.0 : 0.0;
    token_counts_[cell] += 1.0;
}

Choice Calibrator::choose(const std::vector<const SuffixIndex*>& indices, const std::vector<int>& kinds,
                          const int32_t* context, size_t n, int max_tokens, double min_prob, double match_factor,
                          double prior, double floor) const {
    if (indices.size() != kinds.size()) throw std::invalid_argument("choose: one kind per index");
    Choice choice;
    choice.drafts = speculate_all(indices, context, n, max_tokens, min_prob, match_factor, prior);
    const size_t m = choice.drafts.size();
    choice.cells.assign(m, -1);
    choice.token_cells.assign(m, {});
    std::vector<int> agree;
    double best_value = 0.0;
    for (size_t i = 0; i < m; ++i) {
        Draft& d = choice.drafts[i];
        if (d.tokens.empty()) continue;
        const size_t len = d.tokens.size();
        // agree[j]: other sources whose drafts equal this one's up to and including token j.
        agree.assign(len, 0);
        int first_agree = 1;
        for (size_t o = 0; o < m; ++o) {
            if (o == i) continue;
            const std::vector<int32_t>& t = choice.drafts[o].tokens;
            size_t common = 0;
            while (common < len && common < t.size() && t[common] == d.tokens[common]) ++common;
            for (size_t j = 0; j < common; ++j) ++agree[j];
            first_agree += common > 0;
        }
        choice.cells[i] = cell(kinds[i], d.match_len, d.probs[0], first_agree);
        std::vector<int>& cells = choice.token_cells[i];
        cells.resize(len);
        double q = 1.0, previous = 1.0, value = 0.0, score = 0.0;
        int keep = -1;  // tokens above the floor: the first j with q_j < floor, once found
        for (size_t j = 0; j < len; ++j) {
            double cond = previous > 0.0 ? d.probs[j] / previous : 0.0;
            previous = d.probs[j];
            cells[j] = token_cell(kinds[i], d.match_len, static_cast<int>(j), cond, agree[j]);
            q *= token_prob(cells[j], cond);
            d.probs[j] = static_cast<float>(q);
            score += q;
            if (keep < 0 && q < floor) keep = static_cast<int>(j);
            if (keep < 0) value += q - floor;
        }
        d.score = static_cast<float>(score);
        if (keep < 0) keep = static_cast<int>(len);
        if (keep > 0 && value > best_value) {
            best_value = value;
            choice.best = static_cast<int>(i);
            choice.best_len = keep;
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
        // Token j is observed when the committed tokens reach it and every token before it matched.
        size_t seen = std::min({k + 1, t.size(), n});
        for (size_t j = 0; j < seen; ++j) observe_token(choice.token_cells[i][j], j < k);
    }
}

}  // namespace das
