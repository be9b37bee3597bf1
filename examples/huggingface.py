"""A Hugging Face model as its users hold it: dict batches, the model's own loss, Trainer.fit under any strategy.

    python examples/huggingface.py                                                   # one device
    towers launch --nproc-per-node 2 --strategy mirrored examples/huggingface.py     # 2 replicas
    towers launch --nproc-per-node 2 --strategy sharded examples/huggingface.py      # FSDP2 over the GPT-2 blocks

A tiny ``GPT2LMHeadModel`` is built from a config (nothing is downloaded) and trained on
right-padded token sequences given as a dict (``input_ids``, ``attention_mask``, ``labels`` with
-100 on the padding), exactly what a tokenizer and a data collator produce. ``Trainer(model,
optimizer)`` has no ``loss=``: it trains on the loss the model returns, normalised by the global
number of label tokens, so every strategy and replica count computes one device's update (the
printed losses agree). Needs ``pip install transformers``.
"""

from __future__ import annotations

import argparse

import torch

import towers


def token_data(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Sequences that repeat a short pattern (learnable), right-padded to ``length``."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    step = torch.randint(1, 4, (rows, 1), generator=g)
    ids = (start + step * torch.arange(length)) % vocab
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=16)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    strategy = towers.strategy_from_env()
    # Dropout off: each replica draws its own dropout masks, so with it on the runs would differ by chance.
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    with strategy.scope():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)  # from a config: nothing downloaded
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = towers.Trainer(model, optimizer, strategy=strategy, clip_grad_norm=1.0)  # no loss=: the model's own
    history = trainer.fit(token_data(256, 24, config.vocab_size), epochs=args.epochs,
                          global_batch_size=args.global_batch_size)
    scores = trainer.evaluate(token_data(64, 24, config.vocab_size, seed=1))
    if strategy.is_chief:
        losses = ", ".join(f"{v:.4f}" for v in history.history["loss"])
        print(f"{strategy.name}: {strategy.num_replicas_in_sync} replica(s); loss per epoch {losses}; "
              f"held-out loss {scores['loss']:.4f} over {int(scores['examples'])} sequences")


if __name__ == "__main__":
    main()
