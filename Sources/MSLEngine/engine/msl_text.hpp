// Small text helpers for the engine's error messages.
#ifndef MSL_TEXT_HPP
#define MSL_TEXT_HPP

#include <stdint.h>

#include <string>

namespace msl_engine {

/// printf-style formatting into a std::string.
std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/// The indices i in [0, count) with member(i) true, as ranges: "0-15, 17, 20-31". Long lists are
/// cut after a few ranges ("..."). `member` is any callable taking uint32_t.
template <class Member> std::string index_ranges(uint32_t count, Member member) {
    std::string out;
    int ranges = 0;
    for (uint32_t i = 0; i < count;) {
        if (!member(i)) {
            ++i;
            continue;
        }
        uint32_t j = i;
        while (j + 1 < count && member(j + 1)) ++j;
        if (ranges == 8) {
            out += ", ...";
            break;
        }
        if (!out.empty()) out += ", ";
        out += i == j ? std::to_string(i) : std::to_string(i) + "-" + std::to_string(j);
        ++ranges;
        i = j + 1;
    }
    return out;
}

/// "file:line", or just "file" when the line is unknown (0).
std::string source_location(const char *file, unsigned line);

} // namespace msl_engine

#endif
