// GPU evaluation of the primitives. Only where MLX was built with Metal (_METAL_, from MLX's CMake
// config); elsewhere MLX never schedules a node on the GPU, and eval_gpu says so if asked.
#include "primitives.h"

#include <stdexcept>

namespace flash_attention_mlx {

#ifndef _METAL_
void Forward::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
    throw std::runtime_error("flash_attention_metal: this MLX has no Metal backend; run on the CPU stream");
}

void Backward::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
    throw std::runtime_error("flash_attention_metal: this MLX has no Metal backend; run on the CPU stream");
}
#endif

}  // namespace flash_attention_mlx
