"""Exact-match digit accuracy of a digits model on the held-out digits (``build/data/test.json``).

Any family of ``build_data.py --family``: the model class is mm's for the ``model_type`` of
``<build>/model/config.json`` (the ``mm.models`` entry point of that id), the images go through mm-data-vlm's
image format of ``<build>/processor``.

For each test image the model sees the user turn and ``<|im_start|>assistant\\n`` and greedily generates
until ``<|im_end|>`` (at most 4 tokens); the answer is right when the generated text equals the digit.

    python examples/qwen3vl_digits/evaluate.py --model outputs/qwen3vl_digits/hf     # after training
    python examples/qwen3vl_digits/evaluate.py --untrained                           # the initial weights
    python examples/qwen3vl_digits/evaluate.py --build examples/qwen3_5_moe_digits/build \
        --model outputs/qwen3_5_moe_digits/hf                                         # another family
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


@torch.no_grad()
def accuracy(model: torch.nn.Module, build_dir: Path, limit: int | None = None) -> tuple[float, int]:
    """(exact-match accuracy, number of test images)."""
    from mm_data_vlm.encode import VisionProcessor
    from mm_data_vlm.images import load_image
    from mm_data_vlm.records import conversation, image_paths

    proc = VisionProcessor.load(str(build_dir / "processor"), None, None, "evaluate")  # its own sizes
    tok = proc.tokenizer
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    # never generated: an image token in the answer would need image features the prompt does not have
    banned = [int(i) for i in tok.convert_tokens_to_ids(list(proc.format.special_tokens))]
    records = json.loads((build_dir / "data" / "test.json").read_text(encoding="utf-8"))[:limit]
    model.eval()
    right = 0
    for i, rec in enumerate(records):
        turns = conversation(rec, f"test.json[{i}]")
        answer = turns[-1]["content"]
        paths = image_paths(rec, "", str(build_dir / "data"))
        loaded = [load_image(p, target_pixels=proc.target_pixels) for p in paths]
        pixels = proc.images(loaded)
        prompt_ids, _ = proc.encode_sizes(
            turns[:-1] + [{"role": "assistant", "content": ""}], [im.size for im in loaded]
        )
        # drop the empty reply's "<|im_end|>\n": the prompt ends with "<|im_start|>assistant\n"
        ids = prompt_ids[: len(prompt_ids) - 2]
        out: list[int] = []
        for _ in range(4):
            x = torch.tensor([ids + out])
            extra = {}
            if proc.format.token_type_ids:
                extra["mm_token_type_ids"] = (x == proc.image_token_id).long()
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), **extra, **pixels).logits
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
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N test images")
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
    print(json.dumps({"model": name, "test_images": n, "exact_match_accuracy": round(acc, 4)}))


if __name__ == "__main__":
    main()
