// The score features of a call (flash_attention_params.h: mask_type, softcap, has_alibi,
// has_sinks), read by the kernels only through these functions, so how a kernel learns them
// (a field of the parameter struct, or a value fixed when its pipeline is built) is decided here.

inline uint mask_type_of(constant FlashAttentionParams &p) { return p.mask_type; }

inline bool softcap_on(constant FlashAttentionParams &p) { return p.softcap > 0.0f; }

inline bool alibi_on(constant FlashAttentionParams &p) { return p.has_alibi != 0; }

inline bool sinks_on(constant FlashAttentionParams &p) { return p.has_sinks != 0; }
