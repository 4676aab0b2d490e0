// Text helpers for the engine's error messages (see msl_text.hpp).
#include "msl_text.hpp"

#include <stdarg.h>
#include <stdio.h>

namespace msl_engine {

std::string format(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    va_list copy;
    va_copy(copy, args);
    const int length = vsnprintf(nullptr, 0, fmt, copy);
    va_end(copy);
    std::string out(length > 0 ? size_t(length) : 0, '\0');
    if (length > 0) vsnprintf(&out[0], out.size() + 1, fmt, args);
    va_end(args);
    return out;
}

std::string source_location(const char *file, unsigned line) {
    if (file == nullptr) return "<unknown>";
    return line == 0 ? std::string(file) : format("%s:%u", file, line);
}

} // namespace msl_engine
