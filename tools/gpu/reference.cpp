// Float64 reference and per-dtype baseline of attention, row by row (see reference.h). Mirrors
// python/flash_attention_metal/reference.py and accuracy.py so every layer judges by one rule.
#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

size_t mask_index(const AttentionShape &s, int b, int h, int i, int j) {
    const size_t mb = s.options.mask_per_batch ? size_t(b) : 0;
    const size_t mh = s.options.mask_per_head ? size_t(h) : 0;
    return ((mb * size_t(s.mask_heads()) + mh) * size_t(s.seqlen_q) + size_t(i)) * size_t(s.seqlen_k) +
           size_t(j);
}

bool key_visible(const AttentionShape &s, const AttentionInputs &in, int b, int h, int i, int j) {
    const long offset = long(j) - (long(i) + s.seqlen_k - s.seqlen_q);
    const int left = s.options.window_left, right = s.window_right();
    if ((left >= 0 && offset < -left) || (right >= 0 && offset > right)) {
        return false;
    }
    if (s.options.mask == MaskKind::none) {
        return true;
    }
    const float m = in.mask[mask_index(s, b, h, i, j)];
    return s.options.mask == MaskKind::boolean ? m != 0.0f : !(std::isinf(m) && m < 0);
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

// float32 exp, log and tanh correctly rounded (through double, whose own error is far below half a
// float32 ulp): the same values on every host, where C libraries' float32 versions are an ulp off
// now and then (glibc's tanhf in 18% of arguments) and NumPy's SIMD exp up to 2 ulp off (39%).
float exp32(float x) { return float(std::exp(double(x))); }
float log32(float x) { return float(std::log(double(x))); }
float tanh_of(float x) { return float(std::tanh(double(x))); }
double tanh_of(double x) { return std::tanh(x); }

// The score of visible pair (i, j) of (b, h) from its scaled product softmax_scale * q.k, in
// Real (double for the reference, float for the baseline, as reference.modify_scores): softcap,
// ALiBi bias (computed in double, as reference.alibi_bias, then converted), additive mask. *t gets
// tanh(scaled / softcap) (0 without softcap).
template <typename Real>
Real modify_score(const AttentionShape &s, const AttentionInputs &in, int b, int h, int i, int j,
                  Real scaled, Real *t) {
    const ScoreOptions &o = s.options;
    Real x = scaled;
    *t = Real(0);
    if (o.softcap > 0.0f) {
        *t = tanh_of(scaled / Real(o.softcap));
        x = Real(o.softcap) * *t;
    }
    if (o.alibi) {
        const double slope = in.alibi[size_t(o.alibi_per_batch ? b : 0) * s.num_heads + h];
        const double distance = std::fabs(double(i) + s.seqlen_k - s.seqlen_q - j);
        x = x + Real(-slope * distance);
    }
    if (o.mask == MaskKind::additive || o.mask == MaskKind::additive_f32) {
        x = x + Real(in.mask[mask_index(s, b, h, i, j)]);
    }
    return x;
}

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

// a * b rounded to float32 before anything is added to it, whatever the host compiler's
// -ffp-contract: NumPy's order in the streamed baseline (no fused multiply-add).
float product(float a, float b) {
    volatile float p = a * b;
    return p;
}

// sum(a[d] * b[d]) one term at a time in index order, each product rounded (accuracy.py's
// _streamed_matmul).
float streamed_dot(const float *a, const float *b, int n) {
    float acc = 0.0f;
    for (int d = 0; d < n; ++d) {
        acc = acc + product(a[d], b[d]);
    }
    return acc;
}

float sum_of_products(const float *a, const float *b, int n) {
    std::vector<float> products(size_t(std::max(n, 0)));
    for (int i = 0; i < n; ++i) {
        products[size_t(i)] = a[i] * b[i];
    }
    return pairwise_sum(products.data(), n);
}

// A baseline of the shape's sizes before any row is computed: zeros, lse -inf (a row that sees no
// key), sink_terms only with sinks.
BaseResult zero_base(const AttentionShape &s) {
    BaseResult r;
    r.out.assign(s.out_elements(), 0.0f);
    r.dq.assign(s.q_elements(), 0.0f);
    r.dk.assign(s.k_elements(), 0.0f);
    r.dv.assign(s.v_elements(), 0.0f);
    r.lse.assign(s.lse_elements(), -std::numeric_limits<float>::infinity());
    if (s.options.sinks) {
        r.sink_terms.assign(s.lse_elements(), 0.0f);
    }
    return r;
}

}  // namespace

ReferenceResult reference_attention(const AttentionShape &s, const AttentionInputs &in) {
    const Layout at{s};
    const int dim = s.head_dim, dim_v = s.head_dim_v;
    const int group = s.num_heads / s.num_kv_heads;
    const double scale = s.softmax_scale;
    const bool with_sinks = s.options.sinks;
    const std::vector<double> q = to_double(in.q), k = to_double(in.k), v = to_double(in.v),
                              dout = to_double(in.dout);
    ReferenceResult r;
    r.out.assign(s.out_elements(), 0.0);
    r.lse.assign(s.lse_elements(), -std::numeric_limits<double>::infinity());
    r.dq.assign(s.q_elements(), 0.0);
    r.dk.assign(s.k_elements(), 0.0);
    r.dv.assign(s.v_elements(), 0.0);
    r.empty.assign(s.lse_elements(), 0);
    if (with_sinks) {
        r.dsinks.assign(size_t(s.num_heads), 0.0);
        r.sink_terms.assign(s.lse_elements(), 0.0);
    }
    std::vector<int> keys;
    std::vector<double> p, t;
    for (int b = 0; b < s.batch; ++b) {
        for (int h = 0; h < s.num_heads; ++h) {
            const int kvh = h / group;
            const double sink = with_sinks ? double(in.sinks[size_t(h)]) : 0.0;
            for (int i = 0; i < s.seqlen_q; ++i) {
                const size_t row = at.lse_index(b, h, i);
                keys.clear();
                p.clear();
                t.clear();
                const double *qi = &q[at.q_row(b, h, i)];
                const double *gi = &dout[at.out_row(b, h, i)];
                double row_max = with_sinks ? sink : -std::numeric_limits<double>::infinity();
                for (int j = 0; j < s.seqlen_k; ++j) {
                    if (!key_visible(s, in, b, h, i, j)) {
                        continue;
                    }
                    double tanh_j;
                    const double x = modify_score(s, in, b, h, i, j,
                                                  scale * dot(qi, &k[at.k_row(b, kvh, j)], dim),
                                                  &tanh_j);
                    keys.push_back(j);
                    p.push_back(x);
                    t.push_back(tanh_j);
                    row_max = std::max(row_max, x);
                }
                if (keys.empty()) {
                    r.empty[row] = 1;
                    if (with_sinks) {
                        r.lse[row] = sink;  // out 0, no gradient, no sink term (D = 0)
                    }
                    continue;
                }
                const size_t n = keys.size();
                double total = with_sinks ? std::exp(sink - row_max) : 0.0;
                for (size_t e = 0; e < n; ++e) {
                    p[e] = std::exp(p[e] - row_max);
                    total += p[e];
                }
                r.lse[row] = row_max + std::log(total);
                double *oi = &r.out[at.out_row(b, h, i)];
                for (size_t e = 0; e < n; ++e) {
                    p[e] /= total;
                    const double *vj = &v[at.v_row(b, kvh, keys[e])];
                    for (int d = 0; d < dim_v; ++d) {
                        oi[d] += p[e] * vj[d];
                    }
                }
                const double delta = dot(gi, oi, dim_v);
                if (with_sinks) {
                    r.sink_terms[row] = std::exp(sink - r.lse[row]) * delta;
                    r.dsinks[size_t(h)] -= r.sink_terms[row];
                }
                double *dqi = &r.dq[at.q_row(b, h, i)];
                for (size_t e = 0; e < n; ++e) {
                    const size_t kj = at.k_row(b, kvh, keys[e]), vj = at.v_row(b, kvh, keys[e]);
                    const double ds =
                        p[e] * (dot(gi, &v[vj], dim_v) - delta) * (1.0 - t[e] * t[e]);
                    for (int d = 0; d < dim; ++d) {
                        dqi[d] += scale * ds * k[kj + d];
                        r.dk[kj + d] += scale * ds * qi[d];
                    }
                    for (int d = 0; d < dim_v; ++d) {
                        r.dv[vj + d] += p[e] * gi[d];
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
    const bool with_sinks = s.options.sinks;
    auto round = [&](float x) { return round_to(s.dtype, x); };
    const std::vector<float> &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
    BaseResult r = zero_base(s);
    const size_t head_k = size_t(s.seqlen_k) * dim, head_v = size_t(s.seqlen_k) * dim_v;
    std::vector<int> keys;
    std::vector<float> pr, t, ds(size_t(std::max(s.seqlen_k, 1))), weights(ds.size());
    std::vector<float> acc(size_t(std::max(dim, dim_v)));
    std::vector<float> dk_head(head_k), dv_head(head_v), dk_group(head_k), dv_group(head_v);
    for (int b = 0; b < s.batch; ++b) {
        for (int kvh = 0; kvh < s.num_kv_heads; ++kvh) {
            std::fill(dk_group.begin(), dk_group.end(), 0.0f);
            std::fill(dv_group.begin(), dv_group.end(), 0.0f);
            for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
                std::fill(dk_head.begin(), dk_head.end(), 0.0f);
                std::fill(dv_head.begin(), dv_head.end(), 0.0f);
                const float sink = with_sinks ? in.sinks[size_t(h)] : 0.0f;
                for (int i = 0; i < s.seqlen_q; ++i) {
                    const size_t row = at.lse_index(b, h, i);
                    const float *qi = &q[at.q_row(b, h, i)];
                    const float *gi = &dout[at.out_row(b, h, i)];
                    // S = round(float32(q . k) * scale), then the modifiers in float32.
                    keys.clear();
                    pr.clear();
                    t.clear();
                    float row_max = with_sinks ? sink : -std::numeric_limits<float>::infinity();
                    for (int j = 0; j < s.seqlen_k; ++j) {
                        if (!key_visible(s, in, b, h, i, j)) {
                            continue;
                        }
                        float tanh_j;
                        const float x = modify_score(
                            s, in, b, h, i, j, round(dot(qi, &k[at.k_row(b, kvh, j)], dim) * scale),
                            &tanh_j);
                        keys.push_back(j);
                        pr.push_back(x);
                        t.push_back(tanh_j);
                        row_max = std::max(row_max, x);
                    }
                    if (keys.empty()) {
                        if (with_sinks) {
                            r.lse[row] = sink;
                        }
                        continue;
                    }
                    const size_t n = keys.size();
                    // Softmax in float32, the row's weights (0 where hidden) summed over all
                    // seqlen_k keys as NumPy sums them, the sink's weight joining last; P rounded.
                    std::fill(weights.begin(), weights.end(), 0.0f);
                    for (size_t e = 0; e < n; ++e) {
                        pr[e] = exp32(pr[e] - row_max);
                        weights[size_t(keys[e])] = pr[e];
                    }
                    float total = pairwise_sum(weights.data(), s.seqlen_k);
                    if (with_sinks) {
                        total += exp32(sink - row_max);
                    }
                    r.lse[row] = row_max + log32(total);
                    for (size_t e = 0; e < n; ++e) {
                        pr[e] = round(pr[e] / total);
                    }
                    // O = round(P @ V).
                    std::fill(acc.begin(), acc.end(), 0.0f);
                    for (size_t e = 0; e < n; ++e) {
                        const float *vj = &v[at.v_row(b, kvh, keys[e])];
                        for (int d = 0; d < dim_v; ++d) {
                            acc[d] = std::fma(pr[e], vj[d], acc[d]);
                        }
                    }
                    float *oi = &r.out[at.out_row(b, h, i)];
                    for (int d = 0; d < dim_v; ++d) {
                        oi[d] = round(acc[d]);
                    }
                    // dP = round(dout . v), dS = round(P * (dP - D) * (1 - tanh^2)),
                    // D = rowsum(dout * O).
                    const float delta = sum_of_products(gi, oi, dim_v);
                    if (with_sinks) {
                        r.sink_terms[row] = exp32(sink - r.lse[row]) * delta;
                    }
                    for (size_t e = 0; e < n; ++e) {
                        const float dp = round(dot(gi, &v[at.v_row(b, kvh, keys[e])], dim_v));
                        float dse = pr[e] * (dp - delta);
                        if (s.options.softcap > 0.0f) {
                            dse = dse * (1.0f - t[e] * t[e]);
                        }
                        ds[e] = round(dse);
                    }
                    std::fill(acc.begin(), acc.end(), 0.0f);
                    for (size_t e = 0; e < n; ++e) {
                        const float *kj = &k[at.k_row(b, kvh, keys[e])];
                        float *dkj = &dk_head[size_t(keys[e]) * dim];
                        float *dvj = &dv_head[size_t(keys[e]) * dim_v];
                        for (int d = 0; d < dim; ++d) {
                            acc[d] = std::fma(ds[e], kj[d], acc[d]);
                            dkj[d] = std::fma(ds[e], qi[d], dkj[d]);
                        }
                        for (int d = 0; d < dim_v; ++d) {
                            dvj[d] = std::fma(pr[e], gi[d], dvj[d]);
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

BaseResult streamed_base_attention(const AttentionShape &s, const AttentionInputs &in) {
    const Layout at{s};
    const int dim = s.head_dim, dim_v = s.head_dim_v, seqlen_k = s.seqlen_k;
    const int group = s.num_heads / s.num_kv_heads;
    const float scale = s.softmax_scale;
    const bool with_sinks = s.options.sinks;
    const float infinity = std::numeric_limits<float>::infinity();
    const std::vector<float> &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
    BaseResult r = zero_base(s);
    const size_t keys = size_t(std::max(seqlen_k, 1));
    std::vector<char> visible(keys);
    std::vector<float> scores(keys), t(keys), p(keys), ds(keys), weights(kStreamWidth);
    std::vector<float> acc(static_cast<size_t>(dim));
    std::vector<float> dk_group(size_t(seqlen_k) * dim), dv_group(size_t(seqlen_k) * dim_v);
    for (int b = 0; b < s.batch; ++b) {
        for (int kvh = 0; kvh < s.num_kv_heads; ++kvh) {
            std::fill(dk_group.begin(), dk_group.end(), 0.0f);
            std::fill(dv_group.begin(), dv_group.end(), 0.0f);
            // The rows of the group's query heads one after the other (accuracy.py's _group_rows).
            for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
                const float sink = with_sinks ? in.sinks[size_t(h)] : 0.0f;
                for (int i = 0; i < s.seqlen_q; ++i) {
                    const size_t row = at.lse_index(b, h, i);
                    const float *qi = &q[at.q_row(b, h, i)];
                    const float *gi = &dout[at.out_row(b, h, i)];
                    for (int j = 0; j < seqlen_k; ++j) {
                        visible[j] = key_visible(s, in, b, h, i, j);
                        const float scaled = streamed_dot(qi, &k[at.k_row(b, kvh, j)], dim) * scale;
                        const float x = modify_score(s, in, b, h, i, j, scaled, &t[j]);
                        scores[j] = visible[j] ? x : -infinity;
                    }
                    // The online softmax: running max, sum and rescale of out once per tile.
                    float *oi = &r.out[at.out_row(b, h, i)];
                    float running_max = -infinity, total = 0.0f;
                    for (int start = 0; start < seqlen_k; start += kStreamWidth) {
                        const int width = std::min(kStreamWidth, seqlen_k - start);
                        float new_max = running_max;
                        for (int e = 0; e < width; ++e) {
                            new_max = std::max(new_max, scores[start + e]);
                        }
                        const float shift = new_max == -infinity ? 0.0f : new_max;
                        const float rescale = exp32(running_max - shift);
                        for (int e = 0; e < width; ++e) {
                            weights[e] = exp32(scores[start + e] - shift);
                        }
                        total = product(total, rescale) + pairwise_sum(weights.data(), width);
                        for (int d = 0; d < dim_v; ++d) {
                            oi[d] = oi[d] * rescale;
                        }
                        for (int e = 0; e < width; ++e) {
                            const float *vj = &v[at.v_row(b, kvh, start + e)];
                            for (int d = 0; d < dim_v; ++d) {
                                oi[d] = oi[d] + product(weights[e], vj[d]);
                            }
                        }
                        running_max = new_max;
                    }
                    if (with_sinks) {
                        const float new_max = std::max(running_max, sink);
                        const float rescale = exp32(running_max - new_max);
                        total = product(total, rescale) + exp32(sink - new_max);
                        for (int d = 0; d < dim_v; ++d) {
                            oi[d] = oi[d] * rescale;
                        }
                        running_max = new_max;
                    }
                    // A row that sees no key (and has no sink): out 0, lse -inf, no gradient.
                    if (!(total > 0.0f)) {
                        std::fill(oi, oi + dim_v, 0.0f);
                        continue;
                    }
                    for (int d = 0; d < dim_v; ++d) {
                        oi[d] = oi[d] / total;
                    }
                    const float log_total = log32(total);
                    const float lse = running_max + log_total;
                    r.lse[row] = lse;
                    // What float32 lost of log(total) beside the max at large |lse|.
                    const float residual =
                        std::fabs(lse) >= kLseResidualMin ? (running_max - lse) + log_total : 0.0f;
                    // P from the streamed lse, dP = dout . v, D = rowsum(dout * out),
                    // dS = P (dP - D) (1 - tanh^2).
                    const float delta = sum_of_products(gi, oi, dim_v);
                    if (with_sinks) {
                        r.sink_terms[row] = exp32(sink - lse) * delta;
                    }
                    for (int j = 0; j < seqlen_k; ++j) {
                        p[j] = 0.0f;
                        ds[j] = 0.0f;
                        if (!visible[j]) {
                            continue;
                        }
                        p[j] = exp32((scores[j] - lse) - residual);
                        const float dp = streamed_dot(gi, &v[at.v_row(b, kvh, j)], dim_v);
                        ds[j] = product(p[j], dp - delta);
                        if (s.options.softcap > 0.0f) {
                            ds[j] = product(ds[j], 1.0f - product(t[j], t[j]));
                        }
                    }
                    // Hidden keys add zeros in NumPy's sums: skipping them changes no value.
                    std::fill(acc.begin(), acc.end(), 0.0f);
                    for (int j = 0; j < seqlen_k; ++j) {
                        if (!visible[j]) {
                            continue;
                        }
                        const float *kj = &k[at.k_row(b, kvh, j)];
                        float *dkj = &dk_group[size_t(j) * dim];
                        float *dvj = &dv_group[size_t(j) * dim_v];
                        for (int d = 0; d < dim; ++d) {
                            acc[d] = acc[d] + product(ds[j], kj[d]);
                            dkj[d] = dkj[d] + product(ds[j], qi[d]);
                        }
                        for (int d = 0; d < dim_v; ++d) {
                            dvj[d] = dvj[d] + product(p[j], gi[d]);
                        }
                    }
                    float *dqi = &r.dq[at.q_row(b, h, i)];
                    for (int d = 0; d < dim; ++d) {
                        dqi[d] = acc[d] * scale;
                    }
                }
            }
            const size_t first_k = at.k_row(b, kvh, 0), first_v = at.v_row(b, kvh, 0);
            for (size_t e = 0; e < dk_group.size(); ++e) {
                r.dk[first_k + e] = dk_group[e] * scale;
            }
            std::copy(dv_group.begin(), dv_group.end(), r.dv.begin() + first_v);
        }
    }
    return r;
}

std::vector<BaseResult> baselines(const AttentionShape &s, const AttentionInputs &in) {
    if (s.dtype != DType::f32) {
        return {base_attention(s, in)};
    }
    return {streamed_base_attention(s, in), base_attention(s, in)};
}
