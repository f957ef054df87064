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
import torch

sys.path.insert(0, "../2026-11-27-eos-signal")
from eos_signal import quick_start

MAX_NEW, TEMPERATURE = 512, 0.8


def sample_epoch(model, prompts: list[list[int]], samples: int, pad: int, eos: list[int]):
    rows = [g for g in range(len(prompts)) for _ in range(samples)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(prompts[g])) + prompts[g] for g in rows])
    mask = torch.tensor([[0] * (width - len(prompts[g])) + [1] * len(prompts[g]) for g in rows])
    n = len(rows)
    p_end = np.full((n, MAX_NEW), np.nan, np.float32)
    out: list[list[int]] = [[] for _ in range(n)]
    batch, past, step_in, start = np.arange(n), None, ids, time.time()
    with torch.no_grad():
        for t in range(MAX_NEW):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_in.shape[1]:]
            outputs = model(input_ids=step_in, attention_mask=mask, past_key_values=past, position_ids=positions,
                            use_cache=True)
            past = outputs.past_key_values
            probs = torch.softmax(outputs.logits[:, -1].float() / TEMPERATURE, dim=-1)
            p_end[batch, t] = probs[:, eos].sum(-1).numpy()
            nxt = torch.multinomial(probs, 1)
            for row, token in zip(batch, nxt[:, 0].tolist()):
                out[row].append(token)
            ended = np.isin(nxt[:, 0].numpy(), eos)
            if t % 128 == 0:
                print(f"  step {t}: {len(batch) - ended.sum()} of {n} running, {time.time() - start:.0f} s",
                      flush=True)
            keep = np.flatnonzero(~ended)
            if not keep.size:
                break
            if ended.any():
                index = torch.from_numpy(keep)
                past.batch_select_indices(index)
                batch, nxt, mask = batch[keep], nxt[index], mask[index]
            step_in = nxt
            mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], dim=1)
    return rows, out, p_end


def main(problems: int, samples: int, epochs: int, seed: int, out: str) -> None:
    model, tok, eos, probs, prompts = quick_start(problems, seed)
    all_p_end = []
    with gzip.open(out + ".jsonl.gz", "wt") as f:
        for epoch in range(epochs):
            start = time.time()
            rows, outputs, p_end = sample_epoch(model, prompts, samples, tok.pad_token_id or 0, eos)
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
