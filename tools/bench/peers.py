"""mm train against its peers: tokens/s and peak memory per rank, same model, same tokens, same ranks.

    python tools/bench/peers.py [--steps 3] [--warmup 1] [--rounds 2] [--only mm,hf-fsdp2] [--json out.json]

Every peer trains the same Qwen3 (hidden 768, 10 layers, 12 heads / 4 KV heads of 64, MLP 2048, vocab 4096 of
the quickstart tokenizer, tied embeddings: 66M parameters, random init) in fp32 with AdamW (lr 2e-3, weight
decay 0.01, grad clip 1.0) on 2 gloo ranks of one thread each, on the same token blocks (the quickstart
text packed into blocks of ``--seq`` tokens by mm's ``text_pretrain`` pipeline; position ids restart at each
document), with the same micro-batch size, gradient accumulation and so tokens per optimizer step:

- ``mm``: ``mm train`` (``torchrun -m mm_core.train`` on the quickstart YAML with overrides), FSDP2 over both
  ranks, each decoder layer one unit (mm's defaults otherwise).
- ``mm-rs-once``: the same with ``parallel.fsdp_plan.reduce_scatter_per_micro_batch: false``: gradients
  accumulate unsharded over the micro-batches and are reduce-scattered once per step, what the Hugging Face
  Trainer does with FSDP2 (``set_requires_gradient_sync(False)`` before all but the last micro-batch), at the
  memory of unsharded gradients.
- ``mm-keep-gathered``: the same with ``parallel.fsdp_plan.reshard_after_forward: false``: each decoder
  layer stays gathered from its forward to its backward (no second all-gather), at the memory of gathered
  layers.
- ``mm-ddp``: the same with the model replicated on both ranks (``parallel.data_parallel_size: 2``,
  ``fully_shard_parallel_size: 1``: gradients all-reduced), the layout ``hf-accelerate`` ends up with.

Each peer is compared with the fastest mm run whose peak memory is at most the peer's (1% slack): "tokens/s
at equal or lower memory".
- ``hf-fsdp2``: Hugging Face ``Trainer`` on a model sharded with FSDP2 by transformers itself
  (``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``, ``use_cpu=True``): the way
  to get FSDP2 from Hugging Face on CPU.
- ``hf-accelerate``: Hugging Face ``Trainer`` with ``fsdp=True, fsdp_config={"fsdp_version": 2, ...}`` (via
  accelerate), ``use_cpu=True``: what most users try first. accelerate only turns FSDP on for accelerator
  process groups (``AcceleratorState.__init__`` in accelerate/state.py sets ``DistributedType.FSDP`` only
  when the type is ``MULTI_GPU``/``MULTI_NPU``/``MULTI_XPU``/..., never ``MULTI_CPU``), so on CPU it trains
  DDP instead, silently; the table names the layout each run really had.
- ``torchtitan``: ``torchtitan``'s own Trainer (PyPI ``torchtitan``; its Qwen3 at the same sizes, with flex
  attention, as it refuses sdpa for language models) from the Python given by ``--titan-python`` (a
  separate venv: torchtitan needs packages the project's venv does not have). Where it cannot run on CPU
  the table says why, from the error it raised. With torchtitan 0.3.0 and torch 2.13 that is its device
  choice (no CPU; see ``_titan_note``), and past it, found by forcing its device globals to CPU by hand:
  its default ``spmd_types`` backend hands ``fully_shard`` a ``dp_mesh_dims`` that torch 2.13 rejects for
  plain parameters (``partial_dtensor`` avoids it, set below), and then no attention backend trains on CPU
  (``sdpa`` is refused for language models, ``flex`` has no CPU backward in torch 2.13, ``varlen`` calls
  ``aten::_flash_attention_forward``, which has no CPU kernel).

What is measured, the same way for every peer, in each rank process: the wall time between the ends of
consecutive optimizer steps (the whole training loop: data, forward, backward, clipping, the optimizer,
logging), for the steps after ``--warmup`` (excluded); tokens/s = tokens per step (all ranks) / mean step
time. Peak memory is the peak resident set size (``ru_maxrss``, the kernel's VmHWM) of each rank's process on
CPU (the whole process: Python, torch and libraries included; ``base`` is the RSS right after ``import
torch``, the same in every peer; glibc is told to return freed memory at once, ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_``, as in ``tools/bench/memory.py``, so RSS follows live tensors). Peers run in
fresh processes, alternating (the mm runs, hf-fsdp2, hf-accelerate, torchtitan, then again) for
``--rounds`` rounds; tokens/s is the median over rounds, RSS the maximum.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from _ranks import free_port

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart" / "config.yaml"
TEXT = REPO / "examples" / "quickstart" / "data" / "python_reference.jsonl"
TOKENIZER = REPO / "examples" / "quickstart" / "tokenizer"
#: mm's configurations (YAML overrides on top of the shared ones), then the peers
MM_RUNS: dict[str, list[str]] = {
    "mm": [],
    # gradients reduce-scattered once per step, as the Hugging Face Trainer does
    "mm-rs-once": ["parallel.fsdp_plan.reduce_scatter_per_micro_batch=false"],
    # decoder layers stay gathered from forward to backward (no second all-gather)
    "mm-keep-gathered": ["parallel.fsdp_plan.reshard_after_forward=false"],
    # replicated over both ranks, gradients all-reduced: DDP's layout
    "mm-ddp": ["parallel.data_parallel_size=2", "parallel.fully_shard_parallel_size=1"],
}
PEERS = (*MM_RUNS, "hf-fsdp2", "hf-accelerate", "torchtitan")
#: "at equal or lower memory": an mm run counts against a peer when its peak RSS is at most this much above
MEMORY_SLACK = 1.01
DEFAULT_TITAN_PYTHON = "/tmp/peers-venv/bin/python"
TITAN_HINT = (
    "python3.11 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install torch==2.13.0 "
    "torchtitan==0.3.0 numpy triton  (then --titan-python /tmp/peers-venv/bin/python)"
)
WORLD = 2
LR = 2.0e-3
WEIGHT_DECAY = 0.01
CLIP = 1.0
SEED = 42
GiB = 2**30

# the model every peer trains (transformers Qwen3Config fields)
MODEL = {
    "vocab_size": 4096,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 0,
    "use_cache": False,
}


# ------------------------------------------------------------------------------------------ rank side
def _rss_now() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _innermost(exc: BaseException) -> str:
    """The exception and the innermost frame of the library that raised it (or of the call)."""
    frames = traceback.extract_tb(exc.__traceback__)
    lib = [f for f in frames if "site-packages" in f.filename] or frames
    where = ""
    if lib:
        f = lib[-1]
        short = f.filename.split("site-packages/")[-1]
        where = f" (at {short}:{f.lineno} in {f.name}: {(f.line or '').strip()})"
        callers = [g for g in frames if "site-packages" in g.filename and g is not f]
        if callers:
            c = callers[-1]
            where += f", called from {c.filename.split('site-packages/')[-1]}:{c.lineno}"
    return f"{type(exc).__name__}: {exc}{where}"


def _run_mm(spec: dict[str, Any], result: dict[str, Any]) -> None:
    from mm_core.train import trainer as mm_trainer
    from mm_core.train.entry import run_worker

    original = mm_trainer.Trainer.train_step

    def timed(self: Any, micro_batches: Any, **kwargs: Any) -> Any:
        metrics = original(self, micro_batches, **kwargs)
        result["step_ends"].append(time.perf_counter())
        result["layout"] = f"FSDP2 (mm: {self.state.sizes.layout})"
        result["optimizer"] = _optimizer_kind(self.optimizer)
        return metrics

    mm_trainer.Trainer.train_step = timed  # type: ignore[method-assign]
    code = run_worker([str(QUICKSTART), *spec["mm_overrides"]])
    if code:
        raise SystemExit(code)


def _optimizer_kind(optimizer: Any) -> str:
    group = optimizer.param_groups[0]
    mode = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    return f"{type(optimizer).__name__} ({mode})"


def _run_hf(kind: str, spec: dict[str, Any], result: dict[str, Any]) -> None:
    import torch
    from transformers import (
        Qwen3Config,
        Qwen3ForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    blocks = torch.load(spec["blocks"], weights_only=True)

    class Blocks(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return int(blocks["input_ids"].shape[0])

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {k: v[i] for k, v in blocks.items()}

    class StepEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            result["step_ends"].append(time.perf_counter())

    torch.manual_seed(SEED)
    extra: dict[str, Any] = {}
    if kind == "hf-fsdp2":
        from transformers.distributed import DistributedConfig

        model = Qwen3ForCausalLM.from_pretrained(
            spec["model_dir"],
            distributed_config=DistributedConfig(fsdp_size=WORLD),
            dtype=torch.float32,
            attn_implementation="sdpa",
        )
    else:
        config = Qwen3Config.from_pretrained(spec["model_dir"])
        config._attn_implementation = "sdpa"
        model = Qwen3ForCausalLM(config)
        extra = {
            "fsdp": True,
            "fsdp_config": {
                "fsdp_version": 2,
                "reshard_after_forward": True,
                "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
            },
            # the best DDP setting (the default True costs an extra autograd traversal each step)
            "ddp_find_unused_parameters": False,
        }
    args = TrainingArguments(
        output_dir=spec["out_dir"],
        per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=spec["grad_accum"],
        max_steps=spec["total_steps"],
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=CLIP,
        warmup_steps=0,
        seed=SEED,
        use_cpu=True,
        ddp_backend="gloo",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=spec["total_steps"],
        dataloader_num_workers=0,
        **extra,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[StepEnds()])
    trainer.train()
    wrapped = trainer.model_wrapped
    from torch.distributed.fsdp import FSDPModule

    if isinstance(wrapped, FSDPModule) or isinstance(trainer.model, FSDPModule):
        layout = "FSDP2 (transformers DistributedConfig)" if kind == "hf-fsdp2" else "FSDP2 (accelerate)"
    elif isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        layout = f"DDP ({trainer.accelerator.state.distributed_type.value}; no sharding)"
    else:
        layout = type(wrapped).__name__
    result["layout"] = layout
    result["optimizer"] = _optimizer_kind(getattr(trainer.optimizer, "optimizer", trainer.optimizer))


def _titan_model_config(spec: dict[str, Any]) -> Any:
    """torchtitan's Qwen3 at the benchmark's sizes, built with the helpers its own flavors use."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_SKIP_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_layers,
        _qwen3_norm,
    )

    m = spec["model"]
    dim, vocab, head_dim = m["hidden_size"], m["vocab_size"], m["head_dim"]
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_SKIP_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            fuse_qkv=True,
            n_layers=m["num_hidden_layers"],
            dim=dim,
            n_heads=m["num_attention_heads"],
            n_kv_heads=m["num_key_value_heads"],
            head_dim=head_dim,
            hidden_dim=m["intermediate_size"],
            attn_backend="flex",  # torchtitan refuses sdpa for language models
            rope=CosSinRoPE.Config(
                dim=head_dim, max_seq_len=m["max_position_embeddings"], theta=m["rope_theta"]
            ),
        ),
    )


def _run_titan(spec: dict[str, Any], result: dict[str, Any]) -> None:
    import dataclasses

    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.tools import utils as titan_utils
    from torchtitan.trainer import Trainer

    result["device_type"] = titan_utils.device_type  # what torchtitan picked for this machine
    spec_model = dataclasses.replace(model_registry("debugmodel"), flavor="bench")
    spec_model.model = _titan_model_config(spec)
    local = spec["micro"]
    config = Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=spec["model"]["vocab_size"]),
        hf_assets_path=spec["titan_tokenizer"],
        metrics=MetricsProcessor.Config(log_freq=1),
        model_spec=spec_model,
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=spec["titan_data"]),
        optimizer=default_adamw(lr=LR),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0),
        training=TrainingConfig(
            local_batch_size=local,
            global_batch_size=local * spec["grad_accum"] * WORLD,
            seq_len=spec["seq"],
            steps=spec["total_steps"],
            max_norm=CLIP,
            dtype="float32",
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        # plain FSDP2 over a data-parallel mesh (its default "spmd_types" backend passes fully_shard the
        # dp_mesh_dims of newer torch, which torch 2.13 rejects for plain-tensor parameters)
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        dump_folder=spec["out_dir"],
    )
    trainer = config.build()
    original = trainer.train_step

    def timed(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        result["step_ends"].append(time.perf_counter())
        return out

    trainer.train_step = timed
    try:
        trainer.train()
    finally:
        trainer.close()
    result["layout"] = "FSDP2 (torchtitan)"
    result["optimizer"] = _optimizer_kind(trainer.optimizers.optimizers[0])


def worker(kind: str, spec_path: str) -> int:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"rank": rank, "step_ends": [], "base_rss": _rss_now()}
    os.chdir(REPO)
    try:
        if kind.startswith("mm"):
            _run_mm(spec, result)
        elif kind == "torchtitan":
            _run_titan(spec, result)
        else:
            _run_hf(kind, spec, result)
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and not exc.code):
            result["error"] = _innermost(exc)
        raise
    finally:
        result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    return 0


# ---------------------------------------------------------------------------------------- driver side
def _make_model(root: Path, layers: int) -> tuple[Path, int]:
    """config.json plus random fp32 weights (hf-fsdp2 loads them); returns the folder and the parameters."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(num_hidden_layers=layers, **MODEL)
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config)
    d = root / "model"
    model.save_pretrained(d)
    return d, sum(p.numel() for p in model.parameters())


def _mm_overrides(a: argparse.Namespace, model_dir: Path, out: Path) -> list[str]:
    return [
        f"model.model_name_or_path={model_dir}",
        "model.from_scratch=true",
        f"data.dataset_param.basic_parameters.seq_len={a.seq}",
        f"training.micro_batch_size={a.micro}",
        f"training.gradient_accumulation_steps={a.grad_accum}",
        f"training.train_iters={a.warmup + a.steps}",
        f"training.lr={LR}",
        f"training.weight_decay={WEIGHT_DECAY}",
        f"training.clip_grad={CLIP}",
        f"training.seed={SEED}",
        "training.log_interval=1",
        "training.save=null",
        "training.progress_bar=false",
        "tools.tensorboard.enable=false",
        f"training.output_dir={out}",
    ]


def _make_blocks(a: argparse.Namespace, model_dir: Path, root: Path) -> Path:
    """The token blocks mm's pipeline makes from the quickstart text, saved for the Hugging Face peers."""
    import torch

    from mm_core.config import load_config
    from mm_core.data import build_dataset

    cfg = load_config(str(QUICKSTART), _mm_overrides(a, model_dir, root / "prep"))
    dataset = build_dataset(cfg.data, SEED)
    n = WORLD * a.micro * a.grad_accum * (a.warmup + a.steps)
    items = [dataset[i % len(dataset)] for i in range(n)]
    blocks = {k: torch.stack([torch.as_tensor(it[k]) for it in items]) for k in items[0]}
    path = root / "blocks.pt"
    torch.save(blocks, path)
    return path


def _titan_python(a: argparse.Namespace) -> tuple[str | None, str]:
    """The Python that has torchtitan, or None and why not."""
    candidates = [a.titan_python] if a.titan_python else [DEFAULT_TITAN_PYTHON, sys.executable]
    tried = []
    for py in candidates:
        if not py or not Path(py).exists():
            tried.append(f"{py}: not found")
            continue
        probe = subprocess.run(
            [py, "-c", "import torch, torchtitan.train; print(torch.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if probe.returncode == 0:
            return py, f"torch {probe.stdout.strip()}"
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        tried.append(f"{py}: {last}")
    return None, "torchtitan is not importable (" + "; ".join(tried) + "); set it up with: " + TITAN_HINT


def _run_peer(kind: str, python: str, spec: dict[str, Any], root: Path) -> dict[str, Any]:
    out = Path(spec["out_dir"])
    out.mkdir(parents=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += [str(Path(__file__).resolve()), "--worker", kind, "--spec", str(spec_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    # glibc returns freed memory at once, so RSS follows live tensors rather than each allocator's cache
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    t0 = time.perf_counter()
    with open(out / "log.txt", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(WORLD):
        p = out / f"rank{r}.json"
        ranks.append(json.loads(p.read_text(encoding="utf-8")) if p.exists() else {"rank": r})
    row: dict[str, Any] = {"kind": kind, "rc": proc.returncode, "wall_s": wall, "ranks": ranks}
    if proc.returncode != 0:
        errors = [r["error"] for r in ranks if r.get("error")]
        if not errors:  # the rank died before writing its result: the last error line of the log
            text = (out / "log.txt").read_text(encoding="utf-8", errors="replace")
            lines = [ln for ln in text.splitlines() if re.search(r"\w+(Error|Exception):", ln)]
            errors = lines[-1:] or [f"exit status {proc.returncode}; see {out / 'log.txt'}"]
        row["error"] = errors[0]
        return row
    warm = spec["warmup"]
    tokens = WORLD * spec["micro"] * spec["grad_accum"] * spec["seq"]
    per_rank = []
    for r in ranks:
        ends = r["step_ends"]
        if len(ends) != spec["total_steps"]:
            row["error"] = f"rank {r['rank']} recorded {len(ends)} step ends of {spec['total_steps']}"
            return row
        # from the end of the last warm-up step to the end of the last step
        per_rank.append((ends[-1] - ends[warm - 1]) / (len(ends) - warm))
    row["step_s"] = max(per_rank)
    row["tokens_per_s"] = tokens / row["step_s"]
    row["layout"] = ranks[0].get("layout", "?")
    row["optimizer"] = ranks[0].get("optimizer", "?")
    metrics = out / "mm" / "metrics.jsonl"
    if metrics.exists():  # mm's own figure, for comparison with the one measured here
        recs = [json.loads(ln) for ln in metrics.read_text(encoding="utf-8").splitlines() if ln.strip()]
        row["mm_tokens_per_s"] = statistics.mean(r["tokens_per_s"] for r in recs[warm:])
        row["mm_peak_mem_gb"] = max(r["peak_mem_gb"] for r in recs)
    return row


def _titan_note(row: dict[str, Any]) -> str:
    err = row.get("error", "")
    device = next((r.get("device_type") for r in row["ranks"] if r.get("device_type")), None)
    note = err
    if device == "cuda" and "cuda" in err.lower():
        note += (
            "; torchtitan picks its device in torchtitan/tools/utils.py get_device_info() as "
            '`_get_available_device_type() or "cuda"` (no CPU fallback, no option to choose one), and '
            "Trainer.__init__ calls device_module.set_device(...) on it; its process group backend is the "
            "device's (nccl), so this torchtitan does not train on CPU"
        )
    return note


def _fastest_mm_within(summary: dict[str, dict[str, Any]], peak: float) -> tuple[dict[str, Any] | None, str]:
    """The fastest mm run whose peak RSS is at most ``peak`` (times ``MEMORY_SLACK``), and its name."""
    fits = [k for k in MM_RUNS if k in summary and max(summary[k]["peak_rss"]) <= peak * MEMORY_SLACK]
    if not fits:
        return None, ""
    best = max(fits, key=lambda k: summary[k]["tokens_per_s"])
    return summary[best], best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps before them, excluded")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds over the peers")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=1, help="micro-batch size per rank")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--only", default=",".join(PEERS), help="comma-separated peers to run")
    parser.add_argument("--titan-python", default=None, help="a Python with torchtitan (default: try "
                        f"{DEFAULT_TITAN_PYTHON}, then this one)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write every run's results here")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, per-rank results)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        sys.exit(worker(a.worker, a.spec))
    if a.steps < 1 or a.warmup < 1:
        parser.error(
            "--steps and --warmup must be at least 1 (steps are timed from the end of the last warm-up)"
        )
    wanted = [p.strip() for p in a.only.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PEERS))
    if unknown:
        parser.error(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")

    root = Path(tempfile.mkdtemp(prefix="mm-peers-"))
    skipped: dict[str, str] = {}
    pythons = {p: sys.executable for p in wanted if p != "torchtitan"}
    if "torchtitan" in wanted:
        py, why = _titan_python(a)
        if py is None:
            skipped["torchtitan"] = why
        else:
            pythons["torchtitan"] = py
            titan_data = root / "titan_data"
            titan_data.mkdir()
            shutil.copy(TEXT, titan_data / TEXT.name)
            # the same tokenizer without its chat template: torchtitan compiles that with plain jinja, which
            # does not know the {% generation %} tag of Hugging Face templates (unused for pretraining)
            titan_tok = root / "titan_tokenizer"
            titan_tok.mkdir()
            shutil.copy(TOKENIZER / "tokenizer.json", titan_tok / "tokenizer.json")
            tok_cfg = json.loads((TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
            tok_cfg.pop("chat_template", None)
            (titan_tok / "tokenizer_config.json").write_text(json.dumps(tok_cfg), encoding="utf-8")
    model_dir, n_params = _make_model(root, a.layers)
    blocks = _make_blocks(a, model_dir, root)
    tokens = WORLD * a.micro * a.grad_accum * a.seq
    print(
        f"model: Qwen3 {n_params / 1e6:.1f}M parameters (hidden {MODEL['hidden_size']}, {a.layers} layers, "
        f"vocab {MODEL['vocab_size']}), fp32, AdamW; {WORLD} gloo ranks x 1 thread; {a.micro} x {a.seq} "
        f"tokens per micro-batch x {a.grad_accum} accumulation x {WORLD} ranks = {tokens} tokens per step; "
        f"{a.warmup} warm-up + {a.steps} timed steps per run, {a.rounds} alternating rounds",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in pythons}
    for rnd in range(a.rounds):
        for kind in [p for p in PEERS if p in pythons and p not in skipped]:
            spec = {
                "model_dir": str(model_dir),
                "model": {"num_hidden_layers": a.layers, **MODEL},
                "blocks": str(blocks),
                "titan_data": str(root / "titan_data"),
                "titan_tokenizer": str(root / "titan_tokenizer"),
                "seq": a.seq,
                "micro": a.micro,
                "grad_accum": a.grad_accum,
                "warmup": a.warmup,
                "total_steps": a.warmup + a.steps,
                "out_dir": str(root / f"{kind}-{rnd}"),
            }
            spec["mm_overrides"] = _mm_overrides(a, model_dir, Path(spec["out_dir"]) / "mm")
            spec["mm_overrides"] += MM_RUNS.get(kind, [])
            row = _run_peer(kind, pythons[kind], spec, root)
            runs[kind].append(row)
            if "error" in row:
                why = _titan_note(row) if kind == "torchtitan" else row["error"]
                skipped[kind] = f"failed: {why}"
                print(f"round {rnd + 1}: {kind} failed ({row['wall_s']:.0f} s): {why}", flush=True)
                continue
            rss = ", ".join(f"{r['peak_rss'] / GiB:.2f}" for r in row["ranks"])
            print(
                f"round {rnd + 1}: {kind}: {row['tokens_per_s']:,.0f} tokens/s ({row['step_s']:.2f} s/step), "
                f"peak RSS per rank {rss} GiB, {row['layout']}, {row['wall_s']:.0f} s",
                flush=True,
            )

    done = {k: [r for r in v if "error" not in r] for k, v in runs.items()}
    done = {k: v for k, v in done.items() if v and k not in skipped}
    summary: dict[str, dict[str, Any]] = {}
    for kind, rows in done.items():
        summary[kind] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "rounds": [r["tokens_per_s"] for r in rows],
            "peak_rss": [max(r["ranks"][i]["peak_rss"] for r in rows) for i in range(WORLD)],
            "base_rss": [max(r["ranks"][i]["base_rss"] for r in rows) for i in range(WORLD)],
            "layout": rows[0]["layout"],
            "optimizer": rows[0]["optimizer"],
        }
        if "mm_tokens_per_s" in rows[0]:
            summary[kind]["mm_tokens_per_s"] = statistics.median(r["mm_tokens_per_s"] for r in rows)
            summary[kind]["mm_peak_mem_gb"] = max(r["mm_peak_mem_gb"] for r in rows)
    print("\n| framework | layout as run | optimizer | tokens/s (median) | per round | fastest mm at <= its "
          "memory: tokens/s ratio | peak RSS GiB rank 0, 1 | that mm / peer peak RSS |")  # fmt: skip
    print("|---|---|---|---:|---|---|---|---:|")
    for kind, s in summary.items():
        mm, name = _fastest_mm_within(summary, max(s["peak_rss"])) if kind not in MM_RUNS else (None, "")
        ratio = f"{name}: {mm['tokens_per_s'] / s['tokens_per_s']:.2f}x" if mm else "-"
        mem = f"{max(mm['peak_rss']) / max(s['peak_rss']):.2f}" if mm else "-"
        rss = ", ".join(f"{x / GiB:.2f}" for x in s["peak_rss"])
        rounds = ", ".join(f"{x:,.0f}" for x in s["rounds"])
        print(
            f"| {kind} | {s['layout']} | {s['optimizer']} | {s['tokens_per_s']:,.0f} | {rounds} | {ratio} | "
            f"{rss} | {mem} |"
        )
    base = {k: ", ".join(f"{x / GiB:.2f}" for x in s["base_rss"]) for k, s in summary.items()}
    print(
        "RSS right after `import torch` (GiB, rank 0, 1): " + "; ".join(f"{k} {v}" for k, v in base.items())
    )
    mm = summary.get("mm")
    if mm and "mm_tokens_per_s" in mm:
        print(
            f"mm's own metrics.jsonl: {mm['mm_tokens_per_s']:,.0f} tokens/s (mean over the timed steps of "
            f"its tokens / step_time_s: data and train_step only), "
            f"peak_mem_gb {mm['mm_peak_mem_gb']:.2f} (max over ranks)"
        )
    for kind, why in skipped.items():
        print(f"{kind}: not measured: {why}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"summary": summary, "skipped": skipped, "runs": runs}, indent=1), encoding="utf-8"
        )
    if a.keep:
        print(f"work folder: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
