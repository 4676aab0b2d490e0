// Type-check stub, never linked: the few metal-cpp declarations (names and argument types as in
// metal-cpp) that MLX's mlx/backend/metal/device.h and mlx_extension/eval_gpu.cpp use, so that the
// Metal branch of eval_gpu.cpp is compiled with -fsyntax-only against the wheel's real MLX headers
// on Linux (tests/python/test_mlx_native.py). It proves the MLX calls; the metal-cpp ones
// (MTL::Size, maxTotalThreadsPerThreadgroup, staticThreadgroupMemoryLength,
// maxThreadgroupMemoryLength, DataTypeBool/UInt) are only as right as this stub.
#pragma once
namespace NS {
using UInteger = unsigned long;
template <class T> class SharedPtr { T* p_ = nullptr; public: T* get() const { return p_; } };
class AutoreleasePool;
}
namespace MTL {
struct Size { Size(NS::UInteger w, NS::UInteger h, NS::UInteger d); };
enum DataType : NS::UInteger { DataTypeInt = 29, DataTypeUInt = 33, DataTypeBool = 53 };
class Allocation {};
class Resource : public Allocation {};
class Buffer : public Resource {};
class ComputePipelineState {
 public:
  NS::UInteger maxTotalThreadsPerThreadgroup() const;
  NS::UInteger staticThreadgroupMemoryLength() const;
};
class ComputeCommandEncoder {
 public:
  void setBytes(const void* bytes, NS::UInteger length, NS::UInteger index);
  void setComputePipelineState(const ComputePipelineState* state);
  void setThreadgroupMemoryLength(NS::UInteger length, NS::UInteger index);
};
class CommandQueue; class CommandBuffer; class Fence; class Library; class Function; class LinkedFunctions;
class Device { public: NS::UInteger maxThreadgroupMemoryLength() const; };
class ResidencySet;
}
