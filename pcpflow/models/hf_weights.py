"""Hugging Face checkpoint tensors -> pcpflow parameters, by a table of renames.

A checkpoint directory holds ``model.safetensors``, or shards listed by
``model.safetensors.index.json``. Each tensor name is matched against a family's
``Rename`` table (first match wins); the table says which pcpflow parameter it fills and,
for fused parameters (gate and up projections are one ``gate_up_proj``), which slice of
it along dim 0 — or, where the checkpoint fuses what pcpflow keeps apart (Phi-3's ``qkv_proj``), which
parameters it stacks, or, where it stacks every expert in one tensor (gpt-oss), each expert's
parameter (transposed and de-interleaved as the rename says; MXFP4 ``_blocks``/``_scales``
pairs read as the dense tensor). Every pcpflow parameter (every slice of a fused one) must be filled
exactly once; anything the table does not know is an error rather than silently dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import struct
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pcpflow.models.mxfp4 import BLOCKS, SCALES, dequantize_mxfp4

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class Rename:
    """The HF tensor ``hf`` fills pcpflow parameter ``ours``. Both are dotted names where
    ``{i}`` stands for a layer index, ``{j}`` for an expert index and ``{wb}`` for ``weight`` or ``bias``;
    ``part=(k, n)``: the tensor is the k-th of n equal slices of a fused parameter along
    dim 0; ``stacked``: the tensor is ``ours`` and then these parameters, stacked along dim 0
    (each as many rows as the parameter has).

    ``experts``: the tensor stacks every expert's along dim 0 (``hf`` has no ``{j}``, ``ours``
    has), one slice per expert ``{j}`` of the model. Each slice (or the tensor) is then read
    as the checkpoint stores it: ``transposed``, ``[in, out]`` (``x @ W``), where pcpflow
    keeps ``nn.Linear``'s ``[out, in]``; ``interleaved``, a fused gate/up whose gate and up
    rows alternate (gate = rows ``0::2``), where pcpflow keeps ``[gate; up]``. ``mxfp4``:
    the checkpoint may store it as ``<hf>_blocks`` + ``<hf>_scales`` (``pcpflow.models.mxfp4``).
    ``head_rows``: a ``stacked`` tensor whose parameters take turns, ``head_rows`` rows of each per
    head (GPT-NeoX's ``query_key_value``: a head's q, k and v, then the next head's).
    ``either_layout``: a ``transposed`` tensor may also be stored in pcpflow's layout, told apart
    by its shape (``read_as``). ``squeezed``: the tensor has a leading dim of 1 that the parameter
    lacks (ERNIE 4.5's ``[1, E]`` selection bias)."""

    hf: str
    ours: str
    part: tuple[int, int] | None = None
    stacked: tuple[str, ...] = ()
    experts: bool = False
    transposed: bool = False
    interleaved: bool = False
    mxfp4: bool = False
    either_layout: bool = False
    squeezed: bool = False
    head_rows: int = 0

    def pattern(self) -> re.Pattern[str]:
        return _compile(self.hf)

    def target_pattern(self) -> re.Pattern[str]:
        return _compile(self.ours)

    def as_ours(self, tensor: torch.Tensor) -> torch.Tensor:
        """One parameter's slice of the checkpoint tensor, in pcpflow's layout."""
        if self.squeezed:
            tensor = tensor[0]
        if self.transposed:
            tensor = tensor.transpose(-1, -2)
        if self.interleaved:
            # NOTE: de-interleaved here, once, so every expert path slices [gate; up] as the dense MLP's
            tensor = torch.cat([tensor[0::2], tensor[1::2]])
        return tensor

    def read_as(self, shape: tuple[int, ...], shapes: list[tuple[int, ...]]) -> Rename:
        """The rename a stored tensor of ``shape`` filling parameters of ``shapes`` is read by:
        this one; with ``either_layout``, the untransposed one when ``shape`` is the parameters'
        own, as transformers' ``Transpose(check_dims=True)`` reads it (a square tensor is never
        transposed)."""
        plain = dataclasses.replace(self, transposed=False, either_layout=False)
        return plain if self.either_layout and tuple(shape) == plain.checkpoint_shape(shapes) else self

    def checkpoint_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The shape the checkpoint tensor must have to fill parameters of ``shapes`` (its
        targets, in order)."""
        first = shapes[0]
        if self.stacked:
            return (sum(s[0] for s in shapes), *first[1:])
        if self.part is not None:
            first = (first[0] // self.part[1], *first[1:])
        if self.transposed:
            first = (*first[:-2], first[-1], first[-2])
        if self.squeezed:
            return (1, *first)
        return (len(shapes), *first) if self.experts else first


def _compile(template: str) -> re.Pattern[str]:
    regex = re.escape(template)
    regex = regex.replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{wb\}", r"(?P<wb>weight|bias)")
    regex = regex.replace(r"\{j\}", r"(?P<j>\d+)")  # an expert index
    return re.compile(regex)


DECODER_RENAMES = (
    Rename("model.embed_tokens.weight", "embed_tokens.weight"),
    Rename("model.norm.weight", "norm.weight"),
    Rename("lm_head.weight", "lm_head.weight"),
    Rename("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_norm.weight"),
    Rename(
        "model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_norm.weight"
    ),
    Rename("model.layers.{i}.mlp.gate_proj.{wb}", "layers.{i}.mlp.gate_up_proj.{wb}", (0, 2)),
    Rename("model.layers.{i}.mlp.up_proj.{wb}", "layers.{i}.mlp.gate_up_proj.{wb}", (1, 2)),
    Rename("model.layers.{i}.mlp.down_proj.{wb}", "layers.{i}.mlp.down_proj.{wb}"),
)
"""Embedding, norms, MLP and LM head: the same names in Llama and DeepSeek checkpoints."""


def layer_norm_rename(hf: str, ours: str) -> Rename:
    """A layer's norm: ``model.layers.{i}.<hf>.weight`` -> ``layers.{i}.<ours>.weight``."""
    return Rename(f"model.layers.{{i}}.{hf}.weight", f"layers.{{i}}.{ours}.weight")


def attention_rename(hf: str, ours: str) -> Rename:
    """A rename inside a layer's attention block: ``self_attn.<hf>`` -> ``self_attn.<ours>``."""
    return Rename("model.layers.{i}.self_attn." + hf, "layers.{i}.self_attn." + ours)


IGNORED = (
    # rotary tables some older checkpoints saved; pcpflow computes its own
    r".*\.rotary_emb\.inv_freq",
)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint at ``path`` (ValueError if there are none or
    the index names missing files)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index ({exc})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no safetensors weights in {path} (want {SINGLE_FILE} or {INDEX_FILE} with its "
            "shards; .bin/.pt checkpoints are not supported: re-save with safetensors)"
        )
    return files


def is_skipped(hf_name: str, *, num_layers: int, skip: tuple[str, ...] = ()) -> bool:
    """Whether the loader leaves ``hf_name`` out on purpose: a layer ``>= num_layers`` (e.g.
    DeepSeek-V3's MTP layer), a name matching ``skip`` or ``IGNORED`` (saved rotary tables)."""
    layer = re.match(r"model\.layers\.(\d+)\.", hf_name)
    if layer and int(layer.group(1)) >= num_layers:
        return True
    return any(re.fullmatch(p, hf_name) for p in (*IGNORED, *skip))


@dataclass
class NamePlan:
    """Which checkpoint tensor fills which parameter (slice), and what does not fit."""

    targets: dict[str, list[tuple[str, tuple[int, int] | None]]]  # several: a stacked tensor, or experts
    unknown: list[str]  # checkpoint tensors with no place in the model
    twice: list[str]  # checkpoint tensors filling a parameter (slice) already filled
    unfilled: list[str]  # parameters (or their missing slices) as the checkpoint would name them
    rules: dict[str, Rename] = field(default_factory=dict)  # the rename each planned tensor follows
    mxfp4: dict[str, tuple[str, str]] = field(default_factory=dict)  # dense name -> its (blocks, scales)


def mxfp4_pairs(names: list[str], renames: tuple[Rename, ...]) -> dict[str, tuple[str, str]]:
    """The tensors ``names`` store as MXFP4 pairs that an ``mxfp4`` rename takes: dense name ->
    (blocks, scales). A lone half stays itself (and has no place in the model)."""
    have, packed = set(names), [r.pattern() for r in renames if r.mxfp4]
    pairs = {}
    for name in names:
        base = name.removesuffix(BLOCKS)
        if base != name and base + SCALES in have and any(p.fullmatch(base) for p in packed):
            pairs[base] = (name, base + SCALES)
    return pairs


def dense_names(names: list[str], pairs: dict[str, tuple[str, str]]) -> list[str]:
    """``names`` with each MXFP4 pair (``mxfp4_pairs``) as its dense name, in the blocks' place."""
    halves = {half: base for base, both in pairs.items() for half in both}
    return [halves.get(n, n) for n in names if n not in halves or n.endswith(BLOCKS)]


def plan_names(
    names: list[str],
    params: list[str],
    renames: tuple[Rename, ...],
    *,
    num_layers: int,
    skip: tuple[str, ...] = (),
) -> NamePlan:
    """Match the checkpoint tensor ``names`` against the model's parameter names ``params``
    by the rules ``load_checkpoint`` loads with (the same skips); the driver's pre-run
    check calls it on the safetensors headers alone."""
    compiled = [(r.pattern(), r) for r in renames]
    filled: dict[str, set[int]] = {name: set() for name in params}
    plan = NamePlan({}, [], [], [], mxfp4=mxfp4_pairs(names, renames))
    for hf_name in dense_names(names, plan.mxfp4):
        if is_skipped(hf_name, num_layers=num_layers, skip=skip):
            continue
        rule, targets = _rename(hf_name, compiled, filled)
        if rule is None or not targets or any(name not in filled for name, _ in targets):
            plan.unknown.append(hf_name)
            continue
        # NOTE: a tensor without a part fills every part (Phi-3's gate_up_proj is pcpflow's whole)
        indices = {(name, k) for name, part in targets
                   for k in ([part[0]] if part else range(_num_parts(name, renames)))}
        if any(k in filled[name] for name, k in indices):
            plan.twice.append(hf_name)
        else:
            plan.targets[hf_name], plan.rules[hf_name] = targets, rule
        for name, k in indices:
            filled[name].add(k)
    for name in params:
        missing = set(range(_num_parts(name, renames))) - filled[name]
        plan.unfilled += [_hf_name(name, k, renames) for k in sorted(missing)]
    return plan


def _hf_name(name: str, part: int, renames: tuple[Rename, ...]) -> str:
    """The checkpoint name of parameter ``name`` (its slice ``part``), else ``name``."""
    for rule in renames:
        m = rule.target_pattern().fullmatch(name)
        if m and (rule.part is None or rule.part[0] == part):
            return rule.hf.format(**m.groupdict())
    return name


def load_checkpoint(
    model: nn.Module,
    path: Path,
    renames: tuple[Rename, ...],
    *,
    num_layers: int,
    skip: tuple[str, ...] = (),
) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``path``, cast to the
    parameter's dtype. Tensors of layers ``>= num_layers`` (e.g. DeepSeek-V3's MTP layer)
    and names matching ``skip`` or ``IGNORED`` are not loaded; any other unknown name, a
    shape mismatch, a non-finite weight, or a parameter left unfilled raises ValueError."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    with ExitStack() as stack:
        opened = [stack.enter_context(safe_open(str(file), framework="pt")) for file in checkpoint_files(path)]
        names = [name for f in opened for name in f.keys()]  # NOTE: a name in two files is planned twice
        plan = plan_names(names, list(params), renames, num_layers=num_layers, skip=skip)
        _load(params, path, {name: f for f in opened for name in f.keys()}, plan)


def _load(params: dict[str, nn.Parameter], path: Path, where: dict[str, Any], plan: NamePlan) -> None:
    """Fill ``params`` by ``plan`` from the open safetensors files ``where`` each tensor is."""
    if plan.unknown:
        raise ValueError(
            f"{path}: {len(plan.unknown)} checkpoint tensor(s) have no place in the model: "
            + _some(plan.unknown)
        )
    if plan.twice:
        raise ValueError(f"{path}: tensors stored more than once: {_some(plan.twice)}")
    if plan.unfilled:
        raise ValueError(f"{path}: the checkpoint does not provide {_some(plan.unfilled)}")
    nonfinite: list[str] = []
    for hf_name, targets in plan.targets.items():
        rule = plan.rules[hf_name]
        if hf_name in plan.mxfp4:
            blocks, scales = plan.mxfp4[hf_name]
            dtype = params[targets[0][0]].dtype
            tensor = dequantize_mxfp4(where[blocks].get_tensor(blocks), where[scales].get_tensor(scales), dtype)
        else:
            tensor = where[hf_name].get_tensor(hf_name)
        rule = rule.read_as(tuple(tensor.shape), [tuple(params[name].shape) for name, _ in targets])
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # --- faults
            nonfinite.append(f"{hf_name} ({int((~torch.isfinite(tensor)).sum())} of {tensor.numel()} values)")
        if rule.experts:
            want = rule.checkpoint_shape([tuple(params[name].shape) for name, _ in targets])
            if tuple(tensor.shape) != want:
                raise ValueError(f"checkpoint tensor {hf_name} is {list(tensor.shape)}, but its {len(targets)} "
                                 f"experts ({targets[0][0]}, ...) want {list(want)}")
            pieces = tensor.unbind(0)
        elif len(targets) > 1:
            rows = [params[name].shape[0] for name, _ in targets]
            if tensor.dim() == 0 or tensor.shape[0] != sum(rows):
                raise ValueError(f"checkpoint tensor {hf_name} is {list(tensor.shape)}, but it stacks "
                                 f"{', '.join(name for name, _ in targets)}: {sum(rows)} rows")
            pieces = _per_head(tensor, len(rows), rule.head_rows) if rule.head_rows else tensor.split(rows)
        else:
            pieces = (tensor,)
        for (name, part), piece in zip(targets, pieces):
            _copy(params[name], rule.as_ours(piece), part, hf_name, name)
    if nonfinite:
        raise ValueError(f"{path}: non-finite (NaN or inf) weights in {_some(nonfinite)}")


def _per_head(tensor: torch.Tensor, n: int, rows: int) -> list[torch.Tensor]:
    """The ``n`` parameters of a tensor whose rows go head by head, ``rows`` of each parameter per head."""
    by_head = tensor.unflatten(0, (-1, n, rows))
    return [by_head[:, j].flatten(0, 1) for j in range(n)]


def _some(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _rename(hf_name: str, compiled, params) -> tuple[Rename | None, list[tuple[str, tuple[int, int] | None]]]:
    """The rule ``hf_name`` follows and the parameters (slices) it fills; an ``experts`` rule
    fills expert 0, 1, ... of ``params`` (the model's experts, however many)."""
    for pattern, rule in compiled:
        m = pattern.fullmatch(hf_name)
        if m and rule.experts:
            names = (rule.ours.format(**m.groupdict(), j=j) for j in itertools.count())
            return rule, [(name, rule.part) for name in itertools.takewhile(params.__contains__, names)]
        if m:
            return rule, [(rule.ours.format(**m.groupdict()), rule.part),
                          *((name.format(**m.groupdict()), None) for name in rule.stacked)]
    return None, []


def _num_parts(name: str, renames: tuple[Rename, ...]) -> int:
    for rule in renames:
        if rule.part is not None and rule.target_pattern().fullmatch(name):
            return rule.part[1]
    return 1


def _copy(
    param: torch.Tensor,
    tensor: torch.Tensor,
    part: tuple[int, int] | None,
    hf_name: str,
    name: str,
) -> None:
    target = param.data
    if part is not None:
        k, n = part
        rows = param.shape[0] // n
        target = target[k * rows : (k + 1) * rows]
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"checkpoint tensor {hf_name} is {list(tensor.shape)}, but {name}"
            + (f" (part {part[0]} of {part[1]})" if part else "")
            + f" wants {list(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor.to(dtype=target.dtype))


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file; ValueError if the file is not safetensors or
    is shorter than its header says (truncated)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} has {size} bytes: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 * 2**20):
            raise ValueError(f"{path.name} is not safetensors (its first 8 bytes give a header of {n} bytes; the file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path.name} is not safetensors (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not safetensors (its header is not a JSON object)")
    end = _data_end(path.name, header)
    if 8 + n + end > size:
        raise ValueError(f"{path.name} is truncated: its header says {8 + n + end} bytes, the file has {size}")
    if 8 + n + end < size:
        raise ValueError(f"{path.name} has {size - 8 - n - end} bytes after the tensors its header describes "
                         f"(the header says {8 + n + end} bytes, the file has {size})")
    return header


SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
                    "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16,
                    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
"""Bits per element of each dtype a safetensors header may name (the format's own list)."""


def _data_end(name: str, header: dict[str, Any]) -> int:
    """Where the tensors' data ends, after the checks the safetensors loader makes as a rank
    opens the file (each entry a dtype, a shape and offsets that span exactly its bytes; the
    entries tile the data without gap or overlap): a header that lies is found here, in the
    driver, not as a rank's SafetensorError mid-load."""
    spans = []
    for key, v in header.items():
        if key == "__metadata__":
            continue
        entry = f"{name}: tensor {key}"
        if not isinstance(v, dict):
            raise ValueError(f"{entry} is not an object with dtype, shape and data_offsets")
        dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if dtype not in SAFETENSORS_BITS:
            raise ValueError(f"{entry} has dtype {dtype!r}; a safetensors dtype is one of {', '.join(SAFETENSORS_BITS)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{entry} has shape {shape!r}; a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{entry} has data_offsets {offsets!r}; [begin, end] with 0 <= begin <= end")
        count = 1
        for d in shape:
            count *= d
        nbytes = count * SAFETENSORS_BITS[dtype] / 8
        if offsets[1] - offsets[0] != nbytes:
            raise ValueError(f"{entry} is {dtype} {shape} ({nbytes:g} bytes), but its data_offsets {offsets} "
                             f"span {offsets[1] - offsets[0]} bytes")
        spans.append((offsets[0], offsets[1], key))
    at = 0
    for begin, stop, key in sorted(spans):
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves a gap of {begin - at} bytes before it"
            raise ValueError(f"{name}: tensor {key}'s data_offsets [{begin}, {stop}] {what}")
        at = stop
    return at
