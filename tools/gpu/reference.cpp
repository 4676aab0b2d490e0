// Float64 reference and per-dtype baseline of attention, row by row (see reference.h). Mirrors
// python/flash_attention_metal/reference.py and accuracy.py so every layer judges by one rule.
#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

int visible_keys(const AttentionShape &shape, int row) {
    if (!shape.causal) {
        return shape.seqlen_k;
    }
    const long n = long(row) + shape.seqlen_k - shape.seqlen_q + 1;
    return int(std::clamp<long>(n, 0, shape.seqlen_k));
}

namespace {

// Offsets of rows in the row-major layouts of reference.h.
struct Layout {
    const AttentionShape &s;
    size_t q_row(int b, int h, int i) const {  // q, dq
        return ((size_t(b) * s.num_heads + h) * s.seqlen_q + i) * s.head_dim;
    }
    size_t out_row(int b, int h, int i) const {  // out, dout
        return ((size_t(b) * s.num_heads + h) * s.seqlen_q + i) * s.head_dim_v;
    }
    size_t k_row(int b, int kvh, int j) const {  // k, dk
        return ((size_t(b) * s.num_kv_heads + kvh) * s.seqlen_k + j) * s.head_dim;
    }
    size_t v_row(int b, int kvh, int j) const {  // v, dv
        return ((size_t(b) * s.num_kv_heads + kvh) * s.seqlen_k + j) * s.head_dim_v;
    }
    size_t lse_index(int b, int h, int i) const {
        return (size_t(b) * s.num_heads + h) * s.seqlen_q + i;
    }
};

std::vector<double> to_double(const std::vector<float> &x) {
    return std::vector<double>(x.begin(), x.end());
}

double dot(const double *a, const double *b, int n) {
    double acc = 0;
    for (int d = 0; d < n; ++d) {
        acc += a[d] * b[d];
    }
    return acc;
}

// float32 accumulation by fused multiply-add in index order, as BLAS kernels (NumPy's float32
// matmul) and GPU matrix units accumulate; with float32 inputs the baseline's error is mostly this
// summation's, so its order and fusion matter there.
float dot(const float *a, const float *b, int n) {
    float acc = 0;
    for (int d = 0; d < n; ++d) {
        acc = std::fma(a[d], b[d], acc);
    }
    return acc;
}

// sum(a[i] * b[i]) the way NumPy's np.sum(a * b) runs in float32: products rounded, then its
// pairwise summation (8 accumulators over blocks of up to 128, halves recursively above that).
float pairwise_sum(const float *x, int n) {
    if (n < 8) {
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) {
            sum += x[i];
        }
        return sum;
    }
    if (n <= 128) {
        float r[8];
        for (int k = 0; k < 8; ++k) {
            r[k] = x[k];
        }
        int i = 8;
        for (; i + 8 <= n; i += 8) {
            for (int k = 0; k < 8; ++k) {
                r[k] += x[i + k];
            }
        }
        float sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) {
            sum += x[i];
        }
        return sum;
    }
    const int half = n / 2 / 8 * 8;
    return pairwise_sum(x, half) + pairwise_sum(x + half, n - half);
}

float sum_of_products(const float *a, const float *b, int n) {
    std::vector<float> products(size_t(std::max(n, 0)));
    for (int i = 0; i < n; ++i) {
        products[size_t(i)] = a[i] * b[i];
    }
    return pairwise_sum(products.data(), n);
}

}  // namespace

ReferenceResult reference_attention(const AttentionShape &s, const AttentionInputs &in) {
    const Layout at{s};
    const int dim = s.head_dim, dim_v = s.head_dim_v;
    const int group = s.num_heads / s.num_kv_heads;
    const double scale = s.softmax_scale;
    const std::vector<double> q = to_double(in.q), k = to_double(in.k), v = to_double(in.v),
                              dout = to_double(in.dout);
    ReferenceResult r;
    r.out.assign(s.out_elements(), 0.0);
    r.lse.assign(s.lse_elements(), -std::numeric_limits<double>::infinity());
    r.dq.assign(s.q_elements(), 0.0);
    r.dk.assign(s.k_elements(), 0.0);
    r.dv.assign(s.v_elements(), 0.0);
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
                const double *gi = &dout[at.out_row(b, h, i)];
                double row_max = -std::numeric_limits<double>::infinity();
                for (int j = 0; j < n; ++j) {
                    p[j] = scale * dot(qi, &k[at.k_row(b, kvh, j)], dim);
                    row_max = std::max(row_max, p[j]);
                }
                double total = 0.0;
                for (int j = 0; j < n; ++j) {
                    p[j] = std::exp(p[j] - row_max);
                    total += p[j];
                }
                r.lse[at.lse_index(b, h, i)] = row_max + std::log(total);
                double *oi = &r.out[at.out_row(b, h, i)];
                for (int j = 0; j < n; ++j) {
                    p[j] /= total;
                    const double *vj = &v[at.v_row(b, kvh, j)];
                    for (int d = 0; d < dim_v; ++d) {
                        oi[d] += p[j] * vj[d];
                    }
                }
                const double delta = dot(gi, oi, dim_v);
                double *dqi = &r.dq[at.q_row(b, h, i)];
                for (int j = 0; j < n; ++j) {
                    const size_t kj = at.k_row(b, kvh, j), vj = at.v_row(b, kvh, j);
                    const double ds = p[j] * (dot(gi, &v[vj], dim_v) - delta);
                    for (int d = 0; d < dim; ++d) {
                        dqi[d] += scale * ds * k[kj + d];
                        r.dk[kj + d] += scale * ds * qi[d];
                    }
                    for (int d = 0; d < dim_v; ++d) {
                        r.dv[vj + d] += p[j] * gi[d];
                    }
                }
            }
        }
    }
    return r;
}

BaseResult base_attention(const AttentionShape &s, const AttentionInputs &in) {
    const Layout at{s};
    const int dim = s.head_dim, dim_v = s.head_dim_v;
    const int group = s.num_heads / s.num_kv_heads;
    const float scale = s.softmax_scale;
    auto round = [&](float x) { return round_to(s.dtype, x); };
    const std::vector<float> &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
    BaseResult r;
    r.out.assign(s.out_elements(), 0.0f);
    r.dq.assign(s.q_elements(), 0.0f);
    r.dk.assign(s.k_elements(), 0.0f);
    r.dv.assign(s.v_elements(), 0.0f);
    const size_t head_k = size_t(s.seqlen_k) * dim, head_v = size_t(s.seqlen_k) * dim_v;
    std::vector<float> pr(size_t(std::max(s.seqlen_k, 1)));
    std::vector<float> ds(pr.size());
    std::vector<float> acc(size_t(std::max(dim, dim_v)));
    std::vector<float> dk_head(head_k), dv_head(head_v), dk_group(head_k), dv_group(head_v);
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
                    const float *gi = &dout[at.out_row(b, h, i)];
                    // P: S = round(float32(q . k) * scale), softmax in float32, round.
                    float row_max = -std::numeric_limits<float>::infinity();
                    for (int j = 0; j < n; ++j) {
                        pr[j] = round(dot(qi, &k[at.k_row(b, kvh, j)], dim) * scale);
                        row_max = std::max(row_max, pr[j]);
                    }
                    float total = 0.0f;
                    for (int j = 0; j < n; ++j) {
                        pr[j] = std::exp(pr[j] - row_max);
                        total += pr[j];
                    }
                    for (int j = 0; j < n; ++j) {
                        pr[j] = round(pr[j] / total);
                    }
                    // O = round(P @ V).
                    std::fill(acc.begin(), acc.end(), 0.0f);
                    for (int j = 0; j < n; ++j) {
                        const float *vj = &v[at.v_row(b, kvh, j)];
                        for (int d = 0; d < dim_v; ++d) {
                            acc[d] = std::fma(pr[j], vj[d], acc[d]);
                        }
                    }
                    float *oi = &r.out[at.out_row(b, h, i)];
                    for (int d = 0; d < dim_v; ++d) {
                        oi[d] = round(acc[d]);
                    }
                    // dP = round(dout . v), dS = round(P * (dP - D)), D = rowsum(dout * O).
                    const float delta = sum_of_products(gi, oi, dim_v);
                    for (int j = 0; j < n; ++j) {
                        const float dp = round(dot(gi, &v[at.v_row(b, kvh, j)], dim_v));
                        ds[j] = round(pr[j] * (dp - delta));
                    }
                    std::fill(acc.begin(), acc.end(), 0.0f);
                    for (int j = 0; j < n; ++j) {
                        const float *kj = &k[at.k_row(b, kvh, j)];
                        float *dkj = &dk_head[size_t(j) * dim];
                        float *dvj = &dv_head[size_t(j) * dim_v];
                        for (int d = 0; d < dim; ++d) {
                            acc[d] = std::fma(ds[j], kj[d], acc[d]);
                            dkj[d] = std::fma(ds[j], qi[d], dkj[d]);
                        }
                        for (int d = 0; d < dim_v; ++d) {
                            dvj[d] = std::fma(pr[j], gi[d], dvj[d]);
                        }
                    }
                    float *dqi = &r.dq[at.q_row(b, h, i)];
                    for (int d = 0; d < dim; ++d) {
                        dqi[d] = round(acc[d] * scale);
                    }
                }
                for (size_t e = 0; e < head_k; ++e) {
                    dk_group[e] += round(dk_head[e] * scale);
                }
                for (size_t e = 0; e < head_v; ++e) {
                    dv_group[e] += round(dv_head[e]);
                }
            }
            const size_t first_k = at.k_row(b, kvh, 0), first_v = at.v_row(b, kvh, 0);
            for (size_t e = 0; e < head_k; ++e) {
                r.dk[first_k + e] = round(dk_group[e]);
            }
            for (size_t e = 0; e < head_v; ++e) {
                r.dv[first_v + e] = round(dv_group[e]);
            }
        }
    }
    return r;
}
