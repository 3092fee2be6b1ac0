"""Preference tuning against TRL: DPO, ORPO, SimPO and KTO, llmtune vs TRL's own trainers.

    python bench/check_trl.py [--model GGUF] [--steps 20] [--methods dpo orpo simpo kto]
    python bench/check_trl.py --kto-fixture tests/data/kto_trl.json   (tests/test_kto.py's fixture)

For each method, the same model (the GGUF file loaded by transformers, float32, eager attention,
patched as bench/check_transformers.py patches it), the same pairs (DATA below, tokenized once by
llmtune as train/preference.py tokenizes them, and handed to TRL as token ids, so the comparison
is of the training and not of two tokenizers), the same LoRA init (llmtune's init_adapter A/B
copied into PEFT's lora_A / lora_B) and the same optimizer (AdamW, constant lr, no clipping, no
weight decay, batches in file order):

- llmtune: `finetune --method M --lora-rank 4 --lora-alpha 8 --no-shuffle --val-split 0` (M+b: the
           adapter with B != 0 written to a file and given as --lora-init);
- TRL:     DPOTrainer (loss_type sigmoid, the PEFT model's disabled adapter as reference),
           experimental ORPOTrainer, experimental CPOTrainer(loss_type="simpo", cpo_alpha=0), KTOTrainer
           (loss_type kto, on unpaired records: each pair's chosen or rejected completion, labels
           mixed within the batches; the PEFT model's "ref" adapter copy as reference), each
           with trainer.train(), train_sampling_strategy="sequential"; the loss and metrics of every step are read
           where the trainers compute them (compute_loss / their metric stores, unrounded), the
           adapter gradients in on_pre_optimizer_step of the first step.

Compared: the first step's loss and every metric (relative difference; absolute where the value
is 0; KTO: the metrics TRL logs, kl included), the L2 norm of every adapter tensor's first-step
gradient (largest relative difference) and the loss over `--steps` steps (largest relative
difference). Prints a Markdown table, and for KTO a line on each step's KL estimate (the largest
absolute and relative difference over the steps where it is not clamped to 0).
Needs torch, transformers, peft and trl (none of them is a dependency of llmtune).
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

RANK, ALPHA, BATCH, LR, SEED = 4, 8.0, 4, 1e-3, 7
BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "kto": 0.1}
KTO_LABELS = [True, False, True, True, False, True, False, False]  # both labels in each batch of 4, unequal counts
KTO_WEIGHTS = (1.0, 1.33)  # desirable_weight, undesirable_weight
GAMMA = 0.5
HF_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected"]


def pairs_file(tmp: Path) -> Path:
    """Eight story pairs (unique prompts): a fluent continuation chosen over a repetitive one."""
    names, things = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Tim", "Mia"], ["ball", "cat", "dog", "tree",
                                                                                 "cake", "boat", "kite", "toy"]
    rows = [{"prompt": f"Once upon a time, {n} had a {t}.",
             "chosen": f" {n} was very happy and played with the {t} all day.",
             "rejected": f" The {t} {t} was sad sad{' sad' * (i % 3)}."}
            for i, (n, t) in enumerate(zip(names, things))]
    path = tmp / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def unpaired_file(tmp: Path, pairs: Path) -> Path:
    """The pairs as KTO's unpaired records: pair i's chosen completion (label true) or rejected one
    (false), by KTO_LABELS."""
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    path = tmp / "unpaired.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen" if y else "rejected"],
                                        "label": y}) + "\n" for r, y in zip(rows, KTO_LABELS)))
    return path


# ------------------------------------------------------------------------------ llmtune
def initial_adapter(model_path: Path, nonzero_b: bool):
    """llmtune's init_adapter (PEFT's init: B = 0); nonzero_b: B ~ N(0, 0.02^2) too, so the first
    step's gradients reach every A as well (ORPO and SimPO have no reference to keep at the base)."""
    from llmtune.model.adapter import init_adapter
    from llmtune.model.loaded import load_model

    adapter = init_adapter(load_model(model_path), RANK, ALPHA, None, SEED)
    if nonzero_b:
        rng = np.random.default_rng(SEED)
        for pair in adapter.pairs.values():
            pair.b[...] = rng.normal(0.0, 0.02, pair.b.shape).astype(np.float32)
    return adapter


def run_llmtune(model_path: Path, data: Path, method: str, steps: int, tmp: Path, init: Path | None = None,
                kto_loss: str = "kto") -> dict:
    from llmtune.train.finetune import finetune
    from llmtune.train.loop import Hook

    grads = {}

    class FirstGradients(Hook):
        def on_step(self, run, step):
            if step.global_step == 1:
                grads.update({n: float(np.linalg.norm(run.trainer.backend.to_numpy(g).astype(np.float64)))
                              for n, g in run.trainer.grads.items()})

    stem = method if kto_loss == "kto" else f"{method}-{kto_loss}"
    metrics = tmp / f"{stem}.metrics.jsonl"
    epochs = steps // 2  # 8 pairs, 4 per step
    finetune(model_path, data, tmp / f"{stem}.gguf", method=method, beta=BETA[method],
             **({"gamma": GAMMA} if method == "simpo" else {}),
             **(dict(zip(("desirable_weight", "undesirable_weight"), KTO_WEIGHTS)) if method == "kto" else {}),
             **({"kto_loss": kto_loss} if kto_loss != "kto" else {}),
             **({"lora_init": str(init)} if init else {"lora_rank": RANK, "lora_alpha": ALPHA}), ctx=64,
             batch=64 * BATCH, epochs=epochs, lr=LR, val_split=0.0, shuffle=False, seed=SEED, metrics=str(metrics),
             hooks=lambda cfg, model: [FirstGradients()])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps_ = [r for r in records if r["type"] == "train_step"]
    return {"losses": [r["loss"] for r in steps_], "metrics": steps_[0], "grads": grads,
            "kl": [r.get("kl", 0.0) for r in steps_]}


# ------------------------------------------------------------------------------ TRL
def peft_model(model_path: Path, adapter):
    """transformers' model of the GGUF with llmtune's initial adapter's A / B copied into PEFT's."""
    import torch
    from peft import LoraConfig, get_peft_model

    from check_transformers import PATCHES, Patch, load_hf
    from llmtune.model.loaded import load_model

    ours = load_model(model_path)
    hf = load_hf(model_path, PATCHES.get(ours.hp.arch, Patch()))
    # the GGUF loader marks the model quantized; its weights are float32 (dequantized) and train
    hf.hf_quantizer, hf.is_quantized = None, False
    hf.config.quantization_config = None
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                     target_modules=sorted({m.split(".")[1] for m in HF_MODULES.values()}))
    model = get_peft_model(hf, cfg)
    names = {}
    for gguf_name, pair in adapter.pairs.items():
        _, layer, kind, _ = gguf_name.split(".")
        module = model.base_model.model.model.layers[int(layer)].get_submodule(HF_MODULES[kind])
        b = pair.b
        if kind in ("attn_q", "attn_k"):  # GGUF's rope row order (convert_hf_to_gguf permute) back to HF's
            n_head = ours.hp.n_head if kind == "attn_q" else ours.hp.n_head_kv
            b = b.reshape(n_head, b.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(b.shape)
        with torch.no_grad():
            module.lora_A["default"].weight.copy_(torch.from_numpy(pair.a))
            module.lora_B["default"].weight.copy_(torch.from_numpy(np.ascontiguousarray(b)))
        names[f"{gguf_name}.lora_a"] = module.lora_A["default"].weight
        names[f"{gguf_name}.lora_b"] = module.lora_B["default"].weight
    return model, names


def token_pairs(model_path: Path, data: Path):
    """llmtune's token ids of the pairs (train/preference.py tokenize_pair), or of unpaired records:
    (prompt ids, completion ids, label) (tokenize_completions, as train/kto.py)."""
    from llmtune.model.loaded import load_model
    from llmtune.train.preference import tokenize_completions, tokenize_pair
    from llmtune.train.records import read_records

    tok = load_model(model_path).tokenizer
    records = read_records(data)
    if records.format == "unpaired":
        out = []
        for (prompt, completion, label), where in zip(records.items, records.wheres):
            p_ids, (c_ids,) = tokenize_completions(tok, None, prompt, (completion,), where)
            out.append((p_ids, c_ids, label))
        return out
    return [tokenize_pair(tok, None, item, where) for item, where in zip(records.items, records.wheres)]


def hf_tokenizer(model_path: Path):
    """A transformers tokenizer with the model's vocabulary and special tokens (PAD: EOS). TRL reads
    only its special ids here: the pairs come as llmtune's token ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from llmtune.model.loaded import load_model

    tok = load_model(model_path).tokenizer
    vocab = {}
    for i, t in enumerate(tok.tokens):
        vocab.setdefault(t, i)
    eos, bos = tok.tokens[tok.eos_id], tok.tokens[tok.bos_id]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=tok.tokens[0])),
                                   bos_token=bos, eos_token=eos, pad_token=eos)


def run_trl(model_path: Path, data: Path, method: str, steps: int, tmp: Path, adapter, kto_loss: str = "kto") -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    torch.manual_seed(0)
    model, names = peft_model(model_path, adapter)
    pairs = token_pairs(model_path, data)
    tokenizer = hf_tokenizer(model_path)
    rows = [{"prompt": f"p{i}", "chosen": "c", "rejected": "r"} for i in range(len(pairs))]
    by_prompt = {f"p{i}": p for i, p in enumerate(pairs)}
    common = dict(output_dir=str(tmp / f"trl-{method}-{kto_loss}"), per_device_train_batch_size=BATCH,
                  gradient_accumulation_steps=1,
                  learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_steps=steps, logging_steps=1,
                  max_grad_norm=0.0, weight_decay=0.0, report_to="none", save_strategy="no", use_cpu=True, seed=SEED,
                  beta=BETA[method], dataloader_num_workers=0, remove_unused_columns=False,
                  train_sampling_strategy="sequential", bf16=False, fp16=False)  # float32 throughout
    if method == "kto":
        import trl.trainer.kto_trainer as kto_module
        from trl import KTOConfig, KTOTrainer

        # TRL tokenizes "p{i}" and "p{i}" + "c{i}" + EOS (its add_eos): answer with llmtune's ids, so the
        # rest of KTOTrainer._prepare_dataset (its KL completions) runs as it is
        examples = pairs
        eos = tokenizer.eos_token

        def tokenize(processing_class, text, **kw):
            i = int(text[1:].split("c")[0])
            prompt, completion, _ = examples[i]
            ids = prompt.tolist() + (completion.tolist() if text.endswith(eos) else [])
            return {"input_ids": ids}

        kto_module._tokenize = tokenize
        ds = Dataset.from_list([{"prompt": f"p{i}", "completion": f"c{i}", "label": bool(y)}
                                for i, (_, _, y) in enumerate(examples)])
        args = KTOConfig(loss_type=kto_loss, desirable_weight=KTO_WEIGHTS[0], undesirable_weight=KTO_WEIGHTS[1],
                         max_length=None, precompute_ref_log_probs=False, gradient_checkpointing=False, **common)
        trainer = KTOTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    elif method == "dpo":
        from trl import DPOConfig, DPOTrainer

        DPOTrainer._prepare_dataset = lambda self, dataset, *a, **k: dataset  # ids given: llmtune's
        ds = Dataset.from_list([{"prompt_ids": p.prompt.tolist(), "chosen_ids": p.chosen.tolist(),
                                 "rejected_ids": p.rejected.tolist()} for p in pairs])
        args = DPOConfig(loss_type=["sigmoid"], max_length=None, precompute_ref_log_probs=False, **common)
        trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    else:
        def tokenize_row(self, feature, model=None):
            p = by_prompt[feature["prompt"]]
            prompt = p.prompt.tolist()
            out = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
            for key, ids in (("chosen", p.chosen.tolist()), ("rejected", p.rejected.tolist())):
                out[f"{key}_input_ids"] = prompt + ids
                out[f"{key}_attention_mask"] = [1] * (len(prompt) + len(ids))
                out[f"{key}_labels"] = [-100] * len(prompt) + ids
            return out

        ds = Dataset.from_list(rows)
        if method == "orpo":
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer as Trainer

            args = ORPOConfig(max_length=512, **common)
        else:
            from trl.experimental.cpo import CPOConfig, CPOTrainer as Trainer

            args = CPOConfig(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=GAMMA, max_length=512,
                             **common)
        Trainer.tokenize_row = tokenize_row
        trainer = Trainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)

    losses, first_metrics, grads, kl = [], {}, {}, []
    original = trainer.compute_loss

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        value = loss[0] if isinstance(loss, tuple) else loss
        losses.append(float(value.detach()))
        store = trainer._metrics["train"] if method in ("dpo", "kto") else trainer._stored_metrics["train"]
        kl.append(float(store["kl"][-1]) if method == "kto" else 0.0)
        if len(losses) == 1:
            first_metrics.update({k: float(v[-1]) for k, v in store.items() if v})
        return loss

    trainer.compute_loss = compute_loss

    class FirstGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if state.global_step == 0:
                grads.update({n: float(p.grad.double().norm()) if p.grad is not None else 0.0
                              for n, p in names.items()})

    trainer.add_callback(FirstGradients())
    trainer.train()
    return {"losses": losses, "metrics": first_metrics, "grads": grads, "kl": kl}


# ------------------------------------------------------------------------------ KTO fixture
KTO_CASES = [  # (loss_type, beta, desirable_weight, undesirable_weight, labels, KL shift)
    ("kto", 0.1, 1.0, 1.0, [True, False, True, True, False, False], 0.8),
    ("kto", 0.5, 1.33, 0.7, [False, True, False, False, True, False], 1.5),
    ("kto", 2.0, 1.0, 1.0, [True, True, False, True], -0.6),  # a negative KL estimate: clamped to 0
    ("kto", 0.3, 1.0, 2.0, [True, True, True, True, True], 0.4),  # one label only (TRL accepts it)
    ("apo_zero_unpaired", 0.2, 1.0, 1.0, [True, False, False, True, False], 0.0),
]


def kto_fixture(path: Path) -> None:
    """tests/data/kto_trl.json: TRL's KTOTrainer._compute_loss run on given per-sequence
    log-probability sums (float64; a stand-in model answers the sums, precomputed references),
    its loss, metrics and the gradient of the loss wrt each completion's sum (autograd)."""
    from collections import defaultdict
    from types import SimpleNamespace

    import torch
    from trl import KTOTrainer

    rng = np.random.default_rng(11)
    cases = []
    for loss_type, beta, dw, uw, labels, shift in KTO_CASES:
        n = len(labels)
        ref = rng.normal(-40.0, 8.0, n)
        logps = ref + rng.normal(0.0, 3.0, n)
        ref_kl = rng.normal(-60.0, 8.0, n)
        kl_logps = ref_kl + shift + rng.normal(0.0, 0.3, n)
        leaf = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
        ids, kl_ids = torch.zeros((n, 2), dtype=torch.long), torch.zeros((n, 2), dtype=torch.long)

        class Model:  # outputs.log_probs[:, -1:] summed: the sequence's sum
            training = True

            def __call__(self, input_ids=None, **kw):
                lp = torch.tensor(kl_logps)[:, None] if input_ids is kl_ids else leaf[:, None]
                return SimpleNamespace(log_probs=lp, entropy=torch.zeros(n, 1), mean_logits=torch.zeros(n, 1))

        tr = object.__new__(KTOTrainer)
        accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)
        tr.__dict__.update(model=Model(), accelerator=accelerator, beta=beta, loss_type=loss_type,
                           desirable_weight=dw, undesirable_weight=uw, calculate_KL=loss_type != "apo_zero_unpaired",
                           precompute_ref_logps=True, aux_loss_enabled=False, _total_train_tokens=0, _tp_size=1,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
        batch = {"input_ids": ids, "attention_mask": torch.ones((n, 2), dtype=torch.long),
                 "completion_mask": torch.ones((n, 2), dtype=torch.long), "KL_input_ids": kl_ids,
                 "KL_attention_mask": torch.ones((n, 2), dtype=torch.long),
                 "KL_completion_mask": torch.ones((n, 2), dtype=torch.long),
                 "label": torch.tensor(labels), "ref_logps": torch.tensor(ref),
                 "ref_KL_logps": torch.tensor(ref_kl)}
        loss = tr._compute_loss(tr.model, batch, return_outputs=False)
        loss.backward()
        metrics = {k: float(v[-1]) for k, v in tr._metrics["train"].items()
                   if v and (k == "kl" or k.startswith(("rewards/", "logps/")))}
        cases.append({"loss_type": loss_type, "beta": beta, "desirable_weight": dw, "undesirable_weight": uw,
                      "labels": labels, "logps": logps.tolist(), "kl_logps": kl_logps.tolist(),
                      "ref_logps": ref.tolist(), "ref_kl_logps": ref_kl.tolist(), "loss": float(loss.detach()),
                      "grad": leaf.grad.tolist(), "metrics": metrics})
    import trl

    path.write_text(json.dumps({"source": f"trl {trl.__version__} KTOTrainer._compute_loss (bench/check_trl.py "
                                          f"--kto-fixture)", "cases": cases}, indent=1) + "\n")


# ------------------------------------------------------------------------------ compare
def rel(a: float, b: float) -> float:
    if b == 0:
        return abs(a - b)
    return abs(a - b) / abs(b)


def compare(method: str, ours: dict, theirs: dict) -> dict:
    keys = METRICS + (["nll_loss", "log_odds_ratio", "log_odds_chosen"] if method == "orpo" else [])
    keys += ["kl"] if method == "kto" else []
    metric_diff = {k: rel(ours["metrics"][k], theirs["metrics"][k]) for k in keys if k in theirs["metrics"]}
    grad_names = [n for n in theirs["grads"] if theirs["grads"][n] > 0]
    grad_diff = {n: rel(ours["grads"][n], theirs["grads"][n]) for n in grad_names}
    n = min(len(ours["losses"]), len(theirs["losses"]))
    curve = max(rel(a, b) for a, b in zip(ours["losses"][:n], theirs["losses"][:n]))
    # KTO: each step's KL estimate (0 at the first step, where the policy is the reference, and where clamped)
    kl = [(abs(a - b), rel(a, b)) for a, b in zip(ours["kl"][:n], theirs["kl"][:n]) if b]
    worst_m = max(metric_diff, key=metric_diff.get)
    worst_g = max(grad_diff, key=grad_diff.get)
    return {"loss0": (ours["losses"][0], theirs["losses"][0], rel(ours["losses"][0], theirs["losses"][0])),
            "metric": (worst_m, metric_diff[worst_m], len(metric_diff)),
            "grad": (worst_g, grad_diff[worst_g], len(grad_diff)),
            "curve": (n, curve, ours["losses"][n - 1], theirs["losses"][n - 1]),
            "kl": (len(kl), max((d for d, _ in kl), default=0.0), max((r for _, r in kl), default=0.0))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "tests" / "data" / "stories260K.gguf")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--methods", nargs="*", default=["dpo", "orpo", "simpo", "kto", "kto-apo", "orpo+b", "simpo+b",
                                                     "kto+b"],
                    help="METHOD+b: the adapter starts with B != 0 as well (its A gradients are then not 0); "
                         "kto-apo: KTO's loss_type apo_zero_unpaired")
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    ap.add_argument("--kto-fixture", type=Path, help="write TRL's KTO losses and gradients on given log-probabilities "
                                                     "(tests/data/kto_trl.json) and stop")
    a = ap.parse_args()
    if a.kto_fixture:
        kto_fixture(a.kto_fixture)
        return 0
    print("| method | first loss llmtune | first loss TRL | rel | worst metric (rel, of n) | "
          "worst adapter grad norm (rel, of n) | loss curve: steps, max rel, last llmtune / TRL |")
    print("|---|---|---|---|---|---|---|")
    raw, kl = {}, []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        pairs = pairs_file(tmp)
        unpaired = unpaired_file(tmp, pairs)
        for name in a.methods:
            method, nonzero_b = name.removesuffix("+b"), name.endswith("+b")
            method, kto_loss = ("kto", "apo_zero_unpaired") if method == "kto-apo" else (method, "kto")
            adapter, init = initial_adapter(a.model, nonzero_b), None
            if nonzero_b:
                from llmtune.model.adapter import write_adapter

                init = write_adapter(tmp / f"init-{method}.gguf", adapter)
            data = unpaired if method == "kto" else pairs
            ours = run_llmtune(a.model, data, method, a.steps, tmp, init, kto_loss)
            theirs = run_trl(a.model, data, method, a.steps, tmp, adapter, kto_loss)
            raw[name] = {"llmtune": ours, "trl": theirs}
            c = compare(method, ours, theirs)
            l0, m, g, cv = c["loss0"], c["metric"], c["grad"], c["curve"]
            print(f"| {name} | {l0[0]:.8f} | {l0[1]:.8f} | {l0[2]:.1e} | {m[0]} {m[1]:.1e} ({m[2]}) | "
                  f"{g[0]} {g[1]:.1e} ({g[2]}) | {cv[0]}, {cv[1]:.1e}, {cv[2]:.6f} / {cv[3]:.6f} |", flush=True)
            if method == "kto" and kto_loss == "kto":
                kl.append(f"{name}: the KL estimate of the {c['kl'][0]} steps where it is above 0 differs by "
                          f"{c['kl'][1]:.1e} at most ({c['kl'][2]:.1e} relative)")
    print("\n".join(kl))
    if a.json:
        a.json.write_text(json.dumps(raw, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
