// Float64 reference and float16 baseline of attention, row by row (see reference.h). Mirrors
// python/flash_attention_metal/reference.py and accuracy.py so every layer judges by one rule.
#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "half_bits.h"

int visible_keys(const AttentionShape &shape, int row) {
    if (!shape.causal) {
        return shape.seqlen_k;
    }
    const long n = long(row) + shape.seqlen_k - shape.seqlen_q + 1;
    return int(std::clamp<long>(n, 0, shape.seqlen_k));
}

namespace {

// Offsets of head rows in the row-major layouts of reference.h.
struct Layout {
    const AttentionShape &s;
    size_t q_row(int b, int h, int i) const {
        return ((size_t(b) * s.num_heads + h) * s.seqlen_q + i) * s.head_dim;
    }
    size_t kv_row(int b, int kvh, int j) const {
        return ((size_t(b) * s.num_kv_heads + kvh) * s.seqlen_k + j) * s.head_dim;
    }
    size_t lse_index(int b, int h, int i) const {
        return (size_t(b) * s.num_heads + h) * s.seqlen_q + i;
    }
};

std::vector<double> to_double(const std::vector<uint16_t> &x) {
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        y[i] = half_bits_to_float(x[i]);
    }
    return y;
}

std::vector<float> to_float(const std::vector<uint16_t> &x) {
    std::vector<float> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        y[i] = half_bits_to_float(x[i]);
    }
    return y;
}

template <typename T>
T dot(const T *a, const T *b, int n) {
    T acc = 0;
    for (int d = 0; d < n; ++d) {
        acc += a[d] * b[d];
    }
    return acc;
}

}  // namespace

ReferenceResult reference_attention(const AttentionShape &s, const AttentionInputs &in) {
    const Layout at{s};
    const int dim = s.head_dim;
    const int group = s.num_heads / s.num_kv_heads;
    const double scale = s.softmax_scale;
    const std::vector<double> q = to_double(in.q), k = to_double(in.k), v = to_double(in.v),
                              dout = to_double(in.dout);
    ReferenceResult r;
    r.out.assign(s.q_elements(), 0.0);
    r.lse.assign(s.lse_elements(), -std::numeric_limits<double>::infinity());
    r.dq.assign(s.q_elements(), 0.0);
    r.dk.assign(s.kv_elements(), 0.0);
    r.dv.assign(s.kv_elements(), 0.0);
    std::vector<double> p(size_t(std::max(s.seqlen_k, 1)));
    for (int b = 0; b < s.batch; ++b) {
        for (int h = 0; h < s.num_heads; ++h) {
            const int kvh = h / group;
            for (int i = 0; i < s.seqlen_q; ++i) {
                const int n = visible_keys(s, i);
                if (n == 0) {
                    continue;  // out 0, lse -inf, no gradient
                }
                const double *qi = &q[at.q_row(b, h, i)];
                const double *gi = &dout[at.q_row(b, h, i)];
                double row_max = -std::numeric_limits<double>::infinity();
                for (int j = 0; j < n; ++j) {
                    p[j] = scale * dot(qi, &k[at.kv_row(b, kvh, j)], dim);
                    row_max = std::max(row_max, p[j]);
                }
                double total = 0.0;
                for (int j = 0; j < n; ++j) {
                    p[j] = std::exp(p[j] - row_max);
                    total += p[j];
                }
                r.lse[at.lse_index(b, h, i)] = row_max + std::log(total);
                double *oi = &r.out[at.q_row(b, h, i)];
                for (int j = 0; j < n; ++j) {
                    p[j] /= total;
                    const double *vj = &v[at.kv_row(b, kvh, j)];
                    for (int d = 0; d < dim; ++d) {
                        oi[d] += p[j] * vj[d];
                    }
                }
                const double delta = dot(gi, oi, dim);
                double *dqi = &r.dq[at.q_row(b, h, i)];
                for (int j = 0; j < n; ++j) {
                    const size_t kv = at.kv_row(b, kvh, j);
                    const double ds = p[j] * (dot(gi, &v[kv], dim) - delta);
                    for (int d = 0; d < dim; ++d) {
                        dqi[d] += scale * ds * k[kv + d];
                        r.dk[kv + d] += scale * ds * qi[d];
                        r.dv[kv + d] += p[j] * gi[d];
                    }
                }
            }
        }
    }
    return r;
}

BaseResult base_attention(const AttentionShape &s, const AttentionInputs &in) {
    const Layout at{s};
    const int dim = s.head_dim;
    const int group = s.num_heads / s.num_kv_heads;
    const float scale = s.softmax_scale;
    const std::vector<float> q = to_float(in.q), k = to_float(in.k), v = to_float(in.v),
                             dout = to_float(in.dout);
    BaseResult r;
    r.out.assign(s.q_elements(), 0.0f);
    r.dq.assign(s.q_elements(), 0.0f);
    r.dk.assign(s.kv_elements(), 0.0f);
    r.dv.assign(s.kv_elements(), 0.0f);
    const size_t head_kv = size_t(s.seqlen_k) * dim;
    std::vector<float> p16(size_t(std::max(s.seqlen_k, 1)));
    std::vector<float> ds16(p16.size());
    std::vector<float> acc(static_cast<size_t>(dim));
    std::vector<float> dk_head(head_kv), dv_head(head_kv), dk_group(head_kv), dv_group(head_kv);
    for (int b = 0; b < s.batch; ++b) {
        for (int kvh = 0; kvh < s.num_kv_heads; ++kvh) {
            std::fill(dk_group.begin(), dk_group.end(), 0.0f);
            std::fill(dv_group.begin(), dv_group.end(), 0.0f);
            for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
                std::fill(dk_head.begin(), dk_head.end(), 0.0f);
                std::fill(dv_head.begin(), dv_head.end(), 0.0f);
                for (int i = 0; i < s.seqlen_q; ++i) {
                    const int n = visible_keys(s, i);
                    if (n == 0) {
                        continue;
                    }
                    const float *qi = &q[at.q_row(b, h, i)];
                    const float *gi = &dout[at.q_row(b, h, i)];
                    // P: S = round16(float32(q . k) * scale), softmax in float32, round16.
                    float row_max = -std::numeric_limits<float>::infinity();
                    for (int j = 0; j < n; ++j) {
                        p16[j] = round_to_half(dot(qi, &k[at.kv_row(b, kvh, j)], dim) * scale);
                        row_max = std::max(row_max, p16[j]);
                    }
                    float total = 0.0f;
                    for (int j = 0; j < n; ++j) {
                        p16[j] = std::exp(p16[j] - row_max);
                        total += p16[j];
                    }
                    for (int j = 0; j < n; ++j) {
                        p16[j] = round_to_half(p16[j] / total);
                    }
                    // O = round16(P16 @ V).
                    std::fill(acc.begin(), acc.end(), 0.0f);
                    for (int j = 0; j < n; ++j) {
                        const float *vj = &v[at.kv_row(b, kvh, j)];
                        for (int d = 0; d < dim; ++d) {
                            acc[d] += p16[j] * vj[d];
                        }
                    }
                    float *oi = &r.out[at.q_row(b, h, i)];
                    for (int d = 0; d < dim; ++d) {
                        oi[d] = round_to_half(acc[d]);
                    }
                    // dP = round16(dout . v), dS = round16(P16 * (dP - D)), D = rowsum(dout * O16).
                    const float delta = dot(gi, oi, dim);
                    for (int j = 0; j < n; ++j) {
                        const float dp16 = round_to_half(dot(gi, &v[at.kv_row(b, kvh, j)], dim));
                        ds16[j] = round_to_half(p16[j] * (dp16 - delta));
                    }
                    std::fill(acc.begin(), acc.end(), 0.0f);
                    for (int j = 0; j < n; ++j) {
                        const float *kj = &k[at.kv_row(b, kvh, j)];
                        float *dkj = &dk_head[size_t(j) * dim];
                        float *dvj = &dv_head[size_t(j) * dim];
                        for (int d = 0; d < dim; ++d) {
                            acc[d] += ds16[j] * kj[d];
                            dkj[d] += ds16[j] * qi[d];
                            dvj[d] += p16[j] * gi[d];
                        }
                    }
                    float *dqi = &r.dq[at.q_row(b, h, i)];
                    for (int d = 0; d < dim; ++d) {
                        dqi[d] = round_to_half(acc[d] * scale);
                    }
                }
                for (size_t e = 0; e < head_kv; ++e) {
                    dk_group[e] += round_to_half(dk_head[e] * scale);
                    dv_group[e] += round_to_half(dv_head[e]);
                }
            }
            const size_t first = at.kv_row(b, kvh, 0);
            for (size_t e = 0; e < head_kv; ++e) {
                r.dk[first + e] = round_to_half(dk_group[e]);
                r.dv[first + e] = round_to_half(dv_group[e]);
            }
        }
    }
    return r;
}
