"""Rollout traces that carry the model's probability of ending at every token, for replaying the budget with an
ending-probability forecast. The quick start's workload sampled with Hugging Face transformers (SmolLM2-135M-Instruct
as `das serve` prepares it, float32, the chat template, T = 0.8, 512 tokens): PROBLEMS reasoning-gym problems x
SAMPLES samples x EPOCHS epochs of the same problems (policy_version = the epoch), as `das serve` would be asked for
them by `das rollout`. Writes OUT.jsonl.gz (the project's rollout history format; outputs end with their EOS token,
finish_reason "stop", or stop at 512, "length") and OUT.npz (p_end float32 [rollouts, 512]: the EOS ids' mass
under the sampling distribution before each token; rollouts in the file's order).
python sample_traces.py PROBLEMS SAMPLES EPOCHS SEED OUT"""
import gzip
import json
import sys
import time

import numpy as np

sys.path.insert(0, "../2026-11-27-eos-signal")
from eos_signal import decode, quick_start


def main(problems: int, samples: int, epochs: int, seed: int, out: str) -> None:
    model, tok, eos, probs, prompts = quick_start(problems, seed)
    all_p_end = []
    with gzip.open(out + ".jsonl.gz", "wt") as f:
        for epoch in range(epochs):
            start = time.time()
            rows, outputs, p_end = decode(model, prompts, samples, tok.pad_token_id or 0, eos, report_every=128)
            all_p_end.append(p_end)
            lengths = [len(o) for o in outputs]
            for i, (g, tokens) in enumerate(zip(rows, outputs)):
                f.write(json.dumps({"problem_id": probs[g].problem_id, "policy_version": epoch,
                                    "sample_index": i % samples, "prompt_token_ids": prompts[g],
                                    "output_token_ids": tokens,
                                    "finish_reason": "stop" if tokens[-1] in eos else "length"}) + "\n")
            print(f"epoch {epoch}: {len(rows)} rollouts, length p50 {np.median(lengths):.0f} max {max(lengths)}, "
                  f"{time.time() - start:.0f} s", flush=True)
    np.savez_compressed(out + ".npz", p_end=np.concatenate(all_p_end))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
