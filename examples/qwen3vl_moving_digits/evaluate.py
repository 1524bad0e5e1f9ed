"""Direction accuracy of the moving-digits model on the held-out clips (``build/data/test.json``).

For each test clip the model sees the user turn (the video and "Which way does the 3 move?") and
``<|im_start|>assistant\\n`` and greedily generates until ``<|im_end|>`` (at most 4 tokens); the answer is
right when the generated text equals the direction. The clips go through mm-data-vlm's video path (PyAV, the
Qwen3-VL video processor's frame sampling and sizes from ``<build>/processor``), as in training.

    python examples/qwen3vl_moving_digits/evaluate.py --untrained                     # the initial weights
    python examples/qwen3vl_moving_digits/evaluate.py --model outputs/qwen3vl_moving_digits/hf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


@torch.no_grad()
def accuracy(model: torch.nn.Module, build_dir: Path, limit: int | None = None) -> tuple[float, int]:
    """(exact-match accuracy, number of test clips)."""
    from mm_data_vlm.encode import VideoOptions, VisionProcessor
    from mm_data_vlm.records import conversation, read_media
    from mm_data_vlm.videos import load_frames, probe_video

    proc = VisionProcessor.load(str(build_dir / "processor"), None, None, "evaluate", VideoOptions())
    assert proc.videos is not None, proc.no_videos
    tok = proc.tokenizer
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    # never generated: a vision token in the answer would need features the prompt does not have
    banned = [int(i) for i in tok.convert_tokens_to_ids([*proc.format.special_tokens, "<|video_pad|>"])]
    records = json.loads((build_dir / "data" / "test.json").read_text(encoding="utf-8"))[:limit]
    model.eval()
    right = 0
    for i, rec in enumerate(records):
        turns = conversation(rec, f"test.json[{i}]")
        answer = turns[-1]["content"]
        _, _, videos = read_media(rec, str(build_dir / "data"))
        headers = [probe_video(p) for p in videos]
        plans = proc.video_plans(headers)
        clips = [(load_frames(p, h, plan.indices), plan) for p, h, plan in zip(videos, headers, plans)]
        pixels = proc.videos.pixels(clips)
        prompt_ids, _ = proc.encode_sizes(turns[:-1] + [{"role": "assistant", "content": ""}], [], plans)
        # drop the empty reply's "<|im_end|>\n": the prompt ends with "<|im_start|>assistant\n"
        ids = prompt_ids[: len(prompt_ids) - 2]
        out: list[int] = []
        for _ in range(4):
            x = torch.tensor([ids + out])
            types = 2 * (x == proc.video_token_id).long()
            logits = model(
                input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=types, **pixels
            ).logits
            last = logits[0, -1].clone()
            last[banned] = float("-inf")
            nxt = int(last.argmax())
            if nxt == end_id:
                break
            out.append(nxt)
        right += int(tok.decode(out).strip() == answer)
    return right / max(len(records), 1), len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (mm convert dcp-to-hf output)")
    parser.add_argument("--untrained", action="store_true", help="the from-scratch initial weights")
    parser.add_argument("--seed", type=int, default=42, help="with --untrained: training.seed of the run")
    parser.add_argument("--build", type=Path, default=HERE / "build")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N test clips")
    args = parser.parse_args()
    from transformers import AutoConfig

    from mm_core.config.schema import ModelConfig
    from mm_core.models import ModelHub

    config = AutoConfig.from_pretrained(args.build / "model")
    cls = ModelHub.model_class(ModelConfig(model_id=config.model_type))
    if args.untrained:
        torch.manual_seed(args.seed)
        model = cls._from_config(config, dtype=torch.float32)
        name = "untrained"
    elif args.model:
        model = cls.from_pretrained(args.model, dtype=torch.float32)
        name = str(args.model)
    else:
        parser.error("give --model DIR or --untrained")
    acc, n = accuracy(model, args.build, args.limit)
    print(json.dumps({"model": name, "test_clips": n, "direction_accuracy": round(acc, 4)}))


if __name__ == "__main__":
    main()
