"""GRPO against TRL: llmtune's loss and adapter gradients vs TRL's GRPOTrainer._compute_loss.

    python bench/check_grpo_trl.py [--model GGUF] [--write-fixture tests/data/grpo_trl.json]

Generation is bypassed on both sides: the same prompts and completions (token ids, tokenized once
by llmtune and handed to TRL as ids) and the same rewards. For each loss type (grpo, bnpo,
dr_grpo, dapo), beta 0 and 0.04, num_iterations 1 (old log-probs = the current ones, TRL's
detach) and 2 (old log-probs from another adapter: the generation-time policy of a batch's second
step), and a temperature of 1 and 0.7:

- llmtune: train/grpo.py GRPOTrainer on the GGUF with LoRA (bench/check_trl.py's initial adapter,
           B != 0), its Generation built from the fixed completions, `gradient` filling the flat
           gradient buffer (the step's loss and gradient, no update); the reference is the same
           adapter with B = 0 (the base), swapped in as a run's reference is.
- TRL:     GRPOTrainer (the PEFT model of bench/check_trl.py: the GGUF loaded by transformers,
           float32, llmtune's adapter copied in) and its own `_compute_loss(model, inputs)` on the
           inputs dict its _generate_and_score_completions builds (prompt / completion ids and
           masks, advantages, old_per_token_logps computed by its _get_per_token_logps_and_entropies
           with the old adapter copied in, ref_per_token_logps with the adapter disabled, as TRL
           does for a new PEFT adapter, num_items_in_batch); backward for the adapter gradients.
           Its advantages are computed from the rewards with the lines of
           _generate_and_score_completions (sum_then_normalize) and trl's nanstd.

Compared: the loss (relative to the larger of it and the mean |advantage|, the scale of the
terms it sums: at num_iterations 1 the grpo loss is a sum of normalised advantages that cancel to
~0, where TRL's float32 sum keeps ~4e-8 of rounding), every adapter tensor's gradient (relative
L2 distance, B of q/k put back in GGUF row order), the reference and old log-probabilities (largest absolute difference,
each side's own forward pass; TRL's loss reads llmtune's, so the loss is compared on equal inputs).

--write-fixture: TRL's _compute_loss on synthetic per-token log-probs (its log-prob function
replaced by leaf tensors) for each loss type / beta / epsilon_high / old log-probs setting, and its
advantages from rewards with NaNs for each scale_rewards: the fixture tests/test_grpo.py checks
llmtune's numpy loss against without torch.
Needs torch, transformers, peft, datasets and trl (none of them is a dependency of llmtune).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from check_trl import SEED, hf_tokenizer, initial_adapter, peft_model  # noqa: E402

G, MAX_COMPLETION = 4, 12
PROMPTS = ["Once upon a time, Ben had a dog.", "Once upon a time, Tom had a cat."]
COMPLETIONS = [" He was very happy.", " Ben and his mom went to the park to play", " The dog was red",
               " He liked it", " He loved his cat very much.", " The cat said hello", " Tom was sad",
               " They played all day long in the sun"]
EOS_AT = {0, 4, 5}  # completions that end with the end-of-generation token (the others are cut)
REWARDS = [[1.0, 0.5], [0.0, np.nan], [1.0, -0.25], [0.0, 0.0], [np.nan, np.nan], [1.0, 1.0], [0.0, 0.3],
           [1.0, -1.0]]
WEIGHTS = [1.0, 0.5]


def trl_advantages(rewards_per_func, weights, generations: int, scale: str):
    """TRL's sum_then_normalize (grpo_trainer.py _generate_and_score_completions), its own lines."""
    import torch
    from trl.trainer.utils import nanstd

    rewards_per_func = torch.tensor(rewards_per_func, dtype=torch.float32)
    w = torch.tensor(weights, dtype=torch.float32)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(generations, dim=0)
    if scale in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, generations), dim=1).repeat_interleave(generations, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def make_trl_trainer(model, tokenizer, tmp: Path, **cfg):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp / "trl"), per_device_train_batch_size=len(COMPLETIONS), num_generations=G,
                      max_completion_length=MAX_COMPLETION, use_cpu=True, report_to="none", bf16=False, fp16=False,
                      seed=SEED, **cfg)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda prompts, completions, **kw: [0.0] * len(prompts)],
                          args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 4]),
                          processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def set_trl(trainer, **cfg) -> None:
    """A setting of the trainer's loss, as its __init__ sets it from GRPOConfig."""
    for key, value in cfg.items():
        if key == "epsilon_high":
            trainer.epsilon_high = trainer.epsilon_low if value is None else value
        else:
            setattr(trainer, key, value)
            setattr(trainer.args, key, value)


# ------------------------------------------------------------------------------ fixture
def write_fixture(trainer, path: Path) -> None:
    import torch

    rng = np.random.default_rng(3)
    n, t = 6, 7
    lengths = np.array([7, 3, 5, 1, 6, 4])
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    logp = (rng.normal(-2.0, 1.0, (n, t)) * mask).astype(np.float32)
    old = (logp + rng.normal(0.0, 0.3, (n, t)) * mask).astype(np.float32)  # ratios past 1 +- 0.2 too
    ref = (logp + rng.normal(0.0, 0.5, (n, t)) * mask).astype(np.float32)
    adv = rng.normal(0.0, 1.0, n).astype(np.float32)
    cases = []
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for beta in (0.0, 0.04):
            for epsilon_high in (None, 0.28):
                for with_old in (False, True):
                    set_trl(trainer, loss_type=loss_type, beta=beta, epsilon_high=epsilon_high,
                            max_completion_length=t)
                    leaf = torch.tensor(logp, requires_grad=True)
                    trainer._get_per_token_logps_and_entropies = (
                        lambda *a, leaf=leaf, **k: (leaf, torch.zeros_like(leaf), None))
                    inputs = {"prompt_ids": torch.ones((n, 2), dtype=torch.long),
                              "prompt_mask": torch.ones((n, 2), dtype=torch.long),
                              "completion_ids": torch.ones((n, t), dtype=torch.long),
                              "completion_mask": torch.tensor(mask, dtype=torch.long),
                              "advantages": torch.tensor(adv),
                              "old_per_token_logps": torch.tensor(old) if with_old else None,
                              "ref_per_token_logps": torch.tensor(ref) if beta else None,
                              "num_items_in_batch": torch.tensor(float(mask.sum()))}
                    loss = trainer._compute_loss(trainer.model, inputs)
                    loss.backward()
                    cases.append({"loss_type": loss_type, "beta": beta, "epsilon": 0.2, "epsilon_high": epsilon_high,
                                  "max_completion_length": t, "old": with_old, "loss": float(loss),
                                  "grad": leaf.grad.double().numpy().tolist()})
    adv_cases = []
    for scale in ("group", "batch", "none"):
        adv_cases.append({"scale_rewards": scale, "generations": G,
                          "advantages": trl_advantages(REWARDS, WEIGHTS, G, scale).double().numpy().tolist()})
    path.write_text(json.dumps({
        "source": "bench/check_grpo_trl.py --write-fixture (TRL GRPOTrainer._compute_loss; advantages as "
                  "_generate_and_score_completions)",
        "logp": logp.tolist(), "old": old.tolist(), "ref": ref.tolist(), "mask": mask.tolist(), "adv": adv.tolist(),
        "cases": cases, "rewards": [[None if np.isnan(v) else v for v in row] for row in REWARDS],
        "weights": WEIGHTS, "advantage_cases": adv_cases}, indent=None) + "\n")
    print(f"wrote {path} ({len(cases)} loss cases, {len(adv_cases)} advantage cases)")


# ------------------------------------------------------------------------------ the model comparison
def token_data(tok):
    from llmtune.train.chat import prompt_ids

    prompts = [prompt_ids(tok, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 1, "the prompts must tokenize to the same length (no left padding)"
    completions = []
    for i, text in enumerate(COMPLETIONS):
        ids = list(tok.encode(text, add_special=False))[: MAX_COMPLETION - 1]
        completions.append(ids + [tok.eos_id] if i in EOS_AT else ids)
    return prompts, completions


def adapter_values(adapter, scale_b: float = 1.0, shift: int = 0) -> dict:
    """name -> value of an adapter's tensors; B scaled (0: the base) and, with `shift`, perturbed."""
    rng = np.random.default_rng(SEED + shift)
    out = {}
    for name, value in adapter.tensors().items():
        v = np.array(value, dtype=np.float32)
        if name.endswith(".lora_b"):
            v = v * scale_b + (rng.normal(0.0, 0.05, v.shape).astype(np.float32) if shift else 0)
        out[name] = v
    return out


def llmtune_side(model_path: Path, adapter, prompts, completions, settings, old_values, ref_values) -> dict:
    from llmtune.backends import get_backend
    from llmtune.model.adapter import attach
    from llmtune.model.loaded import load_model
    from llmtune.train.grpo import Generation, GRPOTrainer, advantages
    from llmtune.train.rewards import Rewards

    model = attach(load_model(model_path), [adapter])
    trainable = list(adapter.tensors())
    n_ctx = 32
    tr = GRPOTrainer(model, get_backend("cpu"), settings=settings, rewards=Rewards([], np.asarray(WEIGHTS)),
                     rollout=None, n_ctx=n_ctx, n_batch=n_ctx * len(completions), n_ubatch=n_ctx * len(completions),
                     trainable=trainable, seed=SEED)
    now = {n: np.array(tr.backend.to_numpy(tr.values[n])) for n in trainable}

    def load(values):
        for n in trainable:
            tr.values[n][...] = values[n]

    x, y, parts = tr._windows([prompts[i // G] for i in range(len(completions))], completions)
    rewards = np.asarray(REWARDS, dtype=np.float64)
    adv, _, _ = advantages(rewards, np.asarray(WEIGHTS), G, settings.scale_rewards)
    logp = tr.logps(x, y, parts)
    old = logp
    if old_values is not None:
        load(old_values)
        old = tr.logps(x, y, parts)
        load(now)
    ref = None
    if settings.beta:
        tr.ref_weights = np.concatenate([ref_values[n].reshape(-1) for n in tr.trainable]).astype(np.float32)
        ref = tr.reference_logps(x, y, parts)
    gen = Generation(x, y, parts, old, ref, adv, rewards, np.asarray([len(c) for c in completions]),
                     np.zeros(len(completions), bool))
    loss, metrics = tr.gradient(gen, logp)
    mask = gen.mask
    rows = lambda a: [a[r][mask[r]] for r in range(len(a))]  # noqa: E731 - completion tokens of each row
    return {"loss": loss, "grads": {n: np.array(tr.backend.to_numpy(tr.grads[n]), dtype=np.float64)
                                    for n in trainable},
            "old": rows(old), "ref": rows(ref) if ref is not None else None, "adv": adv, "metrics": metrics}


def copy_into(model, names: dict, values: dict, hp) -> None:
    """llmtune adapter values into PEFT's tensors (B of q/k in HF's row order, as peft_model copies)."""
    import torch

    for name, param in names.items():
        v = values[name]
        kind = name.split(".")[2]
        if name.endswith(".lora_b") and kind in ("attn_q", "attn_k"):
            n_head = hp.n_head if kind == "attn_q" else hp.n_head_kv
            v = v.reshape(n_head, v.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(v.shape)
        with torch.no_grad():
            param.copy_(torch.from_numpy(np.ascontiguousarray(v)))


def to_gguf_order(name: str, g: np.ndarray, hp) -> np.ndarray:
    kind = name.split(".")[2]
    if name.endswith(".lora_b") and kind in ("attn_q", "attn_k"):
        n_head = hp.n_head if kind == "attn_q" else hp.n_head_kv
        return g.reshape(n_head, 2, g.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(g.shape)
    return g


def trl_side(trainer, names, hp, prompts, completions, settings, now_values, old_values, mine: dict) -> dict:
    """TRL's loss and adapter gradients; its own old / ref log-probabilities are returned for the
    comparison of the two models, while the loss reads llmtune's (`mine`), so that the loss and its
    gradient are compared on the same inputs (float32 forward passes of two implementations
    differ by ~3e-5 in a log-probability, which exp(logp - old) would carry into the ratio)."""
    import torch

    pad = trainer.processing_class.pad_token_id
    n, t = len(completions), max(len(c) for c in completions)
    prompt_ids = torch.tensor([prompts[i // G] for i in range(n)], dtype=torch.long)
    completion_ids = torch.full((n, t), pad, dtype=torch.long)
    completion_mask = torch.zeros((n, t), dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
    set_trl(trainer, loss_type=settings.loss_type, beta=settings.beta, epsilon_high=settings.epsilon_high,
            num_iterations=settings.num_iterations)
    model = trainer.model
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([torch.ones_like(prompt_ids), completion_mask], dim=1)
    old = None
    with torch.no_grad():
        if old_values is not None:
            copy_into(model, names, old_values, hp)
            old, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attn, t)
            copy_into(model, names, now_values, hp)
        ref = None
        if settings.beta:
            with model.disable_adapter():
                ref, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attn, t)
    adv = trl_advantages(REWARDS, WEIGHTS, G, settings.scale_rewards)
    shared = lambda rows: None if rows is None else torch.stack([  # noqa: E731 - llmtune's per-token values
        torch.nn.functional.pad(torch.tensor(r, dtype=torch.float32), (0, t - len(r))) for r in rows])
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": adv,
              "old_per_token_logps": shared(mine["old"]) if old is not None else None,
              "ref_per_token_logps": shared(mine["ref"]), "num_items_in_batch": completion_mask.sum().float()}
    model.train()
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = {n: to_gguf_order(n, p.grad.double().numpy(), hp) if p.grad is not None else np.zeros(p.shape)
             for n, p in names.items()}
    m = completion_mask.bool().numpy()
    rows = lambda a: None if a is None else [a.double().numpy()[r][m[r]] for r in range(n)]  # noqa: E731
    return {"loss": float(loss), "grads": grads, "old": rows(old), "ref": rows(ref)}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "tests" / "data" / "stories260K.gguf")
    p.add_argument("--write-fixture", type=Path, default=None)
    args = p.parse_args()

    import torch

    from llmtune.model.loaded import load_model
    from llmtune.train.grpo import GRPOSettings

    torch.manual_seed(0)
    ours = load_model(args.model)
    hp, tok = ours.hp, ours.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        adapter = initial_adapter(args.model, nonzero_b=True)
        model, names = peft_model(args.model, adapter)
        if args.write_fixture is not None:
            write_fixture(make_trl_trainer(model, hf_tokenizer(args.model), Path(tmp)), args.write_fixture)
        prompts, completions = token_data(tok)
        now = adapter_values(adapter)
        old = adapter_values(adapter, shift=1)
        ref = adapter_values(adapter, scale_b=0.0)
        print("| loss_type | beta | iterations | temperature | loss llmtune | loss TRL | loss rel | grad rel (max) "
              "| old/ref logp abs (max) | clip |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        worst = 0.0
        for temperature in (1.0, 0.7):
            trainer = make_trl_trainer(model, hf_tokenizer(args.model), Path(tmp), temperature=temperature)
            for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo") if temperature == 1.0 else ("grpo",):
                for beta in (0.0, 0.04):
                    for iterations in (1, 2):
                        s = GRPOSettings(num_generations=G, max_completion_length=MAX_COMPLETION,
                                         temperature=temperature, loss_type=loss_type, beta=beta,
                                         num_iterations=iterations)
                        mine = llmtune_side(args.model, adapter, prompts, completions, s,
                                            old if iterations == 2 else None, ref)
                        copy_into(model, names, now, hp)
                        theirs = trl_side(trainer, names, hp, prompts, completions, s, now,
                                          old if iterations == 2 else None, mine)
                        grad_rel = max(np.linalg.norm(mine["grads"][n] - theirs["grads"][n])
                                       / max(np.linalg.norm(theirs["grads"][n]), 1e-30) for n in names)
                        logp_abs = 0.0
                        for key in ("old", "ref"):
                            if theirs[key] is not None:
                                logp_abs = max(logp_abs, max(float(np.abs(a - b).max())
                                                             for a, b in zip(mine[key], theirs[key])))
                        loss_rel = abs(mine["loss"] - theirs["loss"]) / max(abs(theirs["loss"]),
                                                                                 float(np.abs(mine["adv"]).mean()))
                        worst = max(worst, loss_rel, grad_rel)
                        print(f"| {loss_type} | {beta} | {iterations} | {temperature} | {mine['loss']:.9g} | "
                              f"{theirs['loss']:.9g} | {loss_rel:.2e} | {grad_rel:.2e} | {logp_abs:.2e} | "
                              f"{mine['metrics']['clip_ratio/region_mean']:.3f} |")
        print(f"\nlargest relative difference: {worst:.2e} ({'within' if worst <= 1e-5 else 'PAST'} 1e-5)")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
