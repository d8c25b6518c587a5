"""Fine-tune GPT-2 or a Llama-family model (Llama 3, Qwen2 / Qwen3, Mistral) with any DeepSpeed config.

    python examples/gpt2_large.py --config configs/zero2_bf16.json            # GPU: GPT-2 Large
    python examples/gpt2_large.py --model tiny --steps 200                     # CPU: a tiny GPT-2
    python examples/gpt2_large.py --hf-checkpoint ./gpt2-large --data corpus.jsonl --save runs/ft
    python examples/gpt2_large.py --hf-checkpoint ./Llama-3.2-1B-Instruct --data chat.jsonl \
        --seq-len 2048 --lora 16 --lora-alpha 32 --export-hf runs/adapter    # LoRA on chat data

--model names a GPT-2 size or a Llama-family shape (random init); --hf-checkpoint reads a local
Hugging Face folder of either family (config.json's model_type) with its tokenizer. Without --data
it trains on an embedded corpus (Python's own documentation), so it runs on a fresh machine with no
download. --data takes .txt, or .jsonl fine-tuning records: {"text"} (streamed and cut into blocks,
as .txt), {"prompt", "completion"} and {"messages"} (the checkpoint's chat template): the loss on the
completion / assistant turns only, examples packed into rows (segment ids) or one a row (--pad).
--lora R (or the config's "lora" section, PEFT's LoraConfig keys) freezes the base and trains
adapters; --export-hf then writes PEFT's adapter folder (and with --merge the merged model, in the
base folder's stored dtype).
"""
import os
import sys

# `python examples/gpt2_large.py` from a checkout works without installing.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zerojax import trainer  # noqa: E402


def main(argv=None):
    """The run's SUMMARY (a dict): the trainer with this example's flags (`zerojax train` takes the same)."""
    return trainer.main(argv, prog="gpt2_large.py", description=__doc__)


if __name__ == "__main__":
    sys.exit(trainer.run_cli(prog="gpt2_large.py", description=__doc__))
