"""Runs a causal LM over the row KV cache: chunked prefill of several rows, decode of many.

The runner owns the tensor layout: from the scheduler's rows, chunks and positions it builds each forward's
ForwardBatch. Architectures that families.py describes run as a CompactLM (compact.py); every other
runs transformers' own modules with their linears swapped for the ones linear.py picked, as the
ExecutionPlan says. Both take the same call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.quant import QUANTIZED, FileRows
from ..model.attention import use_row_attention
from ..model.compact import CompactLM, build_compact
from ..model.families import FAMILIES
from ..model.forward_batch import ForwardBatch
from ..model.linear import linear_factory, use_linears
from ..model.lora import LoraAdapter, LoraSlots, load_adapter, targets
from .cuda_graphs import capture_decode
from .kv_cache import RowKVCache
from .plan import ExecutionPlan


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class _HFModel:
    """transformers' modules behind the CompactLM call."""

    def __init__(self, model):
        from .hf_cache import BatchCache

        self.model, self.batch_cache = model, BatchCache

    def forward(self, batch: ForwardBatch, cache: RowKVCache) -> torch.Tensor:
        visible = batch.visible()
        mask = torch.zeros(visible.shape, dtype=self.model.dtype, device=visible.device)
        mask.masked_fill_(~visible, torch.finfo(self.model.dtype).min)  # additive: sdpa and eager alike
        positions = batch.positions
        out = self.model(
            input_ids=batch.ids,
            position_ids=positions,
            attention_mask=mask[:, None],
            past_key_values=self.batch_cache(cache, batch),
            cache_position=positions[0],
            use_cache=True,
            logits_to_keep=1 if batch.last_only else 0,
        )
        logits = out.logits.float()
        return logits[:, -1] if batch.last_only else logits


def build_model(model, plan: ExecutionPlan, kernels, length: int, shard=None, all_reduce=None):
    """The callable model for the runner: the compact decoder or transformers' modules, as the plan says. shard
    (parallel.Shard) and all_reduce: this rank's share of a tensor-parallel group; only rank 0 keeps a head."""
    make_linear = linear_factory(
        model.device, model.dtype, plan.quantize, kernels, plan.torch(plan.batch_dtype), plan.int8_inputs
    )
    if plan.model == "compact":
        logits = shard is None or shard.rank == 0

        def embed_fn(embed_w, head_w, file_rows: FileRows | None = None):
            """file_rows: a GGUF's token embedding left in its file (gguf_blocks.file_rows): on the CPU the lookups
            read it, tied or not, so a tied head keeps no codes beside its packing for them."""
            head_mode = "int8" if plan.quantize != "none" else None
            file_rows = file_rows if model.device.type == "cpu" else None
            # without the file's rows a tied quantized head keeps its codes for the lookups, and the other ranks build
            # it only for the rows rank 0's embedding reads (the same numbers)
            head_lookups = file_rows is None and head_w is embed_w and head_mode is not None
            head = (
                make_linear(head_w, None, group=plan.group or 32, as_mode=head_mode, lookups=head_lookups)
                if logits or head_lookups
                else None
            )
            if file_rows is not None:
                return (lambda ids: file_rows.rows(ids, kernels)), head
            if head_lookups and head is not None and hasattr(head, "rows"):
                return head.rows, head if logits else None  # a tied quantized head: embeddings read from its rows
            head = head if logits else None
            if isinstance(embed_w, (*QUANTIZED, FileRows)):
                if model.device.type == "cpu":  # a GGUF's own blocks: rows dequantized when read
                    return (lambda ids: embed_w.rows(ids, kernels)), head
                embed_w = embed_w.dequantize(kernels)  # a GPU: one dense table in its memory
            table = embed_w.detach().to(model.device, model.dtype).clone()
            return (lambda ids: F.embedding(ids, table)), head

        return build_compact(model, make_linear, embed_fn, length, kernels, shard, all_reduce)
    if shard is not None:  # (the plan refuses this where it knows the architecture)
        raise ValueError(
            f"--tensor-parallel-size {shard.size}: architecture {plan.arch or 'unknown'!r} runs on "
            f"transformers' layers, which cannot be split"
        )
    if model.device.type == "cpu" or plan.quantize != "none":
        use_linears(model, lambda w, b: make_linear(w, b, plan.group))
    use_row_attention(model)
    return _HFModel(model)


def load_runner(config, plan: ExecutionPlan, kernels, gguf, model_dir, shard=None, all_reduce=None) -> ModelRunner:
    """The runner over the model read straight from a GGUF file (gguf: where the compact decoder reads one) or
    loaded from the transformers folder model_dir: one tensor-parallel rank's share where shard says."""
    from ..model.gguf_model import GGUFModel, ModelConfig
    from ..model.loader import load_model

    dtype = plan.torch(plan.dtype)
    model = (
        GGUFModel(gguf, plan.device, dtype, int8_layout=plan.int8_layout, config=ModelConfig.read(model_dir))
        if gguf is not None
        else load_model(model_dir, plan.device, dtype)
    )
    return ModelRunner(
        model, config.rows, config.context_length, plan, kernels, config.prefill_chunk, shard, all_reduce
    )


class ModelRunner:
    """Owns the KV cache and every batch tensor: the scheduler's step in, logits out."""

    def __init__(
        self,
        model,
        rows: int,
        context_length: int,
        plan: ExecutionPlan,
        kernels=None,
        prefill_chunk: int = 512,
        shard=None,
        all_reduce=None,
    ):
        """shard (parallel.Shard) and all_reduce: this rank's share of a tensor-parallel group (its heads, its KV
        heads; a rank other than 0 returns no logits)."""
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.config.vocab_size
        self.plan = plan
        self.config = model.config
        # llama.cpp's architecture name of the model (a LoRA GGUF must name it): the file's, else the family's
        # (None there: llama.cpp writes the family as llama, as Mistral's files)
        family = FAMILIES.get(model.config.model_type)
        self.gguf_arch = getattr(model, "arch", None) or (family.gguf if family is not None else None) or "llama"
        self.split = shard is not None
        self.row_adapters: dict[int, tuple[tuple[int, float], ...]] = {}  # each row's LoRA (slot, scale) pairs
        self.model = build_model(model, plan, kernels, context_length + 1, shard, all_reduce)
        layers, kv_heads, head_dim = kv_geometry(model.config)
        kv_heads //= shard.size if shard is not None else 1
        windows = self.model.spec.windows if plan.kv_ring and isinstance(self.model, CompactLM) else None
        self.cache = RowKVCache(
            layers,
            rows,
            kv_heads,
            context_length,
            head_dim,
            plan.torch(plan.kv_dtype),
            self.device,
            windows,
            prefill_chunk,
            plan.kv_float_layers,
        )
        # the decode step replayed from CUDA graphs where the plan says so (one process: no rank beside it)
        captured = plan.cuda_graphs and isinstance(self.model, CompactLM) and shard is None
        self.graphs = capture_decode(self.model, self.cache, rows, self.device) if captured else None

    def _batch(self, rows: list[int], chunks: list[list[int]], starts: list[int], last_only: bool) -> ForwardBatch:
        """Chunks left-padded so every row's last token is last; padding writes to the scratch slot and sees
        only position 0."""
        width = max(len(c) for c in chunks)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        write = torch.full((len(rows), width), self.cache.scratch, dtype=torch.long)
        for i, (chunk, start) in enumerate(zip(chunks, starts)):
            pad = width - len(chunk)
            ids[i, pad:] = torch.tensor(chunk)
            positions[i, pad:] = torch.arange(start, start + len(chunk))
            write[i, pad:] = positions[i, pad:]
        attend = max(s + len(c) for s, c in zip(starts, chunks))
        ids, positions, write = (t.to(self.device) for t in (ids, positions, write))
        return ForwardBatch(
            ids,
            positions,
            write,
            torch.tensor(rows, device=self.device),
            attend,
            self.cache.scratch,
            last_only=last_only,
            adapters=self._adapters(rows),
        )

    def _adapters(self, rows: list[int]) -> list[tuple[tuple[int, float], ...]] | None:
        """Each entry's LoRA (slot, scale) pairs, for the ForwardBatch (None: no row has any)."""
        if not self.row_adapters or not any(r in self.row_adapters for r in rows):  # (no adapter rows: at once)
            return None
        return [self.row_adapters.get(r, ()) for r in rows]

    # LoRA adapters (model/lora.py): held by the compact decoder, given to rows by the engine
    def add_adapter(self, name: str, path: str) -> tuple[int, LoraAdapter]:
        """Read an adapter for this model and hold it: (its slot, the adapter). ValueError: the file does not fit,
        or the model cannot take adapters (transformers' layers, a tensor-parallel split)."""
        if not isinstance(self.model, CompactLM):
            raise ValueError(
                f"LoRA adapter {name!r}: architecture {self.plan.arch or 'unknown'!r} runs on transformers' layers, "
                f"which take no adapters (the compact decoder's families do)"
            )
        if self.split:
            raise ValueError(f"LoRA adapter {name!r}: a tensor-parallel model takes no adapters")
        family = self.model.spec.family
        adapter = load_adapter(name, path, self.config, family, self.gguf_arch)
        if self.model.lora is None:
            layers = self.config.num_hidden_layers
            self.model.lora = LoraSlots(
                targets(self.config, family), layers, self.device, self.dtype, self.model.kernels
            )
        return self.model.lora.add(adapter), adapter

    def remove_adapter(self, slot: int) -> None:
        """Let go of an adapter's weights (no row may use its slot any more)."""
        if isinstance(self.model, CompactLM) and self.model.lora is not None:
            self.model.lora.remove(slot)

    def use_adapters(self, row: int, adapters: tuple[tuple[int, float], ...]) -> None:
        """The LoRA (slot, scale) pairs a row's forwards apply from now on (empty: none)."""
        if adapters:
            self.row_adapters[row] = adapters
        else:
            self.row_adapters.pop(row, None)

    @torch.inference_mode()
    def prefill(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Write each chunk at positions start.. of its row, all rows in one forward; return the logits of
        each chunk's last token [len(rows), V]."""
        return self.model.forward(self._batch(rows, chunks, starts, True), self.cache)

    @torch.inference_mode()
    def score(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor | None:
        """Write ids at positions start.. of a row; return the logits after every one of them [len(ids), V]
        (in pieces of at most a prefill chunk where the cache has rings); None on a rank that computes no logits."""
        piece = self.cache.chunk or len(ids)
        parts = [
            self.model.forward(self._batch([row], [ids[i : i + piece]], [start + i], False), self.cache)
            for i in range(0, len(ids), piece)
        ]
        return None if parts[0] is None else torch.cat([p[0] for p in parts])

    @property
    def verifies(self) -> bool:
        """Whether a draft's forward (``verify``) gives each token the numbers of its own decode step, bit for
        bit: the compact decoder on the CPU kernels with int8 inputs (batch-invariant), no CUDA graphs."""
        return (
            isinstance(self.model, CompactLM)
            and self.model.kernels is not None
            and self.plan.int8_inputs
            and self.graphs is None
        )

    @torch.inference_mode()
    def verify(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Each chunk (a decoding row's last token and its draft) written at positions start.. of its row, all
        rows in one forward: the logits after every token, the rows' one after another [sum of lengths, V]."""
        batch = self._batch(rows, chunks, starts, False)
        logits = self.model.forward(batch, self.cache)
        return logits.reshape(-1, logits.shape[-1])[batch.tokens]

    @property
    def embeds(self) -> bool:
        """Whether the model gives token vectors (``hidden``): the compact decoder."""
        return isinstance(self.model, CompactLM)

    @torch.inference_mode()
    def hidden(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor:
        """Write ids at positions start.. of a row; return each one's vector after the final norm [len(ids), H]."""
        batch = self._batch([row], [ids], [start], False)
        batch.hidden = True
        return self.model.forward(batch, self.cache)[0]

    @torch.inference_mode()
    def decode(self, rows: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each given row at its position; returns logits [len(rows), V] in that order. The batch
        spans rows 0..highest (the decode kernels' layout: batch index b is cache row b), idle rows writing to
        the scratch slot; with CUDA graphs, the smallest captured bucket that holds them."""
        adapters = self._adapters(rows)
        if self.graphs is not None and (adapters is None or self.graphs.takes(adapters)):
            return self.graphs.decode(rows, tokens, positions, adapters)
        width = max(rows) + 1
        index = torch.tensor(rows)
        ids = torch.zeros(width, 1, dtype=torch.long)
        pos = torch.zeros(width, 1, dtype=torch.long)
        write = torch.full((width, 1), self.cache.scratch, dtype=torch.long)
        ids[index, 0] = torch.tensor(tokens)
        pos[index, 0] = torch.tensor(positions)
        write[index, 0] = pos[index, 0]
        ids, pos, write = (t.to(self.device) for t in (ids, pos, write))
        batch = ForwardBatch(
            ids,
            pos,
            write,
            torch.arange(width, device=self.device),
            max(positions) + 1,
            self.cache.scratch,
            decode=True,
            adapters=None if adapters is None else [self.row_adapters.get(r, ()) for r in range(width)],
        )
        logits = self.model.forward(batch, self.cache)
        if logits is None or (len(rows) == width and rows == sorted(rows)):
            return logits
        return logits[index.to(logits.device)]

    @property
    def decode_ahead(self):
        """The launch of the next decode step from sampled tokens still on the device (DecodeGraphs.decode_ahead),
        or None where the step runs eagerly (nothing to overlap)."""
        return None if self.graphs is None else self.graphs.decode_ahead

    def holds(self, cached: int, length: int) -> bool:
        """Whether a row that wrote cached positions still holds a reuse of its first length (its rings)."""
        return self.cache.holds(cached, length)

    @torch.inference_mode()
    def snapshot(self, row: int, length: int) -> list[torch.Tensor]:
        """A copy of a row's first length cached positions (its rings as they are), for the prompt cache."""
        return self.cache.snapshot(row, length)

    @torch.inference_mode()
    def restore(self, row: int, tensors: list[torch.Tensor]) -> None:
        self.cache.restore(row, tensors)

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give row dst the first length cached positions of row src (a prompt prefix found there)."""
        self.cache.copy_prefix(src, dst, length)
