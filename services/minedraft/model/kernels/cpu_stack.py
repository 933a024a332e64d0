"""A step's forward on CPU as one C call (model/kernels/decode_stack.c): every layer, the final norm and the LM
head of a step of up to MAX_ROWS tokens (decode steps, verification windows, draft steps, short prompts).

On CPU a small model's step costs what dispatching its operators costs: the bundled draft (two layers of 128
features) ran some 230 operators per forward, about a millisecond, for arithmetic one core does in tens of
microseconds, and the bundled target's decode step of one sequence took 3.5 ms where its weights take about one
to read. `DecodeStack` holds each layer's weights and the LM head transposed and packed by tiles of the GEMM's
outputs (a copy, as oneDNN's packed weights are one) and runs them in one call; the embedding stays torch's.

Each row's result depends on that row alone (every output one sum in a fixed order), so in the default mode a
token's logits are the same in a decode step and in a verification window of any batch up to MAX_ROWS rows; above
it torch's GEMMs run, which are as fast there. The runner uses it where it runs the C fused
kernels (the default mode on CPU, float32), for dense Llama/Qwen layers on one device without LoRA; for any other
model `DecodeStack.build` says why not and the layers run as they are. The strict mode keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import itertools

import torch

from minedraft.model.kernels import cpu_kernels
from minedraft.model.kv_cache import NULL_BLOCK, KVCache
from minedraft.model.transformer import MLP, CausalLM

# Rows (tokens) of the step up to which the one call runs it. The call saves the operators' dispatch, a few
# milliseconds a forward of the bundled target, and its GEMMs hold fewer rows in registers than torch's: the
# bundled models' steps took 0.44-0.61x the time at one row, 0.83-1.0x at 64 and 0.88-1.14x at 160 on an AVX-512
# Xeon (MKL); on an AVX-512 EPYC 0.57-0.76x for a prompt of 64-128 tokens, 0.84-0.86x at 160-192 rows and
# 0.92-0.93x at 256 (benchmarks/decode_stack.py, 1 and 2 threads). Prompts (one of 128 tokens: 3 ms less to the
# first token) and verification steps of 32 requests are in.
MAX_ROWS = 192
_WEIGHTS_PER_LAYER = 12  # decode_stack.c's enum: norms, projections and their biases, in its order
_TILE = 64  # decode_stack.c's TILE: the outputs one tile of its GEMM covers (COL_VECS x LANES floats)
_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


class StackModel(ctypes.Structure):
    """decode_stack.c's struct stack_model: the model's weights, shapes and KV pool as the call reads them."""

    _fields_ = [("embed", _ptr), ("weights", _ptr), ("caches", _ptr), ("cos_table", _ptr), ("sin_table", _ptr),
                ("final_norm", _ptr), ("lm_head", _ptr), ("hidden", _i64), ("intermediate", _i64), ("vocab", _i64),
                ("stride_rope", _i64), ("kv_stride_h", _i64), ("kv_stride_b", _i64), ("kv_stride_t", _i64),
                ("layers", _i32), ("heads", _i32), ("kv_heads", _i32), ("dim", _i32), ("block_size", _i32),
                ("bf16", _i32), ("eps", _f32), ("scale", _f32)]  # fmt: skip


class StackStep(ctypes.Structure):
    """A step as the call reads it (decode_stack.c's struct stack_step): its token rows (ids, positions, cache
    slots, logits rows) in one int64 tensor and its sequences (block tables, starts, offsets, query lengths) in one
    int32 tensor, built from the host lists in two conversions (the general path's batch and attention plan take
    about fifteen), and the addresses of each part."""

    _fields_ = [("ids", _ptr), ("positions", _ptr), ("token_index", _ptr), ("logits_rows", _ptr), ("tables", _ptr),
                ("starts", _ptr), ("offsets", _ptr), ("lengths", _ptr), ("tokens", _i64), ("num_logits", _i64),
                ("table_width", _i64), ("seqs", _i32)]  # fmt: skip

    def __init__(self, ids: list[int], positions: list[int], token_index: list[int], logits_rows: list[int],
                 tables: list[list[int]], starts: list[int], query_lens: list[int]) -> None:
        n, s, width = len(ids), len(tables), max(map(len, tables))
        offsets = [0, *itertools.accumulate(query_lens)][:-1]
        padded = [b for table in tables for b in (*table, *[NULL_BLOCK] * (width - len(table)))]
        self._rows = torch.tensor(ids + positions + token_index + logits_rows, dtype=torch.int64)
        self._seqs = torch.tensor(padded + starts + offsets + query_lens, dtype=torch.int32)
        row, seq = self._rows.data_ptr(), self._seqs.data_ptr()
        rows = (row + 8 * i * n for i in range(4))  # ids, positions, token_index, logits_rows
        seqs = (seq + 4 * (len(padded) + i * s) for i in range(3))  # starts, offsets, lengths (the tables first)
        super().__init__(*rows, seq, *seqs, n, len(logits_rows), width, s)


class StackCall(ctypes.Structure):
    """decode_stack_f32's one argument (struct stack_call): the model, the step, the logits' address and the
    threads, and for greedy drafting each sequence's steps (None: no drafting) and where its tokens and their
    confidences go."""

    _fields_ = [("model", StackModel), ("step", StackStep), ("logits", _ptr), ("threads", _i32), ("steps", _ptr),
                ("drafted", _ptr), ("confidence", _ptr), ("max_steps", _i64)]  # fmt: skip


class DecodeStack:
    """The layers of one model as decode_stack.c reads them."""

    def __init__(self, model: CausalLM, bf16: bool | None = None) -> None:
        """`bf16`: hold the weights as bfloat16; None: where every one is a bfloat16 value (False keeps float32
        copies, the same results)."""
        decoder = model.model
        attn = decoder.layers[0].self_attn
        self._kept: list[torch.Tensor] = []  # the tensors the pointer table points into
        # Weights that are all bfloat16 values (a bfloat16 checkpoint run in float32) are held as bfloat16: the
        # call widens each back to the same float32, so it streams half the bytes for the same sums.
        linears = [m for layer in decoder.layers for m in _linears(layer)]
        exact = all(_bf16_exact(w) for w in (*(m.dense_weight() for m in linears), model.lm_head.weight))
        if bf16 and not exact:
            raise ValueError("the model's weights are not all bfloat16 values: bfloat16 copies would change them")
        self.bf16 = exact if bf16 is None else bf16
        self.pointers = torch.tensor([self._layer_pointers(layer) for layer in decoder.layers], dtype=torch.int64)
        self.final_norm = decoder.norm.weight.detach().contiguous()
        self.vocab = model.lm_head.vocab_size
        self.lm_head = _packed(model.lm_head.weight.detach()[: self.vocab], self.bf16)  # [hidden, vocab], packed
        self.embed = decoder.embed_tokens.weight.detach().contiguous()  # [vocab, hidden]
        self.rope = decoder.rotary.cos, decoder.rotary.signed_sin  # [positions, head_dim]
        self._args = StackCall(StackModel(
            embed=self.embed.data_ptr(), weights=self.pointers.data_ptr(), cos_table=self.rope[0].data_ptr(),
            sin_table=self.rope[1].data_ptr(), final_norm=self.final_norm.data_ptr(), lm_head=self.lm_head.data_ptr(),
            hidden=decoder.norm.weight.shape[0], intermediate=decoder.layers[0].mlp.down_proj.dense_weight().shape[1],
            vocab=self.vocab, stride_rope=self.rope[0].stride(0), layers=len(decoder.layers),
            heads=attn.qkv_proj.num_heads, kv_heads=attn.qkv_proj.num_kv_heads, dim=attn.head_dim, bf16=self.bf16,
            eps=decoder.norm.eps, scale=attn.scale,
        ))  # fmt: skip
        self._caches: tuple[int, ctypes.Array] | None = None

    @property
    def streamed_bytes(self) -> int:
        """The bytes of weights one step streams: every layer's packed projections, norms and biases, the final
        norm and the LM head."""
        return sum(t.nbytes for t in self._kept) + self.lm_head.nbytes + self.final_norm.nbytes

    @staticmethod
    def build(model: CausalLM) -> tuple[DecodeStack | None, str | None]:
        """The stack, or None and why the model's layers cannot run as one call here."""
        reason = _unsupported(model) or cpu_kernels.unavailable(_load)
        return (None, reason) if reason else (DecodeStack(model), None)

    @staticmethod
    def takes(query_lens: list[int]) -> bool:
        """Whether the call runs a step of sequences with these new tokens: at most MAX_ROWS in all (the C
        attention kernel reads queries of any length)."""
        return all(n > 0 for n in query_lens) and 0 < sum(query_lens) <= MAX_ROWS

    def logits(self, step: StackStep, cache: KVCache) -> torch.Tensor:
        """float32 logits [rows, vocab] of the step's logits rows; writes its tokens' keys and values."""
        logits = torch.empty(step.num_logits, self.vocab)
        self._call(step, cache, logits)
        return logits

    def draft_greedy(self, step: StackStep, steps: list[int], cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafting in one call: the step (each sequence's last token its logits row), then sequence i's
        argmax fed back at its next position until it has steps[i] tokens (the last not written). Returns the
        tokens and their softmax probabilities, [sequences, max(steps)] each (a row's tail past its steps unset).
        The block tables must hold every position written."""
        if step.num_logits != step.seqs or len(steps) != step.seqs or min(steps) < 1:
            raise ValueError("greedy drafting takes one logits row and at least one step per sequence")
        logits = torch.empty(step.seqs, self.vocab)
        counts = torch.tensor(steps, dtype=torch.int32)
        tokens = torch.empty(step.seqs, max(steps), dtype=torch.int64)
        confidence = torch.empty(step.seqs, max(steps))
        self._call(step, cache, logits, (counts.data_ptr(), tokens.data_ptr(), confidence.data_ptr(), max(steps)))
        return tokens, confidence

    def _call(self, step: StackStep, cache: KVCache, logits: torch.Tensor, drafting: tuple = (None, None, None, 0)
              ) -> None:  # fmt: skip
        args = self._args
        self._point_at(cache)
        args.step, args.logits, args.threads = step, logits.data_ptr(), torch.get_num_threads()
        args.steps, args.drafted, args.confidence, args.max_steps = drafting
        status = _load().decode_stack_f32(ctypes.byref(args))
        if status == -2:
            raise ValueError(f"decode stack: {step.num_logits} logits rows asked of a step of {step.tokens} tokens")
        if status != 0:
            raise MemoryError("decode stack: no memory for its scratch rows")

    def _point_at(self, cache: KVCache) -> None:
        """The call's KV pool: each layer's k and v as the call reads them (the pointers built once per pool)."""
        model, k0 = self._args.model, cache.k[0]
        key = k0.data_ptr()
        if self._caches is None or self._caches[0] != key:
            pools = (t.data_ptr() for layer in range(model.layers) for t in (cache.k[layer], cache.v[layer]))
            self._caches = (key, (ctypes.c_int64 * (2 * model.layers))(*pools))
            model.caches = ctypes.addressof(self._caches[1])
        model.kv_stride_h, model.kv_stride_b, model.kv_stride_t = k0.stride(0), k0.stride(1), k0.stride(2)
        model.block_size = k0.shape[2]

    def _layer_pointers(self, layer: torch.nn.Module) -> list[int]:
        attn, mlp = layer.self_attn, layer.mlp
        packed = lambda linear: _packed(linear.dense_weight(), self.bf16)  # noqa: E731
        tensors = [layer.input_layernorm.weight, packed(attn.qkv_proj), attn.qkv_proj.bias,
                   attn.q_norm.weight if attn.q_norm is not None else None,
                   attn.k_norm.weight if attn.k_norm is not None else None,
                   packed(attn.o_proj), attn.o_proj.bias, layer.post_attention_layernorm.weight,
                   packed(mlp.gate_up_proj), mlp.gate_up_proj.bias, packed(mlp.down_proj),
                   mlp.down_proj.bias]  # fmt: skip
        assert len(tensors) == _WEIGHTS_PER_LAYER
        pointers = []
        for tensor in tensors:
            if tensor is None:
                pointers.append(0)
                continue
            tensor = tensor.detach().contiguous()
            self._kept.append(tensor)
            pointers.append(tensor.data_ptr())
        return pointers


def _linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """A layer's projections (None where a layer has none, as a mixture of experts)."""
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, getattr(layer.mlp, "gate_up_proj", None),
            getattr(layer.mlp, "down_proj", None)]  # fmt: skip


def _bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 `weight` is a bfloat16 value (its lower 16 bits zero)."""
    return bool((weight.detach().contiguous().view(torch.int32) & 0xFFFF).eq(0).all())


def _packed(weight: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """A linear layer's weight [out, in] as decode_stack.c's gemm reads it: transposed ([in, out]) and cut into
    tiles of _TILE columns, each [in, _TILE] contiguous, then the last out % _TILE columns as [in, out % _TILE].
    One tile's weights are then one run of memory that the hardware prefetcher streams, where rows `out` floats
    apart were not."""
    columns = weight.t()
    fan_in, out = columns.shape
    whole = out - out % _TILE
    tiles = columns[:, :whole].reshape(fan_in, whole // _TILE, _TILE).transpose(0, 1)
    packed = torch.cat((tiles.reshape(-1), columns[:, whole:].reshape(-1))).contiguous()
    return packed.to(torch.bfloat16) if bf16 else packed


def _unsupported(model: CausalLM) -> str | None:
    """Why the model's layers cannot run in decode_stack.c, or None."""
    decoder = model.model
    first = decoder.layers[0].self_attn
    linears = [m for layer in decoder.layers for m in _linears(layer)]
    weight = decoder.norm.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"a float32 model on CPU, not {weight.dtype} on {weight.device.type}"
    if not all(isinstance(layer.mlp, MLP) for layer in decoder.layers):
        return "mixture-of-experts layers"
    if any(m.tp.size > 1 or m.quantized is not None or m.lora is not None for m in linears):
        return "tensor-parallel, quantized or LoRA layers"
    if decoder.aux_layers:
        return "an EAGLE head reads its hidden states"
    if first.head_dim % 16:
        return f"head_dim {first.head_dim} (the attention kernel needs a multiple of 16)"
    return None


def _load() -> ctypes.CDLL:
    return cpu_kernels.library("decode_stack.c", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_stack_f32.restype = ctypes.c_int
    lib.decode_stack_f32.argtypes = [ctypes.POINTER(StackCall)]
