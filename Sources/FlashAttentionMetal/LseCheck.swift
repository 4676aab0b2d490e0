import CFlashAttentionMetal

/// The backward's check of the lse it is given, on host memory, before anything runs.
///
/// The forward gives every row a finite lse, except a row that sees no key (lse -inf, out 0). So a
/// NaN or +inf lse is always an error, and -inf is one where the row sees a key: exp(score - lse)
/// would then be infinite. A row sees a key when its causal/window range is not empty and the mask
/// (bool: nonzero; additive: not -inf) leaves a key of that range visible, or when its sink's logit
/// is not -inf. The check reads lse once and, only for -inf rows, that row's mask over the window:
/// at most one pass over what the call reads anyway.
extension HostBuffers {
    /// Throws `invalidArgument` naming the first bad lse element `[b][h][i]` and the rule.
    func checkLse(of problem: Problem) throws {
        guard let bytes = self[.lse] else { return }
        let lse = bytes.bindMemory(to: Float.self)
        let heads = Int(problem.numHeads), seqlenQ = Int(problem.seqlenQ)
        for row in 0..<problem.lseElements where !lse[row].isFinite {
            let (b, h, i) = (row / (heads * seqlenQ), (row / seqlenQ) % heads, row % seqlenQ)
            let at = "lse[\(b)][\(h)][\(i)]"
            if lse[row].isNaN {
                throw FlashAttentionError.invalidArgument(
                    "\(at) is NaN: backward needs the lse that forward returned (finite, or -inf for a row "
                        + "that sees no key)")
            }
            if lse[row] > 0 {
                throw FlashAttentionError.invalidArgument(
                    "\(at) is +inf: backward needs the lse that forward returned (finite, or -inf for a row "
                        + "that sees no key)")
            }
            // Which keys a row of a variable-length batch sees follows from cu_seqlens, whose values
            // the host does not read: a -inf there weighs every key 0 (zero gradients, never NaN).
            if problem.varlen == nil, let key = visibleKey(b: b, h: h, i: i, of: problem) {
                throw FlashAttentionError.invalidArgument(
                    "\(at) is -inf, but that query row sees \(key): -inf is the lse of a row without visible "
                        + "keys only (pass the lse that forward returned for these inputs)")
            }
        }
    }

    /// "key j" or "its sink" when row (b, h, i) sees one; nil when it sees none.
    private func visibleKey(b: Int, h: Int, i: Int, of problem: Problem) -> String? {
        let s = problem.scores
        if s.hasSinks, let sinks = self[.sinks], sinks.bindMemory(to: Float.self)[h] != -.infinity {
            return "its sink (sinks[\(h)] is not -inf)"
        }
        let seqlenK = Int(problem.seqlenK)
        let diagonal = i + seqlenK - Int(problem.seqlenQ)
        let first = s.windowLeft < 0 ? 0 : max(0, diagonal - Int(s.windowLeft))
        let last = s.windowRight < 0 ? seqlenK - 1 : min(seqlenK - 1, diagonal + Int(s.windowRight))
        guard first <= last else { return nil }
        guard let layout = s.mask, let mask = self[.attnMask]?.baseAddress else { return "key \(first)" }
        let start = b * layout.strides.batch + h * layout.strides.head + i * layout.strides.seq
        for j in first...last where !hides(mask, element: start + j, problem) {
            return "key \(j)"
        }
        return nil
    }

    /// Whether mask element `index` hides its key: a zero bool, or an additive -inf.
    private func hides(_ mask: UnsafeMutableRawPointer, element index: Int, _ problem: Problem) -> Bool {
        let kind = Int32(problem.scores.maskType)
        if kind == FA_MASK_BOOL {
            return mask.load(fromByteOffset: index, as: UInt8.self) == 0
        }
        if kind == FA_MASK_ADDITIVE_F32 || problem.dtype == .float32 {
            return mask.loadUnaligned(fromByteOffset: index * 4, as: Float.self) == -.infinity
        }
        let bits = mask.loadUnaligned(fromByteOffset: index * 2, as: UInt16.self)
        return bits == (problem.dtype == .float16 ? 0xFC00 : 0xFF80)
    }
}
