"""Library speculative decoding vs plain decoding, wall clock, side by side in one run (eagle3lib.model.speculative).

  .venv/bin/python benchmarks/speculative.py --checkpoint RUN/train/final        # a trained drafter of the tiny verifier
  .venv/bin/python benchmarks/speculative.py --checkpoint ... --k 1 2 3 4 --prompts 16 --json out.json
  .venv/bin/python benchmarks/speculative.py --no-drafter                       # replay/random bounds only

Per K and drafter, the same prompts are decoded greedily by plain KV-cached decoding and by speculative decoding,
interleaved prompt by prompt (background load hits both alike), batch 1, same max tokens. Reported: tokens/s of each,
the speedup (plain time / speculative time), tau, and verifier forwards per token. Drafters:
  eagle   the trained EAGLE-3 drafter (--checkpoint)
  replay  proposes the verifier's own greedy continuation at no cost (recorded beforehand): tau = K+1, the ceiling
          of what speculation can buy with this verifier on this machine (drafting cost excluded)
  random  uniform proposals: tau ~ 1, so its "speedup" is the pure overhead of verifying K extra tokens per step
Verifiers: the tiny one (hidden 192, 8 layers), and with --mid a random mid-size one (hidden 1024, 16 layers; only
replay/random, no trained drafter exists for it) where a verifier forward costs more than the loop's Python overhead.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


class ReplayDrafter:
    """Proposes the recorded greedy continuation of each prompt (free): what a perfect, zero-cost drafter would do."""

    aux_layer_ids = None

    def __init__(self, prompt_len: int, reference: list[int]):
        self.prompt_len, self.reference = prompt_len, reference

    def reset(self) -> None:
        pass

    def propose(self, inp, k, temperature, generator):
        from eagle3lib.model.speculative import Proposal

        start = inp.tokens.numel() - self.prompt_len
        nxt = self.reference[start : start + k]
        nxt = nxt + [0] * (k - len(nxt))
        return Proposal(torch.tensor(nxt))


def prompts_for(tok, n: int) -> list[list[int]]:
    from eagle3lib.data.datasets import load_conversations

    convs = load_conversations("builtin:tiny-heldout", shuffle=True, seed=0)[:n]
    return [tok.apply_chat_template(c.prompt(), add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for c in convs]


def bench(verifier_model, drafters: dict, prompts, k: int, max_tokens: int, eos: list[int]) -> list[dict]:
    from eagle3lib.model.speculative import Verifier, plain_decode, speculative_decode

    v = Verifier(verifier_model)
    plain_decode(v, prompts[0], 8, eos=eos)  # warm-up
    rows = []
    for name, make in drafters.items():
        t_plain = t_spec = 0.0
        n_tok = rounds = accepted = fwd = 0
        for i, ids in enumerate(prompts):
            ref = plain_decode(v, ids, max_tokens, eos=eos)
            d = make(i, ids, ref.tokens)
            r = speculative_decode(v, d, ids, max_tokens, k, eos=eos)
            assert r.tokens == ref.tokens, f"{name}: greedy speculative output differs from plain decoding"
            t_plain, t_spec = t_plain + ref.seconds, t_spec + r.seconds
            n_tok, rounds, accepted, fwd = n_tok + len(r.tokens), rounds + r.rounds, accepted + r.accepted, fwd + r.forwards
        rows.append({"drafter": name, "k": k, "tokens": n_tok, "plain_tokens_per_s": n_tok / t_plain,
                     "spec_tokens_per_s": n_tok / t_spec, "speedup": t_plain / t_spec,
                     "tau": 1 + accepted / rounds if rounds else None, "verifier_forwards_per_token": fwd / n_tok})
    return rows


def mid_verifier(tiny: Path, out: Path):
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    t = AutoConfig.from_pretrained(tiny)
    cfg = Qwen3Config(vocab_size=t.vocab_size, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="trained drafter checkpoint of the tiny verifier (RUN/train/final)")
    ap.add_argument("--no-drafter", action="store_true", help="replay/random only")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: fastest for batch-1 tiny models)")
    ap.add_argument("--mid", action="store_true", help="also a random mid-size verifier (replay/random)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from eagle3lib.model.speculative import EagleDrafter, RandomDrafter
    from eagle3lib.model.verifier import load_hf_model, load_tokenizer
    from eagle3lib.tiny.build import tiny_verifier_path

    tiny = tiny_verifier_path(progress=False)
    tok = load_tokenizer(str(tiny))
    model = load_hf_model(str(tiny), "float32")
    prompts = prompts_for(tok, a.prompts)
    eos = [tok.eos_token_id, *json.loads((tiny / "generation_config.json").read_text()).get("eos_token_id", [])]
    V = model.config.vocab_size
    drafters: dict = {}
    if a.checkpoint and not a.no_drafter:
        from eagle3lib.model.checkpoint import load_drafter

        d, _ = load_drafter(a.checkpoint, verifier_path=str(tiny))
        drafters["eagle"] = lambda i, ids, ref: EagleDrafter(d)
    elif not a.no_drafter:
        print("no --checkpoint: replay/random only (pass RUN/train/final to measure a trained drafter)")
    drafters["replay"] = lambda i, ids, ref: ReplayDrafter(len(ids), ref)
    drafters["random"] = lambda i, ids, ref: RandomDrafter(V)

    rows = []
    t0 = time.time()
    for k in a.k:
        rows += [{"verifier": "tiny", **r} for r in bench(model, drafters, prompts, k, a.max_tokens, eos)]
    if a.mid:
        with tempfile.TemporaryDirectory() as tmp:
            mid = mid_verifier(tiny, Path(tmp))
            bounds = {n: drafters[n] for n in ("replay", "random")}
            for k in a.k:
                rows += [{"verifier": "mid (h1024, 16 layers, random)", **r}
                         for r in bench(mid, bounds, prompts[: max(2, a.prompts // 4)], k, a.max_tokens, eos)]
    print(f"\nlibrary speculative vs plain greedy decoding, batch 1, {a.threads} thread(s), {len(prompts)} prompts, "
          f"max {a.max_tokens} tokens ({time.time() - t0:.0f} s)")
    print(f"{'verifier':32} {'drafter':8} {'K':>2} {'tau':>5} {'fwd/tok':>7} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'speedup':>7}")
    for r in rows:
        print(f"{r['verifier']:32} {r['drafter']:8} {r['k']:>2} {r['tau']:>5.2f} {r['verifier_forwards_per_token']:>7.2f} "
              f"{r['plain_tokens_per_s']:>11.1f} {r['spec_tokens_per_s']:>10.1f} {r['speedup']:>6.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
