// Online calibration of draft sources (see drafter/source_choice.py for the why).
//
// A candidate draft is described by (source kind, matched-context bucket, first-token probability bucket, number of
// sources proposing the same first token); a table learns the mean accepted tokens per cell from the committed
// tokens. choose() drafts from every index and picks the best expected candidate: O(sources) work beyond the
// drafts themselves. Threading: as SuffixIndex (one owner thread; bindings hold the GIL).
#pragma once

#include <cstdint>
#include <vector>

#include "suffix_index.h"

namespace das {

struct Choice {
    std::vector<Draft> drafts;  // one per source, empty where a source had nothing
    std::vector<int> cells;     // calibration cell per draft, -1 for an empty draft
    int best = -1;              // index of the chosen draft, -1 when every draft is empty
};

class Calibrator {
public:
    static constexpr int kMatchBuckets = 8;  // matched length 1, 2, 3, 4-5, 6-8, 9-12, 13-20, 21+
    static constexpr int kProbBuckets = 8;
    static constexpr int kAgreeBuckets = 3;  // 1, 2, 3+ sources agree on the first token

    Calibrator(int num_kinds, double pseudo_count, double horizon);

    int num_kinds() const { return num_kinds_; }
    int cell(int kind, int match_len, float first_prob, int agree) const;
    // Predicted accepted tokens: the cell's mean, starting from pseudo_count observations of `score`.
    double expected(int cell, double score) const;
    void observe(int cell, int accepted);

    Choice choose(const std::vector<const SuffixIndex*>& indices, const std::vector<int>& kinds,
                  const int32_t* context, size_t n, int max_tokens, double min_prob, double match_factor,
                  double prior) const;
    // Scores every candidate of a choice against the tokens committed after it (censored at their length).
    void observe_choice(const Choice& choice, const int32_t* committed, size_t n);

    const std::vector<double>& sums() const { return sums_; }
    const std::vector<double>& counts() const { return counts_; }

private:
    int num_kinds_;
    double pseudo_count_;
    double horizon_;
    std::vector<double> sums_;
    std::vector<double> counts_;
};

}  // namespace das
