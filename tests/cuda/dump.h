// The check programs' results on disk, for tests/cuda/judge.py to judge with the Python package's
// float64 reference and accuracy rule (python/flash_attention_metal/reference.py, accuracy.py): the
// rule is written once. A dump folder holds cases.txt, one line per case:
//   NAME DTYPE BATCH HEADS KV_HEADS SEQLEN_Q SEQLEN_K HEAD_DIM HEAD_DIM_V CAUSAL SCALE
//   WINDOW_LEFT WINDOW_RIGHT SOFTCAP MASK MASK_PER_BATCH MASK_PER_HEAD ALIBI ALIBI_PER_BATCH SINKS
//   OUTPUTS [DROPOUT_P DROPOUT_SEED DROPOUT_OFFSET] [tensor_ops=PASSES]
// (MASK: MaskKind as a number, 0 none, 1 boolean, 2 additive in the dtype, 3 additive float32;
// WINDOW_RIGHT as given, causal not folded in; OUTPUTS: the GPU tensors dumped, comma-separated,
// from out, lse, dq, dk, dv, dsinks, split_out, split_lse; the dropout fields only on the replay's
// dropout cases, tensor_ops= (forward, backward or both, comma-separated: the passes whose plans
// ran Metal 4 tensor-op kernels) only on its tensor-op cases, both written by cases.py: this
// program writes neither), and per case the raw little-endian
// float32 files NAME.q, .k, .v, .dout (.mask, .alibi, .sinks when present) in problem.h's logical
// order, and NAME.<output> for each output (values of the dtype as float; lse and dsinks float32).
#ifndef FA_GPU_DUMP_H
#define FA_GPU_DUMP_H

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "problem.h"

class Dump {
public:
    // An empty folder dumps nothing (the sanitizer runs, which judge nothing).
    explicit Dump(std::string folder) : folder_(std::move(folder)) {}

    bool enabled() const { return !folder_.empty(); }

    // Writes the case's inputs and `outputs` (name, values) and appends its line to cases.txt;
    // false (with a message on stderr) when a file cannot be written.
    bool write(const std::string &name, const AttentionShape &s, const AttentionInputs &in,
               const std::vector<std::pair<const char *, const std::vector<float> *>> &outputs) const {
        if (!enabled()) {
            return true;
        }
        const std::pair<const char *, const std::vector<float> *> inputs[] = {
            {"q", &in.q},        {"k", &in.k},         {"v", &in.v},        {"dout", &in.dout},
            {"mask", &in.mask}, {"alibi", &in.alibi}, {"sinks", &in.sinks}};
        std::string listed;
        bool ok = true;
        for (const auto &input : inputs) {
            ok = ok && (input.second->empty() || raw(name + "." + input.first, *input.second));
        }
        for (const auto &output : outputs) {
            ok = ok && raw(name + "." + output.first, *output.second);
            listed += (listed.empty() ? "" : ",") + std::string(output.first);
        }
        const ScoreOptions &o = s.options;
        FILE *file = ok ? std::fopen((folder_ + "/cases.txt").c_str(), "a") : nullptr;
        ok = file != nullptr &&
             std::fprintf(file, "%s %s %d %d %d %d %d %d %d %d %.9g %d %d %.9g %d %d %d %d %d %d %s\n",
                          name.c_str(), dtype_name(s.dtype), s.batch, s.num_heads, s.num_kv_heads,
                          s.seqlen_q, s.seqlen_k, s.head_dim, s.head_dim_v, s.causal ? 1 : 0,
                          double(s.softmax_scale), o.window_left, o.window_right, double(o.softcap),
                          int(o.mask), o.mask_per_batch ? 1 : 0, o.mask_per_head ? 1 : 0,
                          o.alibi ? 1 : 0, o.alibi_per_batch ? 1 : 0, o.sinks ? 1 : 0,
                          listed.c_str()) > 0;
        ok = file != nullptr && std::fclose(file) == 0 && ok;
        if (!ok) {
            std::fprintf(stderr, "cannot write case %s into %s\n", name.c_str(), folder_.c_str());
        }
        return ok;
    }

    // A float64 file NAME.k_exact or NAME.v_exact: a quantized KV cache's keys or values in
    // problem.h's order, dequantized exactly (judge.py then judges against them and rounds them to
    // the dtype for k and v, which the case does not write).
    bool exact(const std::string &file_name, const std::vector<double> &values) const {
        return !enabled() || raw(file_name, values);
    }

private:
    template <typename E>
    bool raw(const std::string &file_name, const std::vector<E> &values) const {
        FILE *file = std::fopen((folder_ + "/" + file_name).c_str(), "wb");
        if (file == nullptr) {
            return false;
        }
        const bool ok = std::fwrite(values.data(), sizeof(E), values.size(), file) == values.size();
        return std::fclose(file) == 0 && ok;
    }

    std::string folder_;
};

#endif
