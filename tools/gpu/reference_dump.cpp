// Writes the inputs (float32 values of the dtype), float64 reference and baseline of a few harness
// cases as raw files, so check_reference.py can compare this C++ rule with
// python/flash_attention_metal (one rule in every layer). Usage: reference_dump FOLDER; prints one
// line per case:
// NAME DTYPE BATCH HEADS KV_HEADS SEQLEN_Q SEQLEN_K HEAD_DIM HEAD_DIM_V CAUSAL SCALE
//   WINDOW_LEFT WINDOW_RIGHT SOFTCAP MASK MASK_PER_BATCH MASK_PER_HEAD ALIBI ALIBI_PER_BATCH SINKS
// (MASK: 0 none, 1 boolean, 2 additive in the dtype, 3 additive float32; WINDOW_RIGHT as given,
// causal not folded in). With a mask, alibi or sinks their float32 values are written too, and
// with sinks the reference's dsinks and row terms and the baseline's row terms. float32 cases
// also get the streamed baseline (streamed_out, _lse, _dq, _dk, _dv and, with sinks, _sink_terms).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cases.h"

namespace {

template <typename T>
bool write(const std::string &folder, const std::string &name, const char *tensor,
           const std::vector<T> &values) {
    const std::string path = folder + "/" + name + "." + tensor;
    FILE *file = std::fopen(path.c_str(), "wb");
    if (file == nullptr) {
        std::fprintf(stderr, "reference_dump: cannot write %s\n", path.c_str());
        return false;
    }
    const bool ok = std::fwrite(values.data(), sizeof(T), values.size(), file) == values.size();
    return std::fclose(file) == 0 && ok;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: reference_dump FOLDER\n");
        return 2;
    }
    const std::string folder = argv[1];
    // One case per kind of shape: causal self-attention, GQA, MQA with empty rows, decode, and a
    // custom scale; bfloat16 and float32; head_dim_v != head_dim in each dtype.
    const char *picked[] = {
        "f16_d3_b2_h3x3_q100_k100_causal",       "f16_d40_b1_h8x2_q33_k77_causal",
        "f16_d104_b2_h4x1_q77_k33_causal",       "f16_d200_b2_h2x2_q1_k129_causal",
        "f16_d72_b2_h6x3_q31_k31_causal_s0.5",   "bf16_d64_b1_h8x2_q33_k77_causal",
        "bf16_d128_b2_h4x1_q77_k33_causal",      "f32_d40_b2_h3x3_q100_k100_causal",
        "f32_d256_b2_h4x1_q77_k33_causal",       "f32_d104_b2_h4x1_q77_k33_causal",       "f16_d192v128_b1_h8x2_q33_k77_causal",
        "bf16_d40v3_b2_h3x3_q100_k100_causal",   "f32_d128v40_b1_h8x2_q33_k77_causal",
        "bf16_d576v512_b2_h16x1_q1_k300_causal",  // MLA decode, the 576 bucket
        // score modifiers (issue 15)
        "f32_d32_b2_h4x1_q77_k33_full_w5.3",     "f16_d64_b2_h4x4_q65_k90_causal_s0.5_cap5",
        "f16_d64_b2_h8x2_q100_k100_causal_alibi", "f32_d128_b2_h4x1_q50_k120_full_alibib",
        "f32_d64_b2_h4x2_q100_k100_causal_sinks", "f16_d32_b2_h4x1_q77_k33_causal_sinks",
        "f16_d64_b2_h4x2_q60_k80_full_mbool.bh", "bf16_d64_b2_h4x1_q70_k70_full_madd.1h",
        "f32_d64_b2_h4x2_q50_k90_full_maddf32.bh_min",
        "f16_d128_b2_h8x2_q90_k130_causal_w40.n_cap30_mbool.b1_alibib_sinks",
        "f32_d64_b1_h4x4_q100_k100_full_w30.10_cap10_madd.1h_alibi_sinks",
        // rows whose |lse| >= 256 (the backward's lse residual)
        "bf16_d128_b1_h4x2_q40_k70_causal_maddf32.1h_sinks_min",
        "f32_d32_b2_h4x2_q50_k60_causal_s30_sinks",
    };
    const std::vector<TestCase> grid = full_grid();
    for (const char *wanted : picked) {
        const auto found = std::find_if(grid.begin(), grid.end(),
                                        [&](const TestCase &c) { return c.name == wanted; });
        if (found == grid.end()) {
            std::fprintf(stderr, "reference_dump: the grid has no case %s\n", wanted);
            return 1;
        }
        const TestCase &c = *found;
        const AttentionInputs in = random_inputs(c);
        const ReferenceResult ref = reference_attention(c.shape, in);
        const BaseResult base = base_attention(c.shape, in);
        const bool streamed = c.shape.dtype == DType::f32;
        const BaseResult stream = streamed ? streamed_base_attention(c.shape, in) : BaseResult{};
        const bool ok = write(folder, c.name, "q", in.q) && write(folder, c.name, "k", in.k) &&
                        write(folder, c.name, "v", in.v) &&
                        write(folder, c.name, "dout", in.dout) &&
                        write(folder, c.name, "ref_out", ref.out) &&
                        write(folder, c.name, "ref_lse", ref.lse) &&
                        write(folder, c.name, "ref_dq", ref.dq) &&
                        write(folder, c.name, "ref_dk", ref.dk) &&
                        write(folder, c.name, "ref_dv", ref.dv) &&
                        write(folder, c.name, "base_out", base.out) &&
                        write(folder, c.name, "base_dq", base.dq) &&
                        write(folder, c.name, "base_dk", base.dk) &&
                        write(folder, c.name, "base_dv", base.dv) &&
                        (!streamed || (write(folder, c.name, "streamed_out", stream.out) &&
                                       write(folder, c.name, "streamed_lse", stream.lse) &&
                                       write(folder, c.name, "streamed_dq", stream.dq) &&
                                       write(folder, c.name, "streamed_dk", stream.dk) &&
                                       write(folder, c.name, "streamed_dv", stream.dv))) &&
                        (in.mask.empty() || write(folder, c.name, "mask", in.mask)) &&
                        (in.alibi.empty() || write(folder, c.name, "alibi", in.alibi)) &&
                        (in.sinks.empty() ||
                         (write(folder, c.name, "sinks", in.sinks) &&
                          write(folder, c.name, "ref_dsinks", ref.dsinks) &&
                          write(folder, c.name, "ref_sink_terms", ref.sink_terms) &&
                          write(folder, c.name, "base_sink_terms", base.sink_terms) &&
                          (!streamed ||
                           write(folder, c.name, "streamed_sink_terms", stream.sink_terms))));
        if (!ok) {
            return 1;
        }
        const AttentionShape &s = c.shape;
        const ScoreOptions &o = s.options;
        std::printf("%s %s %d %d %d %d %d %d %d %d %.9g %d %d %.9g %d %d %d %d %d %d\n",
                    c.name.c_str(), dtype_name(s.dtype), s.batch, s.num_heads, s.num_kv_heads,
                    s.seqlen_q, s.seqlen_k, s.head_dim, s.head_dim_v, s.causal ? 1 : 0,
                    double(s.softmax_scale), o.window_left, o.window_right, double(o.softcap),
                    int(o.mask), o.mask_per_batch ? 1 : 0, o.mask_per_head ? 1 : 0,
                    o.alibi ? 1 : 0, o.alibi_per_batch ? 1 : 0, o.sinks ? 1 : 0);
    }
    return 0;
}
