// Python bindings of the suffix index (module das.drafter._suffix_index).
//
// Token arguments accept a 1-D int32 NumPy array (read in place, no copy) or any sequence of ints (converted,
// each checked to lie in [0, 2**31 - 1]). Every call keeps the GIL: see the threading contract in suffix_index.h.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/pair.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "suffix_index.h"

namespace nb = nanobind;
using das::Draft;
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

}  // namespace

NB_MODULE(_suffix_index, m) {
    m.doc() = "Native depth-limited suffix index for draft-token speculation.";

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
            [](const SuffixIndex& self, nb::handle context, int max_tokens, float min_prob) {
                if (max_tokens < 0) throw nb::value_error("speculate: max_tokens must be >= 0");
                if (!(min_prob >= 0.0f && min_prob <= 1.0f)) throw nb::value_error("speculate: min_prob must be in [0, 1]");
                return with_tokens(context, "speculate", [&](const int32_t* p, size_t n) {
                    return self.speculate(p, n, max_tokens, min_prob);
                });
            },
            nb::arg("context"), nb::arg("max_tokens"), nb::arg("min_prob") = 0.0f,
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
        "speculate_best",
        [](const std::vector<const SuffixIndex*>& indices, const std::vector<float>& weights, nb::handle context,
           int max_tokens, float min_prob) {
            if (max_tokens < 0) throw nb::value_error("speculate_best: max_tokens must be >= 0");
            if (!(min_prob >= 0.0f && min_prob <= 1.0f)) throw nb::value_error("speculate_best: min_prob must be in [0, 1]");
            for (const SuffixIndex* ix : indices) {
                if (ix == nullptr) throw nb::type_error("speculate_best: indices must not contain None");
            }
            return with_tokens(context, "speculate_best", [&](const int32_t* p, size_t n) {
                return das::speculate_best(indices, weights, p, n, max_tokens, min_prob);
            });
        },
        nb::arg("indices"), nb::arg("weights"), nb::arg("context"), nb::arg("max_tokens"), nb::arg("min_prob") = 0.0f,
        "Draft from each index; return (position of the best weight * score, its draft), or (-1, empty draft).");
}
