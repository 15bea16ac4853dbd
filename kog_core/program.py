"""The decode program: the contract between model architectures and kernel backends.

A model lowers ONE decode step (one token at position `pos`) into a flat list of ops over
named tensors. Backends execute that list; they never hard-code a model. The persistent GPU
kernels interpret exactly this list (specialised to its shapes at compile time).

Conventions
- Every activation has a leading *lane* dimension L (1 for ordinary dense models, 8 for
  Laneformer-2B). Lane l of every op only reads lane l of its inputs, except the ops whose
  name starts with `lane_` and the `collective` op, which exist to mix lanes.
- Weights are read-only tensors loaded from the checkpoint (kind "weight") or computed by the
  model at lowering time (kind "const", e.g. RoPE inverse frequencies). A 2-D matvec weight
  [N, K] is shared by all lanes; a 3-D one [L, N, K] has one slice per lane.
- Buffers (kind "buffer") are scratch activations, one value per step. KV caches (kind "kv")
  persist across steps: shape [L, n_kv_heads_per_lane, context, head_dim].
- Runtime inputs: the scalar `token` and `pos`. The program's result is the tensor named by
  `DecodeProgram.logits` (float32 [V]); the optional final `sample` op writes `next_token`.

Op kinds and their exact semantics (x[l] is lane l; every reduction in float32):
  embed        out[l, :] = table[token, :] for every lane
  rmsnorm      out = x / sqrt(mean(x_g^2) + eps) * w, mean over groups of `group` elements of
               the last dim (group = whole row unless set); w is [group], [row] or [L, row]
  matvec       out[l] = W[l] @ x[l] (+ bias[l]) (+ residual[l]); inputs (x, W[, bias][, residual])
               named by attrs `has_bias`, `has_residual`
  rope         rotate x[l] (n_heads * head_dim values) at position pos with inv_freq [head_dim/2]:
               style "half" pairs (j, j + hd/2) (Llama/HF), "interleaved" pairs (2j, 2j+1)
  kv_append    cache_k[l, :, pos, :] = k[l]; cache_v[l, :, pos, :] = v[l]
  attention    softmax(q k^T * scale) v per query head over cache positions visible at pos
               (window W: pos - W < t <= pos; no window: t <= pos); GQA maps query head h of a
               lane to kv head h // (n_heads / n_kv_heads) of the same lane
  swiglu       out = silu(gate) * up
  add          out = a + b
  copy         out = x (reshaped to out's shape, same element count and order)
  lane_mean    out[0] = mean over lanes of x[l]            (out has L = 1)
  lane_sum     out[0] = sum over lanes of x[l], lane 0 first (out has L = 1)
  collective   attrs kind="all_gather": after this op every rank holds every lane of `x`
               (single-rank backends: no-op). Emitted right after a partial is produced, so a
               multi-rank backend can send it at once and consume it later.
  lane_residual  Delayed Tensor Parallelism residual, per lane l (attrs mode, scale):
               mode "allreduce": x[l] += sum_j fresh[j]            (j = 0..L-1 in order)
               mode "local":     x[l] += scale * fresh[l]
               mode "delayed":   x[l] += fresh[l] + sum_{j != l} delayed[j] (j in order)
  sample       next_token = sampler(logits) with the request's sampling parameters
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, asdict
from typing import Any, Iterable

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}

OP_KINDS = frozenset({
    "embed", "rmsnorm", "matvec", "rope", "kv_append", "attention", "swiglu", "add", "copy",
    "lane_mean", "lane_sum", "collective", "lane_residual", "sample",
})

TENSOR_KINDS = frozenset({"weight", "const", "buffer", "kv", "output"})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "f32"
    kind: str = "buffer"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Op:
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None  # which decoder layer this op belongs to (None: outside layers)

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


@dataclass
class DecodeProgram:
    """One decode step of one model, ready for a backend."""

    model: str                      # architecture name, e.g. "llama" or "laneformer"
    lanes: int                      # L
    vocab_size: int
    context_length: int
    tensors: dict[str, TensorSpec]
    ops: list[Op]
    logits: str = "logits"
    n_layers: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    # ---- construction helpers (used by model lowerings) ----
    def add_tensor(self, name: str, shape: Iterable[int], dtype: str = "f32", kind: str = "buffer") -> str:
        shape = tuple(int(s) for s in shape)
        if kind not in TENSOR_KINDS:
            raise ValueError(f"unknown tensor kind {kind!r}")
        old = self.tensors.get(name)
        if old is not None and (old.shape != shape or old.kind != kind):
            raise ValueError(f"tensor {name} redeclared as {shape}/{kind}, was {old.shape}/{old.kind}")
        self.tensors[name] = TensorSpec(name, shape, dtype, kind)
        return name

    def add_op(self, kind: str, inputs: Iterable[str], outputs: Iterable[str], /, layer: int | None = None, **attrs) -> Op:
        if kind not in OP_KINDS:
            raise ValueError(f"unknown op kind {kind!r}")
        op = Op(kind, tuple(inputs), tuple(outputs), dict(attrs), layer)
        for t in op.inputs + op.outputs:
            if t not in self.tensors:
                raise ValueError(f"op {kind} uses undeclared tensor {t!r}")
        self.ops.append(op)
        return op

    # ---- queries ----
    def weights(self) -> list[TensorSpec]:
        return [t for t in self.tensors.values() if t.kind == "weight"]

    def op_kinds(self) -> frozenset[str]:
        return frozenset(op.kind for op in self.ops)

    def validate(self) -> None:
        """Check internal consistency: every tensor read is a weight/const/kv or was written earlier."""
        written = {"token", "pos"}
        for i, op in enumerate(self.ops):
            for t in op.inputs:
                spec = self.tensors[t]
                if spec.kind in ("weight", "const", "kv"):
                    continue
                if t not in written:
                    raise ValueError(f"op #{i} {op.kind} reads {t!r} before any op writes it")
            written.update(op.outputs)
        if self.logits not in written:
            raise ValueError(f"no op writes the logits tensor {self.logits!r}")

    def bytes_per_op(self, kv_len: int | None = None, weight_dtype: str | None = None, kv_dtype: str | None = None) -> list[int]:
        """Bytes each op must stream from memory per token: weights it reads, plus KV cache
        entries at sequence length kv_len (default: full context). Activations are not counted
        (they stay on chip in a fused kernel). The embedding costs one row."""
        kv_len = self.context_length if kv_len is None else kv_len
        out = []
        for op in self.ops:
            b = 0
            if op.kind == "embed":
                table = self.tensors[op.inputs[0]]
                b = table.shape[-1] * DTYPE_BYTES[weight_dtype or table.dtype]
            elif op.kind == "attention":
                k = self.tensors[op.inputs[1]]
                L, hkv, T, hd = k.shape
                window = op.attr("window")
                seen = min(kv_len, window) if window else kv_len
                b = 2 * L * hkv * seen * hd * DTYPE_BYTES[kv_dtype or k.dtype]
            elif op.kind == "kv_append":
                k = self.tensors[op.inputs[2]]
                L, hkv, T, hd = k.shape
                b = 2 * L * hkv * hd * DTYPE_BYTES[kv_dtype or k.dtype]
            else:
                for t in op.inputs:
                    spec = self.tensors[t]
                    if spec.kind == "weight":
                        b += spec.numel * DTYPE_BYTES[weight_dtype or spec.dtype]
            out.append(b)
        return out

    def weight_bytes_per_token(self, weight_dtype: str | None = "bf16") -> int:
        """Bytes of weights streamed per token (embedding: one row)."""
        return sum(b for op, b in zip(self.ops, self.bytes_per_op(kv_len=0, weight_dtype=weight_dtype, kv_dtype="bf16"))
                   if op.kind not in ("kv_append", "attention"))

    # ---- serialisation / printing ----
    def to_dict(self) -> dict:
        d = asdict(self)
        d["tensors"] = {k: asdict(v) for k, v in self.tensors.items()}
        d["ops"] = [asdict(op) for op in self.ops]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeProgram":
        tensors = {k: TensorSpec(v["name"], tuple(v["shape"]), v["dtype"], v["kind"]) for k, v in d["tensors"].items()}
        ops = [Op(o["kind"], tuple(o["inputs"]), tuple(o["outputs"]), dict(o["attrs"]), o.get("layer")) for o in d["ops"]]
        return cls(d["model"], d["lanes"], d["vocab_size"], d["context_length"], tensors, ops,
                   d.get("logits", "logits"), d.get("n_layers", 0), dict(d.get("metadata", {})))

    def format(self, kv_len: int | None = None, weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> str:
        """A human-readable listing: one op a line with its shapes and bytes streamed per token."""
        per_op = self.bytes_per_op(kv_len=kv_len, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
        lines = [f"decode program: model={self.model} lanes={self.lanes} layers={self.n_layers} "
                 f"vocab={self.vocab_size} context={self.context_length} ops={len(self.ops)}"]
        for i, (op, b) in enumerate(zip(self.ops, per_op)):
            ins = ", ".join(f"{t}{list(self.tensors[t].shape)}" for t in op.inputs)
            outs = ", ".join(f"{t}{list(self.tensors[t].shape)}" for t in op.outputs)
            attrs = " ".join(f"{k}={v}" for k, v in op.attrs.items() if not isinstance(v, (list, dict)))
            lines.append(f"{i:4d} {op.kind:13s} {outs} <- {ins} {attrs}".rstrip() + (f"   [{_fmt_bytes(b)}]" if b else ""))
        kv = kv_len if kv_len is not None else self.context_length
        w = sum(b for op, b in zip(self.ops, per_op) if op.kind not in ("attention", "kv_append"))
        a = sum(b for op, b in zip(self.ops, per_op) if op.kind in ("attention", "kv_append"))
        lines.append(f"bytes per token ({weight_dtype} weights, {kv_dtype} KV): weights {_fmt_bytes(w)} "
                     f"(input embedding: one row), KV at length {kv} {_fmt_bytes(a)}, total {_fmt_bytes(w + a)}")
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.3f} {unit}" if unit == "GB" else f"{n / div:.2f} {unit}"
    return f"{n} B"


def new_program(model: str, lanes: int, vocab_size: int, context_length: int, n_layers: int, **metadata) -> DecodeProgram:
    prog = DecodeProgram(model, lanes, vocab_size, context_length, {}, [], n_layers=n_layers, metadata=dict(metadata))
    prog.add_tensor("token", (), "i32", "buffer")
    prog.add_tensor("pos", (), "i32", "buffer")
    return prog
