// GPU evaluation of the primitives: the library's exported dispatch plan (fa_plan_*) encoded on
// MLX's own Metal command encoder, so the kernels run on MLX's stream, on MLX's buffers, with MLX's
// hazard tracking (its buffers are untracked: an encoder of our own would race with it).
// Only where MLX was built with Metal (_METAL_, from MLX's CMake config). NOT COMPILED HERE: the
// Linux mlx-cpu wheel's Metal headers include <Metal/Metal.hpp>, which it does not ship. Every MLX
// call below was checked against the 0.32.4 wheel's mlx/backend/metal/device.h (CommandEncoder:
// set_compute_pipeline_state, set_input_array(a, idx, offset), set_output_array(a, idx, offset),
// set_bytes(const T*, n, idx), dispatch_threadgroups(MTL::Size, MTL::Size), add_temporary;
// Device: get_library(name, builder), get_kernel(name, lib, hash_name, MTLFCList), mtl_device(),
// get_architecture())
// and against MLX's own uses in mlx/backend/metal/scaled_dot_product_attention.cpp (function constants as
// {&value, MTL::DataType::DataTypeBool, index}, temporaries allocated then add_temporary).
#include "primitives.h"

#include <stdexcept>

#ifdef _METAL_
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../Shaders/flash_attention_params.h"
#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#endif

namespace flash_attention_mlx {

#ifdef _METAL_
namespace {

// fa_buffer_role -> the node's array bound for it: inputs read, outputs written.
struct Roles {
    std::map<uint32_t, const mx::array*> reads;
    std::map<uint32_t, mx::array*> writes;
};

struct PlanDeleter {
    void operator()(fa_plan* plan) const { fa_plan_destroy(plan); }
};

void check_plan(fa_status status, const char* call) {
    if (status != FA_STATUS_SUCCESS) {
        throw std::runtime_error(std::string("flash_attention_metal ") + call + ": " + fa_last_error_message());
    }
}

// The kernels' library, made once per process: build.sh's .metallib for this OS
// (fa_plan_metallib_path(), MLX's get_library(name, path), which throws when Metal refuses the
// file), else fa_plan_kernel_source() compiled by MLX (get_library(name, builder)); both cached by
// MLX under one name.
MTL::Library* kernels(mx::metal::Device& device) {
    static const char* const kName = "flash_attention_metal";
    if (const char* path = fa_plan_metallib_path()) {
        try {
            return device.get_library(kName, std::string(path));
        } catch (const std::exception&) {
            // Refused (built for a newer macOS than this one): the source below.
        }
    }
    return device.get_library(kName, [] { return std::string(fa_plan_kernel_source()); });
}

// The route of the last pass encoded (fa_plan_tensor_ops), for tensor_ops_route().
std::mutex route_mutex;
std::string last_route;

// What MLX's device offers the tensor-op kernels (docs/tensor-ops.md): its architecture and the
// tensor-op library of its own: build.sh's fa_plan_tensor_metallib_path() (get_library(name, path),
// which throws when Metal refuses the file), else fa_plan_tensor_kernel_source() compiled by MLX
// (get_library(name, builder): MLX's language version, get_metal_version in
// mlx/backend/metal/device.cpp, is MSL 4.0 on macOS 26 and 4.1 on 27, which
// MetalPerformancePrimitives needs). Made once per process where fa_tensor_ops_wanted says so
// for the architecture MLX reads for its own NAX gate (Device::get_architecture(), from
// MTLDevice.architecture.name unless MLX's environment overrides it). A failure (MLX's
// build_library_ throws std::runtime_error with the compiler's message; or a pipeline of it,
// tensor_failed) loses only the tensor-op path: the message goes into the target, hence into the
// plan's route, and is kept, so the library is not tried again.
struct TensorLibrary {
    std::string architecture;
    fa_tensor_library state = FA_TENSOR_LIBRARY_NONE;
    std::string error;
    MTL::Library* library = nullptr;

    fa_plan_target target() const {
        fa_plan_target t{};
        t.struct_size = sizeof t;
        t.tensor_library = state;
        t.architecture = architecture.c_str();
        t.tensor_library_error = state == FA_TENSOR_LIBRARY_FAILED ? error.c_str() : nullptr;
        return t;
    }
};

std::mutex tensor_mutex;
std::optional<std::string> tensor_failure;

// Keeps the first failure of the tensor-op path.
void tensor_failed(const std::string& why) {
    std::lock_guard<std::mutex> lock(tensor_mutex);
    if (!tensor_failure) tensor_failure = why;
}

TensorLibrary tensor_library(mx::metal::Device& device) {
    TensorLibrary t;
    t.architecture = device.get_architecture();
    uint32_t wanted = 0;
    check_plan(fa_tensor_ops_wanted(t.architecture.c_str(), &wanted), "fa_tensor_ops_wanted");
    if (wanted == 0) return t;
    std::lock_guard<std::mutex> lock(tensor_mutex);
    if (!tensor_failure) {
        static const char* const kName = "flash_attention_metal_tensor";
        if (const char* path = fa_plan_tensor_metallib_path()) {
            try {
                t.library = device.get_library(kName, std::string(path));
                t.state = FA_TENSOR_LIBRARY_READY;
                return t;
            } catch (const std::exception&) {
                // Refused (built for a newer macOS than this one): the source below.
            }
        }
        try {
            t.library = device.get_library(kName, [] { return std::string(fa_plan_tensor_kernel_source()); });
            t.state = FA_TENSOR_LIBRARY_READY;
            return t;
        } catch (const std::exception& error) {
            tensor_failure = error.what();
        }
    }
    t.state = FA_TENSOR_LIBRARY_FAILED;
    t.error = *tensor_failure;
    return t;
}

// A pipeline of the tensor-op library that Metal refused (MLX's get_kernel throws).
struct TensorPipelineFailed : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The pipeline of one dispatch: kernel_name specialised with its function constants, built once
// per process from kernels() and cached by MLX under a name that includes the constants. MLX's compile sets only mathMode (safe, which the kernels need for their infinities);
// from macOS 15 the float32 math functions then default to the fast ones
// (MTLCompileOptions.mathFloatingPointFunctions), so the kernels call every one as precise::
// explicitly and give the Swift host's and PyTorch's bits.
// Tensor-op kernels (names with "_tensor_", flash_attention_metal.h) come from `tensor`.
MTL::ComputePipelineState* pipeline(mx::metal::Device& device, const TensorLibrary& tensor, const fa_plan* plan,
                                    uint32_t index, const fa_plan_dispatch& dispatch) {
    const bool is_tensor = std::strstr(dispatch.kernel_name, "_tensor_") != nullptr;
    auto* library = is_tensor ? tensor.library : kernels(device);
    if (library == nullptr) {
        throw std::logic_error("flash_attention_metal: the plan names a tensor-op kernel without the tensor-op library");
    }
    // The values must outlive get_kernel, which reads them through the pointers.
    std::vector<uint32_t> values(dispatch.specialization_count);
    std::unique_ptr<bool[]> bools(new bool[dispatch.specialization_count]);
    mx::metal::MTLFCList constants;
    std::string hash = dispatch.kernel_name;
    for (uint32_t i = 0; i < dispatch.specialization_count; ++i) {
        fa_plan_specialization s{};
        s.struct_size = sizeof s;
        check_plan(fa_plan_get_specialization(plan, index, i, &s), "fa_plan_get_specialization");
        values[i] = s.value;
        bools[i] = s.value != 0;
        if (s.type == FA_SPECIALIZATION_BOOL) {
            constants.emplace_back(&bools[i], MTL::DataType::DataTypeBool, s.index);
        } else {
            constants.emplace_back(&values[i], MTL::DataType::DataTypeUInt, s.index);
        }
        hash += "_" + std::to_string(s.index) + "_" + std::to_string(s.value);
    }
    if (!is_tensor) return device.get_kernel(dispatch.kernel_name, library, hash, constants);
    try {
        return device.get_kernel(dispatch.kernel_name, library, hash, constants);
    } catch (const std::exception& error) {
        throw TensorPipelineFailed(std::string(dispatch.kernel_name) + ": " + error.what());
    }
}

// A plan with every dispatch's pipeline, made before anything is encoded.
struct Planned {
    std::unique_ptr<fa_plan, PlanDeleter> plan;
    fa_plan_info info{};
    std::vector<fa_plan_dispatch> dispatches;
    std::vector<MTL::ComputePipelineState*> kernels;
};

// The plan of `pass` for `problem` on MLX's device and its pipelines. A tensor-op pipeline Metal
// refuses counts as the tensor-op library's failure: the pass is planned again without it (that
// plan names no tensor-op kernel, so this ends).
Planned planned(mx::metal::Device& device, const fa_problem& problem, fa_pass pass) {
    for (;;) {
        const TensorLibrary tensor = tensor_library(device);
        const fa_plan_target target = tensor.target();
        Planned made;
        fa_plan* raw = nullptr;
        check_plan(fa_plan_create_for(&problem, pass, 0, &target, &raw), "fa_plan_create_for");
        made.plan.reset(raw);
        made.info.struct_size = sizeof made.info;
        check_plan(fa_plan_get_info(raw, &made.info), "fa_plan_get_info");
        try {
            for (uint32_t d = 0; d < made.info.dispatch_count; ++d) {
                fa_plan_dispatch dispatch{};
                dispatch.struct_size = sizeof dispatch;
                check_plan(fa_plan_get_dispatch(raw, d, &dispatch), "fa_plan_get_dispatch");
                made.dispatches.push_back(dispatch);
                made.kernels.push_back(pipeline(device, tensor, raw, d, dispatch));
            }
        } catch (const TensorPipelineFailed& failed) {
            tensor_failed(failed.what());
            continue;
        }
        std::lock_guard<std::mutex> lock(route_mutex);
        last_route = fa_plan_tensor_ops(raw);
        return made;
    }
}

// The dispatch's parameter bytes, with scalar_copies set where a tensor the kernels copy in 16-byte
// tiles is bound at an address that is not a multiple of FA_CHUNK_BYTES: the plan sees only
// layouts, and an MLX view (a slice, a reshape of one) can start anywhere in its buffer
// (array::offset(), which set_input_array adds to the binding's offset). The Swift host does the
// same (FlashAttentionParams.checkingAlignment); the header asks every host for it.
std::vector<uint8_t> aligned_params(const fa_plan* plan, uint32_t index, const fa_plan_dispatch& dispatch,
                                    const Roles& roles) {
    if (dispatch.params_size != sizeof(FlashAttentionParams)) {
        throw std::logic_error("flash_attention_metal: the plan's parameter bytes are not a FlashAttentionParams");
    }
    std::vector<uint8_t> bytes(static_cast<const uint8_t*>(dispatch.params),
                               static_cast<const uint8_t*>(dispatch.params) + dispatch.params_size);
    for (uint32_t b = 0; b < dispatch.binding_count; ++b) {
        fa_plan_binding binding{};
        binding.struct_size = sizeof binding;
        check_plan(fa_plan_get_binding(plan, index, b, &binding), "fa_plan_get_binding");
        switch (binding.role) {
            case FA_BUFFER_ROLE_Q: case FA_BUFFER_ROLE_K: case FA_BUFFER_ROLE_V: case FA_BUFFER_ROLE_OUT:
            case FA_BUFFER_ROLE_DOUT: break;
            default: continue;
        }
        auto written = roles.writes.find(binding.role);
        const mx::array& a = written != roles.writes.end() ? *written->second : *roles.reads.at(binding.role);
        if ((a.offset() + static_cast<int64_t>(binding.byte_offset)) % FA_CHUNK_BYTES != 0) {
            const fa_u32 scalar = 1;
            std::memcpy(bytes.data() + offsetof(FlashAttentionParams, scalar_copies), &scalar, sizeof scalar);
        }
    }
    return bytes;
}

// Encodes every dispatch of the plan of `problem` for `pass`: roles bound to `roles`' arrays (at
// their offsets), workspaces allocated as MLX temporaries, parameters by set_bytes. A pass longer
// than one command buffer may be is refused (long_pass_refusal): the plan is one piece.
void encode(const mx::Stream& stream, const fa_problem& problem, fa_pass pass, Roles roles) {
    if (auto why = long_pass_refusal(problem, pass); !why.empty()) throw std::runtime_error(why);
    auto& device = mx::metal::device(stream.device);
    const Planned made = planned(device, problem, pass);
    const fa_plan* plan = made.plan.get();
    const fa_plan_info& info = made.info;
    auto& encoder = mx::metal::get_command_encoder(stream);
    std::vector<mx::array> workspaces;
    std::vector<uint32_t> workspace_roles;
    for (uint32_t i = 0; i < info.buffer_count; ++i) {
        fa_plan_buffer buffer{};
        buffer.struct_size = sizeof buffer;
        check_plan(fa_plan_get_buffer(plan, i, &buffer), "fa_plan_get_buffer");
        if (buffer.usage == FA_BUFFER_WORKSPACE) {
            if (buffer.byte_count > uint64_t(INT32_MAX)) {
                throw std::runtime_error("flash_attention_metal: a workspace above 2 GiB");
            }
            workspaces.emplace_back(mx::Shape{static_cast<int>(buffer.byte_count)}, mx::uint8, nullptr,
                                    std::vector<mx::array>{});
            // At least one byte: MLX's allocator gives no buffer for 0 and the kernels bind every one.
            workspaces.back().set_data(mx::allocator::malloc(std::max<uint64_t>(buffer.byte_count, 1)));
            workspace_roles.push_back(buffer.role);
        } else if ((buffer.usage == FA_BUFFER_OUTPUT ? roles.writes.count(buffer.role)
                                                     : roles.reads.count(buffer.role)) == 0) {
            throw std::logic_error("flash_attention_metal: the plan binds a role the node does not have");
        }
    }
    // Workspaces are written by one dispatch and read by a later one: bound as outputs, so that
    // MLX's encoder puts a barrier between the two.
    for (size_t w = 0; w < workspaces.size(); ++w) roles.writes[workspace_roles[w]] = &workspaces[w];
    for (uint32_t d = 0; d < info.dispatch_count; ++d) {
        const fa_plan_dispatch& dispatch = made.dispatches[d];
        auto* kernel = made.kernels[d];
        const auto* t = dispatch.threads_per_threadgroup;
        if (kernel->maxTotalThreadsPerThreadgroup() < NS::UInteger(t[0]) * t[1] * t[2]) {
            throw std::runtime_error(std::string("flash_attention_metal: kernel ") + dispatch.kernel_name +
                                     " allows fewer threads per threadgroup than its plan uses");
        }
        // metal-cpp's ComputePipelineState::staticThreadgroupMemoryLength() and
        // Device::maxThreadgroupMemoryLength() (MTLComputePipelineState, MTLDevice): the kernels
        // declare all their threadgroup memory statically (no setThreadgroupMemoryLength), so the
        // static length is the whole need; a pipeline above the device's limit fails to launch.
        const NS::UInteger needed = kernel->staticThreadgroupMemoryLength();
        const NS::UInteger available = device.mtl_device()->maxThreadgroupMemoryLength();
        if (needed > available) {
            throw std::runtime_error(std::string("flash_attention_metal: kernel ") + dispatch.kernel_name + " needs " +
                                     std::to_string(needed) + " bytes of threadgroup memory; this GPU has " +
                                     std::to_string(available) + " per threadgroup");
        }
        encoder.set_compute_pipeline_state(kernel);
        for (uint32_t b = 0; b < dispatch.binding_count; ++b) {
            fa_plan_binding binding{};
            binding.struct_size = sizeof binding;
            check_plan(fa_plan_get_binding(plan, d, b, &binding), "fa_plan_get_binding");
            auto offset = static_cast<int64_t>(binding.byte_offset);
            auto written = roles.writes.find(binding.role);
            if (written != roles.writes.end()) {
                encoder.set_output_array(*written->second, binding.index, offset);
            } else {
                encoder.set_input_array(*roles.reads.at(binding.role), binding.index, offset);
            }
        }
        auto params = aligned_params(plan, d, dispatch, roles);
        encoder.set_bytes(params.data(), static_cast<int>(params.size()), dispatch.params_index);
        const auto* g = dispatch.threadgroups_per_grid;
        encoder.dispatch_threadgroups(MTL::Size(g[0], g[1], g[2]), MTL::Size(t[0], t[1], t[2]));
    }
    for (auto& workspace : workspaces) encoder.add_temporary(std::move(workspace));
}

}  // namespace

std::string tensor_ops_route() {
    std::lock_guard<std::mutex> lock(route_mutex);
    return last_route;
}

void Forward::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    require_contiguous(inputs);
    const mx::array* mask = options_.mask_type != FA_ATTN_MASK_NONE ? &inputs[3] : nullptr;
    fa_problem problem = make_problem(options_, inputs[0], inputs[1], inputs[2], mask);
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    Roles roles;
    roles.reads = {{FA_BUFFER_ROLE_Q, &inputs[0]}, {FA_BUFFER_ROLE_K, &inputs[1]}, {FA_BUFFER_ROLE_V, &inputs[2]}};
    roles.writes = {{FA_BUFFER_ROLE_OUT, &outputs[0]}, {FA_BUFFER_ROLE_LSE, &outputs[1]}};
    if (mask != nullptr) roles.reads[FA_BUFFER_ROLE_ATTN_MASK] = mask;
    if (options_.has_sinks) roles.reads[FA_BUFFER_ROLE_SINKS] = &inputs.back();
    encode(stream(), problem, FA_PASS_FORWARD, std::move(roles));
}

void Backward::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    require_contiguous(inputs);
    const mx::array* mask = options_.mask_type != FA_ATTN_MASK_NONE ? &inputs[6] : nullptr;
    fa_problem problem = make_problem(options_, inputs[1], inputs[2], inputs[3], mask);
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    Roles roles;
    roles.reads = {{FA_BUFFER_ROLE_DOUT, &inputs[0]}, {FA_BUFFER_ROLE_Q, &inputs[1]}, {FA_BUFFER_ROLE_K, &inputs[2]},
                   {FA_BUFFER_ROLE_V, &inputs[3]}, {FA_BUFFER_ROLE_OUT, &inputs[4]}, {FA_BUFFER_ROLE_LSE, &inputs[5]}};
    roles.writes = {{FA_BUFFER_ROLE_DQ, &outputs[0]}, {FA_BUFFER_ROLE_DK, &outputs[1]}, {FA_BUFFER_ROLE_DV, &outputs[2]}};
    if (mask != nullptr) roles.reads[FA_BUFFER_ROLE_ATTN_MASK] = mask;
    if (options_.has_sinks) {
        roles.reads[FA_BUFFER_ROLE_SINKS] = &inputs.back();
        roles.writes[FA_BUFFER_ROLE_DSINKS] = &outputs[3];
    }
    encode(stream(), problem, FA_PASS_BACKWARD, std::move(roles));
}
#else
// MLX without Metal never schedules a node on the GPU; these say so if asked.
constexpr const char* kNoMetal = "flash_attention_metal: this MLX has no Metal backend; run on the CPU stream";

std::string tensor_ops_route() { return ""; }

void Forward::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) { throw std::runtime_error(kNoMetal); }

void Backward::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) { throw std::runtime_error(kNoMetal); }
#endif

}  // namespace flash_attention_mlx
