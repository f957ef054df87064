// Online calibration of draft sources (see drafter/source_choice.py for the why).
//
// A candidate draft is described by (source kind, matched-context bucket, first-token probability bucket, number of
// sources proposing the same first token); a table learns the mean accepted tokens per cell from the committed
// tokens (reported per source kind).
//
// A second table calibrates each draft token: P(token j is accepted | tokens before it are), per cell (source kind,
// matched-context bucket, position bucket, the walk's own conditional probability bucket, number of other sources
// whose drafts agree up to and including token j). A candidate's calibrated cumulative probability q_j is the product
// of its tokens' calibrated conditionals; a draft stops before its first token with q_j under the floor (the budget's
// price of a draft token: a token is worth verifying when its chance to be accepted beats its price), and choose()
// picks the candidate with the most expected accepted tokens net of that price, sum_j (q_j - floor). Every
// candidate's tokens are scored against the committed ones (a token is observed when the committed tokens reach it
// and every token before it matched), so the tokens just past a stop teach where to stop.
// Costs: choose() O(sources^2 * K) for the agreement counts and O(sources * K) table reads beyond the drafts
// themselves; observe O(candidate tokens). Threading: as SuffixIndex (one owner thread; bindings hold the GIL).
#pragma once

#include <cstdint>
#include <vector>

#include "suffix_index.h"

namespace das {

struct Choice {
    std::vector<Draft> drafts;  // one per source, empty where a source had nothing
    std::vector<int> cells;     // calibration cell per draft, -1 for an empty draft
    std::vector<std::vector<int>> token_cells;  // per draft, the token calibration cell of each of its tokens
    int best = -1;              // index of the chosen draft, -1 when none has a token worth its price
    int best_len = 0;           // tokens of the chosen draft above the floor (its walk may go on: scored, not sent)
};

class Calibrator {
public:
    static constexpr int kMatchBuckets = 8;  // matched length 1, 2, 3, 4-5, 6-8, 9-12, 13-20, 21+
    static constexpr int kProbBuckets = 8;
    static constexpr int kAgreeBuckets = 3;  // 1, 2, 3+ sources agree on the first token
    static constexpr int kPosBuckets = 7;    // draft position 0, 1, 2, 3, 4-5, 6-8, 9+
    static constexpr int kCondBuckets = 10;  // the walk's conditional probability, tenths
    static constexpr int kTokenAgreeBuckets = 3;  // 0, 1, 2+ other sources agree up to the token
    static constexpr double kTokenPseudoCount = 4.0;  // weight of the walk's own conditional before feedback

    Calibrator(int num_kinds, double pseudo_count, double horizon);

    int num_kinds() const { return num_kinds_; }
    int cell(int kind, int match_len, float first_prob, int agree) const;
    // Predicted accepted tokens: the cell's mean, starting from pseudo_count observations of `score`.
    double expected(int cell, double score) const;
    void observe(int cell, int accepted);
    int token_cell(int kind, int match_len, int pos, double cond, int agree) const;
    // Calibrated P(accepted | the tokens before accepted): the cell's rate, starting from kTokenPseudoCount
    // observations of the walk's own conditional `cond`.
    double token_prob(int cell, double cond) const;
    void observe_token(int cell, bool accepted);

    // Walks every index (stopping where the walk's own cumulative probability falls under `min_prob`), calibrates
    // every candidate's tokens, and picks the one with the most expected accepted tokens net of `floor` per token,
    // cut before its first token whose calibrated cumulative probability is under `floor`. Each draft's probs become
    // its calibrated cumulative probabilities and its score their sum over the whole walk.
    Choice choose(const std::vector<const SuffixIndex*>& indices, const std::vector<int>& kinds,
                  const int32_t* context, size_t n, int max_tokens, double min_prob, double match_factor,
                  double prior, double floor = 0.0) const;
    // Scores every candidate of a choice against the tokens committed after it (censored at their length).
    void observe_choice(const Choice& choice, const int32_t* committed, size_t n);

    const std::vector<double>& sums() const { return sums_; }
    const std::vector<double>& counts() const { return counts_; }
    const std::vector<double>& token_sums() const { return token_sums_; }
    const std::vector<double>& token_counts() const { return token_counts_; }

private:
    int num_kinds_;
    double pseudo_count_;
    double horizon_;
    std::vector<double> sums_;
    std::vector<double> counts_;
    std::vector<double> token_sums_;
    std::vector<double> token_counts_;

    void fade(double& sum, double& count) const;
};

}  // namespace das
