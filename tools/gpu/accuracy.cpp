// The accuracy rule and the empty-row checks (see accuracy.h).
#include "accuracy.h"

#include <algorithm>
#include <cmath>
#include <limits>


namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

template <typename Value>
double max_abs_error(const std::vector<Value> &ours, const std::vector<double> &ref) {
    double worst = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double diff = std::fabs(double(ours[i]) - ref[i]);
        if (!std::isfinite(diff)) {
            return kInfinity;
        }
        worst = std::max(worst, diff);
    }
    return worst;
}

// bound = factor * base_error + absolute_term(ref).
Metric judged(const std::string &name, const std::vector<float> &ours, double base_error,
              const std::vector<double> &ref, double factor) {
    return Metric{name, max_abs_error(ours, ref), base_error,
                  factor * base_error + absolute_term(ref)};
}

}  // namespace

bool Metric::passed() const { return std::isfinite(error) && error <= bound; }

double absolute_term(const std::vector<double> &ref) {
    float worst = 0.0f;
    for (double value : ref) {
        const float r = float(value);
        if (std::isfinite(r)) {
            // volatile: each step rounded to float32, never contracted or kept wider.
            volatile float up = r + 0.3f;
            volatile float back = up - 0.3f;
            worst = std::max(worst, std::fabs(back - r));
        }
    }
    return 2.0 * double(worst);
}

Metric tensor_metric(const std::string &name, const std::vector<float> &ours,
                     const std::vector<float> &base, const std::vector<double> &ref, double factor) {
    return judged(name, ours, max_abs_error(base, ref), ref, factor);
}

Metric tensor_metric(const std::string &name, const std::vector<float> &ours,
                     const std::vector<BaseResult> &bases, std::vector<float> BaseResult::*tensor,
                     const std::vector<double> &ref, double factor) {
    double base_error = 0.0;
    for (const BaseResult &base : bases) {
        base_error = std::max(base_error, max_abs_error(base.*tensor, ref));
    }
    return judged(name, ours, base_error, ref, factor);
}

Metric lse_metric(const std::vector<float> &ours, const std::vector<double> &ref) {
    double worst = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!std::isfinite(ref[i])) {
            if (!(std::isinf(ours[i]) && ours[i] < 0)) {
                worst = kInfinity;
            }
            continue;
        }
        const double diff = std::fabs(double(ours[i]) - ref[i]) / std::max(1.0, std::fabs(ref[i]));
        worst = std::isfinite(diff) ? std::max(worst, diff) : kInfinity;
    }
    return Metric{"lse", worst, 0.0, kLseRelative};
}

Metric dsinks_metric(const AttentionShape &s, const std::vector<float> &ours,
                     const ReferenceResult &ref, const BaseResult &base) {
    double base_error = 0.0;
    for (int h = 0; h < s.num_heads; ++h) {
        double squares = 0.0;
        for (int b = 0; b < s.batch; ++b) {
            for (int i = 0; i < s.seqlen_q; ++i) {
                const size_t row = (size_t(b) * s.num_heads + h) * s.seqlen_q + i;
                const double diff = double(base.sink_terms[row]) - ref.sink_terms[row];
                squares += diff * diff;
            }
        }
        base_error = std::isfinite(squares) ? std::max(base_error, std::sqrt(squares)) : kInfinity;
    }
    return Metric{"dsinks", max_abs_error(ours, ref.dsinks), base_error,
                  kDsinksFactor * base_error + absolute_term(ref.dsinks)};
}

bool empty_rows_correct(const AttentionShape &s, const AttentionInputs &in,
                        const ReferenceResult &ref, const std::vector<float> &out,
                        const std::vector<float> &lse, const std::vector<float> &dq,
                        int *empty_rows) {
    bool correct = true;
    int count = 0;
    for (int bh = 0; bh < s.batch * s.num_heads; ++bh) {
        const int h = bh % s.num_heads;
        for (int i = 0; i < s.seqlen_q; ++i) {
            const size_t row = size_t(bh) * s.seqlen_q + i;
            if (!ref.empty[row]) {
                continue;
            }
            ++count;
            const float row_lse = lse[row];
            correct = correct && (s.options.sinks ? row_lse == in.sinks[size_t(h)]
                                                  : std::isinf(row_lse) && row_lse < 0);
            // +0 and -0 both count as zero.
            for (int d = 0; d < s.head_dim_v; ++d) {
                correct = correct && out[row * s.head_dim_v + d] == 0.0f;
            }
            for (int d = 0; d < s.head_dim; ++d) {
                correct = correct && dq[row * s.head_dim + d] == 0.0f;
            }
        }
    }
    *empty_rows = count;
    return correct;
}
