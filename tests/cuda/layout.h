// Where the harness puts a case's tensors in device memory (cases.h: Layout), the copies between
// those buffers and the contiguous host tensors of problem.h, and the kernels' parameters of a
// placed case. Plain C++17, no CUDA.
#ifndef FA_GPU_LAYOUT_H
#define FA_GPU_LAYOUT_H

#include <cstddef>
#include <vector>

#include "cases.h"
#include "flash_attention_params.h"

// The tensors of one problem, in FlashAttentionParams' order.
enum Role { kQ, kK, kV, kOut, kDout, kDq, kDk, kDv, kRoleCount };

// One tensor: (batch, heads, seqlen, cols) elements of buffer `buffer` starting at element
// `offset`, element (b, h, i, d) at offset + b * batch + h * head + i * seq + d.
struct Placement {
    int buffer;
    size_t offset;
    FlashAttentionStrides strides;
    int heads, seqlen, cols;

    size_t at(int b, int h, int i) const {
        return offset + b * strides.batch + h * strides.head + i * strides.seq;
    }
};

// The buffers of a case (sizes in elements) and where each tensor lies in them. An input tensor
// and an output tensor never share a buffer.
struct DeviceLayout {
    std::vector<size_t> buffer_elements;
    Placement tensors[kRoleCount];
};

// The placement of `shape`'s tensors in `layout` (qkv needs seqlen_q = seqlen_k and head_dim_v =
// head_dim: cases.cpp only makes such cases).
DeviceLayout place(const AttentionShape &shape, Layout layout);

// Writes the contiguous host tensor `values` (the logical order of problem.h) into the bytes of
// its buffer, `image`, in the shape's dtype.
void scatter(const AttentionShape &shape, const Placement &where, const std::vector<float> &values,
             std::vector<unsigned char> *image);

// Reads a tensor back from its buffer's bytes into the logical order.
std::vector<float> gather(const AttentionShape &shape, const Placement &where,
                          const std::vector<unsigned char> &image);

// Elements of buffer `buffer` that no tensor placed in it covers, as a mask.
std::vector<bool> gaps(const AttentionShape &shape, const DeviceLayout &layout, int buffer);

// attn_mask on the device (own buffer): its size in elements and FlashAttentionParams.mask's
// strides, 0 on a broadcast (size-1) axis; rows of seqlen_k elements back to back, or with gaps
// after every row, head and batch in the gapped layout.
struct MaskPlacement {
    size_t elements;
    FlashAttentionStrides strides;
};
MaskPlacement place_mask(const AttentionShape &shape, Layout layout);

// Bytes of a mask element: 1 (boolean), the dtype's (additive) or 4 (additive float32).
size_t mask_element_size(const AttentionShape &shape);

// The mask's device image: the host mask (problem.h's order) at its placement, every other byte
// 0xff (NaN for an additive mask).
std::vector<unsigned char> mask_image(const AttentionShape &shape, const MaskPlacement &where,
                                      const std::vector<float> &mask);

// The kernels' parameters of `shape` placed by `layout` with its mask at `mask`, as the library's
// host fills them: causal folded into window_right = 0; the dense kernels' kv_chunks = 1.
FlashAttentionParams params_of(const AttentionShape &shape, const DeviceLayout &layout,
                               const MaskPlacement &mask);

#endif
