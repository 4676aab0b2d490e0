// Device placement of a case's tensors (see layout.h).
#include "layout.h"

#include <algorithm>
#include <cassert>

namespace {

// (heads, seqlen, cols) of each role.
void dims_of(const AttentionShape &s, Role role, int *heads, int *seqlen, int *cols) {
    const bool query_side = role == kQ || role == kOut || role == kDout || role == kDq;
    *heads = query_side ? s.num_heads : s.num_kv_heads;
    *seqlen = query_side ? s.seqlen_q : s.seqlen_k;
    const bool value_side = role == kV || role == kOut || role == kDout || role == kDv;
    *cols = value_side ? s.head_dim_v : s.head_dim;
}

FlashAttentionStrides strides(uint64_t batch, uint64_t head, uint64_t seq) {
    FlashAttentionStrides st;
    st.batch = batch;
    st.head = head;
    st.seq = seq;
    return st;
}

// One past the last element a placement reaches.
size_t extent(int batch, const Placement &p) {
    return p.at(batch - 1, p.heads - 1, p.seqlen - 1) + size_t(p.cols);
}

// FlashAttentionParams.mask_type of a mask kind.
int fa_mask_type(MaskKind kind) {
    switch (kind) {
        case MaskKind::none:
            return FA_MASK_NONE;
        case MaskKind::boolean:
            return FA_MASK_BOOL;
        case MaskKind::additive:
            return FA_MASK_ADDITIVE;
        case MaskKind::additive_f32:
            return FA_MASK_ADDITIVE_F32;
    }
    return FA_MASK_NONE;
}

}  // namespace

DeviceLayout place(const AttentionShape &s, Layout layout) {
    DeviceLayout result;
    for (int role = 0; role < kRoleCount; ++role) {
        Placement &p = result.tensors[role];
        dims_of(s, Role(role), &p.heads, &p.seqlen, &p.cols);
        const uint64_t heads = p.heads, seqlen = p.seqlen, cols = p.cols;
        p.buffer = role;
        p.offset = 0;
        switch (layout) {
            case Layout::bhsd:
                p.strides = strides(heads * seqlen * cols, seqlen * cols, cols);
                break;
            case Layout::bshd:
                p.strides = strides(seqlen * heads * cols, cols, heads * cols);
                break;
            case Layout::gapped: {
                // Odd gaps after every row, head and batch.
                const uint64_t seq = cols + 3, head = seqlen * seq + 5, batch = heads * head + 7;
                p.strides = strides(batch, head, seq);
                break;
            }
            case Layout::qkv: {
                // q, k, v in buffer 0 and dq, dk, dv in buffer 1, rows of H + 2 Hkv heads; out and
                // dout bshd in buffers of their own.
                assert(s.seqlen_q == s.seqlen_k && s.head_dim_v == s.head_dim);
                const uint64_t width = uint64_t(s.num_heads + 2 * s.num_kv_heads) * s.head_dim;
                if (role == kOut || role == kDout) {
                    p.buffer = role == kOut ? 2 : 3;
                    p.strides = strides(seqlen * heads * cols, cols, heads * cols);
                    break;
                }
                const bool gradient = role == kDq || role == kDk || role == kDv;
                const Role base = gradient ? Role(role - kDq) : Role(role);  // q, k or v
                p.buffer = gradient ? 1 : 0;
                p.offset = base == kQ ? 0
                           : base == kK ? size_t(s.num_heads) * s.head_dim
                                        : size_t(s.num_heads + s.num_kv_heads) * s.head_dim;
                p.strides = strides(seqlen * width, cols, width);
                break;
            }
        }
    }
    int buffers = 0;
    for (const Placement &p : result.tensors) {
        buffers = std::max(buffers, p.buffer + 1);
    }
    result.buffer_elements.assign(size_t(buffers), 0);
    for (const Placement &p : result.tensors) {
        size_t &size = result.buffer_elements[size_t(p.buffer)];
        size = std::max(size, extent(s.batch, p));
    }
    return result;
}

void scatter(const AttentionShape &s, const Placement &where, const std::vector<float> &values,
             std::vector<unsigned char> *image) {
    const size_t size = dtype_size(s.dtype);
    size_t next = 0;
    for (int b = 0; b < s.batch; ++b) {
        for (int h = 0; h < where.heads; ++h) {
            for (int i = 0; i < where.seqlen; ++i) {
                const size_t row = where.at(b, h, i);
                for (int d = 0; d < where.cols; ++d) {
                    encode(s.dtype, values[next++], image->data() + (row + size_t(d)) * size);
                }
            }
        }
    }
}

std::vector<float> gather(const AttentionShape &s, const Placement &where,
                          const std::vector<unsigned char> &image) {
    const size_t size = dtype_size(s.dtype);
    std::vector<float> values;
    values.reserve(size_t(s.batch) * where.heads * where.seqlen * where.cols);
    for (int b = 0; b < s.batch; ++b) {
        for (int h = 0; h < where.heads; ++h) {
            for (int i = 0; i < where.seqlen; ++i) {
                const size_t row = where.at(b, h, i);
                for (int d = 0; d < where.cols; ++d) {
                    values.push_back(decode(s.dtype, image.data() + (row + size_t(d)) * size));
                }
            }
        }
    }
    return values;
}

std::vector<bool> gaps(const AttentionShape &s, const DeviceLayout &layout, int buffer) {
    std::vector<bool> mask(layout.buffer_elements[size_t(buffer)], true);
    for (const Placement &p : layout.tensors) {
        if (p.buffer != buffer) {
            continue;
        }
        for (int b = 0; b < s.batch; ++b) {
            for (int h = 0; h < p.heads; ++h) {
                for (int i = 0; i < p.seqlen; ++i) {
                    std::fill_n(mask.begin() + long(p.at(b, h, i)), p.cols, false);
                }
            }
        }
    }
    return mask;
}

MaskPlacement place_mask(const AttentionShape &s, Layout layout) {
    const bool gapped = layout == Layout::gapped;
    const uint64_t seq = uint64_t(s.seqlen_k) + (gapped ? 3 : 0);
    const uint64_t head = seq * s.seqlen_q + (gapped ? 5 : 0);
    const uint64_t batch = head * s.mask_heads() + (gapped ? 7 : 0);
    MaskPlacement m;
    m.strides = strides(s.options.mask_per_batch ? batch : 0, s.options.mask_per_head ? head : 0, seq);
    m.elements = s.options.mask == MaskKind::none ? 0 : size_t(batch) * s.mask_batches();
    return m;
}

size_t mask_element_size(const AttentionShape &s) {
    switch (s.options.mask) {
        case MaskKind::boolean:
            return 1;
        case MaskKind::additive:
            return dtype_size(s.dtype);
        default:
            return 4;
    }
}

std::vector<unsigned char> mask_image(const AttentionShape &s, const MaskPlacement &where,
                                      const std::vector<float> &mask) {
    const size_t size = mask_element_size(s);
    std::vector<unsigned char> image(where.elements * size, 0xff);
    const uint64_t batch = where.strides.batch, head = where.strides.head, seq = where.strides.seq;
    for (int b = 0; b < s.mask_batches(); ++b) {
        for (int h = 0; h < s.mask_heads(); ++h) {
            for (int i = 0; i < s.seqlen_q; ++i) {
                for (int j = 0; j < s.seqlen_k; ++j) {
                    const float value = mask[mask_index(s, b, h, i, j)];
                    unsigned char *at = image.data() + (b * batch + h * head + i * seq + j) * size;
                    if (s.options.mask == MaskKind::boolean) {
                        *at = value != 0.0f ? 1 : 0;
                    } else {
                        encode(s.options.mask == MaskKind::additive ? s.dtype : DType::f32, value, at);
                    }
                }
            }
        }
    }
    return image;
}

FlashAttentionParams params_of(const AttentionShape &s, const DeviceLayout &layout,
                               const MaskPlacement &mask) {
    FlashAttentionParams p{};
    FlashAttentionStrides *role_strides[kRoleCount] = {&p.q,    &p.k,  &p.v,  &p.out,
                                                       &p.dout, &p.dq, &p.dk, &p.dv};
    for (int role = 0; role < kRoleCount; ++role) {
        *role_strides[role] = layout.tensors[role].strides;
    }
    p.batch = fa_u32(s.batch);
    p.num_heads = fa_u32(s.num_heads);
    p.num_kv_heads = fa_u32(s.num_kv_heads);
    p.seqlen_q = fa_u32(s.seqlen_q);
    p.seqlen_k = fa_u32(s.seqlen_k);
    p.head_dim = fa_u32(s.head_dim);
    p.head_dim_v = fa_u32(s.head_dim_v);
    p.causal = s.causal ? 1u : 0u;
    p.softmax_scale = s.softmax_scale;
    const ScoreOptions &o = s.options;
    p.window_left = o.window_left;
    p.window_right = s.window_right();
    p.softcap = o.softcap;
    p.mask_type = fa_u32(fa_mask_type(o.mask));
    p.mask = mask.strides;
    p.has_alibi = o.alibi ? 1u : 0u;
    p.alibi_batch_stride = o.alibi_per_batch ? fa_u64(s.num_heads) : 0u;
    p.has_sinks = o.sinks ? 1u : 0u;
    p.kv_chunks = 1;  // the dense kernels' values, as the Metal plan sets them
    p.kv_chunk_keys = p.seqlen_k;
    return p;
}
