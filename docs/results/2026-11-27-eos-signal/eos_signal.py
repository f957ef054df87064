"""Does the model's own end-of-sequence probability tell which sibling will run longest? Samples the quick start's
workload with Hugging Face transformers (SmolLM2-135M-Instruct as `das serve` prepares it, float32, the chat
template, T = 0.8, 512 tokens), records at every step each running sample's probability of ending (the EOS ids'
mass under the sampling distribution), then asks, within each problem's group, among the samples still running at
G tokens: does the mean ending probability over their last W tokens rank the final lengths (Spearman), and does it
flag the samples that end within the next D tokens (AUC)?
python eos_signal.py PROBLEMS SAMPLES SEED OUT.npz        (sampling; finished samples leave the batch)
python eos_signal.py --analyse OUT.npz [OUT.npz ...]"""
import sys

import numpy as np


def _ranks(v: np.ndarray) -> np.ndarray:
    r = np.argsort(np.argsort(v, kind="stable"), kind="stable").astype(float)
    for value in np.unique(v):
        tied = v == value
        r[tied] = r[tied].mean()
    return r


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = _ranks(x), _ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1]) if rx.std() and ry.std() else float("nan")


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties half."""
    pos, neg = score[positive], score[~positive]
    if not pos.size or not neg.size:
        return float("nan")
    r = _ranks(np.concatenate([pos, neg]))
    return float((r[:pos.size].sum() - pos.size * (pos.size - 1) / 2) / (pos.size * neg.size))


def quick_start(problems: int, seed: int):
    """(model, tokenizer, EOS ids, problems, chat prompts' token ids) of the quick start's workload, torch seeded:
    SmolLM2 float32 as `das serve` prepares it, `reasoning_gym_problems(problems, seed)`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from das.service.engine.models import prepare_model
    from das.service.prompt_sets import reasoning_gym_problems

    torch.manual_seed(seed)
    path = prepare_model("smollm2", progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = sorted(set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id})
    probs = reasoning_gym_problems(problems, seed=seed)
    prompts = [tok(tok.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False).input_ids for p in probs]
    return model, tok, eos, probs, prompts


MAX_NEW, TEMPERATURE = 512, 0.8


def decode(model, prompts: list[list[int]], samples: int, pad: int, eos: list[int], report_every: int):
    """Samples `samples` rollouts of every prompt at once (left-padded batch, T = 0.8, at most 512 tokens; a finished
    sample leaves the batch). Returns (prompt index per rollout, output token ids per rollout (ending with its EOS
    token if it ended), p_end float32 [rollouts, 512]: the EOS ids' mass before each token, NaN after the end)."""
    import time

    import torch

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
            if t % report_every == 0:
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


def sample(problems: int, samples: int, seed: int, out: str) -> None:
    import time

    model, tok, eos, probs, prompts = quick_start(problems, seed)
    start = time.time()
    rows, outputs, p_end = decode(model, prompts, samples, tok.pad_token_id or 0, eos, report_every=64)
    length = np.array([len(o) for o in outputs], np.int64)
    np.savez_compressed(out, p_end=p_end, length=length, group=np.array(rows))
    print(f"{len(rows)} samples, lengths p50 {np.median(length):.0f}, max {length.max()}, at the cap "
          f"{(length == MAX_NEW).sum()}; {time.time() - start:.0f} s", flush=True)


def analyse(paths: list[str]) -> None:
    """Pooled over the sampled files (each file's groups kept apart)."""
    runs = [np.load(path) for path in paths]
    p_end = np.concatenate([r["p_end"] for r in runs])
    length = np.concatenate([r["length"] for r in runs])
    group = np.concatenate([r["group"] + 1000 * k for k, r in enumerate(runs)])
    log_p = np.log(np.maximum(p_end, 1e-12))
    for g_at in (32, 64, 128, 256):
        for window in (16, 64):
            if window > g_at:
                continue
            running = length > g_at
            feature = np.full(len(length), np.nan)
            feature[running] = log_p[running, g_at - window:g_at].mean(axis=1)
            rhos, weights = [], []
            for gid in np.unique(group):
                m = (group == gid) & (length > g_at)
                if m.sum() >= 3 and len(set(length[m])) > 1:
                    rho = spearman(feature[m], length[m])
                    if np.isfinite(rho):
                        rhos.append(rho)
                        weights.append(m.sum())
            ends = {d: auc(feature[running], (length[running] <= g_at + d)) for d in (16, 64, 256)}
            print(f"G={g_at:3d} W={window:2d}: {running.sum():3d} running; within-group Spearman(mean log p_end, "
                  f"length) {np.average(rhos, weights=weights) if rhos else float('nan'):+.3f} over {len(rhos)} "
                  f"groups; AUC for ending within 16 / 64 / 256 tokens "
                  + " / ".join(f"{v:.3f}" for v in ends.values()), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--analyse":
        analyse(sys.argv[2:])
    else:
        sample(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
