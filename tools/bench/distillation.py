"""On-policy distillation vs GRPO alone: the same warmed-up student, the same steps, in one invocation.

Both runs start from one warmed-up checkpoint (made first, kept when ``--work-dir`` has one) and
train ``--steps`` steps of the recipe (``tiny_moe_opd_cpu``: the demo's task, ``mode=sync``: no stale
samples; runs still vary: the engine's sampling depends on how requests batch), each as its own
``python -m megarl.train`` process, in turn:

  opd   the recipe: ``algorithm.advantage=opd`` (sequence advantage 0), the teacher's per-token
        reverse-KL advantages alone (``algorithm.opd_coef``)
  grpo  ``algorithm.advantage=grpo``, no teacher: the reward alone
  grpo_opd  (with ``--variants``) the reward's GRPO advantage plus the teacher's token advantages at
        weight ``--combined-coef``

The teacher is ``--teacher`` (an HF checkpoint with the student's tokenizer), or, without it and for
``tiny_moe_opd_cpu`` only, made here as that recipe's comment says: the demo (``recipe=tiny_moe_cpu``, its
own warm-up, ``--teacher-steps`` RL steps) from the same base, its final trainer checkpoint converted to HF
by ``tools/convert_checkpoint.py``.
From each run's ``metrics.jsonl``:

  reward_curve      mean reward per ``--window`` steps
  reward_at         mean reward over the ``--window`` steps ending at each of ``--at`` (e.g. 10, 20, 40)
  final_reward      mean reward of the last ``--last`` steps
  reverse_kl_curve  runs with a teacher: ``distill/reverse_kl`` (student - teacher log-prob, nats/token)
                    per window

From the run's trainer checkpoints (every ``--eval-every`` steps, converted to HF), and from the
warm-up for step 0:

  answer_prob_at    the policy's probability of sampling exactly the answer's tokens and then EOS
                    (the recipe's temperature and top-k), averaged over every problem of the task: the
                    expected reward without sampling noise (a lower bound: it misses other spellings
                    of the answer, e.g. with a space before it, which the reward also accepts)

and side by side ``<variant>_reward_curve``, ``<variant>_final_reward``, ``opd_minus_grpo_final_reward``
(and ``grpo_opd_minus_grpo_final_reward``). With ``--seeds`` (e.g. ``0,1,2``: ``task.seed`` and
``trainer.seed`` of every run, the warm-up and teacher shared) each variant runs once per seed, in
turn; the side-by-side keys then hold the mean over the seeds, ``runs`` holds each seed's figures,
and ``opd_ahead_at`` (``opd_ahead_answer_prob_at``) counts, at each of ``--at`` (each evaluated step),
the seeds whose windowed reward (answer probability) is higher under ``opd`` than under ``grpo``
(``grpo_opd_ahead_at`` and ``grpo_opd_ahead_answer_prob_at`` the same for ``grpo_opd``).

Every run's config (warm-up, teacher, each variant and seed) is loaded and validated before anything
trains: a bad one exits at once, naming the run and the key.

Usage: python tools/bench/distillation.py --json FILE [--teacher PATH] [--steps 40 --window 5 --last 10
       --variants opd,grpo_opd,grpo --seeds 0,1,2 --eval-every 10 --set key=value ...
       --variant-set opd:key=value ...]
       (``--set`` overrides apply to the warm-up and the compared runs, not to a teacher made here;
       ``--variant-set`` ones to that variant's runs only, after every other override)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from work_dir import work_directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def windows(values: list[float], window: int) -> list[float]:
    return [round(sum(values[i:i + window]) / len(values[i:i + window]), 3) for i in range(0, len(values), window)]


def mean_of(values: list) -> float | list | dict:
    """Element-wise mean of numbers, of equal-length lists, or of dicts with the same keys (per seed -> one)."""
    if isinstance(values[0], dict):
        return {k: mean_of([v[k] for v in values]) for k in values[0]}
    if isinstance(values[0], list):
        return [round(sum(column) / len(column), 3) for column in zip(*values, strict=True)]
    return round(sum(values) / len(values), 4)


def figures(run_dir: Path, window: int, last: int, at: list[int]) -> dict:
    """The figures above from ``run_dir/metrics.jsonl``."""
    from megarl.metrics.sink import read_metrics

    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no RL rows")
    rewards = [r["reward/mean"] for r in rows]
    tail = rewards[-last:]
    out = {"steps": len(rows), "final_reward": round(sum(tail) / len(tail), 4),
           "reward_curve": windows(rewards, window),
           "reward_at": {str(s): round(sum(rewards[max(0, s - window):s]) / len(rewards[max(0, s - window):s]), 3)
                         for s in at if s <= len(rewards)},
           "seconds_per_step": sum(r["time/wait_s"] + r["time/train_s"] + r["sync/seconds"] for r in rows) / len(rows)}
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    if kl:
        out["reverse_kl_curve"] = windows(kl, window)
        out["teacher_errors"] = rows[-1]["distill/teacher_errors"]
    return out


def answer_prob(hf_dir: Path, max_operand: int, temperature: float, top_k: int) -> float:
    """Mean over the task's problems of the probability that one sample of the HF policy at ``hf_dir``
    (logits / ``temperature``, renormalised over the ``top_k`` most likely tokens, as the engine samples)
    is exactly the answer's tokens followed by EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.tasks.arithmetic import all_problems

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, problems = 0.0, all_problems(max_operand)
    with torch.no_grad():
        for problem in problems:
            prompt = tokenizer.encode(problem.prompt)  # as the rollout encodes it (BOS first)
            answer = tokenizer.encode(problem.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1] / temperature
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
            total += logp.gather(-1, torch.tensor(answer)[:, None]).sum().exp().item()
    return round(total / len(problems), 4)


def answer_prob_at(run_dir: Path, work: Path, every: int, steps: int, sampling: tuple[int, float, int],
                   at_start: float) -> dict:
    """{step: answer_prob}: ``at_start`` (the warm-up's, ``work/warm``) at step 0, then at every ``every``-th
    step of the run (its trainer checkpoint, converted to HF next to the run)."""
    out = {"0": at_start}
    for step in range(every, steps + 1, every):
        hf_dir = run_dir / f"hf_step{step}"
        if not (hf_dir / "config.json").is_file():
            run([sys.executable, "tools/convert_checkpoint.py", "to-hf", "--megatron",
                 str(run_dir / "checkpoints" / f"iter_{step:07d}"), "--hf", str(work / "warm"), "--out", str(hf_dir)])
        out[str(step)] = answer_prob(hf_dir, *sampling)
    return out


def seeds_ahead(variant: dict, grpo: dict, key: str) -> dict:
    """At each step of the runs' ``key`` curve: how many seeds have the variant above grpo."""
    steps = next(iter(variant.values()))[key]
    return {step: sum(variant[s][key][step] > grpo[s][key][step] for s in variant) for step in steps}


def run(command: list[str]) -> float:
    """Run ``command`` in the repository; raises on failure; returns its wall seconds."""
    t0 = time.monotonic()
    if subprocess.run(command, cwd=REPO).returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}")
    return time.monotonic() - t0


def train(overrides: list[str]) -> float:
    return run([sys.executable, "-m", "megarl.train", *overrides])


def shared_overrides(work: Path, warm: Path) -> list[str]:
    """Every run's: the base checkpoint in ``work``, the warm-up checkpoint at ``warm``, no resume."""
    return [f"model.hf_path={work / 'base'}", "model.make_tiny_if_missing=true",
            f"warmup.save_hf_path={warm}", "trainer.resume=false"]


def teacher_overrides(steps: int, work: Path) -> list[str]:
    """The teacher's RL run: the demo (its recipe and its own warm-up, ``work/teacher_warm``, made by the
    run), ``steps`` steps, from the shared base."""
    return [*shared_overrides(work, work / "teacher_warm"), "recipe=tiny_moe_cpu", f"steps={steps}",
            f"logging.run_dir={work / 'teacher_rl'}"]


def make_teacher(work: Path, overrides: list[str]) -> None:
    """``work/teacher``: the teacher's RL run (``overrides``: :func:`teacher_overrides`), its final trainer
    checkpoint converted to HF."""
    train(overrides)
    run([sys.executable, "tools/convert_checkpoint.py", "to-hf", "--megatron", str(work / "teacher_rl" / "checkpoints"),
         "--hf", str(work / "teacher_warm"), "--out", str(work / "teacher")])


def check_configs(runs: dict[str, list[str]]) -> None:
    """Load (and so validate) every run's config before anything trains: exits naming the first bad run
    (in run order) and the key."""
    from megarl.config import ConfigError, load_config

    for name, overrides in runs.items():
        try:
            load_config(overrides)
        except ConfigError as exc:
            raise SystemExit(f"the {name} run's config: {exc}") from exc


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--recipe", default="tiny_moe_opd_cpu")
    parser.add_argument("--teacher", default=None, help="teacher HF checkpoint (default: made here, see above)")
    parser.add_argument("--teacher-steps", type=int, default=300, help="RL steps of a teacher made here")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=5, help="steps per point of the curves")
    parser.add_argument("--last", type=int, default=10, help="steps averaged into final_reward")
    parser.add_argument("--at", default="10,20,30,40", help="steps at which the windowed reward is reported")
    parser.add_argument("--variants", default="opd,grpo", help="comma-separated, in run order: opd, grpo, grpo_opd")
    parser.add_argument("--combined-coef", type=float, default=0.2, help="opd_coef of the grpo_opd variant")
    parser.add_argument("--seeds", default=None, help="comma-separated task/trainer seeds, one run per variant each")
    parser.add_argument("--eval-every", type=int, default=10,
                        help="steps between the checkpoints whose answer probability is computed (0: none)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for both runs")
    parser.add_argument("--variant-set", action="append", default=[], metavar="VARIANT:KEY=VALUE",
                        help="an override for one variant's runs only (e.g. opd:rollout.samples_per_prompt=1)")
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    if args.eval_every < 0:
        parser.error(f"--eval-every: must be >= 0, got {args.eval_every}")
    return args


def check_recipe(args: argparse.Namespace, cfg) -> None:
    """Exits naming the flag when the recipe's config ``cfg`` cannot serve ``args``."""
    if args.eval_every and (cfg.task.name != "arithmetic" or cfg.task.env is not None):
        raise SystemExit(f"--eval-every: the answer probability is computed for single-turn task.name=arithmetic, "
                         f"the recipe's task is {cfg.task.name} (env {cfg.task.env}); pass --eval-every 0")
    if not args.teacher and args.recipe != "tiny_moe_opd_cpu":
        raise SystemExit(f"--teacher: a teacher is made here for tiny_moe_opd_cpu only (the demo's RL); make "
                         f"{args.recipe}'s as its recipe file says and pass its path")
    if args.teacher and not (Path(args.teacher) / "config.json").is_file():
        raise SystemExit(f"--teacher: {args.teacher} is not an HF checkpoint directory (no config.json)")


def variant_overrides(args: argparse.Namespace, teacher: Path) -> dict[str, tuple[list[str], list[str]]]:
    """{variant: (its overrides, its ``--variant-set`` ones)} in ``--variants`` order; exits on a bad flag."""
    known = {"opd": [f"teacher.hf_path={teacher.resolve()}"],
             "grpo": ["algorithm.advantage=grpo", "teacher.hf_path=null", "algorithm.opd_coef=0"],
             "grpo_opd": ["algorithm.advantage=grpo", f"teacher.hf_path={teacher.resolve()}",
                          f"algorithm.opd_coef={args.combined_coef}"]}
    names = args.variants.split(",")
    if not set(names) <= known.keys() or {"opd", "grpo"} - set(names):
        raise SystemExit(f"--variants: {args.variants!r} must include opd and grpo, from {', '.join(known)}")
    variants = {name: (known[name], []) for name in names}
    for item in args.variant_set:
        name, _, override = item.partition(":")
        if name not in variants or "=" not in override:
            raise SystemExit(f"--variant-set: {item!r} must be VARIANT:KEY=VALUE with VARIANT one of {args.variants}")
        variants[name][1].append(override)
    return variants


def plan_runs(args: argparse.Namespace, common: list[str], teacher: Path, evaluated: list[str]
              ) -> tuple[list[int | None], dict[tuple[str, int | None], list[str]]]:
    """The seeds and every compared run's overrides, {(variant, seed): overrides}, in run order (a variant's
    ``--variant-set`` overrides last, so that they win over ``--set``)."""
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    variants = variant_overrides(args, teacher)
    runs = {}
    for seed in seeds:
        for name, (overrides, last) in variants.items():
            runs[name, seed] = [f"recipe={args.recipe}", *common, f"steps={args.steps}", *overrides,
                                *([] if seed is None else [f"task.seed={seed}", f"trainer.seed={1234 + seed}"]),
                                *evaluated, *args.set, *last]
    return seeds, runs


def run_variants(args: argparse.Namespace, work: Path, runs: dict, sampling: tuple, at: list[int],
                 at_start: float | None) -> dict:
    """Train every run of ``runs`` in turn; {variant: {seed: its figures}}."""
    out: dict[str, dict] = {}
    for (name, seed), overrides in runs.items():
        run_dir = work / (name if seed is None else f"{name}_seed{seed}")
        wall = train([*overrides, f"logging.run_dir={run_dir}"])
        f = figures(run_dir, args.window, args.last, at) | {"wall_s": round(wall, 1)}
        if args.eval_every:
            f["answer_prob_at"] = answer_prob_at(run_dir, work, args.eval_every, args.steps, sampling, at_start)
        out.setdefault(name, {})[str(seed)] = f
        print(f"{name:>8} (seed {seed}): reward per {args.window} steps {f['reward_curve']}; "
              f"last-{args.last} {f['final_reward']:.3f}"
              f"{'; reverse KL ' + str(f['reverse_kl_curve']) if 'reverse_kl_curve' in f else ''}"
              f"{'; answer probability ' + str(f['answer_prob_at']) if 'answer_prob_at' in f else ''}", flush=True)
    return out


def side_by_side(result: dict, evaluated: bool) -> None:
    """Adds to ``result`` each variant's means over the seeds and the others' standing against grpo."""
    variants = list(result["runs"])
    for name in variants:
        per_seed = list(result["runs"][name].values())
        for key in ("reward_curve", "reward_at", "final_reward", "answer_prob_at"):
            if key in per_seed[0]:
                result[f"{name}_{key}"] = mean_of([f[key] for f in per_seed])
    grpo = result["runs"]["grpo"]
    for name in (n for n in variants if n != "grpo"):
        result[f"{name}_minus_grpo_final_reward"] = round(result[f"{name}_final_reward"] - result["grpo_final_reward"],
                                                          4)
        result[f"{name}_ahead_at"] = seeds_ahead(result["runs"][name], grpo, "reward_at")
        if evaluated:
            result[f"{name}_ahead_answer_prob_at"] = seeds_ahead(result["runs"][name], grpo, "answer_prob_at")


def print_side_by_side(result: dict, at: list[int], evaluated: bool) -> None:
    variants = list(result["runs"])
    others = [name for name in variants if name != "grpo"]
    ahead = "; ".join(f"seeds with {name} ahead of grpo: {result[name + '_ahead_at']}" for name in others)
    print(f"opd - grpo final reward: {result['opd_minus_grpo_final_reward']:+.3f}; reward at steps {at} "
          f"(mean of {len(result['seeds'])} seed(s)): "
          + ", ".join(f"{name} {result[name + '_reward_at']}" for name in variants) + f"; {ahead}")
    if evaluated:
        ahead = "; ".join(f"seeds with {name} ahead of grpo: {result[name + '_ahead_answer_prob_at']}"
                          for name in others)
        print("answer probability (mean of the seeds): " + ", ".join(
            f"{name} {result[name + '_answer_prob_at']}" for name in variants) + f"; {ahead}")


def main() -> int:
    args = parse_arguments()
    work = work_directory(args.work_dir, "megarl-distillation-")
    common = shared_overrides(work, work / "warm")
    from megarl.config import load_config

    cfg = load_config([f"recipe={args.recipe}", *common, *args.set])
    check_recipe(args, cfg)
    sampling = (cfg.task.max_operand, cfg.rollout.temperature, cfg.rollout.top_k)
    teacher = Path(args.teacher) if args.teacher else work / "teacher"
    evaluated = [f"trainer.save_interval={args.eval_every}"] if args.eval_every else []
    seeds, runs = plan_runs(args, common, teacher, evaluated)
    warmup = [f"recipe={args.recipe}", *common, "mode=warmup", f"logging.run_dir={work / 'warmup'}", *args.set]
    checked = {"warm-up": warmup} | {name + ("" if seed is None else f" (seed {seed})"): overrides
                                     for (name, seed), overrides in runs.items()}
    if not args.teacher:  # the teacher's run is checked and then run with these very overrides
        checked["teacher"] = teacher_overrides(args.teacher_steps, work)
    check_configs(checked)
    warmup_s = 0.0
    if not (work / "warm" / "config.json").is_file():  # a work dir given again keeps its warm-up
        warmup_s = train(warmup)
    if not args.teacher:
        make_teacher(work, checked["teacher"])
    at = [int(s) for s in args.at.split(",")]
    at_start = answer_prob(work / "warm", *sampling) if args.eval_every else None
    result = {"recipe": args.recipe, "steps": args.steps, "window": args.window, "teacher": str(teacher),
              "overrides": args.set, "variant_overrides": args.variant_set, "seeds": seeds,
              "warmup_s": round(warmup_s, 1), "runs": run_variants(args, work, runs, sampling, at, at_start)}
    side_by_side(result, bool(args.eval_every))
    print_side_by_side(result, at, bool(args.eval_every))
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
