"""`zerojax.generate` and `zerojax.generation.chat`: prompts in (token ids or text), new tokens and
text out, on a plain model or an engine's live weights.

The host side of generation: prompts tokenized and left-padded into shape buckets, the cache
sized and guarded before anything compiles, the prefill / decode programs called, stop strings
checked between decode chunks (a stop string needs the tokenizer, which lives on the host), the
rows cut at their stop.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from zerojax.generation import buckets, cache, decoder, sampling
from zerojax.generation.families import family_class, geometry_of_config
from zerojax.planning.memory import device_free_bytes

# decode steps between host checks where stop strings are asked for (without them: one call)
STOP_STRING_CHECK_EVERY = 16
STOP_ID_SLOTS = 8  # stop ids padded to a multiple of this (their count is a shape)


@dataclasses.dataclass
class Generation:
    """One generate call's result, a row per prompt: `tokens` the new token ids (a stop id that
    ended the row included, as Hugging Face's generate returns it; a stop string's tokens cut after
    the token that completed it), `texts` the decoded new text (no stop id, cut before a stop
    string; None without a tokenizer), `finish_reasons` "stop" or "length"."""

    tokens: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]


@dataclasses.dataclass(frozen=True)
class _Target:
    """What the programs run on: the weights as they live, how to merge them, and where."""

    weights: object
    source: object
    model: object  # the module (or an engine's abstract one): config, dtype
    tensor: int  # tensor-parallel ranks (the cache's kv heads split over them)
    device: object
    devices: int  # the devices the weights (and the cache) are spread over


def generation_target(model_or_engine, weights=None) -> _Target:
    """What generate's programs run on for a model or an engine (its live weights, or `weights`)."""
    from zerojax.engine.engine import Engine

    if weights is not None and not isinstance(model_or_engine, Engine):
        raise TypeError("zerojax.generate: weights= goes with an Engine (its (params, rest) as engine.state has them)")
    if isinstance(model_or_engine, Engine):
        eng = model_or_engine
        if weights is None:  # given weights are a copy: no step of the engine's to wait for
            eng.synchronize()
            weights = (eng.state.params, eng.state.rest)
        settings = eng.step_settings
        model = nnx.merge(settings.graphdef, settings.param_template, settings.rest_template)
        from zerojax.sharding import partition
        return _Target(weights, decoder.EngineSource(settings), model,
                       partition.tensor_size(eng.mesh), eng.mesh.devices.flat[0], eng.mesh.devices.size)
    if isinstance(model_or_engine, nnx.Module):
        family_class(model_or_engine)  # a clear error for a model without a decoder
        graphdef, state = nnx.split(model_or_engine)
        leaves = jax.tree.leaves(state)
        placed = [d for x in leaves if isinstance(x, jax.Array) for d in x.devices()]
        return _Target(state, decoder.ModuleSource(graphdef), model_or_engine, 1, placed[0] if placed else None,
                       max(len(set(placed)), 1))
    raise TypeError("zerojax.generate: a zerojax model (Llama, GPT2) or an Engine, "
                    f"got {type(model_or_engine).__name__}")


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if tokenizer is None:
        raise ValueError("zerojax.generate: text prompts need tokenizer= (zerojax.models.load_tokenizer(folder))")
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=add_special_tokens)]


def _prompts(prompts, tokenizer, add_special_tokens) -> list[list[int]]:
    """A string, a list of ids, or a list of either -> a list of id lists."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts)
                                    and np.isscalar(prompts[0]) and not isinstance(prompts[0], str)):
        prompts = [prompts]
    return [_encode(tokenizer, p, add_special_tokens) if isinstance(p, str) else [int(i) for i in np.ravel(p)]
            for p in prompts]


def _eos_ids(model, tokenizer) -> list[int]:
    """The end-of-sequence ids: the model config's eos_token_id (an int or several) and the tokenizer's."""
    out = []
    for v in (getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_id", None),
              getattr(tokenizer, "eos_token_id", None)):
        for i in (v if isinstance(v, (list, tuple)) else [v]):
            if i is not None and int(i) not in out:
                out.append(int(i))
    return out


def _stop_string_end(text: str, stops: Sequence[str]) -> int | None:
    """The index in `text` where the earliest stop string starts, or None."""
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids])


def generate(model_or_engine, prompts, *, max_new_tokens: int = 64, temperature: float = 0.0, top_k=None,
             top_p=None, repetition_penalty=None, stop=None, seed: int = 0, tokenizer=None,
             add_special_tokens: bool = True, ignore_eos: bool = False, decode_attention: str = "xla",
             weights=None) -> Generation:
    """Generate up to `max_new_tokens` new tokens for each prompt.

    model_or_engine: a zerojax `Llama` / `GPT2` (LoRA adapters applied, not merged; a quantized
        base) or an `Engine` (its live compute-dtype weights, as sharded: any ZeRO stage, tensor
        parallel, offload).
    prompts: a string, a list of token ids, or a list of either (text needs `tokenizer`, encoded
        with its special tokens where add_special_tokens, e.g. Llama 3's BOS).
    temperature 0: greedy (Hugging Face's do_sample=False); else sampled after top_k / top_p;
        repetition_penalty: Hugging Face's. seed: the jax.random key's.
    stop: token ids (ints) and / or stop strings; the model's and tokenizer's eos ids always stop a
        row unless ignore_eos.
    decode_attention: "xla" (two batched products), "kernel" (one fused Pallas kernel per
        layer, reading each row's filled slots only) or "auto" (the kernel on one GPU where it
        takes the model's shape, else XLA; `zerojax.generation.decoder.DECODE_ATTENTIONS`).
    weights: with an Engine, the (params, rest) to generate from instead of its live state, laid out
        as `engine.state` holds them (a copy from before a step: one-step off-policy rollouts).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: an int >= 1")
    sampler, values = sampling.settings(temperature, top_k, top_p, repetition_penalty)
    target = generation_target(model_or_engine, weights)
    rows = _prompts(prompts, tokenizer, add_special_tokens)
    stop = [stop] if isinstance(stop, (str, int)) else list(stop or ())
    stop_strings = [s for s in stop if isinstance(s, str)]
    if stop_strings and tokenizer is None:
        raise ValueError("zerojax.generate: stop strings need tokenizer=")
    stop_ids = [int(s) for s in stop if not isinstance(s, str)] + ([] if ignore_eos else _eos_ids(target.model,
                                                                                                 tokenizer))
    stop_arr = np.full((stop_slots(len(stop_ids)),), -2, np.int32)
    stop_arr[:len(stop_ids)] = stop_ids

    distinct, expand = _distinct(rows, buckets.batch_bucket(len(rows)))
    shapes = program_shapes(target, rows=len(rows), distinct=len(distinct), longest_prompt=max(len(r) for r in rows),
                            max_new_tokens=max_new_tokens, decode_attention=decode_attention)
    prompt_len, length, batch = shapes.prompt_len, shapes.length, shapes.batch
    geometry = geometry_of_config(target.model.config)
    nbytes = cache.cache_bytes(geometry, batch, length, target.model.dtype, target.tensor)
    cache.check_cache_fits(nbytes, batch, length, device_free_bytes(target.device), scores=shapes.scores_bytes)

    ids, pad = buckets.left_pad(distinct, prompt_len, shapes.prefill_batch)
    live = np.arange(batch) < len(rows)
    key = jax.random.key(seed)
    state = decoder.prefill(target.weights, ids, pad, live, values, stop_arr, key, expand, source=target.source,
                            sampler=sampler, length=length, out_len=shapes.out_len, piece=shapes.prefill_piece)
    if expand is not None:
        pad = pad[expand]
    chunk = STOP_STRING_CHECK_EVERY if stop_strings else max_new_tokens
    cut = [None] * len(rows)  # (tokens kept, text) of rows a stop string ended
    while True:
        step = int(state.step)
        if step < max_new_tokens and not bool(np.all(np.asarray(state.done))):
            state = decoder.decode(target.weights, state, pad, np.int32(prompt_len),
                                   np.int32(min(step + chunk, max_new_tokens)), values, stop_arr, key,
                                   source=target.source, sampler=sampler, kernel=shapes.kernel)
        if stop_strings:
            state = _apply_stop_strings(state, tokenizer, stop_strings, cut, len(rows))
        if int(state.step) >= max_new_tokens or bool(np.all(np.asarray(state.done))):
            break
    return _result(np.asarray(state.tokens)[:len(rows), :max_new_tokens], stop_ids, cut, tokenizer)


def stop_slots(n: int) -> int:
    """The stop ids' array length for `n` ids: a multiple of STOP_ID_SLOTS (their count is a shape)."""
    return -(-max(n, 1) // STOP_ID_SLOTS) * STOP_ID_SLOTS


@dataclasses.dataclass(frozen=True)
class ProgramShapes:
    """The shapes a generate call compiles its prefill and decode programs for (what a planner
    compiles too, `zerojax.generation.program_memory`, so that its figures are this call's)."""

    prompt_len: int  # the prompts' length bucket
    out_len: int  # max_new_tokens' bucket
    batch: int  # the rows' batch bucket (the decode's rows)
    prefill_batch: int  # the distinct prompts' bucket (the prefill's rows)
    expand: bool  # prompts repeat: the prefill runs each once, its cache copied to its rows
    prefill_piece: int | None  # prompt tokens per prefill pass (None: all)
    scores_bytes: int  # one prefill piece's fp32 attention scores
    kernel: bool  # the decode attends with the fused kernel

    @property
    def length(self) -> int:
        return self.prompt_len + self.out_len


def program_shapes(target: _Target, *, rows: int, distinct: int, longest_prompt: int, max_new_tokens: int,
                   decode_attention: str) -> ProgramShapes:
    """The shapes of a call of `rows` prompts (`distinct` of them different, the longest
    `longest_prompt` tokens) for `max_new_tokens`, on `target`; ValueError past the model's positions."""
    geometry = geometry_of_config(target.model.config)
    prompt_len, out_len = buckets.length_bucket(longest_prompt), buckets.length_bucket(max_new_tokens)
    if geometry.max_positions is not None and longest_prompt + max_new_tokens > geometry.max_positions:
        raise ValueError(f"zerojax.generate: prompt + max_new_tokens = {longest_prompt + max_new_tokens} "
                         f"exceeds this model's {geometry.max_positions} learned positions")
    kernel = decoder.check_decode_attention(decode_attention, geometry, prompt_len + out_len, target.devices)
    prefill_batch = buckets.batch_bucket(distinct)
    heads = cache.per_rank(geometry.heads, target.tensor)
    piece = decoder.prefill_piece(heads, prefill_batch, prompt_len)
    return ProgramShapes(prompt_len, out_len, buckets.batch_bucket(rows), prefill_batch, distinct < rows,
                         None if piece == prompt_len else piece,
                         decoder.prefill_scores_bytes(heads, prefill_batch, prompt_len, piece), kernel)


def _distinct(rows, batch: int):
    """(the distinct prompts, in first-seen order; None, or int32 [batch]: each of the batch's rows'
    index among them, filler rows 0) -> where prompts repeat, the prefill runs each once."""
    index: dict[tuple, int] = {}
    of_row = [index.setdefault(tuple(r), len(index)) for r in rows]
    if len(index) == len(rows):
        return rows, None
    return [list(r) for r in index], np.array(of_row + [0] * (batch - len(rows)), np.int32)


def _apply_stop_strings(state, tokenizer, stop_strings, cut, n):
    """Rows whose new text holds a stop string: cut (recorded in `cut`) and marked done."""
    tokens, done = np.asarray(state.tokens), np.array(state.done)
    for r in range(n):
        if cut[r] is not None:
            continue
        row = tokens[r][tokens[r] >= 0]
        text = _decode(tokenizer, row)
        at = _stop_string_end(text, stop_strings)
        if at is None:
            continue
        keep = next(k for k in range(1, len(row) + 1) if _stop_string_end(_decode(tokenizer, row[:k]), stop_strings)
                    is not None)
        cut[r] = (keep, text[:at])
        done[r] = True
    return state._replace(done=jax.device_put(done, state.done.sharding))


def _result(tokens, stop_ids, cut, tokenizer) -> Generation:
    out, texts, reasons = [], [] if tokenizer is not None else None, []
    for r, row in enumerate(tokens):
        row = [int(t) for t in row if t >= 0]
        if cut[r] is not None:
            keep, text = cut[r]
            out.append(row[:keep])
            reasons.append("stop")
            if texts is not None:
                texts.append(text)
            continue
        stopped = bool(row) and row[-1] in stop_ids
        out.append(row)
        reasons.append("stop" if stopped else "length")
        if texts is not None:
            texts.append(_decode(tokenizer, row[:-1] if stopped else row))
    return Generation(out, texts, reasons)


def check_chat_template(tokenizer, template: str | None = None) -> None:
    """ValueError in one line where neither `template` nor the tokenizer's folder has a chat template
    (tokenizer_config.json's "chat_template", or chat_template.jinja): a conversation cannot be
    rendered for this checkpoint (a base model's, not an instruct one's)."""
    if not (template or getattr(tokenizer, "chat_template", None)):
        raise ValueError(f"{getattr(tokenizer, 'path', 'the tokenizer')}: no chat template (tokenizer_config.json's "
                         "\"chat_template\" or chat_template.jinja), so a conversation cannot be rendered: chat with "
                         "a chat (instruct) checkpoint, give --tokenizer a folder that has one, or continue plain text "
                         "with zerojax generate --prompt")


def chat(model_or_engine, messages: Sequence[dict], *, tokenizer, template: str | None = None,
         **kwargs) -> Generation:
    """The assistant's next turn: `messages` ([{"role", "content"}, ...]) rendered with the
    checkpoint's chat template (`zerojax.data.finetune.render_chat`, transformers' rendering) and a
    generation prompt, then `generate` (kwargs) on that text. -> a one-row Generation."""
    from zerojax.data.finetune import render_chat

    check_chat_template(tokenizer, template)
    text = render_chat(tokenizer, messages, add_generation_prompt=True, template=template)
    # the template writes the special tokens (BOS) itself
    return generate(model_or_engine, [text], tokenizer=tokenizer, add_special_tokens=False, **kwargs)


__all__ = ["Generation", "generate", "chat", "check_chat_template", "STOP_STRING_CHECK_EVERY", "ProgramShapes",
           "program_shapes", "generation_target", "stop_slots"]
