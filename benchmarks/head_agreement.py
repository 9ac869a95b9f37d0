"""Trained heads side by side on the same held-out windows of the target's own answers: how often each head's
draft at positions 1..k is the target's most likely token there. The windows are those `specdecode train eagle3`
holds out (whole answers, chosen by a hash of their id), read from a features folder with the three layers'
inputs (the one `train data` keeps beside its answers, or one `train eagle3 --answers` extracted).

    python benchmarks/head_agreement.py training-data/qwen2.5-coder-1.5b-instruct/features \
        --eagle3 specdecode/heads/qwen2.5-coder-1.5b-instruct/eagle3 --eagle3 ~/.cache/specdecode/heads/new
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.api import load_models
from specdecode.drafters.eagle_head import EagleHead
from specdecode.drafters.eagle3_head import Eagle3Head
from specdecode.training import eagle as eagle_training
from specdecode.training import features
from specdecode.training.eagle3 import TrainingSettings, held_out_agreement
from specdecode.training.loop import split, windows

HEADS = Path(__file__).resolve().parents[1] / "specdecode" / "heads" / "qwen2.5-coder-1.5b-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("features", type=Path, help="a features folder with layer inputs (EAGLE-3's)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="int4", help="the target path the features were taken on")
    parser.add_argument("--eagle3", type=Path, action="append", help="an EAGLE-3 head's folder (repeatable; "
                        "default: the shipped one)")
    parser.add_argument("--eagle", default=str(HEADS / "eagle"), help="an EAGLE head's folder ('' for none)")
    parser.add_argument("--positions", type=int, default=4)
    parser.add_argument("--starts", type=int, default=16, help="EAGLE: draft starts per window")
    args = parser.parse_args()

    model = load_models(args.target, None, dtype=args.dtype, progress=False).target.model
    table = model.get_input_embeddings().weight.detach()
    full_head = model.get_output_embeddings().weight.detach().float()

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table).float()

    _, shards = features.load(args.features)
    settings = TrainingSettings()
    _, held_out = split(windows(shards, settings.sequence_tokens, settings.steps + 8, aux=True), settings.seed)
    print(f"{len(held_out)} held-out windows of {args.features}")
    with torch.no_grad():
        for folder in args.eagle3 or [HEADS / "eagle3"]:
            head, _ = Eagle3Head.load(folder, dtype=torch.float32)
            agreement = held_out_agreement(head.eval(), embed, full_head[head.draft_ids], full_head, held_out,
                                           args.positions)
            print(f"EAGLE-3 {folder}: {', '.join(f'{a:.3f}' for a in agreement)}")
        if args.eagle:  # a string: Path("") would be the current folder
            head, _ = EagleHead.load(Path(args.eagle), dtype=torch.float32)
            agreement = eagle_training.held_out_accuracy(head.eval(), embed, full_head[head.vocab_ids], full_head,
                                                         [w[:3] for w in held_out], args.positions, args.starts)
            print(f"EAGLE {args.eagle} (final hidden states only): {', '.join(f'{a:.3f}' for a in agreement)}")


if __name__ == "__main__":
    main()
