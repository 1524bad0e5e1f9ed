"""Does Muon pay off on the quickstart? Train it with AdamW and with Muon, each over a small lr sweep, and
report how many steps the best Muon run needs to reach the best AdamW run's final (smoothed) loss.

    python tools/muon_study.py                       # ~10 minutes on 2 CPU cores
    python tools/muon_study.py --steps 60 --jobs 1   # quicker

Every run is ``mm train examples/quickstart/config.yaml`` in its own process (``--nproc`` ranks, one
thread each), ``--jobs`` runs at a time, same data order, steps and batch; the Muon sweep starts after the
AdamW sweep and uses the best AdamW lr for its AdamW groups (embeddings, head, norms). The loss is the
training loss (each step sees new samples: the runs stay within the first epoch), smoothed by a trailing
mean over ``--window`` steps. Writes runs under ``--out``, a summary JSON there, and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart" / "config.yaml"


@dataclass
class Run:
    optimizer: str
    lr: float
    overrides: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.optimizer}_lr{self.lr:g}"

    @property
    def label(self) -> str:
        return f"{'Muon' if self.optimizer == 'muon' else 'AdamW'} lr={self.lr:g}"


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i + 1 - window) : i + 1]
        out.append(sum(part) / len(part))
    return out


def steps_to_reach(values: list[float], target: float, window: int) -> int | None:
    """First 1-based step whose smoothed loss is at or below ``target`` (None if never)."""
    for i, v in enumerate(smooth(values, window)):
        if v <= target:
            return i + 1
    return None


def train(run: Run, args: argparse.Namespace) -> Run:
    out = args.out / run.name
    cmd = [
        sys.executable,
        "-m",
        "mm_core.cli",
        "train",
        str(QUICKSTART),
        f"data.dataset_param.basic_parameters.seq_len={args.seq_len}",
        f"training.micro_batch_size={args.batch // args.nproc}",
        "training.gradient_accumulation_steps=1",
        f"training.train_iters={args.steps}",
        f"training.lr={run.lr}",
        f"training.lr_min={run.lr / 10}",
        "training.log_interval=1",
        "training.progress_bar=false",
        "training.save=null",
        "tools.tensorboard.enable=false",
        f"training.output_dir={out}",
        f"training.optimizer={run.optimizer}",
        *run.overrides,
        "--nproc-per-node",
        str(args.nproc),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    run.seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{run.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    run.losses = [r["loss"] for r in records]
    final = smooth(run.losses, args.window)[-1]
    print(f"  {run.label:<16} final smoothed loss {final:.4f} ({run.seconds:.0f} s)", flush=True)
    return run


def sweep(runs: list[Run], args: argparse.Namespace) -> list[Run]:
    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(lambda r: train(r, args), runs))


def plot(
    adamw: list[Run], muon: list[Run], target: float, reach: int | None, args: argparse.Namespace
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    for runs, cmap in ((adamw, plt.cm.Blues), (muon, plt.cm.Oranges)):
        for i, run in enumerate(runs):
            color = cmap(0.45 + 0.5 * i / max(1, len(runs) - 1))
            steps = range(1, len(run.losses) + 1)
            ax.plot(steps, run.losses, color=color, alpha=0.18, linewidth=0.8)
            ax.plot(steps, smooth(run.losses, args.window), color=color, linewidth=1.6, label=run.label)
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"best AdamW final ({target:.3f})")
    if reach is not None:
        label = f"best Muon reaches it: step {reach}"
        ax.axvline(reach, color="tab:red", linestyle=":", linewidth=1, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (thin: raw, thick: mean of last {args.window})")
    ax.set_title(
        f"Quickstart Qwen3 4.2M, {args.steps} steps x {args.batch}x{args.seq_len} tokens, cosine lr, CPU"
    )
    lo = min(min(r.losses) for r in adamw + muon)
    ax.set_ylim(lo - 0.2, lo + 3.5)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot)
    print(f"plot: {args.plot}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch in samples")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--window", type=int, default=5, help="smoothing window in steps")
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    p.add_argument("--ns-dtype", default="bf16", help="training.muon.ns_dtype")
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "muon_study")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "images" / "muon_vs_adamw.png")
    args = p.parse_args()
    args.out = args.out.resolve()

    t0 = time.perf_counter()
    print("AdamW sweep", flush=True)
    adamw = sweep([Run("adamw", lr) for lr in args.adamw_lrs], args)
    best_adamw = min(adamw, key=lambda r: smooth(r.losses, args.window)[-1])
    print(f"Muon sweep (AdamW groups at lr {best_adamw.lr:g})", flush=True)
    muon_overrides = [f"training.muon.adamw_lr={best_adamw.lr}", f"training.muon.ns_dtype={args.ns_dtype}"]
    muon = sweep([Run("muon", lr, muon_overrides) for lr in args.muon_lrs], args)
    best_muon = min(muon, key=lambda r: smooth(r.losses, args.window)[-1])

    target = smooth(best_adamw.losses, args.window)[-1]
    reach = steps_to_reach(best_muon.losses, target, args.window)
    summary = {
        "setup": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "runs": {
            r.name: {"final": smooth(r.losses, args.window)[-1], "seconds": r.seconds, "losses": r.losses}
            for r in adamw + muon
        },
        "best_adamw": best_adamw.name,
        "best_muon": best_muon.name,
        "target": target,
        "muon_steps_to_target": reach,
        "wall_s": time.perf_counter() - t0,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    plot(adamw, muon, target, reach, args)

    print(f"\n| run | final loss (mean of last {args.window} steps) | time |")
    print("|---|---|---|")
    for r in adamw + muon:
        print(f"| {r.label} | {smooth(r.losses, args.window)[-1]:.4f} | {r.seconds:.0f} s |")
    where = f"step {reach} of {args.steps}" if reach else f"not within {args.steps} steps"
    print(f"\nbest AdamW: {best_adamw.label}, final smoothed loss {target:.4f}")
    print(
        f"best Muon : {best_muon.label}, final {smooth(best_muon.losses, args.window)[-1]:.4f}; "
        f"reaches {target:.4f} at {where}"
    )
    print(f"wall time: {summary['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
