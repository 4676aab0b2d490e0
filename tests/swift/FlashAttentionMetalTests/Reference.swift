import Foundation

/// The two references of the accuracy rule (design.md), written here so the Swift tests need no
/// other layer: `exact` is float64 math on the float16 inputs; `base` is what a float16 framework
/// computes (every matrix product accumulated in float32 and rounded to float16: S, P, O; dP, dS,
/// dQ, dK, dV; softmax in float32).
struct AttentionCase: CustomStringConvertible {
    var batch = 1, heads = 1, kvHeads = 1, seqlenQ = 1, seqlenK = 1, headDim = 16
    var causal = false
    var scale: Double { 1 / Double(headDim).squareRoot() }
    var description: String {
        "B\(batch) H\(heads)/\(kvHeads) Nq\(seqlenQ) Nk\(seqlenK) D\(headDim) causal=\(causal)"
    }
    var qCount: Int { batch * heads * seqlenQ * headDim }
    var kvCount: Int { batch * kvHeads * seqlenK * headDim }
    var lseCount: Int { batch * heads * seqlenQ }
    /// Whether query i sees key j (bottom-right causal alignment).
    func visible(_ i: Int, _ j: Int) -> Bool { !causal || j <= i + seqlenK - seqlenQ }
}

struct ForwardResult { var out: [Double]; var lse: [Double] }
struct BackwardResult { var dq: [Double]; var dk: [Double]; var dv: [Double] }

/// float16 rounding of a float32 value, as a float16 framework stores results.
@inline(__always) private func h(_ x: Float) -> Float { Float(Float16(x)) }

enum Reference {
    /// Index helpers for the contiguous layouts.
    private static func qi(_ c: AttentionCase, _ b: Int, _ hd: Int, _ i: Int) -> Int {
        ((b * c.heads + hd) * c.seqlenQ + i) * c.headDim
    }
    private static func ki(_ c: AttentionCase, _ b: Int, _ hk: Int, _ j: Int) -> Int {
        ((b * c.kvHeads + hk) * c.seqlenK + j) * c.headDim
    }

    /// Softmax probabilities of one row in float64, nil when the row sees no key.
    private static func exactRow(_ c: AttentionCase, _ q: [Double], _ k: [Double], b: Int, hd: Int, i: Int)
        -> (p: [Double], lse: Double)? {
        let hk = hd / (c.heads / c.kvHeads)
        var s = [Double](repeating: -.infinity, count: c.seqlenK)
        for j in 0..<c.seqlenK where c.visible(i, j) {
            var dot = 0.0
            for d in 0..<c.headDim {
                dot += q[qi(c, b, hd, i) + d] * k[ki(c, b, hk, j) + d]
            }
            s[j] = c.scale * dot
        }
        let m = s.max() ?? -.infinity
        guard m > -.infinity else { return nil }
        let e = s.map { exp($0 - m) }
        let l = e.reduce(0, +)
        return (e.map { $0 / l }, m + log(l))
    }

    static func forward(_ c: AttentionCase, q: [Float16], k: [Float16], v: [Float16]) -> ForwardResult {
        // float16 -> float64 is exact; converting once keeps the debug-build loops fast.
        let q = q.map(Double.init), k = k.map(Double.init), v = v.map(Double.init)
        var out = [Double](repeating: 0, count: c.qCount)
        var lse = [Double](repeating: -.infinity, count: c.lseCount)
        for b in 0..<c.batch {
            for hd in 0..<c.heads {
                let hk = hd / (c.heads / c.kvHeads)
                for i in 0..<c.seqlenQ {
                    guard let row = exactRow(c, q, k, b: b, hd: hd, i: i) else { continue }
                    lse[(b * c.heads + hd) * c.seqlenQ + i] = row.lse
                    for j in 0..<c.seqlenK where row.p[j] != 0 {
                        for d in 0..<c.headDim {
                            out[qi(c, b, hd, i) + d] += row.p[j] * v[ki(c, b, hk, j) + d]
                        }
                    }
                }
            }
        }
        return ForwardResult(out: out, lse: lse)
    }

    static func backward(_ c: AttentionCase, dout: [Float16], q: [Float16], k: [Float16], v: [Float16])
        -> BackwardResult {
        let out = forward(c, q: q, k: k, v: v).out
        let dout = dout.map(Double.init), q = q.map(Double.init), k = k.map(Double.init), v = v.map(Double.init)
        var dq = [Double](repeating: 0, count: c.qCount)
        var dk = [Double](repeating: 0, count: c.kvCount)
        var dv = [Double](repeating: 0, count: c.kvCount)
        for b in 0..<c.batch {
            for hd in 0..<c.heads {
                let hk = hd / (c.heads / c.kvHeads)
                for i in 0..<c.seqlenQ {
                    guard let row = exactRow(c, q, k, b: b, hd: hd, i: i) else { continue }
                    let qo = qi(c, b, hd, i)
                    var dsum = 0.0
                    for d in 0..<c.headDim { dsum += dout[qo + d] * out[qo + d] }
                    for j in 0..<c.seqlenK where c.visible(i, j) {
                        let ko = ki(c, b, hk, j)
                        var dp = 0.0
                        for d in 0..<c.headDim { dp += dout[qo + d] * v[ko + d] }
                        let ds = row.p[j] * (dp - dsum)
                        for d in 0..<c.headDim {
                            dq[qo + d] += c.scale * ds * k[ko + d]
                            dk[ko + d] += c.scale * ds * q[qo + d]
                            dv[ko + d] += row.p[j] * dout[qo + d]
                        }
                    }
                }
            }
        }
        return BackwardResult(dq: dq, dk: dk, dv: dv)
    }

    /// The float16 framework's forward: S = fp16(scale * q k^T) (float32 accumulation), P =
    /// fp16(softmax_fp32(S)), O = fp16(P v).
    static func baseForward(_ c: AttentionCase, q: [Float16], k: [Float16], v: [Float16])
        -> (out: [Double], p: [[Float]]) {
        let q = q.map(Float.init), k = k.map(Float.init), v = v.map(Float.init)
        var out = [Double](repeating: 0, count: c.qCount)
        var probabilities = [[Float]]()
        for b in 0..<c.batch {
            for hd in 0..<c.heads {
                let hk = hd / (c.heads / c.kvHeads)
                for i in 0..<c.seqlenQ {
                    let qo = qi(c, b, hd, i)
                    var s = [Float](repeating: -.infinity, count: c.seqlenK)
                    for j in 0..<c.seqlenK where c.visible(i, j) {
                        var dot: Float = 0
                        for d in 0..<c.headDim { dot += q[qo + d] * k[ki(c, b, hk, j) + d] }
                        s[j] = h(Float(c.scale) * dot)
                    }
                    let m = s.max() ?? -.infinity
                    var p = [Float](repeating: 0, count: c.seqlenK)
                    if m > -.infinity {
                        let e = s.map { exp($0 - m) }
                        let l = e.reduce(0, +)
                        p = e.map { h($0 / l) }
                    }
                    probabilities.append(p)
                    for d in 0..<c.headDim {
                        var acc: Float = 0
                        for j in 0..<c.seqlenK { acc += p[j] * v[ki(c, b, hk, j) + d] }
                        out[qo + d] = Double(h(acc))
                    }
                }
            }
        }
        return (out, probabilities)
    }

    /// The float16 framework's backward: dP = fp16(dout v^T), dS = fp16(P (dP - rowsum(P dP))),
    /// dQ = fp16(scale dS k), dK = fp16(scale dS^T q), dV = fp16(P^T dout) per query head, then the
    /// heads of a GQA group summed (float32 accumulation, rounded), as autograd through a repeat does.
    static func baseBackward(_ c: AttentionCase, dout: [Float16], q: [Float16], k: [Float16], v: [Float16])
        -> BackwardResult {
        let forward = baseForward(c, q: q, k: k, v: v)
        let p = forward.p
        let dout = dout.map(Float.init), q = q.map(Float.init), k = k.map(Float.init), v = v.map(Float.init)
        var dq = [Double](repeating: 0, count: c.qCount)
        var dkSum = [Float](repeating: 0, count: c.kvCount)
        var dvSum = [Float](repeating: 0, count: c.kvCount)
        for b in 0..<c.batch {
            for hd in 0..<c.heads {
                let hk = hd / (c.heads / c.kvHeads)
                var ds = [[Float]](repeating: [Float](repeating: 0, count: c.seqlenK), count: c.seqlenQ)
                for i in 0..<c.seqlenQ {
                    let row = p[(b * c.heads + hd) * c.seqlenQ + i]
                    let qo = qi(c, b, hd, i)
                    var dp = [Float](repeating: 0, count: c.seqlenK)
                    for j in 0..<c.seqlenK {
                        var acc: Float = 0
                        for d in 0..<c.headDim { acc += dout[qo + d] * v[ki(c, b, hk, j) + d] }
                        dp[j] = h(acc)
                    }
                    // D = rowsum(dout * out) in float32 with out rounded to float16 (FlashAttention-2,
                    // as the kernels and accuracy.py's base).
                    var rowSum: Float = 0
                    for d in 0..<c.headDim { rowSum += dout[qo + d] * Float(forward.out[qo + d]) }
                    for j in 0..<c.seqlenK { ds[i][j] = h(row[j] * (dp[j] - rowSum)) }
                    for d in 0..<c.headDim {
                        var acc: Float = 0
                        for j in 0..<c.seqlenK { acc += ds[i][j] * k[ki(c, b, hk, j) + d] }
                        dq[qo + d] = Double(h(Float(c.scale) * acc))
                    }
                }
                for j in 0..<c.seqlenK {
                    let ko = ki(c, b, hk, j)
                    for d in 0..<c.headDim {
                        var accK: Float = 0
                        var accV: Float = 0
                        for i in 0..<c.seqlenQ {
                            let qo = qi(c, b, hd, i)
                            accK += ds[i][j] * q[qo + d]
                            accV += p[(b * c.heads + hd) * c.seqlenQ + i][j] * dout[qo + d]
                        }
                        dkSum[ko + d] += h(Float(c.scale) * accK)
                        dvSum[ko + d] += h(accV)
                    }
                }
            }
        }
        return BackwardResult(dq: dq, dk: dkSum.map { Double(h($0)) }, dv: dvSum.map { Double(h($0)) })
    }

    /// FlashAttention's atol (python/flash_attention_metal/accuracy.py's absolute_term):
    /// 2 * max|(ref + 0.3 - 0.3) - ref| with every step rounded to float32.
    static func absoluteTerm(_ ref: [Double]) -> Double {
        var worst: Float = 0
        for value in ref where value.isFinite {
            let r = Float(value)
            worst = max(worst, abs((r + 0.3) - 0.3 - r))
        }
        return 2 * Double(worst)
    }

    /// max |a - b| over finite pairs; infinity where one side is NaN.
    static func maxError(_ a: [Double], _ b: [Double]) -> Double {
        var worst = 0.0
        for (x, y) in zip(a, b) {
            if x.isNaN || y.isNaN { return .infinity }
            worst = max(worst, abs(x - y))
        }
        return worst
    }
}

/// Deterministic N(0, 1) float16 samples (64-bit LCG and Box-Muller), so failures reproduce.
struct Normal16 {
    private var state: UInt64
    init(seed: UInt64) { state = seed &* 6364136223846793005 &+ 1442695040888963407 }
    private mutating func uniform() -> Double {
        state = state &* 6364136223846793005 &+ 1442695040888963407
        return (Double(state >> 11) + 0.5) / Double(1 << 53)
    }
    mutating func next(_ count: Int) -> [Float16] {
        (0..<count).map { _ in
            Float16(Float((-2 * log(uniform())).squareRoot() * cos(2 * .pi * uniform())))
        }
    }
}
