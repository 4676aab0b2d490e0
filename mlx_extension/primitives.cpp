// The graph side of the primitives (construction, shapes, vjp, vmap) and their CPU evaluation
// through the library's C ABI on its CPU engine. See primitives.h.
#include "primitives.h"

#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <typeinfo>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace flash_attention_mlx {

namespace {

fa_dtype library_dtype(mx::Dtype dtype) {
    if (dtype == mx::float16) return FA_DTYPE_FLOAT16;
    if (dtype == mx::bfloat16) return FA_DTYPE_BFLOAT16;
    if (dtype == mx::float32) return FA_DTYPE_FLOAT32;
    throw std::invalid_argument("q, k and v must be float16, bfloat16 or float32");
}

// A non-null pointer that only marks an input present (make_problem's contract).
const void* present() {
    static const char marker = 0;
    return &marker;
}

// The one CPU-engine context of the process (thread-safe; the library allows concurrent calls).
fa_context* cpu_context() {
    static fa_context* context = [] {
        fa_context* created = nullptr;
        if (fa_context_create(FA_BACKEND_CPU, &created) != FA_STATUS_SUCCESS) {
            throw std::runtime_error(std::string("flash_attention_metal: the CPU engine did not start: ") +
                                     fa_last_error_message());
        }
        return created;
    }();
    return context;
}

void check_status(fa_status status, const char* call) {
    if (status != FA_STATUS_SUCCESS) {
        throw std::runtime_error(std::string("flash_attention_metal ") + call + " failed (" +
                                 fa_status_name(status) + "): " + fa_last_error_message());
    }
}

void allocate(mx::array& a) { a.set_data(mx::allocator::malloc(a.nbytes())); }

// What the NumPy and PyTorch front ends refuse by name, checked where the host reads the data (the
// CPU stream, in the task, once the inputs are computed; on a GPU stream they are not scanned):
// an additive mask holding NaN or +inf (its rows would be NaN), sinks that are not finite. The
// mask is scanned over its stored elements (its broadcast axes are not expanded).
void check_values(const float* mask, size_t mask_count, const float* sinks, size_t heads) {
    for (size_t i = 0; i < mask_count; ++i) {
        if (std::isnan(mask[i]) || mask[i] == INFINITY) {
            throw std::invalid_argument("mask holds " + std::string(std::isnan(mask[i]) ? "NaN" : "+inf") +
                                        " (stored element " + std::to_string(i) + "): an additive mask must not hold "
                                        "NaN or +inf (its rows would be NaN); use -inf to hide a key");
        }
    }
    for (size_t h = 0; sinks != nullptr && h < heads; ++h) {
        if (!std::isfinite(sinks[h])) {
            throw std::invalid_argument("sinks[" + std::to_string(h) + "] is " + std::to_string(sinks[h]) +
                                        ": sinks must be finite");
        }
    }
}

// vmap: moves the mapped axis to the front (broadcasting unmapped inputs to `size` there) and
// merges it into the batch axis, so the node runs on batch size*B. batch >= 0 also broadcasts the
// batch axis to that size (a mask whose batch axis is 1).
mx::array fold(const mx::array& a, int axis, int size, const mx::Stream& s, int batch = -1) {
    mx::array front = axis < 0 ? mx::expand_dims(a, 0, s) : mx::moveaxis(a, axis, 0, s);
    mx::Shape target = front.shape();
    target[0] = size;
    if (batch >= 0) target[1] = batch;
    front = mx::broadcast_to(front, target, s);
    mx::Shape merged(target.begin() + 1, target.end());
    merged[0] *= size;
    return mx::reshape(front, merged, s);
}

mx::array unfold(const mx::array& a, int size, const mx::Stream& s) {
    mx::Shape split = {size, a.shape(0) / size};
    split.insert(split.end(), a.shape().begin() + 1, a.shape().end());
    return mx::reshape(a, split, s);
}

// The vmapped size of a node's inputs (all mapped axes agree: MLX checks that).
int mapped_size(const std::vector<mx::array>& inputs, const std::vector<int>& axes) {
    for (size_t i = 0; i < inputs.size(); ++i) {
        if (axes[i] >= 0) return inputs[i].shape(axes[i]);
    }
    return 1;
}

// The mask of a vmapped node: (size*B or 1, H or 1, Lq, Lk); a mask that is mapped, or whose batch
// axis is not 1, is tiled over the mapped axis and the batch.
mx::array fold_mask(const mx::array& mask, int axis, int size, int batch, const mx::Stream& s) {
    if (axis < 0 && mask.shape(0) == 1) return mask;
    return mx::contiguous(fold(mask, axis, size, s, batch), false, s);
}

}  // namespace

fa_problem make_problem(const Options& options, const mx::array& q, const mx::array& k, const mx::array& v,
                        const mx::array* mask) {
    fa_problem p{};
    p.struct_size = sizeof(fa_problem);
    p.batch = static_cast<uint32_t>(q.shape(0));
    p.num_heads = static_cast<uint32_t>(q.shape(1));
    p.num_kv_heads = static_cast<uint32_t>(k.shape(1));
    p.seqlen_q = static_cast<uint32_t>(q.shape(2));
    p.seqlen_k = static_cast<uint32_t>(k.shape(2));
    p.head_dim = static_cast<uint32_t>(q.shape(3));
    p.head_dim_v = static_cast<uint32_t>(v.shape(3));
    p.causal = options.causal ? 1 : 0;
    p.softmax_scale = options.scale;
    p.dtype = library_dtype(q.dtype());
    p.attn_mask_type = options.mask_type;
    if (mask != nullptr) {
        p.attn_mask = present();
        // A row-contiguous 4-d mask; its size-1 axes broadcast (stride 0).
        auto stride = [&](int axis) { return mask->shape(axis) == 1 ? int64_t{0} : int64_t(mask->strides()[axis]); };
        p.attn_mask_strides = {stride(0), stride(1), stride(2)};
    }
    if (options.has_sinks) p.sinks = static_cast<const float*>(present());
    p.dropout_p = options.dropout.p;
    p.dropout_seed = options.dropout.seed;
    p.dropout_offset = options.dropout.offset;
    return p;
}

void require_contiguous(const std::vector<mx::array>& inputs) {
    for (const auto& a : inputs) {
        if (!a.flags().row_contiguous) {
            throw std::logic_error("flash_attention_metal: a primitive input is not row-contiguous");
        }
    }
}

void check_problem(const fa_problem& problem, fa_pass pass) {
    fa_plan* plan = nullptr;
    fa_status status = fa_plan_create(&problem, pass, 0, &plan);
    if (status != FA_STATUS_SUCCESS) throw std::invalid_argument(fa_last_error_message());
    fa_plan_destroy(plan);
}

std::string long_pass_refusal(const fa_problem& problem, fa_pass pass) {
    fa_plan* plan = nullptr;
    if (fa_plan_create(&problem, pass, kMaxFlopsPerCommandBuffer, &plan) != FA_STATUS_SUCCESS) return "";
    fa_plan_info info{};
    info.struct_size = sizeof info;
    fa_status status = fa_plan_get_info(plan, &info);
    fa_plan_destroy(plan);
    if (status != FA_STATUS_SUCCESS || info.piece_count <= 1) return "";
    return std::string("flash_attention_metal.mlx: this ") + (pass == FA_PASS_BACKWARD ? "backward" : "forward") +
           " pass needs " + std::to_string(info.piece_count) +
           " Metal command buffers of at most 2^35 FLOP each (macOS's GPU watchdog ends longer ones on a Mac "
           "that drives a display), and an MLX extension cannot end MLX's command buffer inside a node; split "
           "the call over the batch or the heads into calls of at most 2^35 FLOP (about 4 * batch * heads * "
           "seqlen_q * seqlen_k * head_dim forward, 10x that backward) and mx.eval each part before the next "
           "(MLX commits its command buffer at the end of an eval, not between nodes), or run it "
           "on the CPU stream, or through flash_attention_metal.flash_attn_func (NumPy) or the PyTorch MPS "
           "path, which commit a long pass in pieces";
}

std::vector<mx::array> attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                                 bool causal, const std::optional<mx::array>& mask,
                                 const std::optional<mx::array>& sinks, Dropout dropout, mx::StreamOrDevice device) {
    mx::Stream s = mx::to_stream(device);
    for (auto [name, a] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}}) {
        if (a->ndim() != 4) {
            throw std::invalid_argument(std::string(name) + " must be 4-D (batch, heads, seqlen, head_dim), got " +
                                        std::to_string(a->ndim()) + " dimensions");
        }
        if (a->dtype() != q.dtype()) throw std::invalid_argument(std::string(name) + " must have q's dtype");
    }
    library_dtype(q.dtype());
    Options options{scale, causal, FA_ATTN_MASK_NONE, sinks.has_value(), dropout};
    std::vector<mx::array> inputs = {mx::contiguous(q, false, s), mx::contiguous(k, false, s),
                                     mx::contiguous(v, false, s)};
    if (mask) {
        if (mask->ndim() > 4) throw std::invalid_argument("mask must have at most 4 dimensions");
        mx::Shape full = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
        mx::Shape shape(4 - mask->ndim(), 1);
        shape.insert(shape.end(), mask->shape().begin(), mask->shape().end());
        for (int axis = 0; axis < 4; ++axis) {
            if (shape[axis] != 1 && shape[axis] != full[axis]) {
                throw std::invalid_argument("mask must broadcast to (batch, num_heads, seqlen_q, seqlen_k) = (" +
                                            std::to_string(full[0]) + ", " + std::to_string(full[1]) + ", " +
                                            std::to_string(full[2]) + ", " + std::to_string(full[3]) + ")");
            }
        }
        bool boolean = mask->dtype() == mx::bool_;
        options.mask_type = boolean ? FA_ATTN_MASK_BOOL : FA_ATTN_MASK_ADDITIVE_FLOAT32;
        mx::array m = mx::reshape(boolean ? *mask : mx::astype(*mask, mx::float32, s), shape, s);
        // The library reads the key axis contiguously: a mask broadcast over keys is expanded.
        if (shape[3] != full[3]) {
            shape[3] = full[3];
            m = mx::broadcast_to(m, shape, s);
        }
        inputs.push_back(mx::contiguous(m, false, s));
    }
    if (sinks) {
        if (sinks->ndim() != 1 || sinks->shape(0) != q.shape(1)) {
            throw std::invalid_argument("sinks must have shape (num_heads,) = (" + std::to_string(q.shape(1)) + ",)");
        }
        inputs.push_back(mx::contiguous(mx::astype(*sinks, mx::float32, s), false, s));
    }
    check_problem(make_problem(options, inputs[0], inputs[1], inputs[2], mask ? &inputs[3] : nullptr),
                  FA_PASS_FORWARD);
    auto shapes = std::vector<mx::Shape>{{q.shape(0), q.shape(1), q.shape(2), v.shape(3)},
                                         {q.shape(0), q.shape(1), q.shape(2)}};
    return mx::array::make_arrays(std::move(shapes), {q.dtype(), mx::float32},
                                  std::make_shared<Forward>(s, options), std::move(inputs));
}

std::vector<mx::array> attention_backward(const mx::array& dout, const mx::array& q, const mx::array& k,
                                          const mx::array& v, const mx::array& out, const mx::array& lse,
                                          float scale, bool causal, mx::StreamOrDevice device) {
    mx::Stream s = mx::to_stream(device);
    // The forward's checks of q, k, v (shapes, dtypes), then those of the backward's own arrays.
    attention(q, k, v, scale, causal, std::nullopt, std::nullopt, {}, s);
    Options options{scale, causal, FA_ATTN_MASK_NONE, false, {}};
    mx::Shape out_shape = {q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
    if (dout.shape() != out_shape || out.shape() != out_shape || dout.dtype() != q.dtype() || out.dtype() != q.dtype()) {
        throw std::invalid_argument("dout and out must have q's dtype and shape (batch, num_heads, seqlen_q, head_dim_v)");
    }
    if (lse.shape() != mx::Shape{q.shape(0), q.shape(1), q.shape(2)} || lse.dtype() != mx::float32) {
        throw std::invalid_argument("lse must be float32 (batch, num_heads, seqlen_q)");
    }
    std::vector<mx::array> inputs;
    for (const auto* a : {&dout, &q, &k, &v, &out, &lse}) inputs.push_back(mx::contiguous(*a, false, s));
    check_problem(make_problem(options, inputs[1], inputs[2], inputs[3], nullptr), FA_PASS_BACKWARD);
    return mx::array::make_arrays({q.shape(), k.shape(), v.shape()}, {q.dtype(), q.dtype(), q.dtype()},
                                  std::make_shared<Backward>(s, options), std::move(inputs));
}

// ---- Both nodes ----

std::vector<mx::array> Node::jvp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                                 const std::vector<int>&) {
    throw std::invalid_argument(
        "flash_attention_metal.mlx.scaled_dot_product_attention has no jvp (forward-mode differentiation) and "
        "no second derivatives; use mx.vjp/mx.grad, or mx.fast.scaled_dot_product_attention");
}

bool Node::is_equivalent(const mx::Primitive& other) const {
    return typeid(*this) == typeid(other) && options_ == static_cast<const Node&>(other).options_;
}

// ---- Forward ----

std::vector<mx::Shape> Forward::output_shapes(const std::vector<mx::array>& inputs) {
    const auto& q = inputs[0];
    return {{q.shape(0), q.shape(1), q.shape(2), inputs[2].shape(3)}, {q.shape(0), q.shape(1), q.shape(2)}};
}


void Forward::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    require_contiguous(inputs);
    const mx::array* mask = options_.mask_type != FA_ATTN_MASK_NONE ? &inputs[3] : nullptr;
    fa_problem problem = make_problem(options_, inputs[0], inputs[1], inputs[2], mask);
    if (mask != nullptr) problem.attn_mask = mask->data<void>();
    if (options_.has_sinks) problem.sinks = inputs.back().data<float>();
    auto& out = outputs[0];
    auto& lse = outputs[1];
    allocate(out);
    allocate(lse);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.set_output_array(lse);
    const bool additive = options_.mask_type == FA_ATTN_MASK_ADDITIVE_FLOAT32;
    const size_t mask_count = additive ? mask->data_size() : 0;
    const size_t heads = options_.has_sinks ? size_t(inputs[0].shape(1)) : 0;
    encoder.dispatch([problem, q = inputs[0].data<void>(), k = inputs[1].data<void>(), v = inputs[2].data<void>(),
                      o = out.data<void>(), l = lse.data<float>(), mask_count, heads]() {
        check_values(static_cast<const float*>(problem.attn_mask), mask_count, problem.sinks, heads);
        check_status(fa_forward(cpu_context(), &problem, q, k, v, o, l), "fa_forward");
    });
}

std::vector<mx::array> Forward::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                    const std::vector<int>& argnums, const std::vector<mx::array>& outputs) {
    // lse is not part of the public function's result, so its cotangent is not used.
    std::vector<mx::array> inputs = {mx::contiguous(cotangents[0], false, stream())};
    inputs.insert(inputs.end(), primals.begin(), primals.begin() + 3);
    inputs.push_back(outputs[0]);
    inputs.push_back(outputs[1]);
    inputs.insert(inputs.end(), primals.begin() + 3, primals.end());
    const auto& q = primals[0];
    std::vector<mx::Shape> shapes = {q.shape(), primals[1].shape(), primals[2].shape()};
    std::vector<mx::Dtype> dtypes = {q.dtype(), q.dtype(), q.dtype()};
    if (options_.has_sinks) {
        shapes.push_back({q.shape(1)});
        dtypes.push_back(mx::float32);
    }
    auto grads = mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                        std::make_shared<Backward>(stream(), options_), std::move(inputs));
    int sinks_index = options_.has_sinks ? static_cast<int>(primals.size()) - 1 : -1;
    std::vector<mx::array> result;
    for (int arg : argnums) {
        if (arg < 3) {
            result.push_back(grads[arg]);
        } else if (arg == sinks_index) {
            result.push_back(grads[3]);
        } else {
            throw std::invalid_argument(
                "mask: flash_attention_metal.mlx.scaled_dot_product_attention has no gradient with respect to "
                "the mask; stop it with mx.stop_gradient(mask) or use mx.fast.scaled_dot_product_attention");
        }
    }
    return result;
}


std::pair<std::vector<mx::array>, std::vector<int>> Forward::vmap(const std::vector<mx::array>& inputs,
                                                                  const std::vector<int>& axes) {
    if (options_.has_sinks && axes.back() >= 0) {
        throw std::invalid_argument("sinks: mx.vmap over the sinks is not supported (they are per head)");
    }
    const auto& s = stream();
    int size = mapped_size(inputs, axes);
    std::vector<mx::array> folded;
    for (int i = 0; i < 3; ++i) folded.push_back(mx::contiguous(fold(inputs[i], axes[i], size, s), false, s));
    if (options_.mask_type != FA_ATTN_MASK_NONE) folded.push_back(fold_mask(inputs[3], axes[3], size, folded[0].shape(0) / size, s));
    if (options_.has_sinks) folded.push_back(inputs.back());
    const auto& q = folded[0];
    auto shapes = std::vector<mx::Shape>{{q.shape(0), q.shape(1), q.shape(2), folded[2].shape(3)},
                                         {q.shape(0), q.shape(1), q.shape(2)}};
    auto outs = mx::array::make_arrays(std::move(shapes), {q.dtype(), mx::float32},
                                       std::make_shared<Forward>(s, options_), std::move(folded));
    return {{unfold(outs[0], size, s), unfold(outs[1], size, s)}, {0, 0}};
}

// ---- Backward ----

std::vector<mx::Shape> Backward::output_shapes(const std::vector<mx::array>& inputs) {
    std::vector<mx::Shape> shapes = {inputs[1].shape(), inputs[2].shape(), inputs[3].shape()};
    if (options_.has_sinks) shapes.push_back({inputs[1].shape(1)});
    return shapes;
}


void Backward::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    require_contiguous(inputs);
    const mx::array* mask = options_.mask_type != FA_ATTN_MASK_NONE ? &inputs[6] : nullptr;
    fa_problem problem = make_problem(options_, inputs[1], inputs[2], inputs[3], mask);
    if (mask != nullptr) problem.attn_mask = mask->data<void>();
    for (auto& g : outputs) allocate(g);
    if (options_.has_sinks) {
        problem.sinks = inputs.back().data<float>();
        problem.dsinks = outputs[3].data<float>();
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    for (auto& g : outputs) encoder.set_output_array(g);
    encoder.dispatch([problem, dout = inputs[0].data<void>(), q = inputs[1].data<void>(), k = inputs[2].data<void>(),
                      v = inputs[3].data<void>(), out = inputs[4].data<void>(), lse = inputs[5].data<float>(),
                      dq = outputs[0].data<void>(), dk = outputs[1].data<void>(), dv = outputs[2].data<void>()]() {
        check_status(fa_backward(cpu_context(), &problem, dout, q, k, v, out, lse, dq, dk, dv), "fa_backward");
    });
}

std::vector<mx::array> Backward::vjp(const std::vector<mx::array>&, const std::vector<mx::array>&,
                                     const std::vector<int>&, const std::vector<mx::array>&) {
    throw std::invalid_argument(
        "flash_attention_metal.mlx.scaled_dot_product_attention has no second derivatives (grad of grad); use "
        "mx.fast.scaled_dot_product_attention for those");
}


std::pair<std::vector<mx::array>, std::vector<int>> Backward::vmap(const std::vector<mx::array>& inputs,
                                                                   const std::vector<int>& axes) {
    // dsinks sums over the batch, so a vmapped backward with sinks would mix the mapped entries.
    if (options_.has_sinks) {
        throw std::invalid_argument("sinks: mx.vmap of the gradient of attention with sinks is not supported");
    }
    const auto& s = stream();
    int size = mapped_size(inputs, axes);
    std::vector<mx::array> folded;
    for (int i = 0; i < 6; ++i) folded.push_back(mx::contiguous(fold(inputs[i], axes[i], size, s), false, s));
    if (options_.mask_type != FA_ATTN_MASK_NONE) folded.push_back(fold_mask(inputs[6], axes[6], size, folded[1].shape(0) / size, s));
    std::vector<mx::Shape> shapes = {folded[1].shape(), folded[2].shape(), folded[3].shape()};
    auto dtype = folded[1].dtype();
    auto grads = mx::array::make_arrays(std::move(shapes), {dtype, dtype, dtype},
                                        std::make_shared<Backward>(s, options_), std::move(folded));
    return {{unfold(grads[0], size, s), unfold(grads[1], size, s), unfold(grads[2], size, s)}, {0, 0, 0}};
}

}  // namespace flash_attention_mlx
