"""Load-time self-check: every weight form in use computes what its GGUF bytes say.

A packing layout that differs by CPU (torch's int4 layout packs 32-row blocks on AVX2 and
64-row blocks on AVX-512) can turn a model into noise on one CPU while every test passes on
another; the GGUF kernels pick their instruction set per CPU in the same way. So after the linear layers are built, one random row goes through one layer of
each (GGML types, weight form) pair in use, and is compared with x @ W^T computed in fp64
from the exactly dequantized GGUF rows. A mismatch refuses the model instead of generating
garbage. Rows that dequantize to NaN or infinity are the file's fault, not the kernel's (a
tensor retyped to another type of the same size passes every check of the file's layout),
and are reported as such.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cpuinfo import cpu_summary
from engine.errors import ModelError
from engine.models.quant import QuantLinear, dequantize_rows

# Relative L2 error of one output row. The GGUF kernels round activations to int8 per 32
# values, or per 256 against K-quants in AVX-512's direct kernels (|error| <= max/254 per value:
# about 1% per layer), dense bf16 forms round to 8
# significant bits (0.05-1.2% measured per layer on the real models). A scrambled layout
# gives errors of order 1 (uncorrelated outputs: about sqrt 2).
TOLERANCE = 0.05
SAMPLED_ROWS = 512       # output rows compared per layer (all of them for smaller layers)


@dataclass(frozen=True)
class FormCheck:
    layer: str
    types: str
    form: str
    error: float


def check_linears(model: torch.nn.Module, seed: int = 0) -> list[FormCheck]:
    """Check one layer per (types, form) pair; raise ModelError on the first mismatch."""
    picked: dict[tuple[str, str], tuple[QuantLinear, int]] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.sources:
            types = "+".join(dict.fromkeys(t.ggml_type.name for t in module.sources))
            for form, rows in module.kernel_forms().items():
                picked.setdefault((types, form), (module, rows))
    tolerance = TOLERANCE
    gen = torch.Generator().manual_seed(seed)
    results, references = [], {}
    for (types, form), (layer, rows) in picked.items():
        if id(layer) not in references:     # one reference per layer, shared by its forms
            references[id(layer)] = _reference(layer, gen)
        error = relative_error(layer, rows, *references[id(layer)])
        results.append(FormCheck(layer.name, types, form, error))
        if not error <= tolerance:          # NaN fails too
            raise ModelError(
                f"self-check failed: layer {layer.name} ({types}, {form} kernel) is off by "
                f"{error:.3g} relative to its dequantized GGUF weights (tolerance {tolerance}) on "
                f"{cpu_summary()}. The weight layout does not match this CPU's kernel; refusing "
                f"to generate garbage. Try TOKENTOP_KERNEL_ISA=avx2 (or scalar) and report the CPU.")
    return results


def _reference(layer: QuantLinear, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random input row, a sample of output rows, and x W^T + b on them in fp64."""
    k, n = layer.in_features, layer.out_features
    x = torch.randn(k, generator=gen)
    out_rows = torch.arange(n) if n <= SAMPLED_ROWS else \
        torch.randperm(n, generator=gen)[:SAMPLED_ROWS].sort().values
    ref = _reference_rows(layer, out_rows) @ x.double()
    if layer.bias is not None:
        ref += layer.bias.double().cpu()[out_rows]
    if not torch.isfinite(ref.float()).all():   # finite weights, but a NaN bias or sums beyond fp32
        raise _non_finite(layer.sources[0], f"layer {layer.name} gives outputs fp32 cannot hold")
    return x, out_rows, ref


def relative_error(layer: QuantLinear, rows: int, x: torch.Tensor, out_rows: torch.Tensor,
                   ref: torch.Tensor) -> float:
    """||layer(x) - ref|| / ||ref|| on the sampled output rows, for a call of `rows` input rows
    (the row count picks the kernel form)."""
    y = layer(x.expand(rows, -1).to(layer.device))[0].float().cpu()
    return float((y[out_rows].double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _reference_rows(layer: QuantLinear, out_rows: torch.Tensor) -> torch.Tensor:
    """fp64 weight rows `out_rows` of the stacked GGUF tensors, exactly dequantized."""
    parts, start = [], 0
    for td in layer.sources:
        stop = start + td.shape[0]
        mine = out_rows[(out_rows >= start) & (out_rows < stop)] - start
        if mine.numel():
            rows = dequantize_rows(td, mine).double()
            if not torch.isfinite(rows).all():
                raise _non_finite(td, f"tensor {td.name!r} ({td.ggml_type.name}) decodes to NaN or "
                                      f"infinite weights")
            parts.append(rows)
        start = stop
    return torch.cat(parts)


def _non_finite(td, what: str) -> ModelError:
    """Weights that decode to NaN, infinity or outputs no float type holds: the file's fault,
    whatever the kernel does."""
    where = f"model file {td.source}" if td.source is not None else "the model file"
    return ModelError(f"{where} is corrupt: {what} (a type field that names the wrong type, or "
                      f"damaged bytes); re-download or re-assemble the model file")
