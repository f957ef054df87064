// Python bindings of the suffix index (module das.drafter._suffix_index).
//
// Token arguments accept a 1-D int32 NumPy array (read in place, no copy) or any sequence of ints (converted,
// each checked to lie in [0, 2**31 - 1]). Every call keeps the GIL: see the threading contract in suffix_index.h.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "calibrator.h"
#include "request_table.h"
#include "suffix_index.h"

namespace nb = nanobind;
using das::Calibrator;
using das::Choice;
using das::Draft;
using das::RequestTable;
using das::SourceList;
using das::SuffixIndex;

namespace {

using TokenArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

std::vector<int32_t> to_tokens(const nb::handle& obj, const char* what) {
    std::vector<int32_t> out;
    if (!nb::isinstance<nb::sequence>(obj) || nb::isinstance<nb::str>(obj) || nb::isinstance<nb::bytes>(obj)) {
        throw nb::type_error((std::string(what) + ": expected a sequence of token ids or an int32 array").c_str());
    }
    size_t n = nb::len(obj);
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        nb::handle item = obj[i];
        if (!PyLong_Check(item.ptr()) || PyBool_Check(item.ptr())) {
            if (!PyIndex_Check(item.ptr())) {
                throw nb::type_error((std::string(what) + ": item " + std::to_string(i) + " is not an integer").c_str());
            }
        }
        int overflow = 0;
        nb::object index = nb::steal(PyNumber_Index(item.ptr()));
        if (!index.is_valid()) throw nb::python_error();
        long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
        if (overflow != 0 || v < 0 || v > INT32_MAX) {
            throw nb::value_error((std::string(what) + ": token id at position " + std::to_string(i) +
                                   " is outside [0, 2147483647]").c_str());
        }
        out.push_back(static_cast<int32_t>(v));
    }
    return out;
}

// A NumPy array owning a copy of v: one allocation, no per-element Python objects.
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(const std::vector<T>& v) {
    T* data = new T[v.size()];
    std::copy(v.begin(), v.end(), data);
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
    return nb::ndarray<nb::numpy, T, nb::ndim<1>>(data, {v.size()}, owner);
}

// Runs fn(pointer, length) on the tokens of obj without copying when obj is a contiguous int32 array.
template <typename Fn>
auto with_tokens(const nb::handle& obj, const char* what, Fn&& fn) {
    TokenArray arr;
    if (nb::try_cast<TokenArray>(obj, arr, false)) return fn(arr.data(), arr.shape(0));
    std::vector<int32_t> tokens = to_tokens(obj, what);
    return fn(tokens.data(), tokens.size());
}

void check_speculate_args(const char* what, int max_tokens, double min_prob, double match_factor, double prior) {
    auto fail = [&](const char* msg) { throw nb::value_error((std::string(what) + ": " + msg).c_str()); };
    if (max_tokens < 0) fail("max_tokens must be >= 0");
    if (!(min_prob >= 0.0 && min_prob <= 1.0)) fail("min_prob must be in [0, 1]");
    if (!(match_factor >= 0.0 && match_factor < 1e6)) fail("match_factor must be finite and >= 0");
    if (!(prior >= 0.0 && prior < 1e9)) fail("prior must be finite and >= 0");
}

template <typename T>
using Column = nb::ndarray<const T, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using TokenTable2D = nb::ndarray<const int32_t, nb::ndim<2>, nb::device::cpu, nb::c_contig>;

// A source list that keeps its indexes' Python objects alive for as long as it lives.
struct PySourceList : SourceList {
    std::vector<nb::object> keep;
};

// A request table that keeps alive what its slots point to: the chooser, each slot's live index and source list.
struct PyRequestTable : RequestTable {
    PyRequestTable(nb::object chooser_obj, int shadow_gap)
        : RequestTable(nb::cast<das::Calibrator*>(chooser_obj), shadow_gap), chooser(std::move(chooser_obj)) {}
    nb::object chooser;
    std::vector<std::pair<nb::object, nb::object>> keep;  // per slot: (live index, source list)
};

template <typename T>
const T* column(const Column<T>& a, size_t n, const char* what, const char* name) {
    if (a.shape(0) != n) {
        throw nb::value_error((std::string(what) + ": " + name + " must have one entry per row").c_str());
    }
    return a.data();
}

das::TokenTable token_table(const TokenTable2D& t) { return {t.data(), t.shape(0), t.shape(1)}; }

}  // namespace

NB_MODULE(_suffix_index, m) {
    m.doc() = "Native depth-limited suffix index for draft-token speculation.";
    // vLLM's engine core holds the proposer's indexes until its interpreter exits, after nanobind's own teardown:
    // reported as "leaked instances" on every engine stop, though the process is ending and frees them.
    nb::set_leak_warnings(false);

    nb::class_<Draft>(m, "Draft", "A draft continuation proposed by SuffixIndex.speculate.")
        .def_prop_ro("tokens", [](const Draft& d) { return to_numpy(d.tokens); }, nb::rv_policy::move,
                     "Draft token ids (int32 array).")
        .def_prop_ro("probs", [](const Draft& d) { return to_numpy(d.probs); }, nb::rv_policy::move,
                     "probs[i]: estimated probability that tokens[:i+1] are all accepted (float32 array).")
        .def_ro("score", &Draft::score, "Sum of probs: expected accepted tokens.")
        .def_ro("match_len", &Draft::match_len, "Length of the matched context suffix (0: no match).")
        .def("__len__", [](const Draft& d) { return d.tokens.size(); })
        .def("__repr__", [](const Draft& d) {
            return "Draft(len=" + std::to_string(d.tokens.size()) + ", score=" + std::to_string(d.score) +
                   ", match_len=" + std::to_string(d.match_len) + ")";
        });

    nb::class_<SuffixIndex>(m, "SuffixIndex",
                            "Depth-limited, path-compressed suffix trie with occurrence counts over token sequences.\n"
                            "Not thread-safe; calls hold the GIL.")
        .def(nb::init<int>(), nb::arg("max_depth") = 64)
        .def_prop_ro("max_depth", &SuffixIndex::max_depth)
        .def("new_sequence", &SuffixIndex::new_sequence, "Start an empty live sequence; returns its id.")
        .def(
            "extend",
            [](SuffixIndex& self, int32_t seq_id, nb::handle tokens) {
                with_tokens(tokens, "extend", [&](const int32_t* p, size_t n) {
                    self.extend(seq_id, p, n);
                    return 0;
                });
            },
            nb::arg("seq_id"), nb::arg("tokens"), "Append tokens to a live sequence (O(max_depth) per token).")
        .def("seal", &SuffixIndex::seal, nb::arg("seq_id"), "Finish a sequence: frees its cursors.")
        .def("remove", &SuffixIndex::remove, nb::arg("seq_id"), "Remove a sequence and all its suffixes.")
        .def(
            "speculate",
            [](const SuffixIndex& self, nb::handle context, int max_tokens, double min_prob, double match_factor,
               double prior) {
                check_speculate_args("speculate", max_tokens, min_prob, match_factor, prior);
                return with_tokens(context, "speculate", [&](const int32_t* p, size_t n) {
                    return self.speculate(p, n, max_tokens, min_prob, match_factor, prior);
                });
            },
            nb::arg("context"), nb::arg("max_tokens"), nb::arg("min_prob") = 0.0, nb::arg("match_factor") = 0.0,
            nb::arg("prior") = 0.0,
            "Draft up to max_tokens tokens continuing the context.")
        .def(
            "count",
            [](const SuffixIndex& self, nb::handle pattern) {
                return with_tokens(pattern, "count",
                                   [&](const int32_t* p, size_t n) { return self.count(p, n); });
            },
            nb::arg("pattern"), "Occurrences of pattern (0 if empty or longer than max_depth).")
        .def("contains", &SuffixIndex::contains, nb::arg("seq_id"))
        .def("sequence", &SuffixIndex::sequence, nb::arg("seq_id"), "The tokens of a sequence.")
        .def_prop_ro("num_sequences", &SuffixIndex::num_sequences)
        .def_prop_ro("num_tokens", &SuffixIndex::num_tokens)
        .def_prop_ro("num_nodes", &SuffixIndex::num_nodes)
        .def("memory_bytes", &SuffixIndex::memory_bytes, "Bytes held by the index.")
        .def("check_integrity", &SuffixIndex::check_integrity,
             "Empty string if all invariants hold, else the first violation (walks everything: tests only).");

    m.def(
        "speculate_all",
        [](const std::vector<const SuffixIndex*>& indices, nb::handle context, int max_tokens, double min_prob,
           double match_factor, double prior) {
            check_speculate_args("speculate_all", max_tokens, min_prob, match_factor, prior);
            for (const SuffixIndex* ix : indices) {
                if (ix == nullptr) throw nb::type_error("speculate_all: indices must not contain None");
            }
            return with_tokens(context, "speculate_all", [&](const int32_t* p, size_t n) {
                return das::speculate_all(indices, p, n, max_tokens, min_prob, match_factor, prior);
            });
        },
        nb::arg("indices"), nb::arg("context"), nb::arg("max_tokens"), nb::arg("min_prob") = 0.0,
        nb::arg("match_factor") = 0.0, nb::arg("prior") = 0.0,
        "One draft per index for the same context (an empty draft where an index has no continuing match).");

    nb::class_<Choice>(m, "Choice", "All sources' drafts for one step and the one the calibrator picked.")
        .def_ro("best", &Choice::best, "Index of the chosen draft, -1 when no source had a token worth its price.")
        .def_prop_ro(
            "tokens",
            [](const Choice& c) {
                if (c.best < 0) return to_numpy(std::vector<int32_t>{});
                const std::vector<int32_t>& t = c.drafts[c.best].tokens;
                return to_numpy(std::vector<int32_t>(t.begin(), t.begin() + c.best_len));
            },
            nb::rv_policy::move, "The chosen draft's tokens above the floor (empty int32 array when none).")
        .def_prop_ro(
            "probs",
            [](const Choice& c) {
                if (c.best < 0) return to_numpy(std::vector<float>{});
                const std::vector<float>& p = c.drafts[c.best].probs;
                return to_numpy(std::vector<float>(p.begin(), p.begin() + c.best_len));
            },
            nb::rv_policy::move, "The chosen draft's calibrated cumulative acceptance probabilities.")
        .def_prop_ro("match_len", [](const Choice& c) { return c.best < 0 ? 0 : c.drafts[c.best].match_len; })
        .def_prop_ro("drafts", [](const Choice& c) { return c.drafts; }, "Every source's draft.")
        .def_ro("cells", &Choice::cells, "Calibration cell per draft (-1 for an empty draft).")
        .def_ro("token_cells", &Choice::token_cells, "Per draft, the token calibration cell of each token.")
        .def_ro("best_len", &Choice::best_len, "Tokens of the chosen draft above the floor.");

    nb::class_<Calibrator>(m, "Calibrator",
                           "Learns mean accepted tokens per candidate-draft cell from committed tokens and picks the "
                           "best candidate each step. Not thread-safe; calls hold the GIL.")
        .def(nb::init<int, double, double>(), nb::arg("num_kinds"), nb::arg("pseudo_count") = 5.0,
             nb::arg("horizon") = 2000.0)
        .def_prop_ro("num_kinds", &Calibrator::num_kinds)
        .def("cell", &Calibrator::cell, nb::arg("kind"), nb::arg("match_len"), nb::arg("first_prob"), nb::arg("agree"))
        .def("expected", &Calibrator::expected, nb::arg("cell"), nb::arg("score"))
        .def(
            "choose",
            [](const Calibrator& self, const std::vector<const SuffixIndex*>& indices, const std::vector<int>& kinds,
               nb::handle context, int max_tokens, double min_prob, double match_factor, double prior, double floor) {
                check_speculate_args("choose", max_tokens, min_prob, match_factor, prior);
                if (!(floor >= 0.0)) throw nb::value_error("choose: floor must be >= 0");
                for (const SuffixIndex* ix : indices) {
                    if (ix == nullptr) throw nb::type_error("choose: indices must not contain None");
                }
                for (int k : kinds) {
                    if (k < 0 || k >= self.num_kinds()) throw nb::value_error("choose: kind out of range");
                }
                return with_tokens(context, "choose", [&](const int32_t* p, size_t n) {
                    return self.choose(indices, kinds, p, n, max_tokens, min_prob, match_factor, prior, floor);
                });
            },
            nb::arg("indices"), nb::arg("kinds"), nb::arg("context"), nb::arg("max_tokens"),
            nb::arg("min_prob") = 0.0, nb::arg("match_factor") = 0.0, nb::arg("prior") = 0.0, nb::arg("floor") = 0.0,
            "Draft from every index (walks stop under min_prob), calibrate every candidate's tokens, and pick the "
            "one with the most expected accepted tokens net of `floor` per token, cut before its first token whose "
            "calibrated cumulative probability is under `floor`.")
        .def(
            "observe",
            [](Calibrator& self, const Choice& choice, nb::handle committed) {
                for (int c : choice.cells) {
                    if (c >= static_cast<int>(self.counts().size())) throw nb::value_error("observe: foreign choice");
                }
                with_tokens(committed, "observe", [&](const int32_t* p, size_t n) {
                    self.observe_choice(choice, p, n);
                    return 0;
                });
            },
            nb::arg("choice"), nb::arg("committed"), "Score every candidate of `choice` against the committed tokens.")
        .def_prop_ro("sums", [](const Calibrator& c) { return to_numpy(c.sums()); }, nb::rv_policy::move)
        .def_prop_ro("counts", [](const Calibrator& c) { return to_numpy(c.counts()); }, nb::rv_policy::move)
        .def("token_cell", &Calibrator::token_cell, nb::arg("kind"), nb::arg("match_len"), nb::arg("pos"),
             nb::arg("cond"), nb::arg("agree"))
        .def("token_prob", &Calibrator::token_prob, nb::arg("cell"), nb::arg("cond"))
        .def_prop_ro("token_sums", [](const Calibrator& c) { return to_numpy(c.token_sums()); }, nb::rv_policy::move)
        .def_prop_ro("token_counts", [](const Calibrator& c) { return to_numpy(c.token_counts()); },
                     nb::rv_policy::move);
    nb::class_<PySourceList>(m, "SourceList", "The indexes a request of one problem drafts from, with their kinds.")
        .def(
            "__init__",
            [](PySourceList* self, nb::list indices, const std::vector<int>& kinds) {
                if (nb::len(indices) != kinds.size()) throw nb::value_error("SourceList: one kind per index");
                new (self) PySourceList();
                for (nb::handle h : indices) {
                    self->indices.push_back(nb::cast<const SuffixIndex*>(h));
                    if (self->indices.back() == nullptr) throw nb::type_error("SourceList: an index is None");
                    self->keep.push_back(nb::borrow(h));
                }
                self->kinds = kinds;
            },
            nb::arg("indices"), nb::arg("kinds"))
        .def_prop_ro("kinds", [](const PySourceList& s) { return s.kinds; })
        .def("__len__", [](const PySourceList& s) { return s.indices.size(); });

    nb::class_<PyRequestTable>(m, "RequestTable",
                               "The in-flight requests' drafter state, stepped a whole batch per call "
                               "(request_table.h). Not thread-safe; calls hold the GIL.")
        .def(
            "__init__",
            [](PyRequestTable* self, nb::object chooser, int shadow_gap) {
                if (!nb::isinstance<das::Calibrator>(chooser)) throw nb::type_error("RequestTable: chooser must be a Calibrator");
                new (self) PyRequestTable(std::move(chooser), shadow_gap);
            },
            nb::arg("chooser"), nb::arg("shadow_gap"))
        .def(
            "add",
            [](PyRequestTable& self, int slot, nb::object live, int32_t seq, nb::object sources) {
                self.add(slot, nb::cast<SuffixIndex*>(live), seq, nb::cast<PySourceList*>(sources));
                if (static_cast<size_t>(slot) >= self.keep.size()) self.keep.resize(slot + 1);
                self.keep[slot] = {std::move(live), std::move(sources)};
            },
            nb::arg("slot"), nb::arg("live"), nb::arg("seq"), nb::arg("sources"),
            "Registers a request: it writes into sequence `seq` of `live` and drafts from `sources`.")
        .def(
            "set_sources",
            [](PyRequestTable& self, int slot, nb::object sources) {
                self.set_sources(slot, nb::cast<PySourceList*>(sources));
                self.keep[slot].second = std::move(sources);
            },
            nb::arg("slot"), nb::arg("sources"))
        .def(
            "remove",
            [](PyRequestTable& self, int slot) {
                self.remove(slot);
                self.keep[slot] = {};
            },
            nb::arg("slot"))
        .def("__contains__", &PyRequestTable::contains, nb::arg("slot"))
        .def(
            "commit",
            [](PyRequestTable& self, const Column<int32_t>& slots, const TokenTable2D& table,
               const Column<int32_t>& rows, const Column<int64_t>& start, const Column<int64_t>& end) {
                size_t n = slots.shape(0);
                std::vector<int32_t> out(5 * n);
                das::CommitOutcome outcome{out.data(), out.data() + n, out.data() + 2 * n, out.data() + 3 * n,
                                           out.data() + 4 * n};
                self.commit(slots.data(), n, token_table(table), column(rows, n, "commit", "rows"),
                            column(start, n, "commit", "start"), column(end, n, "commit", "end"), outcome);
                int32_t* data = new int32_t[out.size()];
                std::copy(out.begin(), out.end(), data);
                nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
                return nb::ndarray<nb::numpy, int32_t, nb::ndim<2>>(data, {5, n}, owner);
            },
            nb::arg("slots"), nb::arg("table"), nb::arg("rows"), nb::arg("start"), nb::arg("end"),
            "Feeds each row's committed tokens table[rows[r], start[r]:end[r]] for request slots[r]. Returns an "
            "int32 array of shape (5, rows): the last proposal's length, its accepted tokens and its source kind "
            "(-1: none), and a shadow draft settled by these tokens: its length and accepted tokens (0, 0: none).")
        .def(
            "commit_one",
            [](PyRequestTable& self, int slot, nb::handle tokens) {
                return with_tokens(tokens, "commit_one", [&](const int32_t* p, size_t n) {
                    int32_t out[5], row = 0;
                    int64_t start = 0, end = static_cast<int64_t>(n);
                    self.commit(&slot, 1, {p, 1, n}, &row, &start, &end,
                                {out, out + 1, out + 2, out + 3, out + 4});
                    return nb::make_tuple(out[0], out[1], out[2], out[3], out[4]);
                });
            },
            nb::arg("slot"), nb::arg("tokens"),
            "commit() for one request: returns (drafted, accepted, source, shadow_drafted, shadow_accepted).")
        .def(
            "draft_one",
            [](PyRequestTable& self, int slot, nb::handle context, int k, double min_prob, int shadow_room,
               double base_min_prob, double match_factor, double prior, int context_len, int vocab_size) {
                check_speculate_args("draft_one", 0, base_min_prob, match_factor, prior);
                return with_tokens(context, "draft_one", [&](const int32_t* p, size_t n) {
                    int32_t row = 0;
                    int64_t end = static_cast<int64_t>(n);
                    das::Drafts d = self.draft(&slot, 1, {p, 1, n}, &row, &end, &k, &min_prob, &shadow_room,
                                               {base_min_prob, match_factor, prior, context_len, vocab_size});
                    return nb::make_tuple(to_numpy(d.tokens), to_numpy(d.probs), d.sources[0], d.match_lens[0],
                                          d.shadowed[0] != 0);
                });
            },
            nb::arg("slot"), nb::arg("context"), nb::arg("k"), nb::arg("min_prob"), nb::arg("shadow_room"),
            nb::arg("base_min_prob") = 0.0, nb::arg("match_factor") = 0.0, nb::arg("prior") = 0.0,
            nb::arg("context_len") = 32, nb::arg("vocab_size") = 0,
            "draft() for one request whose prompt + output so far is `context`: returns (tokens, probs, source, "
            "match_len, shadowed).")
        .def(
            "draft",
            [](PyRequestTable& self, const Column<int32_t>& slots, const TokenTable2D& table,
               const Column<int32_t>& rows, const Column<int64_t>& end, const Column<int32_t>& k,
               const Column<double>& min_prob, const Column<int32_t>& shadow_room, double base_min_prob,
               double match_factor, double prior, int context, int vocab_size) {
                check_speculate_args("draft", 0, base_min_prob, match_factor, prior);
                size_t n = slots.shape(0);
                das::Drafts d = self.draft(slots.data(), n, token_table(table), column(rows, n, "draft", "rows"),
                                           column(end, n, "draft", "end"), column(k, n, "draft", "k"),
                                           column(min_prob, n, "draft", "min_prob"),
                                           column(shadow_room, n, "draft", "shadow_room"),
                                           {base_min_prob, match_factor, prior, context, vocab_size});
                return nb::make_tuple(to_numpy(d.tokens), to_numpy(d.probs), to_numpy(d.offsets),
                                      to_numpy(d.sources), to_numpy(d.match_lens), to_numpy(d.shadowed));
            },
            nb::arg("slots"), nb::arg("table"), nb::arg("rows"), nb::arg("end"), nb::arg("k"), nb::arg("min_prob"),
            nb::arg("shadow_room"), nb::arg("base_min_prob") = 0.0, nb::arg("match_factor") = 0.0,
            nb::arg("prior") = 0.0, nb::arg("context") = 32, nb::arg("vocab_size") = 0,
            "Drafts for each row from the context table[rows[r], :end[r]] (its last `context` tokens): with "
            "k[r] > 0 at most k[r] tokens above max(base_min_prob, min_prob[r]); else, with shadow_room[r] > 0, "
            "a shadow draft may start. Returns (tokens, probs, offsets, sources, match_lens, shadowed): row r's "
            "draft is tokens[offsets[r]:offsets[r + 1]].");
}
