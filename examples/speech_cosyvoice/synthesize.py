"""Speak a held-out sentence with the three trained CosyVoice3 stages, and measure each stage before and after
training.

**Synthesis** (one held-out utterance, ``--utterance``, default the first of ``build/heldout``):

1. the LM (``cosyvoice3_lm``) continues ``[sos, instruct, text, task_id]`` with speech tokens until it
   predicts a special id (:meth:`CosyVoice3LMForTraining.generate`; ``--top-k 1``, the default, is greedy
   decoding, with upstream's repetition-aware resampling switched off; ``--top-k N`` samples from the N most
   likely tokens with it on);
2. the flow model (``cosyvoice3_flow``) integrates noise to a log-mel on those tokens
   (:meth:`CosyVoice3FlowForTraining.sample`: ``--flow-steps`` Euler steps on the cosine schedule,
   classifier-free guidance ``--cfg``; no speaker embedding: zeros, as in training);
3. the HiFT vocoder (``cosyvoice3_hift``) turns the mel into a 24 kHz wave.

Written to ``--out`` (default ``outputs/speech_cosyvoice``): ``heldout.wav`` (text -> LM -> flow ->
vocoder), ``heldout_gt_tokens.wav`` (the utterance's own k-means tokens -> flow -> vocoder: the acoustic
stages alone, without the LM's errors), ``heldout_vocoder.wav`` (its true mel -> vocoder: the vocoder
alone) and ``heldout_reference.wav`` (the utterance as stored); ``results.json`` gives for each the mean L1
distance of its log-mel to the true one, when it has as many frames (always, except maybe ``heldout.wav``,
whose length the LM decides).

**Measurements** (``results.json``, also printed as one JSON line), each on the held-out utterances
(``--num-utterances``, default all), for a random initialisation of the stage's config (seeded, the
"before") and the trained export (the "after"):

- per stage, the training loss of the first and the last step of its ``metrics.jsonl`` (the vocoder's also
  its mel L1 term);
- LM: the teacher-forced cross entropy and next-token accuracy of the held-out utterances' tokens; for the
  synthesised sentence, the generated and the true token counts and the share of positions where they
  agree;
- flow: the mean L1 distance between the sampled log-mel (from the utterance's own tokens) and the true one,
  next to the k-means tokenizer's quantisation floor (its centroids' mel, ``build_info.json``);
- vocoder: the mean L1 distance between ``log_mel(vocoder(mel))`` and ``mel`` (mel reconstruction);
- flow and vocoder together: the same distance for ``log_mel(vocoder(flow(tokens)))``, the utterance's own
  tokens to a wave.

    python examples/speech_cosyvoice/synthesize.py          # after train.sh (which exports every stage)

The trained stages are read from ``--runs`` (default ``outputs/speech_cosyvoice``): ``<stage>/hf`` (``mm
convert dcp-to-hf``) and ``<stage>/metrics.jsonl``; model sizes for the random "before" models and the
vocoder's structure come from the stage YAMLs (``--configs``, default this folder).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from mm_core.config.schema import ModelConfig
from mm_data_audio.cosyvoice.audio import SAMPLE_RATE, log_mel, write_wav
from mm_data_audio.cosyvoice.data import load_text_tokenizer
from mm_data_audio.cosyvoice.sequence import lm_sequence
from mm_data_audio.cosyvoice.store import (
    SPEAKER_DIM,
    SpeechRecord,
    load_mel,
    load_tokens,
    load_wave,
    read_index,
    read_meta,
)
from mm_models_cosyvoice.flow import CosyVoice3FlowForTraining
from mm_models_cosyvoice.hift import HiFTGenerator
from mm_models_cosyvoice.lm import CosyVoice3LMForTraining

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STAGES = ("lm", "flow", "vocoder")
MODEL_IDS = {"lm": "cosyvoice3_lm", "flow": "cosyvoice3_flow", "vocoder": "cosyvoice3_hift"}


# ------------------------------------------------------------------------------------------------ models
def stage_config(configs: Path, stage: str) -> dict[str, Any]:
    """The stage YAML as a mapping."""
    loaded: dict[str, Any] = yaml.safe_load((configs / f"{stage}.yaml").read_text(encoding="utf-8"))
    return loaded


def model_args(cfg: dict[str, Any], stage: str, build: Path, folder: Path | None) -> ModelConfig:
    """The stage's model arguments: the exported ``folder`` (trained), or the build's config folder with the
    YAML's ``config_overrides`` (random initialisation)."""
    overrides = dict(cfg["model"].get("config_overrides") or {})
    if folder is not None:
        # the export's config.json is complete (LM, flow); the vocoder's structure is only in the YAML
        return ModelConfig(
            model_id=MODEL_IDS[stage],
            model_name_or_path=str(folder),
            config_overrides=overrides if stage == "vocoder" else {},
        )
    path = None if stage == "vocoder" else str(build / "models" / stage)
    return ModelConfig(
        model_id=MODEL_IDS[stage], model_name_or_path=path, from_scratch=True, config_overrides=overrides
    )


def load_model(cfg: dict[str, Any], stage: str, build: Path, folder: Path | None, seed: int) -> Any:
    """The trained export (``folder``) or, with ``folder`` None, a seeded random initialisation as ``mm
    train`` makes one (``init_weights`` after building)."""
    cls: Any = {"lm": CosyVoice3LMForTraining, "flow": CosyVoice3FlowForTraining, "vocoder": HiFTGenerator}[
        stage
    ]
    args = model_args(cfg, stage, build, folder)
    if folder is None:
        torch.manual_seed(seed)
        model = cls._from_config(args)
        model.init_weights()
    else:
        model = cls.from_pretrained(args)
    return model.eval()


# ------------------------------------------------------------------------------------------------ stages
def encode(tokenizer: Any, text: str) -> list[int]:
    """Text ids as the ``cosyvoice_speech`` dataset makes them (no special tokens added)."""
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)] if text else []


@torch.no_grad()
def lm_heldout(
    lm: Any, instruct: list[int], texts: list[list[int]], tokens: list[torch.Tensor]
) -> dict[str, float]:
    """Teacher-forced cross entropy and next-token accuracy over the held-out utterances (token-weighted)."""
    total_loss, total_hits, count = 0.0, 0.0, 0
    for text, speech in zip(texts, tokens):
        seq = lm_sequence(instruct, text, speech, lm.speech_vocab)
        out = lm(seq.input_ids[None], seq.speech_mask[None], labels=seq.labels[None])
        n = len(speech) + 1  # the speech tokens and eos
        total_loss += float(out.loss) * n
        total_hits += float(out.acc) * n
        count += n
    return {"cross_entropy": round(total_loss / count, 4), "accuracy": round(total_hits / count, 4)}


def generate_tokens(lm: Any, instruct: list[int], text: list[int], top_k: int, seed: int) -> list[int]:
    """Speech tokens for ``text``: greedy (``top_k`` 1, no repetition-aware resampling) or top-k sampling."""
    if top_k == 1:
        # top_p 1 with one candidate is the argmax; tau_r above 1 never triggers a resampling
        return list(lm.generate(instruct, text, top_k=1, top_p=1.0, tau_r=2.0, seed=seed))
    return list(lm.generate(instruct, text, top_k=top_k, top_p=1.0, seed=seed))


@torch.no_grad()
def flow_mel(flow: Any, tokens: torch.Tensor, steps: int, cfg_rate: float, seed: int) -> torch.Tensor:
    """``[S]`` tokens -> ``[2S, 80]`` sampled log-mel (no speaker embedding: zeros, as in training)."""
    mel: torch.Tensor = flow.sample(
        tokens[None], torch.zeros(1, SPEAKER_DIM), n_timesteps=steps, cfg_rate=cfg_rate, seed=seed
    )[0]
    return mel


@torch.no_grad()
def vocode(hift: Any, mel: torch.Tensor, seed: int) -> torch.Tensor:
    """``[T, 80]`` log-mel -> ``[480 T]`` wave."""
    wave: torch.Tensor = hift(speech_feat=mel[None], noise_seed=[seed]).waveform[0]
    return wave


def l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean())


def acoustic_distances(
    models: dict[str, Any],
    tokens: list[torch.Tensor],
    mels: list[torch.Tensor],
    steps: int,
    cfg_rate: float,
    seed: int,
) -> dict[str, float]:
    """Mean L1 distances to the true log-mel over the held-out utterances: of the flow's mel sampled from
    the utterance's tokens, of the vocoder's wave from the true mel (through :func:`log_mel`), and of the
    vocoder's wave from the flow's mel."""
    flow, vocoder = models["flow"], models["vocoder"]
    flow_d, vocoder_d, chain_d = [], [], []
    for i, (t, mel) in enumerate(zip(tokens, mels)):
        sampled = flow_mel(flow, t, steps, cfg_rate, seed + i)
        flow_d.append(l1(sampled, mel))
        vocoder_d.append(l1(log_mel(vocode(vocoder, mel, seed + i)), mel))
        chain_d.append(l1(log_mel(vocode(vocoder, sampled, seed + i)), mel))
    return {
        "flow_mel_l1_heldout": round(float(np.mean(flow_d)), 4),
        "vocoder_mel_l1_heldout": round(float(np.mean(vocoder_d)), 4),
        "tokens_to_wave_mel_l1_heldout": round(float(np.mean(chain_d)), 4),
    }


def first_last(metrics: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """``{key: {"first": .., "last": ..}}`` of the first and last records of a ``metrics.jsonl``, and their
    steps."""
    records = [json.loads(t) for t in metrics.read_text(encoding="utf-8").splitlines() if t.strip()]
    if not records:
        raise SystemExit(f"synthesize.py: {metrics} is empty")
    out: dict[str, Any] = {"first_step": records[0]["step"], "last_step": records[-1]["step"]}
    for key in keys:
        out[key] = {"first": round(float(records[0][key]), 4), "last": round(float(records[-1][key]), 4)}
    return out


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--build", type=Path, default=HERE / "build")
    parser.add_argument("--runs", type=Path, default=REPO / "outputs" / "speech_cosyvoice")
    parser.add_argument(
        "--configs", type=Path, default=HERE, help="folder of lm.yaml, flow.yaml, vocoder.yaml"
    )
    parser.add_argument("--out", type=Path, help="default: --runs")
    parser.add_argument("--utterance", help="id of the held-out utterance to speak (default: the first)")
    parser.add_argument("--num-utterances", type=int, help="held-out utterances measured (default: all)")
    parser.add_argument("--flow-steps", type=int, default=10, help="Euler steps of the flow (upstream 10)")
    parser.add_argument("--cfg", type=float, default=0.7, help="classifier-free guidance (upstream 0.7)")
    parser.add_argument("--top-k", type=int, default=1, help="LM decoding: 1 greedy, N top-k sampling")
    parser.add_argument("--seed", type=int, default=42, help="random inits and the sampling noise")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()
    out = args.out or args.runs
    out.mkdir(parents=True, exist_ok=True)
    cfgs = {s: stage_config(args.configs, s) for s in STAGES}

    heldout = args.build / "heldout"
    vocab = read_meta(heldout).speech_vocab
    records: list[SpeechRecord] = read_index(heldout)
    if args.utterance is not None:
        chosen = [r for r in records if r.id == args.utterance]
        if not chosen:
            raise SystemExit(f"synthesize.py: no held-out utterance {args.utterance!r} in {heldout}")
        records = chosen + [r for r in records if r.id != args.utterance]
    records = records[: args.num_utterances or len(records)]
    tokens = [load_tokens(r, vocab) for r in records]
    mels = [load_mel(r, len(t)) for r, t in zip(records, tokens)]
    tokenizer = load_text_tokenizer(str(args.build / "tokenizer"))
    pre = cfgs["lm"]["data"]["dataset_param"].get("preprocess_parameters") or {}
    instruct_text = pre.get("instruct", "You are a helpful assistant.<|endofprompt|>") or ""
    instruct = encode(tokenizer, instruct_text)
    texts = [encode(tokenizer, r.text) for r in records]

    trained = {s: args.runs / s / "hf" for s in STAGES}
    for stage, folder in trained.items():
        if not folder.is_dir():
            raise SystemExit(
                f"synthesize.py: {folder} does not exist; train and export the {stage} stage first "
                f"(bash examples/speech_cosyvoice/train.sh)"
            )
    results: dict[str, Any] = {
        "utterance": {"id": records[0].id, "text": records[0].text, "speech_tokens": len(tokens[0])},
        "heldout_utterances": len(records),
        "flow_steps": args.flow_steps,
        "cfg": args.cfg,
        "top_k": args.top_k,
    }
    info_path = args.build / "build_info.json"
    if info_path.is_file():
        results["quantisation_mel_l1_heldout"] = json.loads(info_path.read_text(encoding="utf-8")).get(
            "quantisation_mel_l1_heldout"
        )

    # per stage: training loss first -> last step
    results["training"] = {
        "lm": first_last(args.runs / "lm" / "metrics.jsonl", ("loss",)),
        "flow": first_last(args.runs / "flow" / "metrics.jsonl", ("loss",)),
        "vocoder": first_last(args.runs / "vocoder" / "metrics.jsonl", ("loss", "loss_mel")),
    }

    models: dict[str, dict[str, Any]] = {}
    for when, get in (("untrained", lambda s: None), ("trained", lambda s: trained[s])):
        models[when] = {s: load_model(cfgs[s], s, args.build, get(s), args.seed) for s in STAGES}

    for key in (
        "lm_heldout",
        "flow_mel_l1_heldout",
        "vocoder_mel_l1_heldout",
        "tokens_to_wave_mel_l1_heldout",
    ):
        results[key] = {}
    for when, m in models.items():
        results["lm_heldout"][when] = lm_heldout(m["lm"], instruct, texts, tokens)
        for key, value in acoustic_distances(m, tokens, mels, args.flow_steps, args.cfg, args.seed).items():
            results[key][when] = value

    # the held-out sentence, three ways, with the trained stages
    m = models["trained"]
    generated = generate_tokens(m["lm"], instruct, texts[0], args.top_k, args.seed)
    truth = tokens[0].tolist()
    agree = sum(a == b for a, b in zip(generated, truth))
    results["generated"] = {
        "tokens": len(generated),
        "true_tokens": len(truth),
        "position_agreement": round(agree / max(len(generated), len(truth)), 4),
    }
    waves = {"heldout_reference": load_wave(records[0])}
    waves["heldout_vocoder"] = vocode(m["vocoder"], mels[0], args.seed)
    gt_mel = flow_mel(m["flow"], tokens[0], args.flow_steps, args.cfg, args.seed)
    waves["heldout_gt_tokens"] = vocode(m["vocoder"], gt_mel, args.seed)
    # never empty: generate bars every stop id for the first 2 x len(text) tokens
    lm_mel = flow_mel(m["flow"], torch.tensor(generated), args.flow_steps, args.cfg, args.seed)
    waves["heldout"] = vocode(m["vocoder"], lm_mel, args.seed)
    files = {}
    for name, wave in waves.items():
        path = out / f"{name}.wav"
        write_wav(path, wave.numpy(), SAMPLE_RATE)
        # the distance to the true mel where the frames line up (the LM may speak longer or shorter)
        frames = log_mel(wave)
        distance = round(l1(frames, mels[0]), 4) if frames.shape == mels[0].shape else None
        files[name] = {"path": str(path), "seconds": round(len(wave) / SAMPLE_RATE, 3), "mel_l1": distance}
    results["files"] = files
    results["seconds"] = round(time.time() - start, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    main()
