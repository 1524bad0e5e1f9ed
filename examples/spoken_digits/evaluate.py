"""Character error rate of a spoken-digits Qwen3-ASR model on the held-out voices (``build/data/test.jsonl``),
or, with ``--omni``, answer accuracy of the omni variant's thinker (``build_omni/data/test.jsonl``).

The model class is mm's for ``<build>/model/config.json``'s ``model_type``, so ``--build`` may be another
ASR family's assets: ``examples/fun_asr_nano_digits/build`` (``build_data.py --family fun_asr_nano``, whose
answer is the bare transcript), with ``--manifest`` naming the clips.

ASR: for each clip the model sees the user turn (the audio) and ``<|im_start|>assistant\\n`` and greedily
generates until ``<|im_end|>`` (at most :data:`MAX_NEW_TOKENS` tokens, with a KV cache); the hypothesis is the
text after the last ``<asr_text>`` (Qwen3-ASR answers ``language English<asr_text>371``), or all the generated
text when there is none. CER = (sum over clips of the Levenshtein distance between hypothesis and transcript,
in characters) / (sum of the transcripts' lengths): the fraction of digits substituted, dropped or inserted;
it can exceed 1 when a model inserts many characters. Also reported: exact-match rate (whole digit string
right) and the CER of each voice.

Omni: each test record (a spoken digit, a written digit, one question) is answered greedily (at most 4
tokens); an answer is right when it equals the reference; accuracy overall and per question kind.

    python examples/spoken_digits/evaluate.py --untrained                          # the initial weights
    python examples/spoken_digits/evaluate.py --model outputs/spoken_digits/hf     # after training + export
    python examples/spoken_digits/evaluate.py --build DIR --manifest M.jsonl ...   # other assets / clips
    python examples/spoken_digits/evaluate.py --omni --model outputs/spoken_digits_omni/hf

The results also go to ``--json`` (default ``outputs/spoken_digits[_omni]/eval_<untrained|trained>.json``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ASR_TEXT = "<asr_text>"
MAX_NEW_TOKENS = 16
OMNI_NEW_TOKENS = 4


def levenshtein(a: Sequence[str], b: Sequence[str]) -> int:
    """Edit distance (substitutions, deletions, insertions, each 1) between two sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def hypothesis(text: str) -> str:
    """The transcript part of a generated answer (see the module docstring)."""
    return text.rsplit(ASR_TEXT, 1)[-1].strip()


@torch.no_grad()
def greedy(
    model: torch.nn.Module,
    proc: Any,
    messages: Sequence[Mapping[str, str]],
    media: Mapping[str, torch.Tensor],
    audio_samples: Sequence[int],
    image_sizes: Sequence[tuple[int, int]],
    max_new_tokens: int,
    use_cache: bool,
) -> str:
    """Greedy decoding of the reply to ``messages`` (special tokens kept in the text, so ``<asr_text>`` can
    be found). ``media``: the forward's audio / image inputs. Without ``use_cache`` every step reruns the
    whole sequence with no attention mask (the thinker then computes its 3-D positions itself)."""
    tok = proc.tokenizer
    end_id = int(tok.convert_tokens_to_ids("<|im_end|>"))
    specials = [*proc.format.special_tokens, *(proc.images.special_tokens if proc.images else ())]
    banned = [int(i) for i in tok.convert_tokens_to_ids(specials)]
    ids, _ = proc.encode([*messages, {"role": "assistant", "content": ""}], audio_samples, image_sizes)
    prompt = ids[: len(ids) - 2]  # drop the empty reply's "<|im_end|>\n": it ends "<|im_start|>assistant\n"
    out: list[int] = []
    cache = None
    for _ in range(max_new_tokens):
        if use_cache:
            step = {"input_ids": torch.tensor([out[-1:] if cache is not None else prompt])}
            if cache is None:
                step.update(media)
            n = len(prompt) + len(out)
            result = model(
                **step, attention_mask=torch.ones(1, n, dtype=torch.long), cache=cache, use_cache=True
            )
            cache = result.cache
        else:
            result = model(input_ids=torch.tensor([prompt + out]), **media)
        last = result.logits[0, -1].clone()
        last[banned] = float("-inf")  # media tokens in the answer would need features the prompt has not got
        nxt = int(last.argmax())
        if nxt == end_id:
            break
        out.append(nxt)
    return str(tok.decode(out, skip_special_tokens=False))


def asr_scores(
    model: torch.nn.Module, processor_dir: Path, manifest: Path, limit: int | None = None
) -> dict[str, Any]:
    """CER, exact-match rate and per-voice CER of ``model`` on the clips of ``manifest`` (paths relative to
    its folder), through the processor folder ``processor_dir``."""
    from mm_data_audio.audio import load_audio
    from mm_data_audio.encode import AudioProcessor
    from mm_data_audio.records import manifest_record

    proc = AudioProcessor.load(str(processor_dir), "evaluate")
    lines = [json.loads(t) for t in manifest.read_text(encoding="utf-8").splitlines() if t.strip()][:limit]
    model.eval()
    edits = chars = exact = 0
    voices: dict[str, list[int]] = {}
    examples: list[dict[str, str]] = []
    start = time.perf_counter()
    for line in lines:
        record = manifest_record(line, str(manifest.parent), "", "")  # only its user turn is used
        wave = load_audio(record.audios[0], proc.format.sampling_rate)
        media = proc.format.features([wave])
        answer = greedy(model, proc, record.messages[:-1], media, [len(wave)], [], MAX_NEW_TOKENS, True)
        hyp, ref = hypothesis(answer), line["text"]
        d = levenshtein(hyp, ref)
        edits, chars, exact = edits + d, chars + len(ref), exact + int(hyp == ref)
        per = voices.setdefault(str(line.get("voice", "?")), [0, 0])
        per[0], per[1] = per[0] + d, per[1] + len(ref)
        if len(examples) < 5:
            examples.append({"text": ref, "hypothesis": hyp, "answer": answer})
    return {
        "clips": len(lines),
        "characters": chars,
        "cer": round(edits / max(chars, 1), 4),
        "exact_match": round(exact / max(len(lines), 1), 4),
        "cer_by_voice": {v: round(e / max(n, 1), 4) for v, (e, n) in sorted(voices.items())},
        "examples": examples,
        "seconds": round(time.perf_counter() - start, 1),
    }


def omni_scores(
    model: torch.nn.Module, processor_dir: Path, dataset: Path, limit: int | None = None
) -> dict[str, Any]:
    """Answer accuracy of ``model`` on the ``audio_sft`` records of ``dataset`` (paths relative to its
    folder), overall and per ``question`` kind."""
    from mm_data_audio.audio import load_audio
    from mm_data_audio.encode import AudioProcessor
    from mm_data_audio.images import load_image
    from mm_data_audio.records import sft_record

    proc = AudioProcessor.load(str(processor_dir), "evaluate")
    if proc.images is None:
        raise SystemExit(
            f"{processor_dir}: no image processor; --omni needs build_data.py --omni's processor"
        )
    rows = [json.loads(t) for t in dataset.read_text(encoding="utf-8").splitlines() if t.strip()][:limit]
    model.eval()
    kinds: dict[str, list[int]] = {}
    examples: list[dict[str, Any]] = []
    start = time.perf_counter()
    for row in rows:
        record = sft_record(row, str(dataset.parent))
        waves = [load_audio(p, proc.format.sampling_rate) for p in record.audios]
        images = [load_image(p) for p in record.images]
        media = {**proc.format.features(waves), **proc.images.pixels(images)}
        messages = record.messages[:-1]
        answer = greedy(
            model,
            proc,
            messages,
            media,
            [len(w) for w in waves],
            [im.size for im in images],
            OMNI_NEW_TOKENS,
            False,
        ).strip()
        right = int(answer == record.messages[-1]["content"])
        per = kinds.setdefault(str(row.get("question", "?")), [0, 0])
        per[0], per[1] = per[0] + right, per[1] + 1
        if len(examples) < 8:
            examples.append(
                {"question": messages[-1]["content"], "answer": answer, "reference": row["messages"][-1]}
            )
    right, total = sum(r for r, _ in kinds.values()), sum(n for _, n in kinds.values())
    return {
        "records": total,
        "accuracy": round(right / max(total, 1), 4),
        "accuracy_by_question": {k: round(r / max(n, 1), 4) for k, (r, n) in sorted(kinds.items())},
        "examples": examples,
        "seconds": round(time.perf_counter() - start, 1),
    }


def load_model(build: Path, hf_dir: Path | None, seed: int) -> torch.nn.Module:
    """mm's class for ``<build>/model/config.json``'s ``model_type``: exported weights from ``hf_dir``, or
    (``hf_dir`` None) a random initialisation as a run with ``training.seed`` = ``seed`` draws it."""
    from transformers import AutoConfig

    from mm_core.config.schema import ModelConfig
    from mm_core.models import ModelHub

    config = AutoConfig.from_pretrained(build / "model")
    model_id = {"qwen3_omni_moe_thinker": "qwen3_omni_moe"}.get(config.model_type, config.model_type)
    cls: Any = ModelHub.model_class(ModelConfig(model_id=model_id))
    if hf_dir is None:
        torch.manual_seed(seed)
        return cls._from_config(config, dtype=torch.float32)
    return cls.from_pretrained(hf_dir, dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (mm convert dcp-to-hf output)")
    parser.add_argument("--untrained", action="store_true", help="the from-scratch initial weights")
    parser.add_argument("--seed", type=int, default=42, help="with --untrained: training.seed of the run")
    parser.add_argument("--omni", action="store_true", help="the omni variant (build_data.py --omni)")
    parser.add_argument("--build", type=Path, help="build_data.py's --out (default: build/ or build_omni/)")
    parser.add_argument("--manifest", type=Path, help="records to score (default: <build>/data/test.jsonl)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N records")
    parser.add_argument("--json", type=Path, help="where to write the results (default: see above)")
    args = parser.parse_args()
    if args.untrained == (args.model is not None):
        parser.error("give exactly one of --model DIR and --untrained")
    build = args.build or HERE / ("build_omni" if args.omni else "build")
    model = load_model(build, args.model, args.seed)
    name = "untrained" if args.untrained else "trained"
    if args.omni:
        manifest = args.manifest or build / "data" / "test.jsonl"
        scores = omni_scores(model, build / "processor", manifest, args.limit)
        keys = ("records", "accuracy", "accuracy_by_question")
    else:
        manifest = args.manifest or build / "data" / "test.jsonl"
        scores = asr_scores(model, build / "processor", manifest, args.limit)
        keys = ("clips", "cer", "exact_match")
    results = {
        "model": "untrained" if args.untrained else str(args.model),
        "manifest": str(manifest),
        **scores,
    }
    out = (
        args.json
        or REPO / "outputs" / ("spoken_digits_omni" if args.omni else "spoken_digits") / f"eval_{name}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    summary = {k: results[k] for k in ("model", *keys, "seconds")}
    print(json.dumps({**summary, "json": str(out)}))


if __name__ == "__main__":
    main()
